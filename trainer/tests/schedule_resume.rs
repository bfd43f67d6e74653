//! Mid-step recovery as data: property tests of `resume_after_loss` and `validate_resumed` over
//! progress states that executions of the generated schedules actually reach — whole backwards
//! (`gpipe`, `1f1b`, `seq1f1b`) and backwards split into input and weight halves (`seq1f1b-zb`).
//!
//! Each case runs a schedule in a seeded random interleaving of its stages (FIFO channels, sends
//! never block, a receive waits for its message), stops somewhere, loses one stage and resumes.
//! The resumed step is checked by `validate_resumed` and, independently, by running it to the end
//! in another random interleaving from the state the loss left: every stage computes every
//! unit's forward and backward (halves) exactly once, and the stage whose state was lost
//! accumulates its parameter gradients (`B`, or `W` with split backwards) in the original order,
//! which is what makes the recovered step bit-identical.

use std::collections::{HashSet, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use trainer::schedule::{
    Action, Op, ResumedStep, Schedule, ScheduleError, ScheduleKind, Unit, generate, render_text,
    resume_after_loss, validate_resumed,
};

/// Random stop points per schedule, besides the start, the end and the two points before it.
const RANDOM_STOPS: usize = 24;

/// Stages running action lists over FIFO channels, one action at a time.
#[derive(Clone)]
struct Run {
    lists: Vec<Vec<Action>>,
    pc: Vec<usize>,
    /// `act[c]`: activations from stage c to c+1; `grad[c]`: gradients from c+1 to c.
    act: Vec<VecDeque<Unit>>,
    grad: Vec<VecDeque<Unit>>,
    /// Per stage, what it has received and computed, in order.
    received_act: Vec<Vec<Unit>>,
    received_grad: Vec<Vec<Unit>>,
    computed: Vec<Vec<Action>>,
}

impl Run {
    fn new(s: &Schedule) -> Self {
        let p = s.stages;
        Run {
            lists: s.actions.clone(),
            pc: vec![0; p],
            act: vec![VecDeque::new(); p - 1],
            grad: vec![VecDeque::new(); p - 1],
            received_act: vec![Vec::new(); p],
            received_grad: vec![Vec::new(); p],
            computed: vec![Vec::new(); p],
        }
    }

    /// Whether stage r can run its next action now (a receive whose message has not arrived
    /// cannot; a different message at the head of the channel is a test failure).
    fn ready(&self, r: usize) -> bool {
        let head = |q: &VecDeque<Unit>, u: Unit| match q.front() {
            None => false,
            Some(&h) => {
                assert_eq!(
                    h, u,
                    "stage {r} expects {u} but {h} is at the head of the channel"
                );
                true
            }
        };
        match self.lists[r].get(self.pc[r]) {
            None => false,
            Some(&Action::RecvActivation(u)) => head(&self.act[r - 1], u),
            Some(&Action::RecvGrad(u)) => head(&self.grad[r], u),
            Some(_) => true,
        }
    }

    /// Runs stage r's next action (which must be ready).
    fn step(&mut self, r: usize) {
        let a = self.lists[r][self.pc[r]];
        match a {
            Action::RecvActivation(u) => {
                self.act[r - 1].pop_front();
                self.received_act[r].push(u);
            }
            Action::RecvGrad(u) => {
                self.grad[r].pop_front();
                self.received_grad[r].push(u);
            }
            Action::SendActivation(u) => self.act[r].push_back(u),
            Action::SendGrad(u) => self.grad[r - 1].push_back(u),
            Action::Forward(_) | Action::Backward(_) => self.computed[r].push(a),
            Action::Extended {
                op: Op::BackwardInput | Op::BackwardWeight,
                chunk: 0,
                ..
            } => self.computed[r].push(a),
            Action::Extended { .. } => {
                unreachable!("these kinds hold one chunk per stage, so no {a}")
            }
        }
        self.pc[r] += 1;
    }

    /// Runs one ready stage other than `frozen`, chosen at random; the stage, or `None` when no
    /// such stage can progress.
    fn random_step(&mut self, rng: &mut ChaCha8Rng, frozen: Option<usize>) -> Option<usize> {
        let ready: Vec<usize> = (0..self.lists.len())
            .filter(|&r| Some(r) != frozen && self.ready(r))
            .collect();
        let r = *ready.get(rng.random_range(0..ready.len().max(1)))?;
        self.step(r);
        Some(r)
    }

    fn finished(&self) -> bool {
        (0..self.lists.len()).all(|r| self.pc[r] == self.lists[r].len())
    }
}

/// One resumption case: a reachable state of the original run, the lost stage and the result.
struct Case {
    label: String,
    s: Schedule,
    lost: usize,
    /// The run of the original schedule when the stage was lost.
    at_loss: Run,
    resumed: ResumedStep,
}

/// Calls `check` on every case: kinds × p ∈ {2,3,4} × m ∈ {1,2,4} × k ∈ {1,2,4}, stop points
/// (start, end, the two before the end, random ones), each stage lost in turn, and for each the
/// progress at the stop and the progress after the survivors ran on until they all wait for the
/// lost stage. Returns the number of cases.
fn for_each_case(mut check: impl FnMut(&Case)) -> usize {
    let mut cases = 0;
    for (kind_index, kind) in ScheduleKind::runtime_kinds().enumerate() {
        for p in [2, 3, 4] {
            for m in [1, 2, 4] {
                for k in [1, 2, 4] {
                    let s = generate(kind, p, m, k).unwrap();
                    let seed = kind_index * 1000 + p * 100 + m * 10 + k;
                    let mut rng = ChaCha8Rng::seed_from_u64(seed as u64);
                    let mut run = Run::new(&s);
                    let mut trajectory = vec![run.clone()];
                    while run.random_step(&mut rng, None).is_some() {
                        trajectory.push(run.clone());
                    }
                    assert!(
                        run.finished(),
                        "{kind} p={p} m={m} k={k}: the original stalls"
                    );
                    let n = trajectory.len() - 1;
                    let mut stops: Vec<usize> = vec![0, n.saturating_sub(2), n - 1, n];
                    stops.extend((0..RANDOM_STOPS).map(|_| rng.random_range(0..=n)));
                    stops.sort_unstable();
                    stops.dedup();
                    for &t in &stops {
                        for lost in 0..p {
                            let mut drained = trajectory[t].clone();
                            while drained.random_step(&mut rng, Some(lost)).is_some() {}
                            for (how, at_loss) in
                                [("stopped", &trajectory[t]), ("drained", &drained)]
                            {
                                let label = format!(
                                    "{kind} p={p} m={m} k={k}, step {t}/{n} ({how}), lost stage \
                                     {lost}, progress {:?}",
                                    at_loss.pc
                                );
                                let resumed = resume_after_loss(&s, lost, &at_loss.pc)
                                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                                check(&Case {
                                    label,
                                    s: s.clone(),
                                    lost,
                                    at_loss: at_loss.clone(),
                                    resumed,
                                });
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    cases
}

/// Runs the rest of the step from the state the loss left, in a random interleaving: survivors
/// keep what they received and what is in flight between them; the links to the lost stage
/// start empty; the replacement starts from nothing. Returns the finished run.
fn run_rest(case: &Case, rng: &mut ChaCha8Rng) -> Run {
    let (p, lost) = (case.s.stages, case.lost);
    let mut run = case.at_loss.clone();
    run.lists = case.resumed.rest.actions.clone();
    run.pc = vec![0; p];
    run.received_act[lost].clear();
    run.received_grad[lost].clear();
    run.computed[lost].clear();
    for c in [lost.checked_sub(1), (lost + 1 < p).then_some(lost)]
        .into_iter()
        .flatten()
    {
        run.act[c].clear();
        run.grad[c].clear();
    }
    while run.random_step(rng, None).is_some() {}
    assert!(
        run.finished(),
        "{}: the rest stalls at {:?}\n{}",
        case.label,
        run.pc,
        render_text(&case.resumed.rest)
    );
    run
}

#[test]
fn resumed_steps_validate_complete_and_recompute_nothing_on_survivors() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let started = std::time::Instant::now();
    let cases = for_each_case(|case| {
        let (s, lost, res) = (&case.s, case.lost, &case.resumed);
        let label = &case.label;
        if let Err(e) = validate_resumed(s, res) {
            panic!("{label}: {e}\nrest:\n{}", render_text(&res.rest));
        }
        for r in (0..s.stages).filter(|&r| r != lost) {
            let done = &s.actions[r][..case.at_loss.pc[r]];
            let rest = &res.rest.actions[r];
            assert_eq!(res.done[r], done.len(), "{label}: stage {r}");
            // Re-sends first (everything sent to the lost stage), then the list from where the
            // stage stood; no compute action that is already done.
            let to_lost: Vec<Action> = done
                .iter()
                .copied()
                .filter(|a| match a {
                    Action::SendActivation(_) => r + 1 == lost,
                    Action::SendGrad(_) => r == lost + 1,
                    _ => false,
                })
                .collect();
            assert_eq!(res.resent[r], to_lost.len(), "{label}: stage {r}");
            assert_eq!(rest[..res.resent[r]], to_lost[..], "{label}: stage {r}");
            assert_eq!(
                rest[res.resent[r]..],
                s.actions[r][done.len()..],
                "{label}: stage {r}"
            );
            let computed: HashSet<Action> =
                done.iter().copied().filter(|a| a.is_compute()).collect();
            assert!(
                rest.iter().all(|a| !computed.contains(a)),
                "{label}: stage {r} recomputes"
            );
        }
        // An independent run of the rest: every stage ends with every unit forwarded and
        // backwarded exactly once (the replacement: all of them itself) and every input received
        // exactly once; nothing is left in the channels.
        let end = run_rest(case, &mut rng);
        assert!(
            end.act.iter().chain(&end.grad).all(VecDeque::is_empty),
            "{label}: messages left unreceived"
        );
        // The replacement starts from the step-start state (zero gradients) and accumulates
        // every unit's parameter gradients itself, in the original list's order.
        let accumulates = |a: &&Action| matches!(a.op(), Op::Backward | Op::BackwardWeight);
        let order =
            |v: &[Action]| -> Vec<Action> { v.iter().filter(accumulates).copied().collect() };
        assert_eq!(
            order(&end.computed[lost]),
            order(&s.actions[lost]),
            "{label}: the replacement's gradient accumulation order"
        );
        let units: Vec<Unit> = (0..s.microbatches)
            .flat_map(|i| (0..s.splits).map(move |j| Unit::new(i, j)))
            .collect();
        let backward: &[Op] = if s.kind.splits_backward() {
            &[Op::BackwardInput, Op::BackwardWeight]
        } else {
            &[Op::Backward]
        };
        for r in 0..s.stages {
            let mut computed = end.computed[r].clone();
            computed.sort_by_key(|a| (a.unit(), a.op()));
            let want: Vec<Action> = units
                .iter()
                .flat_map(|&u| {
                    std::iter::once(Action::Forward(u))
                        .chain(backward.iter().map(move |&op| Action::new(op, u, 0)))
                })
                .collect();
            assert_eq!(computed, want, "{label}: stage {r}'s compute");
            let sorted = |v: &[Unit]| {
                let mut v = v.to_vec();
                v.sort();
                v
            };
            let want_in = |has: bool| if has { units.clone() } else { Vec::new() };
            assert_eq!(
                sorted(&end.received_act[r]),
                want_in(r > 0),
                "{label}: stage {r}"
            );
            assert_eq!(
                sorted(&end.received_grad[r]),
                want_in(r + 1 < s.stages),
                "{label}: stage {r}"
            );
        }
    });
    eprintln!(
        "{cases} resumptions validated and run in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert!(cases > 5000, "{cases}");
}

#[test]
fn replayed_units_are_those_whose_outputs_a_neighbour_received() {
    let (mut replayed_total, mut weights_replayed) = (0, 0);
    let cases = for_each_case(|case| {
        let (s, lost, res, run) = (&case.s, case.lost, &case.resumed, &case.at_loss);
        let label = &case.label;
        let at_next: HashSet<Unit> = run
            .received_act
            .get(lost + 1)
            .into_iter()
            .flatten()
            .copied()
            .collect();
        let at_prev: HashSet<Unit> = lost
            .checked_sub(1)
            .map(|q| run.received_grad[q].iter().copied().collect())
            .unwrap_or_default();
        // The sends of the lost stage whose message a neighbour has; every action before the
        // last of them was done (the stage runs its list in order), which is what proves a
        // weight half (it sends nothing).
        let delivered = |a: &Action| match a.op() {
            Op::SendActivation => at_next.contains(&a.unit()),
            Op::SendGrad => at_prev.contains(&a.unit()),
            _ => false,
        };
        let list = &s.actions[lost];
        let proven = list.iter().rposition(delivered).map_or(0, |i| i + 1);
        let want: Vec<Action> = list
            .iter()
            .enumerate()
            .filter(|&(i, a)| match a.op() {
                Op::Forward => at_next.contains(&a.unit()) || at_prev.contains(&a.unit()),
                Op::Backward | Op::BackwardInput => at_prev.contains(&a.unit()),
                Op::BackwardWeight => i < proven,
                _ => false,
            })
            .map(|(_, &a)| a)
            .collect();
        assert_eq!(res.replayed, want, "{label}");
        weights_replayed += want.iter().filter(|a| a.op() == Op::BackwardWeight).count();
        // Replayed work was really done by the lost stage, and the progress its neighbours prove
        // never exceeds what it really did.
        let really_done: HashSet<Action> = run.computed[lost].iter().copied().collect();
        assert!(
            res.replayed.iter().all(|a| really_done.contains(a)),
            "{label}"
        );
        assert!(res.done[lost] <= run.pc[lost], "{label}");
        // The replacement skips exactly the sends whose message a neighbour has.
        let skipped: Vec<Action> = list.iter().copied().filter(delivered).collect();
        let kept: Vec<Action> = s.actions[lost]
            .iter()
            .copied()
            .filter(|a| !skipped.contains(a))
            .collect();
        assert_eq!(res.rest.actions[lost], kept, "{label}");
        replayed_total += res.replayed.len();
    });
    assert!(
        cases > 5000 && replayed_total > 0 && weights_replayed > 0,
        "{cases} {replayed_total} {weights_replayed}"
    );
}

fn actions(line: &str) -> Vec<Action> {
    line.split_whitespace()
        .map(|a| a.parse().unwrap())
        .collect()
}

#[test]
fn gpipe_last_stage_lost_after_its_first_backward() {
    // p=2, m=2, k=1. Stage 0 has sent both activations and received the gradient of 0.0; stage 1
    // died after sending it. Its replacement redoes F0.0 and B0.0 (proven by the gradient) and
    // everything else, without sending SB0.0 again.
    let s = generate(ScheduleKind::GPipe, 2, 2, 1).unwrap();
    assert_eq!(
        s.actions[0],
        actions("F0.0 SF0.0 F1.0 SF1.0 RB0.0 B0.0 RB1.0 B1.0")
    );
    let res = resume_after_loss(&s, 1, &[6, 0]).unwrap();
    assert_eq!(res.rest.actions[0], actions("SF0.0 SF1.0 RB1.0 B1.0"));
    assert_eq!(
        res.rest.actions[1],
        actions("RF0.0 F0.0 RF1.0 F1.0 B0.0 B1.0 SB1.0")
    );
    assert_eq!(res.resent, [2, 0]);
    assert_eq!(res.done, [6, 6]);
    assert_eq!(res.replayed, actions("F0.0 B0.0"));
    validate_resumed(&s, &res).unwrap();

    // Losing it at the start: nothing to skip, nothing replayed, the rest is the whole step.
    let res = resume_after_loss(&s, 1, &[0, 0]).unwrap();
    assert_eq!(res.rest.actions, s.actions);
    assert!(res.replayed.is_empty());
    validate_resumed(&s, &res).unwrap();
}

#[test]
fn unreachable_progress_is_rejected() {
    let s = generate(ScheduleKind::Seq1F1B, 3, 2, 2).unwrap();
    assert_eq!(s.actions[2][0], Action::RecvActivation(Unit::new(0, 0)));

    // Stage 2 claims the activation of 0.0 from the lost stage 1, which cannot have sent it:
    // stage 0 has not sent stage 1 its input.
    let e = resume_after_loss(&s, 1, &[0, 0, 1]).unwrap_err();
    let ScheduleError::UnreachableProgress {
        ref done,
        ref reason,
    } = e
    else {
        panic!("{e}");
    };
    assert_eq!(done, &[0, 3, 1]);
    assert!(
        reason.contains("stage 1 waits at #0 RF0.0 for an activation from stage 0"),
        "{e}"
    );
    assert!(e.to_string().contains("not reachable"), "{e}");

    // The same claim between two survivors (stage 0 lost).
    let e = resume_after_loss(&s, 0, &[0, 0, 1]).unwrap_err();
    assert!(
        e.to_string()
            .contains("stage 2 waits at #0 RF0.0 for an activation from stage 1"),
        "{e}"
    );

    // A gradient from the last stage before it could have had the activation.
    let first_rb = s.actions[1]
        .iter()
        .position(|a| matches!(a, Action::RecvGrad(_)))
        .unwrap();
    let e = resume_after_loss(&s, 0, &[0, first_rb + 1, 0]).unwrap_err();
    assert!(
        matches!(e, ScheduleError::UnreachableProgress { .. })
            && e.to_string().contains("stage 1 waits"),
        "{e}"
    );

    // More actions than the stage has; a stage that does not exist; a wrong progress length.
    let e = resume_after_loss(&s, 1, &[0, 0, 1000]).unwrap_err();
    assert!(
        e.to_string().contains("stage 2 claims 1000 actions done"),
        "{e}"
    );
    let e = resume_after_loss(&s, 3, &[0, 0, 0]).unwrap_err();
    assert!(
        matches!(e, ScheduleError::InvalidParameters(ref m) if m.contains("lost stage 3")),
        "{e}"
    );
    let e = resume_after_loss(&s, 1, &[0, 0]).unwrap_err();
    assert!(e.to_string().contains("progress has 2 entries"), "{e}");
}

#[test]
fn tampered_rests_are_rejected() {
    // p=3, m=2, k=2 Seq1F1B, stage 1 lost halfway through the step.
    let s = generate(ScheduleKind::Seq1F1B, 3, 2, 2).unwrap();
    let mut run = Run::new(&s);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let half = s.actions.iter().map(Vec::len).sum::<usize>() / 2;
    for _ in 0..half {
        run.random_step(&mut rng, None).unwrap();
    }
    let good = resume_after_loss(&s, 1, &run.pc).unwrap();
    validate_resumed(&s, &good).unwrap();
    assert!(good.resent[0] > 1 && good.resent[2] > 0, "{good:?}");
    let tampered = |edit: &dyn Fn(&mut Vec<Vec<Action>>)| {
        let mut bad = good.clone();
        edit(&mut bad.rest.actions);
        validate_resumed(&s, &bad).unwrap_err()
    };

    // Stage 0 forgets its first re-send: the replacement finds the next unit at the head.
    let e = tampered(&|a| {
        a[0].remove(0);
    });
    assert!(
        matches!(
            e,
            ScheduleError::ChannelMismatch {
                stage: 1,
                from: 0,
                ..
            }
        ),
        "{e}"
    );
    // The replacement sends again what stage 2 already has: stage 2 finds it at the head.
    let e = tampered(&|a| a[1] = s.actions[1].clone());
    assert!(
        matches!(
            e,
            ScheduleError::ChannelMismatch {
                stage: 2,
                from: 1,
                ..
            }
        ),
        "{e}"
    );
    // One send too many at the end: never received.
    let e = tampered(&|a| a[1].push(Action::SendActivation(Unit::new(1, 1))));
    assert!(
        matches!(e, ScheduleError::Undelivered { from: 1, to: 2, action }
            if action == Action::SendActivation(Unit::new(1, 1))),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "stage 1's SF1.1 is never received by stage 2"
    );
    // A survivor recomputes a unit it had done.
    let done_f = s.actions[0][..good.done[0]]
        .iter()
        .copied()
        .find(|a| a.is_compute())
        .unwrap();
    let e = tampered(&|a| a[0].push(done_f));
    assert!(
        matches!(
            e,
            ScheduleError::Incomplete {
                stage: 0,
                count: 2,
                ..
            }
        ),
        "{e}"
    );
    // Re-sends in the wrong order.
    let e = tampered(&|a| a[0][..good.resent[0]].reverse());
    assert!(matches!(e, ScheduleError::ChannelMismatch { .. }), "{e}");
    // Lost at the start, the replacement waiting first for the step's last gradient: stage 2
    // needs the replacement's activations to send any gradient.
    let mut bad = resume_after_loss(&s, 1, &[0, 0, 0]).unwrap();
    let list = &mut bad.rest.actions[1];
    let last_rb = list
        .iter()
        .rposition(|a| matches!(a, Action::RecvGrad(_)))
        .unwrap();
    let rb = list.remove(last_rb);
    list.insert(0, rb);
    let e = validate_resumed(&s, &bad).unwrap_err();
    assert!(
        matches!(e, ScheduleError::Deadlock { ref blocked, .. }
            if blocked.contains("stage 1 waits at #0 RB1.0 for a gradient from stage 2")),
        "{e}"
    );
    // A rest for other parameters.
    let mut bad = good.clone();
    bad.rest.splits = 4;
    assert!(matches!(
        validate_resumed(&s, &bad),
        Err(ScheduleError::InvalidParameters(_))
    ));
}
