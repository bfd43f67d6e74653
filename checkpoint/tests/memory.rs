//! The core suite over the in-process `memory://` store.

#[macro_use]
mod common;

core_suite!(common::Backend::memory());
