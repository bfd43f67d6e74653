//! The pure decision, driven through its public API with the clock moved by hand.
//! (Longer stories live in `tests/scenarios/*.txt`.)

use std::time::{Duration, Instant};

use elastic::{
    ClusterState, Decision, ElasticConfig, NodeId, NodeInfo, ReplicaPolicy, buddies, decide,
    restart_plan,
};

/// A coordinator core with a hand-moved clock.
struct Sim {
    t0: Instant,
    cfg: ElasticConfig,
    state: ClusterState,
}

impl Sim {
    fn new(cfg: ElasticConfig, max_stages: usize) -> Self {
        cfg.validate().unwrap();
        Self {
            t0: Instant::now(),
            cfg,
            state: ClusterState::new(max_stages),
        }
    }

    fn at(&self, s: f64) -> Instant {
        self.t0 + Duration::from_secs_f64(s)
    }

    fn join(&mut self, id: &str, slots: usize, s: f64) {
        let t = self.at(s);
        self.state
            .membership
            .join(NodeInfo::new(id, slots, format!("{id}:29500")), t)
            .unwrap();
    }

    fn fail(&mut self, id: &str, s: f64) {
        let t = self.at(s);
        self.state
            .membership
            .report_failure(&id.into(), "connection broken", t)
            .unwrap();
    }

    /// Decides at `s` seconds without applying.
    fn peek(&self, s: f64) -> (Decision, String) {
        decide(self.at(s), &self.state, &self.cfg)
    }

    /// Decides at `s` seconds and applies the decision.
    fn decide(&mut self, s: f64) -> (Decision, String) {
        let (d, r) = self.peek(s);
        self.state.apply(&d, self.at(s));
        (d, r)
    }

    /// Joins single-slot nodes at t=0 and adopts the first plan.
    fn started(cfg: ElasticConfig, max_stages: usize, ids: &[&str]) -> Self {
        let mut sim = Self::new(cfg, max_stages);
        for id in ids {
            sim.join(id, 1, 0.0);
        }
        let (d, r) = sim.decide(0.0);
        assert!(matches!(d, Decision::Grow { .. }), "{r}");
        sim
    }

    fn midstep(&mut self) {
        self.state.at_step_boundary = false;
    }

    fn boundary(&mut self, step: u64) {
        self.state.step = step;
        self.state.at_step_boundary = true;
    }
}

fn ids(s: &str) -> Vec<NodeId> {
    s.split_whitespace().map(NodeId::from).collect()
}

fn cfg() -> ElasticConfig {
    ElasticConfig::default()
}

#[test]
fn broken_connection_recovers_at_once_with_the_next_generation() {
    let mut sim = Sim::started(cfg(), 8, &["a", "b", "c"]);
    sim.boundary(7);
    sim.midstep();
    sim.fail("b", 1.0);
    let (d, reason) = sim.decide(1.0);
    let Decision::Recover { plan, lost, joined } = &d else {
        panic!("{d:?}: {reason}")
    };
    assert_eq!((plan.generation, plan.step), (2, 7));
    assert_eq!((&plan.nodes, &plan.stages), (&ids("a c"), &ids("a c")));
    assert_eq!((lost, joined), (&ids("b"), &vec![]));
    assert_eq!(
        reason,
        "node b lost (connection broken); 2 of 3 nodes alive; plan: 2 stages on a, c (generation 2)"
    );
    assert_eq!(sim.state.restarts, 1);
    assert_eq!(sim.state.current.as_ref(), Some(plan));
    assert_eq!(sim.decide(2.0).0, Decision::Continue);
}

