//! Cloud preemption notices: a spot or preemptible instance learns from its cloud's instance
//! metadata service that it is about to be reclaimed (AWS: two minutes ahead, GCP and Azure:
//! about 30 s), and its node leaves the run at the next step boundary, as SIGTERM makes it do.
//!
//! - [`notice`]: the pure part — each cloud's documented answer read strictly into a [`Notice`]
//!   or nothing, tested on the documentation's examples and on garbage.
//! - [`client`]: the I/O part — [`MetadataClient`] asks the metadata service as each cloud
//!   documents it (AWS IMDSv2 with a session token, GCP's `wait_for_change` long poll, Azure
//!   Scheduled Events), every call under a deadline and with a bounded answer.
//!
//! The agent's polling thread (the trainer's `runtime::notice_watch`) is a thin shell around
//! [`MetadataClient::poll`].

pub mod client;
pub mod notice;

pub use client::{MetadataClient, MetadataError, Polled};
pub use notice::{BadAnswer, Cloud, Notice, NoticeSource, SpotAction, leave_reason};
