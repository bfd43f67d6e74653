//! Plans: deterministic placement, slot packing, the max_stages cap, data-parallel layouts,
//! buddies and fencing.

use std::collections::BTreeMap;

use elastic::{
    ElasticError, Generation, NodeId, NodeInfo, Plan, ReplicaPolicy, best_layout, buddies,
    plan_for, plan_layout,
};

/// `"a:2 b:1"` → nodes.
fn nodes(spec: &str) -> Vec<NodeInfo> {
    spec.split_whitespace()
        .map(|s| {
            let (n, slots) = s.split_once(':').unwrap();
            NodeInfo::new(n, slots.parse().unwrap(), format!("{n}.local:29500"))
        })
        .collect()
}

fn names(ids: &[NodeId]) -> String {
    ids.iter().map(|i| i.as_str()).collect::<Vec<_>>().join(" ")
}

#[test]
fn placement_table() {
    // (nodes with slots, max_stages, expected stage → node, expected plan nodes)
    let cases = [
        ("a:1", 4, "a", "a"),
        ("a:4", 4, "a a a a", "a"),
        ("a:8", 4, "a a a a", "a"),
        ("a:2 b:1 c:3", 10, "a a b c c c", "a b c"),
        ("a:2 b:1 c:3", 4, "a a b c", "a b c"),
        ("a:2 b:1 c:3", 3, "a b c", "a b c"),
        ("a:2 b:1 c:3", 2, "a b", "a b"),
        ("a:2 b:2 c:2", 5, "a a b b c", "a b c"),
        ("c:1 a:1 b:1", 8, "a b c", "a b c"),
        ("b:3 a:1", 3, "a b b", "a b"),
        ("a:1 a:1 b:1", 8, "a b", "a b"),
        ("a:0 b:2", 8, "b b", "b"),
    ];
    for (spec, max_stages, stages, members) in cases {
        let plan = plan_for(&nodes(spec), max_stages, 7, 42).unwrap();
        assert_eq!(names(&plan.stages), stages, "{spec} max {max_stages}");
        assert_eq!(names(&plan.nodes), members, "{spec} max {max_stages}");
        assert_eq!((plan.generation, plan.step), (7, 42));
        // Stages of one node are consecutive; every plan node has at least one.
        for n in &plan.nodes {
            let r = plan.stages_of(n);
            assert!(
                !r.is_empty() && r.windows(2).all(|w| w[1] == w[0] + 1),
                "{spec}"
            );
        }
    }
}

#[test]
fn nothing_to_place_is_none() {
    assert_eq!(plan_for(&[], 4, 1, 0), None);
    assert_eq!(plan_for(&nodes("a:2"), 0, 1, 0), None);
    assert_eq!(plan_for(&nodes("a:0"), 4, 1, 0), None);
}

#[test]
fn placement_does_not_depend_on_input_order() {
    let base = nodes("e:1 b:3 a:2 d:1 c:2");
    let want = plan_for(&base, 6, 3, 9).unwrap();
    assert_eq!(names(&want.stages), "a a b c d e");
    // Every rotation and the reversal of the input give the same plan.
    for k in 0..base.len() {
        let mut v = base.clone();
        v.rotate_left(k);
        assert_eq!(plan_for(&v, 6, 3, 9).as_ref(), Some(&want));
        v.reverse();
        assert_eq!(plan_for(&v, 6, 3, 9).as_ref(), Some(&want));
    }
}

#[test]
fn plan_round_trips_through_json() {
    let plan = plan_for(&nodes("a:2 b:1"), 8, 5, 100).unwrap();
    let json = serde_json::to_string(&plan).unwrap();
    assert_eq!(
        json,
        r#"{"generation":5,"step":100,"stages":["a","a","b"],"nodes":["a","b"]}"#
    );
    assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
}

#[test]
fn generations_fence_everything_but_the_current_one() {
    // (current, message, admitted)
    for (current, message, ok) in [(3, 3, true), (3, 2, false), (3, 0, false), (3, 4, false)] {
        assert_eq!(
            Generation::admits(current, message),
            ok,
            "{current} vs {message}"
        );
        let checked = Generation::check(current, message);
        if ok {
            checked.unwrap();
        } else {
            assert_eq!(
                checked,
                Err(ElasticError::StaleGeneration { current, message })
            );
        }
    }
    let plan = plan_for(&nodes("a:1"), 1, 2, 0).unwrap();
    assert!(plan.admits(2) && !plan.admits(1));
    let err = Generation::check(2, 1).unwrap_err().to_string();
    assert!(err.contains("generation 1 refused") && err.contains("current generation is 2"));
}

#[test]
fn buddies_are_the_next_stage_on_another_node() {
    // (plan's stage → node, expected "node>buddy" pairs)
    let cases = [
        ("a", ""),
        ("a a a", ""),
        ("a b", "a>b b>a"),
        ("a a b c", "a>b b>c c>a"),
        ("a b b b", "a>b b>a"),
        ("a b c d", "a>b b>c c>d d>a"),
    ];
    for (stages, want) in cases {
        let stages: Vec<NodeId> = stages.split(' ').map(NodeId::from).collect();
        let mut members = stages.clone();
        members.dedup();
        let plan = Plan {
            generation: 1,
            step: 0,
            replicas: 1,
            stages,
            nodes: members,
        };
        let got: BTreeMap<NodeId, NodeId> = buddies(&plan);
        let got: Vec<String> = got.iter().map(|(a, b)| format!("{a}>{b}")).collect();
        assert_eq!(got.join(" "), want, "{:?}", plan.stages);
    }
}