#[test]
fn two_nodes_lost_at_once() {
    let mut sim = Sim::started(cfg(), 8, &["a", "b", "c", "d"]);
    sim.midstep();
    sim.fail("d", 1.0);
    sim.fail("b", 1.0);
    let (d, reason) = sim.decide(1.0);
    let Decision::Recover { plan, lost, .. } = &d else {
        panic!("{reason}")
    };
    assert_eq!(
        (plan.generation, &plan.nodes, lost),
        (2, &ids("a c"), &ids("b d"))
    );
    assert!(
        reason.contains("node b lost (connection broken), node d lost"),
        "{reason}"
    );
    assert_eq!(sim.state.restarts, 1, "one recovery for both");
}

#[test]
fn reasons_do_not_change_while_only_time_moves() {
    let c = ElasticConfig {
        min_nodes: 2,
        join_timeout_s: 30.0,
        ..cfg()
    };
    let mut sim = Sim::started(c, 8, &["a", "b"]);
    sim.join("z", 1, 0.0); // a joiner waiting for the boundary
    sim.midstep();
    let first = sim.peek(0.0);
    assert_eq!(first.1, "node z waits for the next step boundary to join");
    for s in [0.5, 3.0, 4.9, 20.0] {
        assert_eq!(sim.peek(s), first, "at {s} s");
    }
    // Losing b (and z) leaves a short: the Wait keeps its reason and deadline while it lasts.
    sim.fail("b", 10.0);
    sim.fail("z", 10.0);
    let (waiting, reason) = sim.decide(10.0);
    assert_eq!(
        reason,
        "node b lost (connection broken); 1 node alive, 2 needed (elastic.min_nodes); \
         waiting up to 30 s (elastic.join_timeout_s) for more to join"
    );
    assert_eq!(
        waiting,
        Decision::Wait {
            alive: 1,
            needed: 2,
            until: sim.at(40.0)
        }
    );
    for s in [11.0, 25.0, 39.999] {
        assert_eq!(sim.decide(s), (waiting.clone(), reason.clone()), "at {s} s");
    }
    let (d, fail) = sim.decide(40.0);
    assert_eq!(
        d,
        Decision::Fail {
            reason: fail.clone()
        }
    );
    for must in [
        "only 1 node alive, 2 needed",
        "committed checkpoints are intact",
        "seqpipe resume",
    ] {
        assert!(fail.contains(must), "{fail}");
    }
}

#[test]
fn joiners_wait_for_a_step_boundary() {
    let mut sim = Sim::started(cfg(), 8, &["a", "b"]);
    sim.join("c", 2, 1.0);
    for step in 1..4 {
        sim.boundary(step);
        sim.midstep();
        let (d, r) = sim.decide(step as f64);
        assert_eq!(d, Decision::Continue, "{r}");
    }
    sim.boundary(4);
    let (d, r) = sim.decide(5.0);
    let Decision::Grow { plan, joined } = &d else {
        panic!("{r}")
    };
    assert_eq!((plan.generation, plan.step, joined), (2, 4, &ids("c")));
    assert_eq!(plan.stages, ids("a b c c"));
    assert_eq!(
        r,
        "node c joined at step 4; plan: 4 stages on a, b, c (generation 2)"
    );
    assert_eq!(sim.state.restarts, 0, "growing is not a restart");
}

/// A joiner announced at a boundary and lost before the growth was adopted: `decide` keeps the
/// plan, and `restart_plan` gives the same nodes under the next generation (the stopped pipeline
/// restarts, fenced from its old workers).
#[test]
fn a_growth_undone_before_adoption_restarts_the_same_nodes() {
    let mut sim = Sim::started(cfg(), 8, &["a", "b"]);
    sim.join("c", 1, 1.0);
    sim.boundary(3);
    assert!(matches!(sim.peek(2.0).0, Decision::Grow { .. }));
    sim.fail("c", 2.5);
    let (d, r) = sim.peek(3.0);
    assert_eq!(d, Decision::Continue, "{r}");
    let (d, r) = restart_plan(&sim.state).unwrap();
    let Decision::Grow { plan, joined } = &d else {
        panic!("{r}")
    };
    assert!(joined.is_empty());
    assert_eq!((plan.generation, plan.step), (2, 3));
    assert_eq!(plan.stages, ids("a b"));
    assert_eq!(
        r,
        "the plan change at step 3 was undone before it was adopted; restarting on the same nodes: \
         2 stages on a, b (generation 2)"
    );
    sim.state.apply(&d, sim.at(3.0));
    assert_eq!(sim.state.restarts, 0, "not a recovery");
    assert!(restart_plan(&ClusterState::new(8)).is_none(), "no plan yet");
}

