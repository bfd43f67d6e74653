//! Hostile peers against the real binary: a coordinator that does not know the job token, one that
//! does and sends values that must not be used, and frames over a channel's limits. Each attack
//! must end in a clear error (or a closed connection), never a panic, and never a file outside
//! the directory the victim was given.

mod common;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use common::{fresh_dir, seqpipe};
use trainer::runtime::auth::{self, Purpose};
use trainer::runtime::control::{FromAgent, ToAgent};
use trainer::runtime::wire::{Frame, Limits, read_frame, write_frame};

const TOKEN: &str = "adversarial-test-token";

/// Every path under `root`, relative, sorted.
fn tree(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            out.push(path.strip_prefix(root).unwrap().display().to_string());
            if path.is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// Runs `seqpipe agent` against a fake coordinator on a fresh port that plays `coordinator`
/// with each connection; returns the agent's exit code and stderr. The agent's `--dir` is four
/// levels below `root`, so that `../../../../x` would land inside `root`, where the test looks.
fn agent_against(
    root: &Path,
    coordinator: impl Fn(TcpStream) + Send + Sync + 'static,
) -> (Option<i32>, String) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            coordinator(stream);
        }
    });
    let dir = root.join("a/b/c/agent");
    let out = seqpipe()
        .args(["agent", "--join", &addr.to_string(), "--name", "victim"])
        .arg("--dir")
        .arg(&dir)
        .args(["--connect-timeout-s", "5"])
        .env(auth::TOKEN_ENV, TOKEN)
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !stderr.contains("panicked"),
        "the agent panicked:\n{stderr}"
    );
    (out.status.code(), stderr)
}

/// Nothing under `root` but the agent's own directory.
fn assert_only_agent_dir(root: &Path) {
    for path in tree(root) {
        assert!(
            path == "a" || path == "a/b" || path == "a/b/c" || path.starts_with("a/b/c/agent"),
            "the agent wrote {path} outside its --dir; tree: {:?}",
            tree(root)
        );
    }
}

fn send(stream: &mut TcpStream, msg: &ToAgent) {
    write_frame(stream, &Frame::new(msg, Vec::new())).unwrap();
}

/// Plays an authenticated coordinator: proves the token, reads the join, then sends `messages`.
fn authenticated(messages: Vec<ToAgent>) -> impl Fn(TcpStream) + Send + Sync + 'static {
    move |mut stream: TcpStream| {
        if auth::accept(&mut stream, TOKEN, Purpose::Control).is_err() {
            return;
        }
        let join: FromAgent = read_frame(&mut stream, Limits::CONTROL)
            .unwrap()
            .header()
            .unwrap();
        assert!(matches!(join, FromAgent::Join { .. }), "{join:?}");
        for msg in &messages {
            send(&mut stream, msg);
        }
        // Keep the connection open until the agent acts on what it got.
        std::thread::sleep(Duration::from_secs(10));
    }
}

#[test]
fn an_agent_refuses_a_coordinator_that_does_not_know_the_token() {
    // Speaks the protocol with another token; then one that skips the proof entirely (the old
    // one-sided handshake) and goes straight to a welcome and a start order.
    let impostors: Vec<Box<dyn Fn(TcpStream) + Send + Sync>> = vec![
        Box::new(|mut s| {
            let _ = auth::accept(&mut s, "a-guess", Purpose::Control);
        }),
        Box::new(|mut s| {
            let mut hello = b"SQPAUTH2".to_vec();
            hello.extend_from_slice(&[7u8; 32]);
            s.write_all(&hello).unwrap();
            let mut answer = [0u8; 64];
            let _ = std::io::Read::read_exact(&mut s, &mut answer);
            let _ = s.write_all(&[0u8; 32]);
            send(
                &mut s,
                &ToAgent::Welcome {
                    incarnation: 1,
                    heartbeat_s: 1.0,
                },
            );
        }),
    ];
    for impostor in impostors {
        let root = fresh_dir("adv-impostor");
        let (code, stderr) = agent_against(&root, impostor);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains("authentication failed"), "{stderr}");
        assert!(stderr.contains(auth::TOKEN_ENV), "{stderr}");
        assert!(!stderr.contains("joined the run"), "{stderr}");
        assert_only_agent_dir(&root);
    }
}

#[test]
fn an_authenticated_coordinator_cannot_make_an_agent_panic_or_escape_its_dir() {
    let welcome = ToAgent::Welcome {
        incarnation: 1,
        heartbeat_s: 1.0,
    };
    let order = |session: &str, stages: Vec<usize>, dump: Option<&str>, snapshot_to: &[&str]| {
        ToAgent::StartWorkers {
            generation: 1,
            stages,
            config: String::new(),
            snapshot_to: snapshot_to.iter().map(|a| a.to_string()).collect(),
            session: session.into(),
            dump_grads: dump.map(Into::into),
            keep_running: false,
        }
    };
    let start = |session: &str| order(session, vec![0], None, &[]);
    let cases: Vec<(Vec<ToAgent>, &str)> = vec![
        (
            vec![ToAgent::Welcome {
                incarnation: 1,
                heartbeat_s: 1e300,
            }],
            "heartbeat_s",
        ),
        (
            vec![ToAgent::Welcome {
                incarnation: 1,
                heartbeat_s: f64::NAN,
            }],
            "heartbeat_s",
        ),
        (
            vec![welcome.clone(), start("../../../../elsewhere")],
            "session",
        ),
        (vec![welcome.clone(), start("/tmp/elsewhere")], "session"),
        (
            vec![welcome.clone(), order("s", vec![0, 1, 2], None, &[])],
            "slot",
        ),
        (
            vec![
                welcome.clone(),
                order("s", vec![0], Some("/tmp/anywhere"), &[]),
            ],
            "dump_grads",
        ),
        (
            vec![welcome, order("s", vec![0], None, &["not an address"])],
            "snapshot_to",
        ),
    ];
    for (messages, field) in cases {
        let root = fresh_dir("adv-hostile");
        let (code, stderr) = agent_against(&root, authenticated(messages));
        assert_eq!(code, Some(1), "{field}: {stderr}");
        assert!(stderr.contains("sent a bad message"), "{field}: {stderr}");
        assert!(stderr.contains(field), "{field}: {stderr}");
        assert_only_agent_dir(&root);
        assert!(!root.join("a/elsewhere").exists());
    }
}
