//! A tiny blocking HTTP/1.1 client, just enough for etcd's JSON gateway: one `POST` with a JSON
//! body per connection (`Connection: close`). Response bodies may be framed by
//! `Content-Length`, by `Transfer-Encoding: chunked` (trailers included: etcd sends one on
//! errors) or by the end of the connection.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The largest response body accepted, so that a wrong server cannot make us buffer forever.
const MAX_BODY: u64 = 64 << 20;

/// The longest status, header or chunk-size line accepted.
const MAX_LINE: u64 = 64 << 10;

/// A response: its status code and its (de-chunked) body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Response {
    /// The HTTP status code, e.g. 200.
    pub status: u16,
    /// The body, with any chunked framing removed.
    pub body: Vec<u8>,
}

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// No TCP connection could be opened (refused, unresolvable host, connect timeout).
    #[error("{0}")]
    Connect(io::Error),
    /// The server did not answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection broke while the request was sent or the response read.
    #[error("{0}")]
    Io(io::Error),
    /// The bytes received are not an HTTP/1.x response.
    #[error("{0}")]
    Malformed(String),
}

impl From<io::Error> for HttpError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// `POST path` with a JSON `body` to `endpoint` (`host:port`). `timeout` bounds the connect,
/// and each write and read on the socket.
pub(crate) fn post(
    endpoint: &str,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let stream = connect(endpoint, timeout)?;
    let timed_out = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => HttpError::Timeout(timeout),
        _ => HttpError::from(e),
    };
    stream
        .set_read_timeout(Some(timeout))
        .map_err(HttpError::Io)?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(HttpError::Io)?;
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    (&stream).write_all(&request).map_err(timed_out)?;
    read_response(BufReader::new(stream)).map_err(|e| match e {
        HttpError::Io(e) => timed_out(e),
        other => other,
    })
}

/// A connection to the first address of `endpoint` that accepts one.
fn connect(endpoint: &str, timeout: Duration) -> Result<TcpStream, HttpError> {
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        "the host name resolved to no address",
    );
    for addr in endpoint.to_socket_addrs().map_err(HttpError::Connect)? {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(HttpError::Connect(last))
}

/// Reads one response (status line, headers, body) from `r`. Informational (1xx) responses
/// before the final one are skipped.
pub(crate) fn read_response(mut r: impl BufRead) -> Result<Response, HttpError> {
    loop {
        let status_line = read_line(&mut r, "the status line")?;
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or_default();
        let status = parts.next().and_then(|s| s.parse::<u16>().ok());
        let status = match status {
            Some(status) if version.starts_with("HTTP/1.") => status,
            _ => {
                return Err(HttpError::Malformed(format!(
                    "not an HTTP/1.x status line: {status_line:?}"
                )));
            }
        };
        let headers = read_headers(&mut r)?;
        if (100..200).contains(&status) {
            continue;
        }
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        let chunked =
            header("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let body = if chunked {
            read_chunked(&mut r)?
        } else if let Some(len) = header("content-length") {
            let len: u64 = len
                .parse()
                .map_err(|_| HttpError::Malformed(format!("bad Content-Length {len:?}")))?;
            if len > MAX_BODY {
                return Err(HttpError::Malformed(format!(
                    "a body of {len} bytes (more than {MAX_BODY})"
                )));
            }
            let mut body = Vec::new();
            r.take(len).read_to_end(&mut body)?;
            if body.len() as u64 != len {
                return Err(closed_early(&format!(
                    "after {} of {len} body bytes",
                    body.len()
                )));
            }
            body
        } else {
            let mut body = Vec::new();
            r.take(MAX_BODY + 1).read_to_end(&mut body)?;
            if body.len() as u64 > MAX_BODY {
                return Err(HttpError::Malformed(format!(
                    "a body of more than {MAX_BODY} bytes"
                )));
            }
            body
        };
        return Ok(Response { status, body });
    }
}

/// Header lines up to the empty line that ends them, as `(name, value)`.
fn read_headers(r: &mut impl BufRead) -> Result<Vec<(String, String)>, HttpError> {
    let mut headers = Vec::new();
    loop {
        let line = read_line(r, "the headers")?;
        if line.is_empty() {
            return Ok(headers);
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| HttpError::Malformed(format!("a header line without `:`: {line:?}")))?;
        headers.push((name.trim().to_string(), value.trim().to_string()));
    }
}

