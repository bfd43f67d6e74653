//! Schedule generation: per-stage action lists for GPipe, 1F1B and Seq1F1B.
//!
//! All three kinds are one algorithm over "groups" of units:
//!
//! * forward groups in order, backward groups in order (the backward order is always micro-batch
//!   ascending, segment descending, for every kind and every stage, so gradient accumulation
//!   order never depends on the partition);
//! * stage r first runs `w(r)` forward groups (warm-up), then alternates one forward group and
//!   one backward group (steady state), then runs the remaining backward groups (cool-down).
//!
//! | kind      | group                       | warm-up groups on stage r        |
//! |-----------|-----------------------------|----------------------------------|
//! | `gpipe`   | one unit                    | all m·k                          |
//! | `1f1b`    | one micro-batch (k units)   | min(p−r−1, m)                    |
//! | `seq1f1b` | one unit                    | min((p−r−1)+(k−1), m·k)          |
//!
//! Compute actions are then wrapped in their communication actions: on stage r>0 a forward is
//! preceded by its `RecvActivation`, on r<p−1 followed by its `SendActivation`; on r<p−1 a
//! backward is preceded by its `RecvGrad`, on r>0 followed by its `SendGrad`.

use serde::{Deserialize, Serialize};

use super::{Action, ScheduleError, ScheduleKind, Unit};

/// A whole schedule: one ordered action list per stage, communication actions included.
///
/// On stage r>0 every `Forward(u)` is preceded by `RecvActivation(u)`; on r<p−1 it is followed by
/// `SendActivation(u)`. On r<p−1 every `Backward(u)` is preceded by `RecvGrad(u)`; on r>0 it is
/// followed by `SendGrad(u)`. A `forward_only` schedule (evaluation) has no backward-pass
/// actions. Serializes to JSON with actions as strings (`"RF0.1"`), so a schedule can be saved,
/// edited and loaded; run [`super::validate`] on anything loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Which schedule this is (forward-only schedules say [`ScheduleKind::GPipe`]: their order is
    /// GPipe's forward phase).
    pub kind: ScheduleKind,
    /// Number of pipeline stages p.
    pub stages: usize,
    /// Micro-batches per step m.
    pub microbatches: usize,
    /// Segments per micro-batch k.
    pub splits: usize,
    /// True for evaluation schedules: forwards only, no backward, no gradients.
    pub forward_only: bool,
    /// `actions[r]` is stage r's ordered action list.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Stage `stage`'s compute actions ([`Action::Forward`] / [`Action::Backward`]) in order.
    pub fn compute_actions(&self, stage: usize) -> impl Iterator<Item = Action> + '_ {
        self.actions[stage]
            .iter()
            .copied()
            .filter(|a| a.is_compute())
    }

    /// Stage `stage`'s backward units in execution order.
    pub fn backward_order(&self, stage: usize) -> Vec<Unit> {
        self.actions[stage]
            .iter()
            .filter_map(|a| match a {
                Action::Backward(u) => Some(*u),
                _ => None,
            })
            .collect()
    }
}

/// Checks that p, m and k are all at least 1.
pub(crate) fn check_parameters(
    stages: usize,
    microbatches: usize,
    splits: usize,
) -> Result<(), ScheduleError> {
    let mut bad = Vec::new();
    if stages == 0 {
        bad.push("stages must be at least 1 (got 0)");
    }
    if microbatches == 0 {
        bad.push("microbatches must be at least 1 (got 0)");
    }
    if splits == 0 {
        bad.push("splits must be at least 1 (got 0)");
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(ScheduleError::InvalidParameters(bad.join("; ")))
    }
}

/// Units in forward order: (0,0), (0,1), …, (0,k−1), (1,0), …
pub(crate) fn forward_units(microbatches: usize, splits: usize) -> Vec<Unit> {
    (0..microbatches)
        .flat_map(|i| (0..splits).map(move |j| Unit::new(i, j)))
        .collect()
}

/// Units in the one backward order used by every kind: micro-batch ascending, segment descending.
pub(crate) fn backward_units(microbatches: usize, splits: usize) -> Vec<Unit> {
    (0..microbatches)
        .flat_map(|i| (0..splits).rev().map(move |j| Unit::new(i, j)))
        .collect()
}

