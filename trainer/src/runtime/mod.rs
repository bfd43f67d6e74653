//! The stage runtime: worker processes that execute their stage's action list over a
//! [`transport::Transport`], the node agents that start and watch them, and the coordinator that
//! plans the pipeline and drives the steps.

pub mod agent;
pub mod auth;
mod checkpoint_writer;
pub mod collective;
pub mod control;
pub mod coordinator;
pub mod driver;
pub mod error;
pub mod events;
pub mod goodput;
pub mod kill_switch;
pub mod live_metrics;
pub mod metrics_endpoint;
pub mod metrics_log;
pub mod notice_watch;
mod peer_input;
pub mod peer_snapshots;
pub mod pipeline;
pub mod recovery;
pub mod run;
mod store;
pub mod trace;
pub mod transport;
pub mod wire;
pub mod worker;
