//! A client of one cloud's instance metadata service that asks, as the cloud documents it,
//! whether this instance is about to be reclaimed. Every call has a total deadline and a bounded
//! answer; what the answers mean is decided by the pure functions of [`super::notice`].

use std::io;
use std::time::{Duration, Instant};

use thiserror::Error;
use ureq::Agent;
use ureq::http::Method;

use super::notice::{self, AwsAnswer, BadAnswer, Cloud, Notice, OtherEvent};
use crate::http::{self, HttpError, Response};

/// Deadline of one call that does not long-poll: connect, request and the whole answer. The
/// metadata services answer on the same host in milliseconds.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest answer body accepted (a Scheduled Events document with many events is a few KiB).
pub const MAX_BODY: u64 = 64 << 10;

/// Seconds an AWS session token is asked to live (the documented maximum, 6 hours).
pub const AWS_TOKEN_TTL_S: u64 = 21600;

/// Why a poll of the metadata service learned nothing.
#[derive(Debug, Error)]
pub enum MetadataError {
    /// No connection (refused, unroutable, no such host) or it broke.
    #[error(
        "cannot reach the {cloud} metadata service at {url}: {source} (not on {cloud}? choose \
         the cloud with --preemption-notice / elastic.preemption_notice, or its address with \
         --metadata-endpoint / elastic.metadata_endpoint)"
    )]
    Unreachable {
        /// The cloud watched.
        cloud: Cloud,
        /// The URL asked.
        url: String,
        /// What failed.
        source: io::Error,
    },
    /// No complete answer in time.
    #[error("the {cloud} metadata service at {url} gave no complete answer within {timeout:?}")]
    Timeout {
        /// The cloud watched.
        cloud: Cloud,
        /// The URL asked.
        url: String,
        /// The call's deadline.
        timeout: Duration,
    },
    /// An answer that is not what the cloud documents.
    #[error(
        "the {cloud} metadata service's answer to {url}: {problem} (is --preemption-notice the \
         right cloud?)"
    )]
    BadAnswer {
        /// The cloud watched.
        cloud: Cloud,
        /// The URL asked.
        url: String,
        /// What was wrong.
        problem: BadAnswer,
    },
}

/// What one poll found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Polled {
    /// The notice, if the instance is being reclaimed.
    pub notice: Option<Notice>,
    /// Azure: scheduled events that are not this VM's preemption (to log, not to act on).
    pub ignored: Vec<OtherEvent>,
}

/// `url` if it is a metadata service address the client can use: `http://HOST[:PORT]`, no path
/// (a trailing `/` is dropped). The error says what is wrong.
pub fn endpoint(url: &str) -> Result<String, String> {
    let Some(authority) = url.strip_prefix("http://") else {
        return Err(format!(
            "`{url}` must start with http:// (the metadata services speak plain HTTP on a \
             link-local address)"
        ));
    };
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.is_empty()
        || authority
            .chars()
            .any(|c| !(c.is_ascii_alphanumeric() || "-._:[]".contains(c)))
    {
        return Err(format!(
            "`{url}` must be http://HOST or http://HOST:PORT, with no path, query or user"
        ));
    }
    Ok(format!("http://{authority}"))
}

/// A client of `cloud`'s metadata service at one endpoint; it keeps what the protocol needs
/// between polls (AWS's session token, GCP's ETag, the Azure VM's name).
pub struct MetadataClient {
    cloud: Cloud,
    /// `http://HOST[:PORT]`.
    endpoint: String,
    agent: Agent,
    /// GCP's long poll: seconds the server may hold the answer.
    long_poll_s: u64,
    long_agent: Agent,
    /// AWS: the session token and when to get a new one.
    aws_token: Option<(String, Instant)>,
    /// GCP: the ETag of the last answer, for `wait_for_change`.
    gcp_etag: Option<String>,
    /// Azure: this VM's name, `None` until known; `Some(None)` when the service does not say.
    azure_vm: Option<Option<String>>,
}

