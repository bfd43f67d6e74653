//! The failure detector's check of itself: silence heard while the coordinator was stalled is no
//! evidence of death. Time is moved by hand.

use std::time::{Duration, Instant};

use elastic::{FailureDetector, Membership, NodeId, NodeInfo, NodeStatus, own_stall};

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

fn id(s: &str) -> NodeId {
    NodeId::new(s)
}

fn fleet(t0: Instant, ids: &[&str]) -> Membership {
    let mut m = Membership::new();
    for &n in ids {
        m.join(NodeInfo::new(n, 1, format!("{n}:1")), t0).unwrap();
    }
    m
}

#[test]
fn own_stall_is_the_gap_beyond_the_tolerance() {
    let t0 = Instant::now();
    // (previous check, now, tolerance, stall)
    let cases = [
        (None, 0.0, 1.0, 0.0),
        (None, 30.0, 1.0, 0.0),
        (Some(0.0), 0.05, 1.0, 0.0),
        (Some(0.0), 1.0, 1.0, 0.0),
        (Some(0.0), 1.5, 1.0, 0.5),
        (Some(0.0), 16.0, 1.0, 15.0),
        (Some(5.0), 4.0, 1.0, 0.0), // a clock that went backwards: no stall
    ];
    for (last, now, tolerance, stall) in cases {
        let got = own_stall(last.map(|l| t0 + secs(l)), t0 + secs(now), secs(tolerance));
        assert_eq!(
            got,
            secs(stall),
            "last {last:?}, now {now}, tolerance {tolerance}"
        );
    }
}

/// One scenario: nodes `a` and `b` joined at 0 and heartbeat at the listed times; the detector
/// checks at the listed times (heartbeat interval 1 s, dead after 5 s). Expected: who is dead
/// after the last check, and the stall the last check excused.
struct Case {
    what: &'static str,
    beats_a: &'static [f64],
    beats_b: &'static [f64],
    checks: &'static [f64],
    dead: &'static [&'static str],
    last_stall: f64,
}

#[test]
fn a_stalled_detector_declares_nobody_dead_on_the_silence_it_slept_through() {
    // Checks every 50 ms from `from` to `to` seconds.
    let every = |from: f64, to: f64| -> Vec<f64> {
        let n = ((to - from) / 0.05).round() as usize;
        (0..=n).map(|i| from + i as f64 * 0.05).collect()
    };
    let before_stall: &'static [f64] = [every(0.0, 5.0), vec![25.0, 25.5]].concat().leak();
    let cases = [
        Case {
            what: "a running detector declares the silent node dead after 5 s",
            beats_a: &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
            beats_b: &[1.0],
            checks: every(0.0, 7.0).leak(),
            dead: &["b"],
            last_stall: 0.0,
        },
        Case {
            what: "the detector stalled 15 s (the issue's 15.4 s): everyone's heartbeats were \
                   still in the sockets; nobody is dead",
            beats_a: &[1.0, 2.0, 3.0],
            beats_b: &[1.0, 2.0, 3.0],
            checks: &[0.0, 1.0, 2.0, 3.0, 18.4],
            dead: &[],
            last_stall: 14.4,
        },
        Case {
            what: "after a stall, a node that stays silent is still declared dead: its silence \
                   while the detector ran adds up",
            beats_a: &[1.0, 2.0, 3.0, 19.0, 20.0, 21.0, 22.0, 23.0, 24.0],
            beats_b: &[1.0, 2.0, 3.0],
            checks: &[0.0, 1.0, 2.0, 3.0, 18.4, 19.0, 20.0, 21.0, 22.0, 23.0, 24.0],
            dead: &["b"],
            last_stall: 0.0,
        },
        Case {
            what: "a slow detector (checks 2 s apart) excuses only the second beyond the \
                   interval: a dead node is found, later",
            beats_a: &[
                1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0,
            ],
            beats_b: &[1.0],
            checks: &[0.0, 1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0],
            dead: &["b"],
            last_stall: 1.0,
        },
        Case {
            what: "a node silent 4 s before a 20 s stall and 1.5 s after it is dead: only the \
                   stall is excused",
            beats_a: &[1.0, 2.0, 3.0, 4.0, 5.0, 25.0, 25.5],
            beats_b: &[1.0],
            checks: before_stall,
            dead: &["b"],
            last_stall: 0.0,
        },
    ];
    for case in cases {
        let t0 = Instant::now();
        let mut m = fleet(t0, &["a", "b"]);
        let mut detector = FailureDetector::new(secs(1.0), secs(5.0));
        let mut events: Vec<(f64, Option<&str>)> = case
            .checks
            .iter()
            .map(|&t| (t, None))
            .chain(case.beats_a.iter().map(|&t| (t, Some("a"))))
            .chain(case.beats_b.iter().map(|&t| (t, Some("b"))))
            .collect();
        // At equal times, heartbeats first (they were in the socket before the check).
        events.sort_by(|x, y| x.0.total_cmp(&y.0).then(y.1.is_some().cmp(&x.1.is_some())));
        let mut last_stall = Duration::ZERO;
        for (t, beat) in events {
            let now = t0 + secs(t);
            match beat {
                Some(node) => {
                    let _ = m.heartbeat(&id(node), now);
                }
                None => last_stall = detector.check(now, &mut m).stalled,
            }
        }
        let dead: Vec<&str> = m
            .members()
            .filter(|x| x.status.is_dead())
            .map(|x| x.info.id.as_str())
            .collect();
        assert_eq!(dead, case.dead, "{}", case.what);
        assert!(
            (last_stall.as_secs_f64() - case.last_stall).abs() < 1e-6,
            "{}: stall {last_stall:?}",
            case.what
        );
    }
}

#[test]
fn a_loss_found_out_about_one_incarnation_never_fences_the_next() {
    let t0 = Instant::now();
    let mut m = fleet(t0, &["a"]);
    // Incarnation 1 is declared dead (a stall of the fleet); its agent joins again at once.
    assert_eq!(m.expire(t0 + secs(6.0), secs(5.0)), vec![id("a")]);
    assert_eq!(
        m.join(NodeInfo::new("a", 1, "a:1"), t0 + secs(7.0))
            .unwrap(),
        2
    );
    // The recovery of that failure declares incarnation 1 lost: incarnation 2 stays alive.
    assert_eq!(
        m.report_failure_of(&id("a"), 1, "missed heartbeats", t0 + secs(8.0)),
        Ok(false)
    );
    assert_eq!(m.status(&id("a")), Some(&NodeStatus::Alive));
    m.heartbeat(&id("a"), t0 + secs(8.5)).unwrap();
    // A loss of incarnation 2 itself does fence it.
    assert_eq!(
        m.report_failure_of(&id("a"), 2, "its worker exited", t0 + secs(9.0)),
        Ok(true)
    );
    assert!(m.status(&id("a")).unwrap().is_dead());
}

#[test]
fn excusing_a_stall_never_moves_a_heartbeat_past_now_nor_revives_the_dead() {
    let t0 = Instant::now();
    let mut m = fleet(t0, &["a", "b"]);
    m.report_failure(&id("b"), "connection closed", t0).unwrap();
    m.excuse(secs(100.0), t0 + secs(3.0));
    assert_eq!(m.get(&id("a")).unwrap().last_heartbeat, t0 + secs(3.0));
    assert!(m.status(&id("b")).unwrap().is_dead());
    assert_eq!(m.get(&id("b")).unwrap().last_heartbeat, t0);
}
