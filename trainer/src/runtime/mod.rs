//! The stage runtime: worker processes that execute their stage's action list over a
//! [`transport::Transport`], and the launcher that starts them and drives the steps.

pub mod auth;
mod checkpoints;
mod cluster;
pub mod control;
pub mod driver;
pub mod launcher;
pub mod transport;
pub mod wire;
pub mod worker;
