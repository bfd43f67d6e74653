//! Test support (cargo feature `test-support`): a real etcd server started by the test.
//!
//! Tests never skip: if the `etcd` binary is missing, [`EtcdServer::start`] panics saying how
//! to install it.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::client::EtcdClient;
use super::url::EtcdUrl;

/// How long etcd may take to serve its first read (it takes < 3 s on an idle machine).
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Start attempts, each on fresh ports (another process may take a port we picked).
const ATTEMPTS: u32 = 3;

/// A single-member etcd on loopback, with its client and peer ports picked free and a fresh
/// data directory. Dropping it kills the server and removes the directory.
///
/// The binary is `$SEQPIPE_ETCD`, else `etcd` on `PATH` (`apt-get install -y etcd-server`
/// puts it in `/usr/bin`).
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    client_port: u16,
}

impl EtcdServer {
    /// Starts a server and waits (up to 10 s) until it serves reads. Panics, with the server's
    /// log, if it does not come up.
    pub fn start() -> Self {
        let etcd = find_etcd();
        let mut last_log = String::new();
        for attempt in 1..=ATTEMPTS {
            match Self::try_start(&etcd) {
                Ok(server) => return server,
                Err(log) => {
                    eprintln!("etcd start attempt {attempt} failed; retrying with new ports");
                    last_log = log;
                }
            }
        }
        panic!(
            "etcd (`{}`) did not start in {ATTEMPTS} attempts; last log:\n{last_log}",
            etcd.display()
        );
    }

    /// One start attempt; on failure returns the log after stopping the process.
    fn try_start(etcd: &Path) -> Result<Self, String> {
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let (client_port, peer_port) = free_ports();
        let dir = std::env::temp_dir().join(format!(
            "seqpipe-etcd-{}-{}-{client_port}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("creating etcd's dir {}: {e}", dir.display()));
        let log_path = dir.join("etcd.log");
        let log = std::fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log_path.display()));
        let log_err = log.try_clone().expect("cloning the log file handle");
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut command = Command::new(etcd);
        command
            .arg("--name=t")
            .arg(format!("--data-dir={}", dir.join("data").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=t={peer_url}"))
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        // etcd also reads its flags from ETCD_* variables: keep the caller's out.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD_") {
                command.env_remove(name);
            }
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting `{}`: {e}", etcd.display()));
        let mut server = EtcdServer {
            child,
            dir,
            client_port,
        };
        let probe = server.client().with_timeout(Duration::from_secs(1));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!("etcd exited early with {status}\n{}", server.log()));
            }
            // A (linearizable) read succeeds once the member is its cluster's raft leader.
            match probe.get(b"/ready-probe") {
                Ok(_) => return Ok(server),
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(format!(
                        "etcd did not serve a read within {READY_TIMEOUT:?} (last error: {e})\n{}",
                        server.log()
                    ));
                }
            }
        }
    }

    /// The client endpoint, `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// A client of this server.
    pub fn client(&self) -> EtcdClient {
        EtcdClient::new(self.endpoint())
    }

    /// The rendezvous URL `etcd://127.0.0.1:<port>/<prefix>`.
    pub fn url(&self, prefix: &str) -> EtcdUrl {
        EtcdUrl::parse(&format!("etcd://{}/{prefix}", self.endpoint()))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Finds the `etcd` binary or panics with how to install it.
fn find_etcd() -> PathBuf {
    if let Some(p) = std::env::var_os("SEQPIPE_ETCD") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "SEQPIPE_ETCD={} is not a file: point it at an etcd (3.4 or later) binary, or unset it",
            p.display()
        );
        return p;
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    });
    on_path.unwrap_or_else(|| {
        panic!(
            "the `etcd` binary is needed for the rendezvous tests and was not found (looked at \
             $SEQPIPE_ETCD and PATH): install it with `apt-get install -y etcd-server` (Debian \
             and Ubuntu; it lands in /usr/bin/etcd), or without root `apt-get download \
             etcd-server && dpkg-deb -x etcd-server_*.deb DIR` and set \
             SEQPIPE_ETCD=DIR/usr/bin/etcd"
        )
    })
}

/// Two distinct free loopback ports (client, peer). Another process may take one before etcd
/// binds it; [`EtcdServer::start`] then retries.
fn free_ports() -> (u16, u16) {
    let bind = || TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("binding a free port");
    let (a, b) = (bind(), bind());
    let port = |l: &TcpListener| l.local_addr().expect("a bound port").port();
    (port(&a), port(&b))
}
