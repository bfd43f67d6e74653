//! The etcd rendezvous against a real etcd, started by each test on free loopback ports (never
//! skipped: a missing `etcd` binary fails the test with how to install it).

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use elastic::etcd::testing::EtcdServer;
use elastic::etcd::{Compare, EtcdClient, EtcdError, EtcdUrl, Leader, Rendezvous, TxnOp};
use elastic::{NodeId, NodeInfo, plan_for};

/// etcd's shortest lease: a TTL of 1 s is raised to 2 s with the default election timeout.
const SHORT_TTL: Duration = Duration::from_secs(1);

/// How long a test waits for etcd to expire a lease (TTL + its 0.5 s expiry sweep + slack).
const EXPIRY_DEADLINE: Duration = Duration::from_secs(10);

/// Polls `check` every 100 ms until it holds; panics with `what` after [`EXPIRY_DEADLINE`].
fn wait_until(what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < EXPIRY_DEADLINE,
            "{what}: not after {EXPIRY_DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

fn ids(nodes: &[NodeInfo]) -> Vec<&str> {
    nodes.iter().map(|n| n.id.as_str()).collect()
}

#[test]
fn put_range_delete_round_trip() {
    let etcd = EtcdServer::start();
    let c = etcd.client();
    assert_eq!(c.get(b"/t/a").unwrap(), None);
    c.put(b"/t/a", b"1", None).unwrap();
    c.put(b"/t/b", &[0, 0xff, b'\n'], None).unwrap();
    c.put(b"/t0", b"outside the prefix", None).unwrap();

    let a = c.get(b"/t/a").unwrap().unwrap();
    assert_eq!(
        (a.key.as_slice(), a.value.as_slice()),
        (&b"/t/a"[..], &b"1"[..])
    );
    assert_eq!(a.lease, None);
    c.put(b"/t/a", b"2", None).unwrap();
    let a2 = c.get(b"/t/a").unwrap().unwrap();
    assert_eq!(a2.value, b"2");
    assert_eq!(a2.create_revision, a.create_revision);
    assert!(a2.mod_revision > a.mod_revision);

    let listed = c.get_prefix(b"/t/").unwrap();
    let keys: Vec<&[u8]> = listed.iter().map(|kv| kv.key.as_slice()).collect();
    assert_eq!(keys, [&b"/t/a"[..], &b"/t/b"[..]]);
    assert_eq!(listed[1].value, [0, 0xff, b'\n']);

    assert!(c.delete(b"/t/a").unwrap());
    assert!(!c.delete(b"/t/a").unwrap(), "already deleted");
    assert_eq!(c.get(b"/t/a").unwrap(), None);
    assert_eq!(c.get_prefix(b"/t/").unwrap().len(), 1);
    assert_eq!(c.get_prefix(b"/none/").unwrap(), vec![]);
}

#[test]
fn txn_runs_one_branch_and_reads_in_it() {
    let etcd = EtcdServer::start();
    let c = etcd.client();
    let put = |v: &[u8]| TxnOp::Put {
        key: b"/k".to_vec(),
        value: v.to_vec(),
        lease: None,
    };
    let get = [TxnOp::Get(b"/k".to_vec())];
    let created = c
        .txn(&[Compare::Absent(b"/k".to_vec())], &[put(b"x")], &get)
        .unwrap();
    assert!(created.succeeded);
    assert!(
        created.fetched.is_empty(),
        "the success branch reads nothing"
    );

    let again = c
        .txn(&[Compare::Absent(b"/k".to_vec())], &[put(b"y")], &get)
        .unwrap();
    assert!(!again.succeeded);
    assert_eq!(again.fetched[0].value, b"x", "the failure branch read it");

    let swapped = c
        .txn(
            &[Compare::Value(b"/k".to_vec(), b"x".to_vec())],
            &[put(b"z")],
            &[],
        )
        .unwrap();
    assert!(swapped.succeeded);
    assert_eq!(c.get(b"/k").unwrap().unwrap().value, b"z");
}

#[test]
fn lease_expiry_removes_a_registered_node() {
    let etcd = EtcdServer::start();
    let r = Rendezvous::connect(&etcd.url("job"), "h").unwrap();
    let dying = r.grant(SHORT_TTL).unwrap();
    assert!(dying.ttl >= SHORT_TTL, "granted {:?}", dying.ttl);
    let living = r.grant(SHORT_TTL).unwrap();
    r.register(&NodeInfo::new("a", 2, "10.0.0.1:1"), dying.id)
        .unwrap();
    r.register(&NodeInfo::new("b", 1, "10.0.0.2:1"), living.id)
        .unwrap();
    assert_eq!(
        r.nodes().unwrap(),
        [
            NodeInfo::new("a", 2, "10.0.0.1:1"),
            NodeInfo::new("b", 1, "10.0.0.2:1")
        ]
    );

    // b keeps its lease alive; a's process "died": nobody renews its lease.
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                r.keep_alive(living.id).unwrap();
                std::thread::sleep(living.ttl / 4);
            }
        });
        let took = wait_until("a's registration expires", || {
            ids(&r.nodes().unwrap()) == ["b"]
        });
        stop.store(true, Ordering::Relaxed);
        assert!(took >= dying.ttl / 2, "a expired after only {took:?}");
    });

    let err = r.keep_alive(dying.id).unwrap_err();
    assert!(matches!(err, EtcdError::LeaseExpired { .. }), "{err}");
    assert!(err.to_string().contains("grant a new lease"), "{err}");
    let err = r
        .register(&NodeInfo::new("a", 2, "10.0.0.1:1"), dying.id)
        .unwrap_err();
    assert!(matches!(err, EtcdError::LeaseExpired { .. }), "{err}");

    assert!(r.deregister(&NodeId::new("b")).unwrap());
    assert!(r.nodes().unwrap().is_empty());
    r.revoke(living.id).unwrap();
    r.revoke(living.id).unwrap(); // a lease already gone is fine
}

