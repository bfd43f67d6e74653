//! `etcd://HOST:PORT/PREFIX`: where the rendezvous lives.

use std::fmt;
use std::str::FromStr;

use super::error::EtcdError;

/// A parsed rendezvous URL: an etcd client endpoint and the key prefix of one job.
///
/// `etcd://10.0.0.5:2379/seqpipe/my-job` is endpoint `10.0.0.5:2379` and prefix
/// `/seqpipe/my-job`; the job's keys are `/seqpipe/my-job/nodes/<id>`, `.../leader` and so on.
/// IPv6 hosts go in brackets (`etcd://[::1]:2379/p`). The prefix is required, so that jobs
/// sharing an etcd never share keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdUrl {
    endpoint: String,
    prefix: String,
}

impl EtcdUrl {
    /// Parses `etcd://HOST:PORT/PREFIX`; a trailing `/` is dropped. The error says what is
    /// wrong and shows the expected form.
    pub fn parse(url: &str) -> Result<Self, EtcdError> {
        let bad = |reason: &str| EtcdError::BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let Some(rest) = url.strip_prefix("etcd://") else {
            return Err(bad(match url.split_once("://") {
                Some(("http" | "https", _)) => {
                    "the scheme must be `etcd://` (seqpipe speaks HTTP to HOST:PORT itself; TLS \
                     is not supported)"
                }
                Some(_) => "the scheme must be `etcd://`",
                None => "it does not start with `etcd://`",
            }));
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.contains('@') {
            return Err(bad("user names and passwords are not supported"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| bad("an IPv6 host needs its closing `]`"))?;
            (host, after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("the host is missing"));
        }
        let port =
            port.ok_or_else(|| bad("the port is missing (etcd's client port is usually 2379)"))?;
        if !matches!(port.parse::<u16>(), Ok(p) if p > 0) {
            return Err(bad(&format!(
                "the port `{port}` is not a number in 1..=65535"
            )));
        }
        if path.contains(['?', '#']) {
            return Err(bad("query strings and fragments are not supported"));
        }
        let path = path.trim_end_matches('/');
        if path.is_empty() {
            return Err(bad(
                "the key prefix is missing: name one after HOST:PORT so that jobs sharing this \
                 etcd do not share keys",
            ));
        }
        if path.split('/').any(str::is_empty) {
            return Err(bad("the key prefix has an empty segment (`//`)"));
        }
        Ok(Self {
            endpoint: authority.to_string(),
            prefix: format!("/{path}"),
        })
    }

    /// The client endpoint, `HOST:PORT` (IPv6 hosts in brackets).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The key prefix, with a leading and no trailing `/`, e.g. `/seqpipe/my-job`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl FromStr for EtcdUrl {
    type Err = EtcdError;

    fn from_str(url: &str) -> Result<Self, EtcdError> {
        Self::parse(url)
    }
}

impl fmt::Display for EtcdUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "etcd://{}{}", self.endpoint, self.prefix)
    }
}