/// Generates the training schedule of `kind` for `stages` stages, `microbatches` micro-batches
/// and `splits` segments per micro-batch.
///
/// Errors with [`ScheduleError::InvalidParameters`] when any of them is 0. The result always
/// passes [`super::validate`].
pub fn generate(
    kind: ScheduleKind,
    stages: usize,
    microbatches: usize,
    splits: usize,
) -> Result<Schedule, ScheduleError> {
    check_parameters(stages, microbatches, splits)?;
    let (p, m, k) = (stages, microbatches, splits);
    let units = |v: Vec<Unit>| v.into_iter().map(|u| vec![u]).collect::<Vec<_>>();
    let (fwd_groups, bwd_groups): (Vec<Vec<Unit>>, Vec<Vec<Unit>>) = match kind {
        ScheduleKind::GPipe | ScheduleKind::Seq1F1B => {
            (units(forward_units(m, k)), units(backward_units(m, k)))
        }
        ScheduleKind::OneFOneB => (
            (0..m)
                .map(|i| (0..k).map(|j| Unit::new(i, j)).collect())
                .collect(),
            (0..m)
                .map(|i| (0..k).rev().map(|j| Unit::new(i, j)).collect())
                .collect(),
        ),
    };
    let actions = (0..p)
        .map(|r| {
            let warmup = match kind {
                ScheduleKind::GPipe => m * k,
                ScheduleKind::OneFOneB => (p - r - 1).min(m),
                ScheduleKind::Seq1F1B => ((p - r - 1) + (k - 1)).min(m * k),
            };
            let order = one_f_one_b(&fwd_groups, &bwd_groups, warmup);
            with_communication(&order, r, p)
        })
        .collect();
    Ok(Schedule {
        kind,
        stages: p,
        microbatches: m,
        splits: k,
        forward_only: false,
        actions,
    })
}

/// Generates an evaluation (forward-only) schedule: every stage forwards the units in order
/// (0,0), (0,1), …, (m−1,k−1), with activation receives/sends and nothing else.
///
/// The schedule's `kind` is [`ScheduleKind::GPipe`] (the order is GPipe's forward phase; all
/// kinds share it). Errors with [`ScheduleError::InvalidParameters`] when any count is 0.
pub fn generate_forward_only(
    stages: usize,
    microbatches: usize,
    splits: usize,
) -> Result<Schedule, ScheduleError> {
    check_parameters(stages, microbatches, splits)?;
    let order: Vec<Action> = forward_units(microbatches, splits)
        .into_iter()
        .map(Action::Forward)
        .collect();
    Ok(Schedule {
        kind: ScheduleKind::GPipe,
        stages,
        microbatches,
        splits,
        forward_only: true,
        actions: (0..stages)
            .map(|r| with_communication(&order, r, stages))
            .collect(),
    })
}

/// Warm-up / steady / cool-down over groups: `warmup` forward groups, then alternately one
/// forward group and one backward group, then the remaining backward groups.
fn one_f_one_b(fwd: &[Vec<Unit>], bwd: &[Vec<Unit>], warmup: usize) -> Vec<Action> {
    debug_assert_eq!(fwd.len(), bwd.len());
    let n = fwd.len();
    let warmup = warmup.min(n);
    let fwd_actions = |g: &Vec<Unit>| g.iter().copied().map(Action::Forward).collect::<Vec<_>>();
    let bwd_actions = |g: &Vec<Unit>| g.iter().copied().map(Action::Backward).collect::<Vec<_>>();
    let mut out = Vec::new();
    for g in &fwd[..warmup] {
        out.extend(fwd_actions(g));
    }
    for t in 0..n - warmup {
        out.extend(fwd_actions(&fwd[warmup + t]));
        out.extend(bwd_actions(&bwd[t]));
    }
    for g in &bwd[n - warmup..] {
        out.extend(bwd_actions(g));
    }
    out
}

