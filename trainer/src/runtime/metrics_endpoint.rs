//! `GET /metrics` on `elastic.metrics_listen`: the coordinator's Prometheus endpoint, serving
//! [`LiveMetrics`]'s text exposition from a thread of its own (hyper's HTTP/1.1 server on a
//! single-threaded tokio runtime). Bounded so that scrapers cannot hurt the run, nor slow clients
//! starve scrapers: at most [`MAX_PENDING`] connections at once (more are closed unanswered),
//! each given [`HEADER_READ_TIMEOUT`] to send its request and closed after
//! [`CONNECTION_TIMEOUT`]; only requests that have fully arrived count against the
//! [`MAX_CONNECTIONS`] answered at once (503 beyond), so connections that dribble or hold a
//! partial request cannot take a scrape's place; no keep-alive, small request buffers; any other
//! path or method is answered 404 or 405. The training loop never waits on it: it only updates the metrics'
//! atomics.

use std::convert::Infallible;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Semaphore, oneshot};
use tracing::{debug, info, warn};

use super::live_metrics::{self, LiveMetrics};

/// Complete requests answered at once; beyond, 503.
pub const MAX_CONNECTIONS: usize = 8;

/// Connections open at once, most of them still sending their request; beyond, new ones are
/// closed at once. Each takes a few KiB, and one that is slow to send its request is closed
/// after [`HEADER_READ_TIMEOUT`].
pub const MAX_PENDING: usize = 64;

/// The longest a connection may take, from accepting it to the end of the response.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a client may take to send its request headers (a scraper sends them at once).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Request bytes buffered per connection (hyper's minimum is 8 KiB).
const MAX_BUF_SIZE: usize = 8 * 1024;

/// The running endpoint; dropping it stops the server and joins its thread.
pub struct MetricsEndpoint {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsEndpoint {
    /// Binds `listen` (`host:port`; port 0 picks a free one) and serves `metrics` there from a
    /// new thread. Fails when the address cannot be bound or the thread cannot start.
    pub fn start(listen: &str, metrics: Arc<LiveMetrics>) -> io::Result<Self> {
        let listener = TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("metrics-endpoint".into())
            .spawn(move || {
                runtime.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => serve(listener, metrics, stopped).await,
                        Err(error) => warn!(%error, "the metrics endpoint cannot serve"),
                    }
                });
            })?;
        info!(%addr, "serving Prometheus metrics on http://{addr}/metrics");
        Ok(Self {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepts connections until `stopped`; each is served on a task of its own, at most
/// [`MAX_CONNECTIONS`] at once.
async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<LiveMetrics>,
    mut stopped: oneshot::Receiver<()>,
) {
    let pending = Arc::new(Semaphore::new(MAX_PENDING));
    let serving = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait a little rather than spin.
                    debug!(%error, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = pending.clone().try_acquire_owned() else {
            debug!(%peer, "metrics endpoint: too many connections at once, closing one");
            continue;
        };
        let (metrics, serving) = (metrics.clone(), serving.clone());
        tokio::spawn(async move {
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .keep_alive(false)
                .max_buf_size(MAX_BUF_SIZE)
                .serve_connection(
                    TokioIo::new(stream),
                    service_fn(move |request| {
                        // The request has arrived: only now does it take a serving slot.
                        let response = match serving.try_acquire() {
                            Ok(_answering) => respond(&request, &metrics),
                            Err(_) => busy(),
                        };
                        async move { Ok::<_, Infallible>(response) }
                    }),
                );
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Err(error)) => debug!(%peer, %error, "metrics endpoint: bad request"),
                Err(_) => debug!(%peer, "metrics endpoint: connection timed out"),
                Ok(Ok(())) => {}
            }
            drop(slot);
        });
    }
}

/// The answer when [`MAX_CONNECTIONS`] requests are being answered already.
fn busy() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(
        b"too many scrapes at once; retry\n",
    )));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    response
        .headers_mut()
        .insert(RETRY_AFTER, hyper::header::HeaderValue::from_static("1"));
    response
}