/// Replica counts `wanted`, any of `valid` accepted.
fn policy(wanted: usize, valid: &[usize]) -> ReplicaPolicy {
    ReplicaPolicy {
        wanted,
        valid: valid.to_vec(),
    }
}

/// Slots with replicas separated: `"a b | c d"`.
fn replicas(plan: &Plan) -> String {
    (0..plan.replicas)
        .map(|r| names(plan.replica(r)))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// (total slots, max_stages, wanted, valid, expected (replicas, stages))
type LayoutCase = (
    usize,
    usize,
    usize,
    &'static [usize],
    Option<(usize, usize)>,
);

/// (nodes with slots, max_stages, wanted, valid, expected replicas' slots, plan nodes)
type PlacementCase = (
    &'static str,
    usize,
    usize,
    &'static [usize],
    &'static str,
    &'static str,
);

#[test]
fn layout_table() {
    let cases: &[LayoutCase] = &[
        // Most workers first, then most replicas.
        (4, 8, 2, &[1, 2], Some((2, 2))),
        (3, 8, 2, &[1, 2], Some((1, 3))),
        (2, 8, 2, &[1, 2], Some((2, 1))),
        (4, 1, 2, &[1, 2], Some((2, 1))),
        (4, 8, 4, &[1, 2, 4], Some((4, 1))),
        (5, 4, 2, &[1, 2], Some((2, 2))),
        (5, 8, 2, &[1, 2], Some((1, 5))),
        (6, 4, 2, &[1, 2], Some((2, 3))),
        (6, 8, 4, &[1, 2, 4], Some((2, 3))),
        (7, 2, 4, &[1, 2, 4], Some((4, 1))),
        (8, 2, 4, &[1, 2, 4], Some((4, 2))),
        // A count the trainer does not accept, or above `wanted`, is never used.
        (3, 1, 3, &[1, 2], Some((2, 1))),
        (4, 1, 2, &[1, 2, 4], Some((2, 1))),
        // 1 is always accepted; a wanted count of 0 means 1.
        (3, 8, 2, &[2], Some((1, 3))),
        (3, 8, 0, &[1, 2], Some((1, 3))),
        // Nothing to place.
        (0, 8, 2, &[1, 2], None),
        (4, 0, 2, &[1, 2], None),
    ];
    for &(total, max_stages, wanted, valid, want) in cases {
        assert_eq!(
            best_layout(total, max_stages, &policy(wanted, valid)),
            want,
            "{total} slots, max {max_stages}, wanted {wanted} of {valid:?}"
        );
    }
    // One replica wanted: one pipeline of min(slots, max_stages) stages.
    for total in 0..10 {
        for max_stages in 0..10 {
            let want = (total.min(max_stages) > 0).then_some((1, total.min(max_stages)));
            let got = best_layout(total, max_stages, &ReplicaPolicy::default());
            assert_eq!(got, want, "{total} slots, max {max_stages}");
        }
    }
}

#[test]
fn replica_placement_table() {
    let cases: &[PlacementCase] = &[
        ("a:1 b:1 c:1 d:1", 8, 2, &[1, 2], "a b | c d", "a b c d"),
        ("a:1 b:1 c:1", 8, 2, &[1, 2], "a b c", "a b c"),
        ("a:1 b:1", 8, 2, &[1, 2], "a | b", "a b"),
        // One stage at most: two replicas of one stage, c and d are spares.
        ("a:1 b:1 c:1 d:1", 1, 2, &[1, 2], "a | b", "a b"),
        (
            "a:1 b:1 c:1 d:1",
            8,
            4,
            &[1, 2, 4],
            "a | b | c | d",
            "a b c d",
        ),
        // 2 × 2 ties 1 × 4 on 4 of the 5 slots: more replicas win, e is a spare.
        ("a:1 b:1 c:1 d:1 e:1", 4, 2, &[1, 2], "a b | c d", "a b c d"),
        // Dealt as one pipeline, then cut: a replica's stages on a node are consecutive.
        ("a:2 b:1 c:3", 3, 2, &[1, 2], "a a b | c c c", "a b c"),
        ("a:2 b:1 c:3", 2, 2, &[1, 2], "a a | b c", "a b c"),
        ("a:2 b:2", 2, 2, &[1, 2], "a a | b b", "a b"),
        ("d:1 c:1 b:1 a:1 a:1", 8, 2, &[1, 2], "a b | c d", "a b c d"),
    ];
    for &(spec, max_stages, wanted, valid, slots, members) in cases {
        let p = policy(wanted, valid);
        let plan = plan_layout(&nodes(spec), max_stages, &p, 7, 42).unwrap();
        let label = format!("{spec} max {max_stages} wanted {wanted}");
        assert_eq!(replicas(&plan), slots, "{label}");
        assert_eq!(names(&plan.nodes), members, "{label}");
        assert_eq!((plan.generation, plan.step), (7, 42));
        assert_eq!(plan.num_workers(), plan.replicas * plan.num_stages());
        for n in &plan.nodes {
            let w = plan.slots_of(n);
            assert!(
                !w.is_empty() && w.windows(2).all(|w| w[1] == w[0] + 1),
                "{label}"
            );
        }
    }
    assert_eq!(plan_layout(&[], 4, &policy(2, &[1, 2]), 1, 0), None);
    assert_eq!(
        plan_layout(&nodes("a:2"), 0, &policy(2, &[1, 2]), 1, 0),
        None
    );
}

#[test]
fn one_replica_wanted_plans_exactly_as_plan_for() {
    let specs = [
        "a:1",
        "a:8",
        "a:2 b:1 c:3",
        "a:2 b:2 c:2",
        "b:3 a:1",
        "a:0 b:2",
    ];
    for spec in specs {
        for max_stages in 0..8 {
            for valid in [&[1][..], &[1, 2, 4]] {
                let p = policy(1, valid);
                assert_eq!(
                    plan_layout(&nodes(spec), max_stages, &p, 3, 9),
                    plan_for(&nodes(spec), max_stages, 3, 9),
                    "{spec} max {max_stages}"
                );
            }
        }
    }
}

#[test]
fn slots_map_to_replicas_and_stages() {
    // 2 replicas × 3 stages: slot w = r · 3 + s.
    let plan = plan_layout(&nodes("a:2 b:1 c:3"), 3, &policy(2, &[1, 2]), 1, 0).unwrap();
    assert_eq!(
        (plan.replicas, plan.num_stages(), plan.num_workers()),
        (2, 3, 6)
    );
    for w in 0..6 {
        let (r, s) = (plan.replica_of(w), plan.stage_of(w));
        assert_eq!((r, s), (w / 3, w % 3));
        assert_eq!(plan.slot(r, s), w);
    }
    assert_eq!(names(plan.replica(0)), "a a b");
    assert_eq!(names(plan.replica(1)), "c c c");
    assert!(plan.replica(2).is_empty());
    assert_eq!(plan.slots_of(&"c".into()), vec![3, 4, 5]);
    assert_eq!(plan.stages_of(&"c".into()), plan.slots_of(&"c".into()));
    assert!(plan.slots_of(&"z".into()).is_empty());
    // One replica: a slot is its stage.
    let single = plan_for(&nodes("a:2 b:1"), 8, 1, 0).unwrap();
    assert_eq!((single.replicas, single.num_stages()), (1, 3));
    assert_eq!(
        (single.replica_of(2), single.stage_of(2), single.slot(0, 2)),
        (0, 2, 2)
    );
}

#[test]
fn replicas_round_trip_through_json_and_old_plans_read_as_one() {
    let plan = plan_layout(&nodes("a:1 b:1"), 8, &policy(2, &[1, 2]), 5, 100).unwrap();
    let json = serde_json::to_string(&plan).unwrap();
    assert_eq!(
        json,
        r#"{"generation":5,"step":100,"replicas":2,"stages":["a","b"],"nodes":["a","b"]}"#
    );
    assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
    // A plan stored before replicas existed is one replica.
    let old = r#"{"generation":5,"step":100,"stages":["a","a","b"],"nodes":["a","b"]}"#;
    let old: Plan = serde_json::from_str(old).unwrap();
    assert_eq!((old.replicas, old.num_stages()), (1, 3));
    // Replicas that do not divide the slots are refused, not divided by.
    for bad in [0, 2, 4] {
        let json = format!(
            r#"{{"generation":5,"step":1,"replicas":{bad},"stages":["a","a","b"],"nodes":["a","b"]}}"#
        );
        let err = serde_json::from_str::<Plan>(&json).unwrap_err().to_string();
        assert!(
            err.contains(&format!("3 worker slots cannot have {bad} replicas")),
            "{err}"
        );
    }
}

#[test]
fn buddies_are_those_of_replica_0() {
    // (replicas' slots, expected "node>buddy" pairs): only replica 0 takes peer snapshots.
    let cases = [
        ("a b | c d", "a>b b>a"),
        ("a a | b c", ""),
        ("a a b | c c c", "a>b b>a"),
        ("a b c | a b c", "a>b b>c c>a"),
        ("a | b | c | d", ""),
    ];
    for (spec, want) in cases {
        let groups: Vec<&str> = spec.split(" | ").collect();
        let stages: Vec<NodeId> = groups
            .iter()
            .flat_map(|g| g.split(' '))
            .map(NodeId::from)
            .collect();
        let mut members = stages.clone();
        members.sort();
        members.dedup();
        let plan = Plan {
            generation: 1,
            step: 0,
            replicas: groups.len(),
            stages,
            nodes: members,
        };
        let got: Vec<String> = buddies(&plan)
            .iter()
            .map(|(a, b)| format!("{a}>{b}"))
            .collect();
        assert_eq!(got.join(" "), want, "{spec}");
    }
}