impl MetadataClient {
    /// A client of `cloud`'s service at `endpoint` (checked by [`endpoint`]), whose GCP long
    /// polls last at most `interval` (rounded up to whole seconds). Opens nothing yet.
    pub fn new(cloud: Cloud, endpoint: &str, interval: Duration) -> Self {
        let long_poll_s = interval.as_secs_f64().ceil().max(1.0) as u64;
        Self {
            cloud,
            endpoint: endpoint.trim_end_matches('/').to_string(),
            agent: http::agent(REQUEST_TIMEOUT),
            long_poll_s,
            long_agent: http::agent(REQUEST_TIMEOUT + Duration::from_secs(long_poll_s)),
            aws_token: None,
            gcp_etag: None,
            azure_vm: None,
        }
    }

    /// The cloud watched.
    pub fn cloud(&self) -> Cloud {
        self.cloud
    }

    /// Asks once whether this instance is being reclaimed. On GCP this may wait up to the long
    /// poll's seconds for a change.
    pub fn poll(&mut self) -> Result<Polled, MetadataError> {
        match self.cloud {
            Cloud::Aws => self.poll_aws().map(|notice| Polled {
                notice,
                ignored: Vec::new(),
            }),
            Cloud::Gcp => self.poll_gcp().map(|notice| Polled {
                notice,
                ignored: Vec::new(),
            }),
            Cloud::Azure => self.poll_azure(),
        }
    }

    fn poll_aws(&mut self) -> Result<Option<Notice>, MetadataError> {
        const PATH: &str = "/latest/meta-data/spot/instance-action";
        for _ in 0..2 {
            let token = self.aws_token()?;
            let response = self.call(
                Method::GET,
                PATH,
                &[("X-aws-ec2-metadata-token", &token)],
                false,
            )?;
            match notice::aws_instance_action(response.status, &response.body)
                .map_err(|problem| self.bad(PATH, problem))?
            {
                AwsAnswer::NoNotice => return Ok(None),
                AwsAnswer::Notice(notice) => return Ok(Some(notice)),
                // Expired or revoked: get a new token and ask again, once.
                AwsAnswer::TokenRejected => self.aws_token = None,
            }
        }
        Err(self.bad(
            PATH,
            BadAnswer::Status {
                status: 401,
                expected: "200 or 404 with a fresh session token",
            },
        ))
    }

    /// The AWS session token, from `PUT /latest/api/token` when there is none or it is about
    /// to expire.
    fn aws_token(&mut self) -> Result<String, MetadataError> {
        const PATH: &str = "/latest/api/token";
        if let Some((token, renew_at)) = &self.aws_token
            && Instant::now() < *renew_at
        {
            return Ok(token.clone());
        }
        let ttl = AWS_TOKEN_TTL_S.to_string();
        let response = self.call(
            Method::PUT,
            PATH,
            &[("X-aws-ec2-metadata-token-ttl-seconds", &ttl)],
            false,
        )?;
        let token = notice::aws_token(response.status, &response.body)
            .map_err(|problem| self.bad(PATH, problem))?;
        // Renewed a minute before AWS expires it.
        let renew_at = Instant::now() + Duration::from_secs(AWS_TOKEN_TTL_S - 60);
        self.aws_token = Some((token.clone(), renew_at));
        Ok(token)
    }

    /// GCP's `instance/preempted`: the first ask answers at once (and gives the ETag); later
    /// ones wait for a change from that ETag, up to the long poll's seconds.
    fn poll_gcp(&mut self) -> Result<Option<Notice>, MetadataError> {
        let base = "/computeMetadata/v1/instance/preempted";
        let (path, long) = match &self.gcp_etag {
            Some(etag) => (
                format!(
                    "{base}?wait_for_change=true&last_etag={etag}&timeout_sec={}",
                    self.long_poll_s
                ),
                true,
            ),
            None => (base.to_string(), false),
        };
        let response = self.call(Method::GET, &path, &[("Metadata-Flavor", "Google")], long)?;
        let google = response
            .headers
            .get("Metadata-Flavor")
            .is_some_and(|v| v.as_bytes() == b"Google");
        let notice = notice::gcp_preempted(response.status, google, &response.body)
            .map_err(|problem| self.bad(&path, problem))?;
        // An ETag that could not go into a URL as it is, is not used: the next ask answers at
        // once instead of waiting for a change.
        self.gcp_etag = response
            .headers
            .get("ETag")
            .and_then(|v| v.to_str().ok())
            .filter(|e| {
                !e.is_empty()
                    && e.len() <= 64
                    && e.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            })
            .map(String::from);
        Ok(notice)
    }