/// The answer to one request: the exposition for `GET /metrics` (and `HEAD`), 404 for any other
/// path, 405 for any other method.
fn respond(request: &Request<Incoming>, metrics: &LiveMetrics) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response
    };
    if request.uri().path() != "/metrics" {
        return reply(
            StatusCode::NOT_FOUND,
            "seqpipe serves only /metrics here\n".into(),
        );
    }
    match *request.method() {
        Method::GET | Method::HEAD => {
            let mut response = reply(StatusCode::OK, metrics.encode());
            response.headers_mut().insert(
                CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(live_metrics::CONTENT_TYPE),
            );
            response
        }
        _ => {
            let mut response = reply(StatusCode::METHOD_NOT_ALLOWED, "only GET /metrics\n".into());
            response
                .headers_mut()
                .insert(ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    /// Sends `request` and reads the whole answer (the server closes the connection).
    fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        stream.write_all(request).unwrap();
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer
    }

    #[test]
    fn serves_metrics_and_refuses_the_rest() {
        let metrics = Arc::new(LiveMetrics::new());
        let endpoint = MetricsEndpoint::start("127.0.0.1:0", metrics).unwrap();
        let addr = endpoint.local_addr();
        let ok = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("application/openmetrics-text"), "{ok}");
        assert!(
            ok.contains("seqpipe_step 0\n") && ok.ends_with("# EOF\n"),
            "{ok}"
        );
        let missing = exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = exchange(addr, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        // Garbage is answered with an error or a closed connection, and the server goes on.
        let garbage = exchange(addr, b"\x00\x01 not http at all\r\n\r\n");
        assert!(!garbage.contains("200 OK"), "{garbage}");
        let again = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(again.starts_with("HTTP/1.1 200 OK\r\n"), "{again}");
        drop(endpoint);
        assert!(
            TcpStream::connect(addr).is_err(),
            "still listening after drop"
        );
    }

    #[test]
    fn a_taken_port_is_an_error() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        assert!(MetricsEndpoint::start(&addr, Arc::new(LiveMetrics::new())).is_err());
    }

    /// Issue 35: 20 slowloris connections filled the 8 slots and 24 of 25 scrapes failed. With
    /// 20 clients that keep a partial request open (dribbling a header line now and then, and
    /// coming back as soon as they are closed), every scrape is still answered.
    #[test]
    fn slow_clients_do_not_starve_scrapes() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let metrics = Arc::new(LiveMetrics::new());
        let endpoint = MetricsEndpoint::start("127.0.0.1:0", metrics).unwrap();
        let addr = endpoint.local_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let holding = Arc::new(AtomicUsize::new(0));
        let attackers: Vec<_> = (0..20)
            .map(|_| {
                let (stop, holding) = (Arc::clone(&stop), Arc::clone(&holding));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        let Ok(mut stream) = TcpStream::connect(addr) else {
                            std::thread::sleep(Duration::from_millis(50));
                            continue;
                        };
                        if stream
                            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                            .is_ok()
                        {
                            holding.fetch_add(1, Ordering::SeqCst);
                            while !stop.load(Ordering::SeqCst)
                                && stream.write_all(b"X-Slow: 1\r\n").is_ok()
                            {
                                std::thread::sleep(Duration::from_millis(300));
                            }
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                })
            })
            .collect();
        // Every attacker has connected at least once before the scrapes start.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while holding.load(Ordering::SeqCst) < 20 {
            assert!(
                std::time::Instant::now() < deadline,
                "attackers never connected"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
        let mut failed = Vec::new();
        for i in 0..15 {
            let answer = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
            if !answer.starts_with("HTTP/1.1 200 OK\r\n") {
                failed.push((i, answer));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        stop.store(true, Ordering::SeqCst);
        for a in attackers {
            a.join().unwrap();
        }
        assert!(failed.is_empty(), "scrapes that failed: {failed:?}");
    }
}
