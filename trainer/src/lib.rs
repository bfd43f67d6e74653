//! seqpipe's trainer: the GPT model split into pipeline stages, Seq1F1B schedules as data,
//! the stage runtime that executes a schedule over a [`runtime::transport::Transport`],
//! and data loading. The `seqpipe` command line and its benchmarks are the root package's binary.

pub mod checkpointing;
pub mod config;
pub mod cuda;
pub mod data;
pub mod lr;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod plan;
pub mod plot;
pub mod runtime;
pub mod schedule;
pub mod svg;
pub mod usage;
