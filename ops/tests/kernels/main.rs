//! Tests of the `ops` kernels: finite-difference gradient checks in f64, forward references,
//! dtype coverage (F32) and determinism.

mod adamw;
mod attention;
mod clip;
mod common;
mod cross_entropy;
mod doc_attention;
mod embedding;
mod gelu;
mod linear;
mod lm_head;
mod norm;
mod rope;
mod softmax;
