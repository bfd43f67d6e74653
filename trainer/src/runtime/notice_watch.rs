//! The agent's preemption-notice thread: a thin shell that polls the cloud's instance metadata
//! service ([`elastic::preemption::MetadataClient`]) at a modest interval and hands the first
//! notice to the agent, which leaves at the next step boundary as SIGTERM makes it do. A service
//! that cannot be reached or answers garbage is warned about once and otherwise ignored: a
//! node is never stopped by its watcher.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use elastic::ElasticConfig;
use elastic::preemption::{Cloud, MetadataClient, Notice};
use tracing::{debug, info, warn};

/// What an agent watches: `elastic.preemption_notice`, `metadata_endpoint`, `metadata_poll_s`
/// (or the `seqpipe agent` flags that set them).
#[derive(Clone, Debug, PartialEq)]
pub struct WatchConfig {
    /// The cloud whose metadata service is asked.
    pub cloud: Cloud,
    /// `http://HOST[:PORT]` of its metadata service.
    pub endpoint: String,
    /// Time between two polls (at least; GCP's long poll waits up to this long).
    pub interval: Duration,
}

impl WatchConfig {
    /// The watch an `[elastic]` section asks for (after its validation), if any; an empty
    /// `metadata_endpoint` is the cloud's documented address.
    pub fn from_elastic(cfg: &ElasticConfig) -> Option<Self> {
        let cloud = cfg.preemption_notice.cloud()?;
        let endpoint = if cfg.metadata_endpoint.is_empty() {
            cloud.default_endpoint().to_string()
        } else {
            cfg.metadata_endpoint.clone()
        };
        Some(Self {
            cloud,
            endpoint,
            interval: cfg.metadata_poll(),
        })
    }
}

/// The most Azure event ids remembered as logged (a few events at a time are normal).
const MAX_LOGGED_EVENTS: usize = 1024;

/// Starts the thread: it polls until the first notice, logs it with its deadline, and calls
/// `on_notice` with it (then ends).
pub fn spawn(
    watch: WatchConfig,
    on_notice: impl FnOnce(Notice) + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("preemption-notices".into())
        .spawn(move || {
            let notice = watch_until_notice(&watch);
            warn!(
                %notice,
                deadline = %notice.deadline(),
                "preemption notice from the cloud: leaving at the next step boundary"
            );
            on_notice(notice);
        })
        .map(|_| ())
}

/// Polls every `interval` until the metadata service gives a notice.
fn watch_until_notice(watch: &WatchConfig) -> Notice {
    let mut client = MetadataClient::new(watch.cloud, &watch.endpoint, watch.interval);
    info!(cloud = %watch.cloud, endpoint = %watch.endpoint, "watching for preemption notices");
    let mut warned = false;
    let mut logged_events = BTreeSet::new();
    loop {
        let started = Instant::now();
        match client.poll() {
            Ok(polled) => {
                if let Some(notice) = polled.notice {
                    return notice;
                }
                for event in polled.ignored {
                    if logged_events.len() < MAX_LOGGED_EVENTS
                        && logged_events.insert(event.id.clone())
                    {
                        info!(
                            id = %event.id,
                            kind = %event.kind,
                            this_vm = event.this_vm,
                            "scheduled event that is not a preemption of this VM: ignored"
                        );
                    }
                }
            }
            Err(e) if !warned => {
                warned = true;
                warn!(
                    error = %e,
                    "no preemption notices from the metadata service; the node runs on without \
                     them (SIGTERM still works) and this warning is not repeated"
                );
            }
            Err(e) => debug!(error = %e, "metadata service poll failed"),
        }
        std::thread::sleep(watch.interval.saturating_sub(started.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use elastic::preemption::NoticeSource;

    #[test]
    fn the_watch_follows_the_elastic_section() {
        let off = ElasticConfig::default();
        assert_eq!(WatchConfig::from_elastic(&off), None);
        let aws = ElasticConfig {
            preemption_notice: NoticeSource::Aws,
            ..ElasticConfig::default()
        };
        assert_eq!(
            WatchConfig::from_elastic(&aws),
            Some(WatchConfig {
                cloud: Cloud::Aws,
                endpoint: "http://169.254.169.254".into(),
                interval: Duration::from_secs(2),
            })
        );
        let gcp = ElasticConfig {
            preemption_notice: NoticeSource::Gcp,
            metadata_endpoint: "http://127.0.0.1:9".into(),
            metadata_poll_s: 0.25,
            ..ElasticConfig::default()
        };
        let watch = WatchConfig::from_elastic(&gcp).unwrap();
        assert_eq!(watch.endpoint, "http://127.0.0.1:9");
        assert_eq!(watch.interval, Duration::from_millis(250));
    }
}