#[test]
fn max_nodes_caps_growth() {
    // (max_nodes, max_stages, joiners, admitted, spare reason fragment)
    let cases = [
        (0, 16, "c d e", "c d e", ""),
        (
            3,
            16,
            "c d e",
            "c",
            "nodes d, e stay spare: elastic.max_nodes = 3 reached",
        ),
        (
            4,
            16,
            "e d c",
            "e d",
            "node c stays spare: elastic.max_nodes = 4 reached",
        ),
        (
            2,
            16,
            "c",
            "",
            "node c stays spare: elastic.max_nodes = 2 reached",
        ),
        (
            0,
            3,
            "c d",
            "c",
            "node d stays spare: all 3 stages are placed",
        ),
    ];
    for (max_nodes, max_stages, joiners, admitted, note) in cases {
        let mut sim = Sim::started(
            ElasticConfig { max_nodes, ..cfg() },
            max_stages,
            &["a", "b"],
        );
        for (k, j) in joiners.split_whitespace().enumerate() {
            sim.join(j, 1, 1.0 + k as f64);
        }
        sim.boundary(1);
        let (d, r) = sim.decide(5.0);
        match &d {
            Decision::Grow { joined, .. } => assert_eq!(joined, &ids(admitted), "{r}"),
            Decision::Continue => assert!(admitted.is_empty(), "{r}"),
            other => panic!("{other:?}: {r}"),
        }
        assert!(r.contains(note), "max_nodes {max_nodes}: {r}");
        let n = sim.state.current.as_ref().unwrap().nodes.len();
        assert!(max_nodes == 0 || n <= max_nodes);
    }
}

#[test]
fn graceful_leave_shrinks_at_the_boundary_without_a_restart() {
    let mut sim = Sim::started(cfg(), 8, &["a", "b", "c"]);
    sim.midstep();
    sim.state
        .membership
        .leave(&"b".into(), sim.at(1.0))
        .unwrap();
    assert_eq!(sim.decide(1.0).0, Decision::Continue);
    sim.boundary(1);
    let (d, r) = sim.decide(2.0);
    let Decision::Shrink { plan, left, joined } = &d else {
        panic!("{r}")
    };
    assert_eq!(
        (plan.generation, &plan.nodes, left, joined),
        (2, &ids("a c"), &ids("b"), &vec![])
    );
    assert_eq!(
        r,
        "node b left at step 1; plan: 2 stages on a, c (generation 2)"
    );
    assert_eq!(sim.state.restarts, 0);
    assert!(
        sim.state
            .membership
            .heartbeat(&"b".into(), sim.at(2.5))
            .is_err(),
        "b is fenced"
    );
}

#[test]
fn restarts_are_bounded() {
    let c = ElasticConfig {
        max_restarts: 2,
        ..cfg()
    };
    let mut sim = Sim::started(c, 8, &["a", "b", "c", "d"]);
    sim.midstep();
    for (k, id) in ["d", "c"].iter().enumerate() {
        sim.fail(id, k as f64);
        assert!(matches!(sim.decide(k as f64).0, Decision::Recover { .. }));
    }
    sim.fail("b", 5.0);
    let (d, r) = sim.decide(5.0);
    assert!(matches!(d, Decision::Fail { .. }), "{r}");
    assert!(
        r.contains("already recovered 2 times and elastic.max_restarts is 2"),
        "{r}"
    );
    assert!(r.contains("committed checkpoints are intact"), "{r}");
}