    fn poll_azure(&mut self) -> Result<Polled, MetadataError> {
        const PATH: &str = "/metadata/scheduledevents?api-version=2020-07-01";
        const NAME: &str = "/metadata/instance/compute/name?api-version=2021-02-01&format=text";
        let headers = [("Metadata", "true")];
        if self.azure_vm.is_none() {
            let response = self.call(Method::GET, NAME, &headers, false)?;
            // A service that does not say the VM's name still lists events: then every
            // `Preempt` counts.
            self.azure_vm = Some(notice::azure_vm_name(response.status, &response.body).ok());
        }
        let response = self.call(Method::GET, PATH, &headers, false)?;
        let vm = self.azure_vm.clone().flatten();
        let events = notice::azure_events(response.status, &response.body, vm.as_deref())
            .map_err(|problem| self.bad(PATH, problem))?;
        Ok(Polled {
            notice: events.preempt,
            ignored: events.others,
        })
    }

    /// One call to `path` on the endpoint.
    fn call(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        long: bool,
    ) -> Result<Response, MetadataError> {
        let url = format!("{}{path}", self.endpoint);
        let (agent, timeout) = if long {
            (
                &self.long_agent,
                REQUEST_TIMEOUT + Duration::from_secs(self.long_poll_s),
            )
        } else {
            (&self.agent, REQUEST_TIMEOUT)
        };
        let cloud = self.cloud;
        http::call(agent, method, &url, headers, MAX_BODY, timeout).map_err(|e| match e {
            HttpError::Connect(source) | HttpError::Io(source) => {
                MetadataError::Unreachable { cloud, url, source }
            }
            HttpError::Timeout(timeout) => MetadataError::Timeout {
                cloud,
                url,
                timeout,
            },
            HttpError::Malformed(problem) => MetadataError::BadAnswer {
                cloud,
                url,
                problem: BadAnswer::Http(problem),
            },
        })
    }

    fn bad(&self, path: &str, problem: BadAnswer) -> MetadataError {
        MetadataError::BadAnswer {
            cloud: self.cloud,
            url: format!("{}{path}", self.endpoint),
            problem,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_plain_http_hosts() {
        assert_eq!(
            endpoint("http://169.254.169.254").unwrap(),
            "http://169.254.169.254"
        );
        assert_eq!(
            endpoint("http://127.0.0.1:8080/").unwrap(),
            "http://127.0.0.1:8080"
        );
        assert_eq!(
            endpoint("http://metadata.google.internal").unwrap(),
            "http://metadata.google.internal"
        );
        assert_eq!(endpoint("http://[::1]:80").unwrap(), "http://[::1]:80");
        for bad in [
            "",
            "169.254.169.254",
            "https://169.254.169.254",
            "http://",
            "http://host/latest",
            "http://user@host",
            "http://host?x",
            "http://a b",
        ] {
            assert!(endpoint(bad).is_err(), "{bad}");
        }
    }

    /// A closed port is `Unreachable`, quickly, with a message that says what to do.
    #[test]
    fn a_closed_port_is_unreachable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        for cloud in [Cloud::Aws, Cloud::Gcp, Cloud::Azure] {
            let mut client = MetadataClient::new(
                cloud,
                &format!("http://127.0.0.1:{port}"),
                Duration::from_secs(1),
            );
            let started = Instant::now();
            let err = client.poll().unwrap_err();
            assert!(matches!(err, MetadataError::Unreachable { .. }), "{err}");
            assert!(err.to_string().contains("--preemption-notice"), "{err}");
            assert!(started.elapsed() < Duration::from_secs(30));
        }
    }
}