/// A chunked body: `<hex size>[;ext]\r\n<data>\r\n` ... `0\r\n<trailers>\r\n`.
fn read_chunked(r: &mut impl BufRead) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r, "a chunk size")?;
        let hex = line.split(';').next().unwrap_or_default().trim();
        let size = u64::from_str_radix(hex, 16)
            .map_err(|_| HttpError::Malformed(format!("bad chunk size line {line:?}")))?;
        if size == 0 {
            // Trailers (etcd sends `Grpc-Trailer-Content-Type`), then an empty line. A server
            // that closes right after the last chunk loses nothing we need.
            loop {
                match read_line(r, "the trailers") {
                    Ok(line) if !line.is_empty() => continue,
                    Ok(_) | Err(HttpError::Io(_)) => return Ok(body),
                    Err(e) => return Err(e),
                }
            }
        }
        if body.len() as u64 + size > MAX_BODY {
            return Err(HttpError::Malformed(format!(
                "a chunked body of more than {MAX_BODY} bytes"
            )));
        }
        let start = body.len();
        r.take(size).read_to_end(&mut body)?;
        if (body.len() - start) as u64 != size {
            return Err(closed_early(&format!(
                "inside a chunk of {size} bytes ({} received)",
                body.len() - start
            )));
        }
        let end = read_line(r, "the end of a chunk")?;
        if !end.is_empty() {
            return Err(HttpError::Malformed(format!(
                "a chunk of {size} bytes followed by {end:?} instead of CRLF"
            )));
        }
    }
}

/// One line without its line ending (CRLF or a bare LF). `what` names the part of the response
/// for the error when the connection closes first.
fn read_line(r: &mut impl BufRead, what: &str) -> Result<String, HttpError> {
    let mut line = Vec::new();
    r.take(MAX_LINE).read_until(b'\n', &mut line)?;
    if line.last() != Some(&b'\n') {
        return Err(if line.len() as u64 >= MAX_LINE {
            HttpError::Malformed(format!("a line in {what} longer than {MAX_LINE} bytes"))
        } else {
            closed_early(&format!("in {what}"))
        });
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| HttpError::Malformed(format!("{what} is not UTF-8")))
}

fn closed_early(where_: &str) -> HttpError {
    HttpError::Io(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the connection closed {where_}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8]) -> Result<Response, HttpError> {
        read_response(raw)
    }

    #[test]
    fn content_length_body() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\":\"b\"}\n\nextra";
        let r = parse(raw).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"{\"a\":\"b\"}\n\n");
    }

    /// What etcd 3.4 sends for an error on a lease call: chunked, with a trailer.
    #[test]
    fn chunked_body_with_extension_and_trailer() {
        let raw = b"HTTP/1.1 404 Not Found\r\nTrailer: Grpc-Trailer-Content-Type\r\n\
            Transfer-Encoding: chunked\r\n\r\n\
            6;name=value\r\n{\"a\":1\r\n3\r\n, \"\r\n5\r\nb\":2}\r\nA\r\n0123456789\r\n0\r\n\
            Grpc-Trailer-Content-Type: application/grpc\r\n\r\n";
        let r = parse(raw).unwrap();
        assert_eq!(r.status, 404);
        assert_eq!(r.body, b"{\"a\":1, \"b\":2}0123456789");
    }

    #[test]
    fn chunked_body_ended_by_close_after_last_chunk() {
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n2\r\nok\r\n0\r\n";
        assert_eq!(parse(raw).unwrap().body, b"ok");
    }

    #[test]
    fn body_until_close_and_bare_lf_lines() {
        let raw = b"HTTP/1.0 200 OK\nServer: x\n\nall of it";
        assert_eq!(parse(raw).unwrap().body, b"all of it");
    }

    #[test]
    fn informational_response_is_skipped() {
        let raw =
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nhi";
        let r = parse(raw).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (201, &b"hi"[..]));
    }

    #[test]
    fn malformed_responses_say_what_is_wrong() {
        let cases: [(&[u8], &str); 6] = [
            (b"SSH-2.0-OpenSSH\r\n", "not an HTTP/1.x status line"),
            (b"HTTP/1.1 abc OK\r\n\r\n", "not an HTTP/1.x status line"),
            (
                b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
                "header line without `:`",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
                "bad Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                "bad chunk size",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokX\r\n",
                "instead of CRLF",
            ),
        ];
        for (raw, expected) in cases {
            match parse(raw) {
                Err(HttpError::Malformed(m)) => assert!(m.contains(expected), "{m}"),
                other => panic!(
                    "{:?}: expected Malformed, got {other:?}",
                    raw.escape_ascii()
                ),
            }
        }
    }

    #[test]
    fn truncated_responses_are_io_errors() {
        let cases: [(&[u8], &str); 4] = [
            (b"", "closed in the status line"),
            (b"HTTP/1.1 200 OK\r\nContent-Le", "closed in the headers"),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
                "after 5 of 10 body bytes",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
                "inside a chunk of 5 bytes (2 received)",
            ),
        ];
        for (raw, expected) in cases {
            match parse(raw) {
                Err(HttpError::Io(e)) => {
                    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
                    assert!(e.to_string().contains(expected), "{e}");
                }
                other => panic!("{:?}: expected Io, got {other:?}", raw.escape_ascii()),
            }
        }
    }
}