#[test]
fn impossible_plans_fail_with_a_reason() {
    let mut sim = Sim::new(cfg(), 0);
    sim.join("a", 1, 0.0);
    let (d, r) = sim.peek(0.0);
    assert!(
        matches!(d, Decision::Fail { .. }) && r.contains("max_stages is 0"),
        "{r}"
    );
    let mut sim = Sim::new(
        ElasticConfig {
            min_nodes: 3,
            ..cfg()
        },
        2,
    );
    sim.join("a", 1, 0.0);
    let (d, r) = sim.peek(0.0);
    assert!(
        matches!(d, Decision::Fail { .. }) && r.contains("elastic.min_nodes is 3"),
        "{r}"
    );
}

#[test]
fn a_wait_keeps_the_time_its_shortfall_began() {
    let mut sim = Sim::new(
        ElasticConfig {
            min_nodes: 2,
            ..cfg()
        },
        4,
    );
    sim.join("a", 1, 0.0);
    assert!(matches!(sim.decide(1.0).0, Decision::Wait { .. }));
    assert_eq!(sim.state.waiting_since, Some(sim.at(1.0)));
    let (d, _) = sim.decide(9.0);
    assert_eq!(
        d,
        Decision::Wait {
            alive: 1,
            needed: 2,
            until: sim.at(31.0)
        }
    );
    assert_eq!(sim.state.waiting_since, Some(sim.at(1.0)));
    sim.join("b", 1, 10.0);
    let (d, r) = sim.decide(10.0);
    assert_eq!(r, "first plan at step 0: 2 stages on a, b (generation 1)");
    assert_eq!(d.plan().unwrap().generation, 1);
    assert_eq!(sim.state.waiting_since, None);
}

/// A core that wants two data-parallel replicas, with single-slot nodes `ids` joined at t=0.
fn two_replicas(max_stages: usize, ids: &[&str]) -> Sim {
    let mut sim = Sim::new(cfg(), max_stages);
    sim.state.replicas = ReplicaPolicy {
        wanted: 2,
        valid: vec![1, 2],
    };
    for id in ids {
        sim.join(id, 1, 0.0);
    }
    sim
}

