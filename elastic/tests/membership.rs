//! Membership: joins, heartbeats, expiry, failures, leaves and fencing, with time moved by hand.

use std::time::{Duration, Instant};

use elastic::{ElasticError, Membership, NodeId, NodeInfo, NodeStatus, Plan, plan_for};

fn id(s: &str) -> NodeId {
    NodeId::new(s)
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

fn joined(t0: Instant, ids: &[&str]) -> Membership {
    let mut m = Membership::new();
    for &n in ids {
        m.join(NodeInfo::new(n, 1, format!("{n}:1")), t0).unwrap();
    }
    m
}

fn adopt(m: &mut Membership, ids: &[&str]) -> Plan {
    let infos: Vec<NodeInfo> = ids.iter().map(|&n| NodeInfo::new(n, 1, "")).collect();
    let plan = plan_for(&infos, 16, 1, 0).unwrap();
    m.admit(&plan);
    plan
}

#[test]
fn expiry_is_strictly_after_dead_after() {
    let dead_after = secs(5.0);
    // (seconds since the last heartbeat, dead?, reason)
    let cases = [
        (0.0, false, ""),
        (4.999, false, ""),
        (5.0, false, ""),
        (5.001, true, "missed heartbeats for 5 s"),
        (5.5, true, "missed heartbeats for 5.5 s"),
        (12.0, true, "missed heartbeats for 12 s"),
    ];
    for (silent, dead, reason) in cases {
        let t0 = Instant::now();
        let mut m = joined(t0, &["a", "b"]);
        let last = t0 + secs(1.0);
        m.heartbeat(&id("a"), last).unwrap();
        m.heartbeat(&id("b"), last).unwrap();
        let now = last + secs(silent);
        m.heartbeat(&id("b"), now).unwrap(); // b keeps beating
        let newly = m.expire(now, dead_after);
        if dead {
            assert_eq!(newly, vec![id("a")], "silent {silent} s");
            let status = m.status(&id("a")).unwrap();
            assert_eq!(
                status,
                &NodeStatus::Dead {
                    reason: reason.into()
                }
            );
            // Expiry reports each node once.
            assert!(m.expire(now + secs(1.0), dead_after).is_empty());
        } else {
            assert!(newly.is_empty(), "silent {silent} s");
        }
        assert_eq!(m.status(&id("b")), Some(&NodeStatus::Alive));
    }
}

#[test]
fn dead_nodes_are_fenced_until_they_join_again() {
    let t0 = Instant::now();
    let mut m = joined(t0, &["a", "b"]);
    m.report_failure(&id("b"), "connection broken", t0 + secs(1.0))
        .unwrap();
    // A second report keeps the first reason.
    m.report_failure(&id("b"), "something else", t0 + secs(2.0))
        .unwrap();
    let err = m.heartbeat(&id("b"), t0 + secs(2.0)).unwrap_err();
    assert_eq!(
        err,
        ElasticError::Fenced {
            id: id("b"),
            reason: "connection broken".into()
        }
    );
    assert!(err.to_string().contains("join again"), "{err}");
    assert!(matches!(
        m.leave(&id("b"), t0),
        Err(ElasticError::Fenced { .. })
    ));
    assert_eq!(
        m.heartbeat(&id("z"), t0),
        Err(ElasticError::UnknownNode(id("z")))
    );
    assert_eq!(
        m.report_failure(&id("z"), "x", t0),
        Err(ElasticError::UnknownNode(id("z")))
    );

    // Re-joining starts a new incarnation that is alive but not admitted.
    assert_eq!(m.join(NodeInfo::new("b", 2, "b:2"), t0 + secs(3.0)), Ok(2));
    m.heartbeat(&id("b"), t0 + secs(4.0)).unwrap();
    let b = m.get(&id("b")).unwrap();
    assert_eq!((b.incarnation, b.info.slots, b.admitted), (2, 2, false));
    let pending: Vec<&str> = m.pending_joiners().iter().map(|n| n.id.as_str()).collect();
    assert_eq!(pending, ["a", "b"], "nothing admitted yet");
}

#[test]
fn joins_are_checked() {
    let t0 = Instant::now();
    let mut m = Membership::new();
    for info in [NodeInfo::new("", 1, "x"), NodeInfo::new("a", 0, "x")] {
        assert!(matches!(
            m.join(info, t0),
            Err(ElasticError::BadJoin { .. })
        ));
    }
    assert!(m.alive().is_empty());
}

#[test]
fn alive_is_sorted_and_joiners_queue_in_join_order() {
    let t0 = Instant::now();
    let mut m = Membership::new();
    for (n, t) in [("c", 0.0), ("a", 1.0), ("d", 1.0), ("b", 2.0)] {
        m.join(NodeInfo::new(n, 1, ""), t0 + secs(t)).unwrap();
    }
    let names = |v: Vec<&NodeInfo>| v.iter().map(|n| n.id.to_string()).collect::<Vec<_>>();
    assert_eq!(names(m.alive()), ["a", "b", "c", "d"]);
    assert_eq!(names(m.pending_joiners()), ["c", "a", "d", "b"]);
    adopt(&mut m, &["a", "c"]);
    assert_eq!(names(m.pending_joiners()), ["d", "b"]);
    m.report_failure(&id("d"), "gone", t0).unwrap();
    assert_eq!(names(m.alive()), ["a", "b", "c"]);
    assert_eq!(names(m.pending_joiners()), ["b"]);
}

#[test]
fn leave_marks_plan_nodes_leaving_and_drops_joiners() {
    let t0 = Instant::now();
    let mut m = joined(t0, &["a", "b", "c"]);
    adopt(&mut m, &["a", "b"]);
    m.leave(&id("b"), t0 + secs(1.0)).unwrap();
    m.leave(&id("b"), t0 + secs(2.0)).unwrap(); // repeated notice: no change
    let b = m.get(&id("b")).unwrap();
    assert_eq!(
        (&b.status, b.status_since),
        (&NodeStatus::Leaving, t0 + secs(1.0))
    );
    m.heartbeat(&id("b"), t0 + secs(3.0)).unwrap(); // still running until the boundary
    // c was never admitted: it simply goes.
    m.leave(&id("c"), t0 + secs(1.0)).unwrap();
    assert!(m.status(&id("c")).unwrap().is_dead());
    assert!(m.pending_joiners().is_empty());
    // A leaving node that goes silent still dies.
    assert_eq!(m.expire(t0 + secs(9.0), secs(5.0)), vec![id("a"), id("b")]);
}