/// Wraps stage `r`'s compute order in its receives and sends.
fn with_communication(compute: &[Action], r: usize, p: usize) -> Vec<Action> {
    let first = r == 0;
    let last = r + 1 == p;
    let mut out = Vec::with_capacity(compute.len() * 3);
    for &a in compute {
        match a {
            Action::Forward(u) => {
                if !first {
                    out.push(Action::RecvActivation(u));
                }
                out.push(a);
                if !last {
                    out.push(Action::SendActivation(u));
                }
            }
            Action::Backward(u) => {
                if !last {
                    out.push(Action::RecvGrad(u));
                }
                out.push(a);
                if !first {
                    out.push(Action::SendGrad(u));
                }
            }
            other => unreachable!("compute order holds only compute actions, got {other}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{render_text, validate};
    use super::*;

    fn compute_line(s: &Schedule, r: usize) -> String {
        s.compute_actions(r)
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn seq1f1b_golden_orders_p4_k2_m3() {
        let s = generate(ScheduleKind::Seq1F1B, 4, 3, 2).unwrap();
        assert_eq!(
            compute_line(&s, 0),
            "F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1 B0.0 B1.1 B1.0 B2.1 B2.0"
        );
        assert_eq!(
            compute_line(&s, 3),
            "F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 F2.0 B1.0 F2.1 B2.1 B2.0"
        );
        validate(&s).unwrap();
    }

    #[test]
    fn gpipe_and_1f1b_golden_orders() {
        let g = generate(ScheduleKind::GPipe, 2, 2, 2).unwrap();
        for r in 0..2 {
            assert_eq!(
                compute_line(&g, r),
                "F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 B1.1 B1.0"
            );
        }
        let o = generate(ScheduleKind::OneFOneB, 3, 3, 2).unwrap();
        assert_eq!(
            compute_line(&o, 0),
            "F0.0 F0.1 F1.0 F1.1 F2.0 F2.1 B0.1 B0.0 B1.1 B1.0 B2.1 B2.0"
        );
        assert_eq!(
            compute_line(&o, 1),
            "F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 F2.0 F2.1 B1.1 B1.0 B2.1 B2.0"
        );
        assert_eq!(
            compute_line(&o, 2),
            "F0.0 F0.1 B0.1 B0.0 F1.0 F1.1 B1.1 B1.0 F2.0 F2.1 B2.1 B2.0"
        );
        // Textbook 1F1B, k = 1, p = 4, m = 6, stage 1: warm-up 2.
        let t = generate(ScheduleKind::OneFOneB, 4, 6, 1).unwrap();
        assert_eq!(
            compute_line(&t, 1),
            "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 B4.0 B5.0"
        );
    }

    #[test]
    fn communication_wraps_compute() {
        let s = generate(ScheduleKind::Seq1F1B, 3, 1, 1).unwrap();
        let line = |r: usize| {
            s.actions[r]
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(line(0), "F0.0 SF0.0 RB0.0 B0.0");
        assert_eq!(line(1), "RF0.0 F0.0 SF0.0 RB0.0 B0.0 SB0.0");
        assert_eq!(line(2), "RF0.0 F0.0 B0.0 SB0.0");
        let f = generate_forward_only(3, 1, 2).unwrap();
        assert_eq!(
            f.actions[1]
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>(),
            ["RF0.0", "F0.0", "SF0.0", "RF0.1", "F0.1", "SF0.1"]
        );
    }

    #[test]
    fn k1_seq1f1b_equals_1f1b() {
        for p in 1..=6 {
            for m in 1..=8 {
                let a = generate(ScheduleKind::Seq1F1B, p, m, 1).unwrap();
                let b = generate(ScheduleKind::OneFOneB, p, m, 1).unwrap();
                assert_eq!(a.actions, b.actions, "p={p} m={m}");
            }
        }
    }

    #[test]
    fn every_generated_schedule_validates() {
        for kind in ScheduleKind::ALL {
            for p in 1..=6 {
                for m in 1..=6 {
                    for k in 1..=5 {
                        let s = generate(kind, p, m, k).unwrap();
                        if let Err(e) = validate(&s) {
                            panic!("{kind} p={p} m={m} k={k}: {e}\n{}", render_text(&s));
                        }
                    }
                }
            }
        }
        for p in 1..=6 {
            for m in 1..=6 {
                for k in 1..=5 {
                    let s = generate_forward_only(p, m, k).unwrap();
                    validate(&s).unwrap_or_else(|e| panic!("forward-only p={p} m={m} k={k}: {e}"));
                    assert!(s.actions.iter().flatten().all(|a| !a.is_backward_pass()));
                }
            }
        }
    }

    #[test]
    fn backward_order_is_the_same_everywhere() {
        for p in 1..=6 {
            for m in 1..=6 {
                for k in 1..=5 {
                    let expected = backward_units(m, k);
                    for kind in ScheduleKind::ALL {
                        let s = generate(kind, p, m, k).unwrap();
                        for r in 0..p {
                            assert_eq!(
                                s.backward_order(r),
                                expected,
                                "{kind} p={p} m={m} k={k} r={r}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn warmup_counts() {
        // Seq1F1B stage r runs min((p-r-1)+(k-1), m*k) forwards before its first backward.
        for (p, m, k) in [(4, 3, 2), (4, 8, 4), (6, 2, 3), (2, 5, 1)] {
            let s = generate(ScheduleKind::Seq1F1B, p, m, k).unwrap();
            for r in 0..p {
                let before = s
                    .compute_actions(r)
                    .take_while(|a| matches!(a, Action::Forward(_)))
                    .count();
                // The first backward is preceded by warm-up + one steady-state forward,
                // unless warm-up already covers every unit.
                let w = ((p - r - 1) + (k - 1)).min(m * k);
                assert_eq!(before, (w + 1).min(m * k), "p={p} m={m} k={k} r={r}");
            }
        }
    }

    #[test]
    fn zero_parameters_are_rejected() {
        for (p, m, k) in [(0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 0)] {
            let e = generate(ScheduleKind::Seq1F1B, p, m, k).unwrap_err();
            assert!(matches!(e, ScheduleError::InvalidParameters(_)), "{e}");
            assert!(e.to_string().contains("at least 1"), "{e}");
            assert!(generate_forward_only(p, m, k).is_err());
        }
    }

    #[test]
    fn schedule_json_round_trip() {
        let s = generate(ScheduleKind::Seq1F1B, 3, 2, 2).unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert!(
            json.contains("\"RF0.1\"") && json.contains("\"seq1f1b\""),
            "{json}"
        );
        let back: Schedule = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }
}
