//! Plans: deterministic placement, slot packing, the max_stages cap, buddies and fencing.

use std::collections::BTreeMap;

use elastic::{ElasticError, Generation, NodeId, NodeInfo, Plan, buddies, plan_for};

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
            stages,
            nodes: members,
        };
        let got: BTreeMap<NodeId, NodeId> = buddies(&plan);
        let got: Vec<String> = got.iter().map(|(a, b)| format!("{a}>{b}")).collect();
        assert_eq!(got.join(" "), want, "{:?}", plan.stages);
    }
}