/// Slots with replicas separated: `"a b | c d"`.
fn replicas(plan: &elastic::Plan) -> String {
    (0..plan.replicas)
        .map(|r| {
            plan.replica(r)
                .iter()
                .map(NodeId::as_str)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

#[test]
fn a_fourth_node_grows_one_pipeline_of_3_into_2_replicas_of_2() {
    let mut sim = two_replicas(4, &["a", "b", "c"]);
    let (d, r) = sim.decide(0.0);
    let Decision::Grow { plan, .. } = &d else {
        panic!("{r}")
    };
    assert_eq!((plan.replicas, replicas(plan).as_str()), (1, "a b c"));
    assert_eq!(
        r,
        "first plan at step 0: 1 replica × 3 stages on a, b, c (generation 1), using all 3 slots \
         (2 replicas would use fewer)"
    );
    // d joins mid-step: it waits for the boundary, then the job becomes 2 × 2.
    sim.boundary(5);
    sim.midstep();
    sim.join("d", 1, 1.0);
    let (d, r) = sim.decide(1.0);
    assert_eq!(d, Decision::Continue, "{r}");
    assert_eq!(r, "node d waits for the next step boundary to join");
    sim.boundary(6);
    let (d, r) = sim.decide(2.0);
    let Decision::Grow { plan, joined } = &d else {
        panic!("{r}")
    };
    assert_eq!((plan.generation, plan.step, joined), (2, 6, &ids("d")));
    assert_eq!((plan.replicas, plan.num_stages()), (2, 2));
    assert_eq!(replicas(plan), "a b | c d");
    assert_eq!(
        r,
        "node d joined at step 6; plan: 2 replicas × 2 stages on a, b, c, d (generation 2), \
         using all 4 slots"
    );
    assert_eq!(sim.state.current.as_ref(), Some(plan));
    assert_eq!(sim.decide(3.0).0, Decision::Continue);
}

#[test]
fn a_loss_replans_with_the_same_rule() {
    let mut sim = two_replicas(4, &["a", "b", "c", "d"]);
    sim.decide(0.0);
    sim.boundary(3);
    sim.midstep();
    sim.fail("b", 1.0);
    let (d, r) = sim.decide(1.0);
    let Decision::Recover { plan, lost, joined } = &d else {
        panic!("{r}")
    };
    assert_eq!((lost, joined), (&ids("b"), &vec![]));
    assert_eq!((plan.generation, plan.step), (2, 3));
    assert_eq!((plan.replicas, replicas(plan).as_str()), (1, "a c d"));
    assert_eq!(
        r,
        "node b lost (connection broken); 3 of 4 nodes alive; plan: 1 replica × 3 stages on a, \
         c, d (generation 2), using all 3 slots (2 replicas would use fewer)"
    );
}

#[test]
fn survivors_without_a_worker_stay_spares() {
    // Two stages at most: 4 nodes run 2 × 2; 3 survivors can only run 2 workers.
    let mut sim = two_replicas(2, &["a", "b", "c", "d"]);
    let (d, _) = sim.decide(0.0);
    assert_eq!(replicas(d.plan().unwrap()), "a b | c d");
    sim.midstep();
    sim.fail("a", 1.0);
    let (d, r) = sim.decide(1.0);
    let Decision::Recover { plan, .. } = &d else {
        panic!("{r}")
    };
    assert_eq!(replicas(plan), "b | c");
    assert_eq!(
        r,
        "node a lost (connection broken); 3 of 4 nodes alive; plan: 2 replicas × 1 stage on b, c \
         (generation 2), using 2 of 3 slots, the most any layout can; node d stays spare: the \
         best layout, 2 × 1, has no worker for it"
    );
    // d waits as a spare; a new node e makes 4 slots again: 2 × 2, with d back in.
    sim.boundary(1);
    let (d, r) = sim.decide(2.0);
    assert_eq!(d, Decision::Continue, "{r}");
    assert_eq!(
        r,
        "plan generation 2 unchanged: 2 nodes alive; node d stays spare: the best layout, 2 × 1, \
         has no worker for it"
    );
    sim.join("e", 1, 3.0);
    let (d, r) = sim.decide(3.0);
    let Decision::Grow { plan, joined } = &d else {
        panic!("{r}")
    };
    assert_eq!(
        (replicas(plan).as_str(), joined),
        ("b c | d e", &ids("d e"))
    );
}

#[test]
fn joiners_are_admitted_together_when_only_together_they_add_workers() {
    // max 4 stages: 5 nodes run 2 × 2 like 4 do (e stays spare); 6 run 2 × 3.
    let mut sim = two_replicas(4, &["a", "b", "c", "d", "e"]);
    let (d, r) = sim.decide(0.0);
    let Decision::Grow { plan, joined } = &d else {
        panic!("{r}")
    };
    assert_eq!(
        (replicas(plan).as_str(), joined),
        ("a b | c d", &ids("a b c d"))
    );
    assert_eq!(
        r,
        "first plan at step 0: 2 replicas × 2 stages on a, b, c, d (generation 1), using all 4 \
         slots"
    );
    let (d, r) = sim.peek(0.5);
    assert_eq!(d, Decision::Continue, "{r}");
    assert_eq!(
        r,
        "plan generation 1 unchanged: 4 nodes alive; node e stays spare: the best layout, 2 × 2, \
         has no worker for it"
    );
    sim.boundary(1);
    sim.join("f", 1, 1.0);
    let (d, r) = sim.decide(1.0);
    let Decision::Grow { plan, joined } = &d else {
        panic!("{r}")
    };
    assert_eq!(
        (replicas(plan).as_str(), joined),
        ("a b c | d e f", &ids("e f"))
    );
    assert_eq!(
        r,
        "nodes e, f joined at step 1; plan: 2 replicas × 3 stages on a, b, c, d, e, f \
         (generation 2), using all 6 slots"
    );
    // Peer snapshots: replica 0 (a b c) only.
    let pairs: Vec<String> = buddies(plan)
        .iter()
        .map(|(a, b)| format!("{a}>{b}"))
        .collect();
    assert_eq!(pairs.join(" "), "a>b b>c c>a");
}

#[test]
fn every_node_leaving_with_no_joiner_stops_the_run_at_the_boundary() {
    let mut sim = Sim::started(cfg(), 8, &["a", "b"]);
    for id in ["a", "b"] {
        sim.state.membership.leave(&id.into(), sim.at(1.0)).unwrap();
    }
    sim.boundary(1);
    let (d, r) = sim.decide(1.0);
    assert_eq!(
        d,
        Decision::Stop {
            leaving: ids("a b")
        },
        "{r}"
    );
    assert!(r.starts_with("nodes a, b are leaving, and without them only 0 nodes would remain"));
    assert!(r.contains("the run stops with a checkpoint"), "{r}");
}

/// When notices leave too few nodes (`min_nodes`): mid-step the nodes stay; at a boundary the run
/// stops (`Stop`); a joiner that makes up the shortfall turns it into a `Shrink`.
#[test]
fn notices_that_leave_too_few_nodes_stop_the_run_at_the_boundary_as_a_table() {
    // (min_nodes, nodes, leaving, joiners, at a boundary, expected)
    type Row = (
        usize,
        &'static [&'static str],
        &'static [&'static str],
        &'static [&'static str],
        bool,
        &'static str,
    );
    let table: &[Row] = &[
        (1, &["a", "b"], &["a", "b"], &[], true, "Stop"),
        (1, &["a", "b"], &["a", "b"], &[], false, "Continue"),
        (1, &["a", "b"], &["a"], &[], true, "Shrink"),
        (2, &["a", "b"], &["a"], &[], true, "Stop"),
        (2, &["a", "b"], &["a"], &[], false, "Continue"),
        (2, &["a", "b"], &["a"], &["c"], true, "Shrink"),
        (
            1,
            &["a", "b", "c", "d"],
            &["a", "b", "c", "d"],
            &[],
            true,
            "Stop",
        ),
        (3, &["a", "b", "c", "d"], &["a", "b"], &[], true, "Stop"),
        (2, &["a", "b", "c", "d"], &["a", "b"], &[], true, "Shrink"),
    ];
    for &(min_nodes, nodes, leaving, joiners, boundary, expected) in table {
        let mut config = cfg();
        config.min_nodes = min_nodes;
        let mut sim = Sim::started(config, 8, nodes);
        for id in leaving {
            sim.state
                .membership
                .leave(&(*id).into(), sim.at(1.0))
                .unwrap();
        }
        for id in joiners {
            sim.join(id, 1, 1.0);
        }
        if boundary {
            sim.boundary(1);
        } else {
            sim.midstep();
        }
        let (d, r) = sim.decide(1.0);
        let got = match &d {
            Decision::Stop { leaving: l } => {
                assert_eq!(l, &ids(&leaving.join(" ")), "{r}");
                "Stop"
            }
            Decision::Continue => "Continue",
            Decision::Shrink { .. } => "Shrink",
            other => panic!("unexpected {other:?}: {r}"),
        };
        assert_eq!(
            got, expected,
            "min_nodes {min_nodes}, nodes {nodes:?}, leaving {leaving:?}, joiners {joiners:?}, \
             boundary {boundary}: {r}"
        );
    }
}