#[test]
fn campaign_first_wins_and_the_next_wins_when_the_leader_goes() {
    let etcd = EtcdServer::start();
    let r = Rendezvous::connect(&etcd.url("job"), "h").unwrap();
    let leader = |name: &str| Leader {
        candidate: name.into(),
        addr: format!("{name}:29400"),
    };
    assert_eq!(r.leader().unwrap(), None);
    let a = r.grant(Duration::from_secs(30)).unwrap().id;
    let b = r.grant(Duration::from_secs(30)).unwrap().id;
    assert!(r.campaign("a", "a:29400", a).unwrap());
    assert!(!r.campaign("b", "b:29400", b).unwrap());
    assert!(r.campaign("a", "a:29400", a).unwrap(), "campaigning again");
    assert!(!r.resign(b).unwrap(), "b does not hold it");
    assert_eq!(r.leader().unwrap(), Some(leader("a")));

    // a's lease is revoked (e.g. its agent shuts down): b takes over.
    r.revoke(a).unwrap();
    assert_eq!(r.leader().unwrap(), None);
    assert!(r.campaign("b", "b:29400", b).unwrap());
    assert_eq!(r.leader().unwrap(), Some(leader("b")));

    // b resigns; c leads on a short lease, then its node dies (no keep-alive): d takes over.
    assert!(r.resign(b).unwrap());
    let c = r.grant(SHORT_TTL).unwrap().id;
    let d = r.grant(Duration::from_secs(30)).unwrap().id;
    assert!(r.campaign("c", "c:29400", c).unwrap());
    assert!(!r.campaign("d", "d:29400", d).unwrap());
    wait_until("d wins once c's lease expires", || {
        r.campaign("d", "d:29400", d).unwrap()
    });
    assert_eq!(r.leader().unwrap(), Some(leader("d")));
}

