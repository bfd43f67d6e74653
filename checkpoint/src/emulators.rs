//! Test support (cargo feature `test-support`): the cloud storage emulator the `az://` store is
//! tested against, Azurite (Microsoft's Azure Storage emulator), started on loopback by the test,
//! with the environment that points seqpipe's stores at it.
//!
//! Tests never skip: a missing emulator panics saying how to install it (`./scripts/test.sh`
//! installs it).
//!
//! (No GCS emulator: object_store's GCS client writes through GCS's XML API — objects, and shards
//! as XML multipart uploads — which the stock fake-gcs-server does not serve (PUT answers 400,
//! `POST ?uploads` 400: fsouza/fake-gcs-server#331, #852), and gcp-storage-emulator serves PUT but
//! not multipart uploads (501) or DELETE (501), and ignores `x-goog-if-generation-match: 0`.)

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
