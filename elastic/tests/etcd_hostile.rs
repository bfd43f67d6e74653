//! The etcd client against fake etcds that misbehave on purpose (in-process servers on
//! loopback): one that drips a byte at a time, one that floods header lines, one that announces
//! a chunk or a body of absurd size. Each call must end within its deadline with an error that
//! says what was wrong, where and for which request, and the process's memory must stay
//! bounded. A fake that answers like etcd 3.4 does with an error checks that those answers are
//! still read.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use elastic::etcd::{EtcdClient, EtcdError};

/// The client's deadline for each call in these tests.
const TIMEOUT: Duration = Duration::from_secs(2);

/// How long past [`TIMEOUT`] a call may end on a busy machine.
const SLACK: Duration = Duration::from_secs(3);

/// How much the process's peak memory may grow across a test. The client's limits keep it to
/// a few tens of MiB; the old client buffered 2.2 GB for a single huge chunk.
const MAX_GROWTH_KIB: u64 = 200 << 10;

/// A fake etcd on a free loopback port: every connection is read up to the end of the request
/// headers and then handed to `answer` on a thread of its own. Returns `host:port`.
fn fake_etcd(answer: fn(TcpStream)) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                skip_request_head(&mut stream);
                answer(stream);
            });
        }
    });
    endpoint
}

/// Reads until the blank line that ends the request's headers (the small JSON body that follows
/// is left unread: these servers do not care).
fn skip_request_head(stream: &mut TcpStream) {
    let mut seen = Vec::new();
    let mut byte = [0u8];
    while !seen.ends_with(b"\r\n\r\n") && seen.len() < 64 << 10 {
        match stream.read(&mut byte) {
            Ok(1) => seen.push(byte[0]),
            _ => return,
        }
    }
}

/// Writes `data` again and again until the client goes away.
fn flood(mut stream: TcpStream, head: &[u8], data: &[u8]) {
    if stream.write_all(head).is_err() {
        return;
    }
    while stream.write_all(data).is_ok() {}
}

