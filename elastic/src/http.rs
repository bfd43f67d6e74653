//! The crate's HTTP/1.1 (the etcd client's `POST`s, the cloud metadata services' `GET`s and
//! `PUT`s), on the maintained `ureq` crate: one request per call, under a total deadline
//! (resolve, connect, send and the whole response) and with bounded memory (response headers
//! and body have size limits), so that a slow, broken or hostile server yields a clear error in
//! time instead of a hang or an allocation it chose.

use std::io;
use std::time::Duration;

use ureq::Agent;

/// The largest etcd response body accepted. etcd's own limit on a request is 1.5 MiB by default and
/// the rendezvous keeps a few small keys, so anything near this is not an etcd answer.
pub(crate) const MAX_BODY: u64 = 16 << 20;

/// The largest status line plus headers accepted (etcd sends a few hundred bytes).
pub(crate) const MAX_HEADER: usize = 64 << 10;

/// A response: its status code, headers and (de-chunked) body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Response {
    /// The HTTP status code, e.g. 200.
    pub status: u16,
    /// The response headers.
    pub headers: ureq::http::HeaderMap,
    /// The body, with any chunked framing removed.
    pub body: Vec<u8>,
}

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// No TCP connection could be opened (refused, unresolvable host, connect timeout).
    #[error("{0}")]
    Connect(io::Error),
    /// The whole call (connect, request, response) did not finish within the deadline.
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
    /// The connection broke while the request was sent or the response read.
    #[error("{0}")]
    Io(io::Error),
    /// The bytes received are not an acceptable HTTP/1.x response (malformed, or over a limit).
    #[error("{0}")]
    Malformed(String),
}

/// An HTTP agent whose every call ends within `timeout`, all of it: resolving, connecting,
/// sending, and receiving the headers and the whole body. It keeps no idle connection (one
/// connection per call, so that a call never meets a socket the server has since closed),
/// follows no redirect, ignores proxy environment variables (etcd and the metadata services
/// are reached directly) and returns error statuses as responses (etcd's JSON errors come with
/// them; a metadata service's 404 is an answer).
pub(crate) fn agent(timeout: Duration) -> Agent {
    let config = Agent::config_builder()
        .timeout_global(Some(timeout))
        // Without this the connect phase has no own budget and a connect timeout is reported
        // as a global one; with it, it is told apart as "unreachable".
        .timeout_connect(Some(timeout))
        .max_response_header_size(MAX_HEADER)
        .max_idle_connections(0)
        .max_idle_connections_per_host(0)
        .max_redirects(0)
        .max_redirects_will_error(false)
        .http_status_as_error(false)
        .proxy(None)
        .build();
    Agent::new_with_config(config)
}

/// `POST path` with a JSON `body` to `endpoint` (`host:port`) through `agent` (see [`agent`]).
/// `timeout` is the agent's deadline, for the error that reports it.
pub(crate) fn post(
    agent: &Agent,
    endpoint: &str,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let request = ureq::http::Request::post(format!("http://{endpoint}{path}"))
        .header("Content-Type", "application/json")
        .body(body)
        .map_err(|e| convert(e.into(), endpoint, timeout))?;
    send(agent, request, MAX_BODY, endpoint, timeout)
}

/// `method url` with `headers` and no body through `agent` (see [`agent`]), accepting a body
/// of at most `max_body` bytes. `timeout` is the agent's deadline, for the error that reports
/// it.
pub(crate) fn call(
    agent: &Agent,
    method: ureq::http::Method,
    url: &str,
    headers: &[(&str, &str)],
    max_body: u64,
    timeout: Duration,
) -> Result<Response, HttpError> {
    let mut request = ureq::http::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(&[][..])
        .map_err(|e| convert(e.into(), url, timeout))?;
    send(agent, request, max_body, url, timeout)
}

/// Sends `request` and reads the whole response, its body up to `max_body` bytes.
fn send(
    agent: &Agent,
    request: ureq::http::Request<&[u8]>,
    max_body: u64,
    endpoint: &str,
    timeout: Duration,
) -> Result<Response, HttpError> {
    let convert = |e| convert(e, endpoint, timeout);
    let mut response = agent.run(request).map_err(convert)?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.body_mut();
    // Refuse an announced oversize body before reading any of it.
    if let Some(len) = body.content_length().filter(|&len| len > max_body) {
        return Err(HttpError::Malformed(format!(
            "HTTP {status} announces a body of {len} bytes (Content-Length), more than the \
             {max_body} accepted"
        )));
    }
    // Chunked and close-delimited bodies are counted as they arrive; the buffer grows with
    // what was received, never with what a chunk size claims.
    let body = body
        .with_config()
        .limit(max_body)
        .read_to_vec()
        .map_err(convert)?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// A `ureq` error as an [`HttpError`].
fn convert(e: ureq::Error, endpoint: &str, timeout: Duration) -> HttpError {
    use ureq::Timeout as T;
    match e {
        ureq::Error::Timeout(T::Connect | T::Resolve) => HttpError::Connect(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no TCP connection within {timeout:?}"),
        )),
        ureq::Error::Timeout(_) => HttpError::Timeout(timeout),
        ureq::Error::HostNotFound => HttpError::Connect(io::Error::new(
            io::ErrorKind::NotFound,
            "the host name resolved to no address",
        )),
        ureq::Error::ConnectionFailed => HttpError::Connect(io::Error::other("connection failed")),
        // The request's method and headers are fixed: only the address in `endpoint` (etcd's
        // `HOST:PORT`, a metadata service's URL) can be bad.
        e @ (ureq::Error::BadUri(_) | ureq::Error::Http(_)) => HttpError::Connect(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "`{endpoint}` is not a usable {} ({e})",
                if endpoint.contains("://") {
                    "URL"
                } else {
                    "HOST:PORT"
                }
            ),
        )),
        ureq::Error::Io(e) => match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => HttpError::Timeout(timeout),
            io::ErrorKind::ConnectionRefused
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::NetworkDown
            | io::ErrorKind::AddrNotAvailable => HttpError::Connect(e),
            _ => HttpError::Io(e),
        },
        ureq::Error::BodyExceedsLimit(limit) => HttpError::Malformed(format!(
            "the response body goes past {limit} bytes, the most accepted (reading stopped there)"
        )),
        ureq::Error::LargeResponseHeader(_, limit) => HttpError::Malformed(format!(
            "the response headers go past {limit} bytes, the most accepted (reading stopped there)"
        )),
        ureq::Error::Protocol(e) => HttpError::Malformed(format!("not valid HTTP/1.1: {e}")),
        other => HttpError::Malformed(other.to_string()),
    }
}