#[test]
fn generation_is_a_compare_and_swap() {
    let etcd = EtcdServer::start();
    let url = etcd.url("job");
    let r = Rendezvous::connect(&url, "h").unwrap();
    assert_eq!(r.generation().unwrap(), 0);
    assert_eq!(r.plan().unwrap(), None);
    assert_eq!(r.bump_generation(0).unwrap(), 1);

    // Two coordinators both saw generation 1; only one may advance it.
    let coordinators: Vec<Rendezvous> = (0..4)
        .map(|_| Rendezvous::connect(&url, "h").unwrap())
        .collect();
    let barrier = Barrier::new(coordinators.len());
    let results: Vec<Result<u64, EtcdError>> = std::thread::scope(|s| {
        let handles: Vec<_> = coordinators
            .iter()
            .map(|c| {
                s.spawn(|| {
                    barrier.wait();
                    c.bump_generation(1)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let won: Vec<u64> = results
        .iter()
        .filter_map(|r| r.as_ref().ok().copied())
        .collect();
    assert_eq!(won, [2], "exactly one bump wins: {results:?}");
    for err in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            matches!(
                err,
                EtcdError::GenerationRace {
                    expected: 1,
                    found: 2,
                    ..
                }
            ),
            "{err}"
        );
    }
    assert_eq!(r.generation().unwrap(), 2);

    // A stale expected value (the generation is 2 now) fails and names both.
    let err = r.bump_generation(1).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("expected `/job/generation` = 1 but it is 2"),
        "{text}"
    );

    // The plan is published only under the current generation.
    let nodes = [NodeInfo::new("a", 1, "a:1"), NodeInfo::new("b", 1, "b:1")];
    let plan = plan_for(&nodes, 4, 2, 10).unwrap();
    r.publish_plan(&plan).unwrap();
    assert_eq!(r.plan().unwrap(), Some(plan.clone()));
    let stale = plan_for(&nodes[..1], 4, 1, 10).unwrap();
    let err = r.publish_plan(&stale).unwrap_err();
    assert!(
        matches!(
            err,
            EtcdError::GenerationRace {
                expected: 1,
                found: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(r.plan().unwrap(), Some(plan));
}

#[test]
fn a_node_with_another_job_token_is_refused() {
    let etcd = EtcdServer::start();
    let url = etcd.url("seqpipe/job-1");
    Rendezvous::connect(&url, "hash-1").unwrap();
    Rendezvous::connect(&url, "hash-1").expect("the same job joins again");
    let err = Rendezvous::connect(&url, "hash-2").unwrap_err();
    assert!(matches!(err, EtcdError::WrongJob { .. }), "{err}");
    let text = err.to_string();
    for part in [
        "`/seqpipe/job-1`",
        "belongs to another job",
        "`/seqpipe/job-1/job` holds the job token hash `hash-1`, ours is `hash-2`",
        &etcd.endpoint(),
    ] {
        assert!(text.contains(part), "{part:?} not in: {text}");
    }
    // Another job under its own prefix is fine.
    Rendezvous::connect(&etcd.url("seqpipe/job-2"), "hash-2").unwrap();
}

#[test]
fn bad_urls_say_what_is_wrong() {
    let good = EtcdUrl::parse("etcd://10.0.0.5:2379/seqpipe/my-job/").unwrap();
    assert_eq!(good.endpoint(), "10.0.0.5:2379");
    assert_eq!(good.prefix(), "/seqpipe/my-job");
    assert_eq!(good.to_string(), "etcd://10.0.0.5:2379/seqpipe/my-job");
    let v6: EtcdUrl = "etcd://[::1]:2379/p".parse().unwrap();
    assert_eq!((v6.endpoint(), v6.prefix()), ("[::1]:2379", "/p"));

    let cases = [
        ("10.0.0.5:2379/p", "does not start with `etcd://`"),
        ("http://10.0.0.5:2379/p", "the scheme must be `etcd://`"),
        ("etcd:///p", "the host is missing"),
        ("etcd://10.0.0.5/p", "the port is missing"),
        ("etcd://10.0.0.5:http/p", "the port `http` is not a number"),
        ("etcd://10.0.0.5:0/p", "the port `0` is not a number"),
        ("etcd://[::1/p", "closing `]`"),
        ("etcd://u:pw@10.0.0.5:2379/p", "passwords are not supported"),
        ("etcd://10.0.0.5:2379", "the key prefix is missing"),
        ("etcd://10.0.0.5:2379/", "the key prefix is missing"),
        ("etcd://10.0.0.5:2379/a//b", "empty segment"),
        ("etcd://10.0.0.5:2379/p?x=1", "query strings"),
    ];
    for (url, reason) in cases {
        let err = EtcdUrl::parse(url).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, EtcdError::BadUrl { .. }), "{url}: {text}");
        assert!(text.contains(reason), "{url}: {text}");
        assert!(text.contains(&format!("`{url}`")), "{text}");
        assert!(
            text.contains("expected `etcd://HOST:PORT/PREFIX`"),
            "{text}"
        );
    }
}

#[test]
fn an_unreachable_etcd_is_named() {
    // A port nobody listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("127.0.0.1:{port}");
    let err = EtcdClient::new(&endpoint).get(b"/k").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, EtcdError::Unreachable { .. }), "{text}");
    assert!(
        text.contains(&format!(
            "cannot reach etcd at {endpoint} for kv/range `/k`"
        )),
        "{text}"
    );
}