/// Writes `data` one byte every 200 ms, then one `x` every 200 ms forever, until the client
/// goes away.
fn drip(mut stream: TcpStream, data: &[u8]) {
    for byte in data.iter().chain(std::iter::repeat(&b'x')) {
        if stream.write_all(std::slice::from_ref(byte)).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The process's peak resident memory so far (`VmHWM`), KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Runs `call` against a fake etcd answering with `answer`, checks that it failed within
/// [`TIMEOUT`] + [`SLACK`] without growing memory by more than [`MAX_GROWTH_KIB`], and returns the
/// error with its message.
fn hostile(
    answer: fn(TcpStream),
    call: impl FnOnce(&EtcdClient) -> Result<(), EtcdError>,
) -> (EtcdError, String, String) {
    let endpoint = fake_etcd(answer);
    let client = EtcdClient::new(&endpoint).with_timeout(TIMEOUT);
    let before = peak_rss_kib();
    let start = Instant::now();
    let err = call(&client).expect_err("a hostile server must give an error");
    let elapsed = start.elapsed();
    let growth = peak_rss_kib().saturating_sub(before);
    let text = err.to_string();
    eprintln!("{elapsed:.2?}, peak memory +{growth} KiB: {text}");
    assert!(
        elapsed < TIMEOUT + SLACK,
        "took {elapsed:?}, deadline {TIMEOUT:?}: {text}"
    );
    assert!(
        growth < MAX_GROWTH_KIB,
        "peak memory grew by {growth} KiB: {text}"
    );
    assert!(text.contains(&endpoint), "{text}");
    (err, text, endpoint)
}

fn get(client: &EtcdClient) -> Result<(), EtcdError> {
    client.get(b"/job/k").map(|_| ())
}

fn put(client: &EtcdClient) -> Result<(), EtcdError> {
    client.put(b"/job/k", b"v", None)
}

#[test]
fn a_server_dripping_its_status_line_times_out_at_the_deadline() {
    let (err, text, _) = hostile(|s| drip(s, b"HTTP/1.1 200 OK\r\n"), get);
    assert!(matches!(err, EtcdError::Timeout { .. }), "{text}");
    assert!(
        text.contains("did not answer kv/range `/job/k` completely within 2s"),
        "{text}"
    );
    assert!(text.contains("etcdctl endpoint health"), "{text}");
}

/// Headers on time, then a body that never ends: the deadline covers the body too, not just
/// each read.
#[test]
fn a_server_dripping_its_body_times_out_at_the_deadline() {
    let (err, text, _) = hostile(
        |mut s| {
            let head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                         Content-Length: 1000000\r\n\r\n{";
            if s.write_all(head).is_ok() {
                drip(s, b"");
            }
        },
        put,
    );
    assert!(matches!(err, EtcdError::Timeout { .. }), "{text}");
    assert!(
        text.contains("did not answer kv/put `/job/k` completely within 2s"),
        "{text}"
    );
}

/// Many header lines, and one header line that never ends: both stop at a limit (ureq's count
/// of header lines, the client's 64 KiB of headers).
#[test]
fn endless_headers_are_refused_at_a_limit() {
    let (err, text, _) = hostile(
        |s| {
            flood(
                s,
                b"HTTP/1.1 200 OK\r\n",
                b"X-Flood: aaaaaaaaaaaaaaaaaaaaaaaa\r\n",
            )
        },
        get,
    );
    assert!(matches!(err, EtcdError::BadResponse { .. }), "{text}");
    assert!(text.contains("unreadable answer from"), "{text}");
    assert!(text.contains("to kv/range `/job/k`"), "{text}");
    assert!(text.contains("too many headers"), "{text}");
    assert!(text.contains("etcd 3.4 or later"), "{text}");

    let (err, text, _) = hostile(
        |s| flood(s, b"HTTP/1.1 200 OK\r\nX-Flood: ", &[b'a'; 4096]),
        put,
    );
    assert!(matches!(err, EtcdError::BadResponse { .. }), "{text}");
    assert!(text.contains("to kv/put `/job/k`"), "{text}");
    assert!(
        text.contains("the response headers go past 65536 bytes, the most accepted"),
        "{text}"
    );
}

/// `ffffffffffffffff` is the largest chunk size a u64 holds: the old client checked
/// `len + size` against its limit, which overflowed, and buffered gigabytes.
#[test]
fn a_huge_chunk_is_refused_at_the_body_limit_without_allocating_it() {
    let (err, text, _) = hostile(
        |s| {
            let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                         ffffffffffffffff\r\n";
            flood(s, head, &[b'x'; 64 << 10]);
        },
        get,
    );
    assert!(matches!(err, EtcdError::BadResponse { .. }), "{text}");
    assert!(
        text.contains("the response body goes past 16777216 bytes, the most accepted"),
        "{text}"
    );
}

#[test]
fn a_chunk_size_beyond_u64_is_refused() {
    let (err, text, _) = hostile(
        |s| {
            let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                         1ffffffffffffffff\r\n";
            flood(s, head, &[b'x'; 64 << 10]);
        },
        put,
    );
    assert!(matches!(err, EtcdError::BadResponse { .. }), "{text}");
    assert!(text.contains("not valid HTTP/1.1"), "{text}");
    assert!(text.contains("chunk length"), "{text}");
}

/// A Content-Length of 10 GB is refused as soon as the headers are in, before any of the body.
#[test]
fn an_announced_10_gb_body_is_refused_before_reading_it() {
    let (err, text, _) = hostile(
        |s| {
            let head = b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n";
            flood(s, head, &[b'x'; 64 << 10]);
        },
        get,
    );
    assert!(matches!(err, EtcdError::BadResponse { .. }), "{text}");
    assert!(
        text.contains("announces a body of 10000000000 bytes (Content-Length), more than the 16777216 accepted"),
        "{text}"
    );
}

/// Neither a length nor chunks: the body runs to the end of the connection, which never comes.
#[test]
fn an_endless_close_delimited_body_is_refused_at_the_body_limit() {
    let (err, text, _) = hostile(
        |s| {
            flood(
                s,
                b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
                &[b'x'; 64 << 10],
            )
        },
        put,
    );
    assert!(matches!(err, EtcdError::BadResponse { .. }), "{text}");
    assert!(
        text.contains("the response body goes past 16777216 bytes, the most accepted"),
        "{text}"
    );
}

#[test]
fn a_server_that_is_not_http_is_named() {
    let (err, text, _) = hostile(|s| flood(s, b"SSH-2.0-OpenSSH_9.6\r\n", b""), get);
    assert!(matches!(err, EtcdError::BadResponse { .. }), "{text}");
    assert!(text.contains("not valid HTTP/1.1"), "{text}");
}

/// What etcd 3.4 sends for an error on a lease call: HTTP 404, chunked, with an extension and a
/// trailer. It must still reach the caller as etcd's own error.
#[test]
fn an_etcd_error_in_a_chunked_answer_with_a_trailer_is_read() {
    let endpoint = fake_etcd(|mut s| {
        let body: &[u8] = b"{\"error\":\"etcdserver: requested lease not found\",\"code\":5,\
            \"message\":\"etcdserver: requested lease not found\"}\n";
        let mut answer = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n\
            Trailer: Grpc-Trailer-Content-Type\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
        for (i, chunk) in body.chunks(40).enumerate() {
            let extension = if i == 0 { ";name=value" } else { "" };
            answer.extend_from_slice(format!("{:X}{extension}\r\n", chunk.len()).as_bytes());
            answer.extend_from_slice(chunk);
            answer.extend_from_slice(b"\r\n");
        }
        answer.extend_from_slice(b"0\r\nGrpc-Trailer-Content-Type: application/grpc\r\n\r\n");
        let _ = s.write_all(&answer);
    });
    let client = EtcdClient::new(&endpoint).with_timeout(TIMEOUT);
    let err = client.get(b"/job/k").unwrap_err();
    let text = err.to_string();
    match err {
        EtcdError::Server {
            status,
            code,
            message,
            ..
        } => {
            assert_eq!((status, code), (404, 5), "{text}");
            assert_eq!(message, "etcdserver: requested lease not found", "{text}");
        }
        other => panic!("expected a Server error, got {other:?}"),
    }
    assert!(
        text.contains(&format!("etcd at {endpoint} refused kv/range `/job/k`")),
        "{text}"
    );
}

#[test]
fn an_endpoint_that_is_no_host_port_is_named() {
    let err = EtcdClient::new("10.0.0.5:2379/x y")
        .with_timeout(TIMEOUT)
        .get(b"/job/k")
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, EtcdError::Unreachable { .. }), "{text}");
    assert!(
        text.contains("cannot reach etcd at 10.0.0.5:2379/x y for kv/range `/job/k`"),
        "{text}"
    );
    assert!(text.contains("is not a usable HOST:PORT"), "{text}");
}
