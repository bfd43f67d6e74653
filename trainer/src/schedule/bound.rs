//! How short a step with split backwards can be at Seq1F1B's memory per worker: a lower bound
//! on the step time of every order that splits each backward into its input half `I` and weight
//! half `W` (the `seq1f1b-zb` family) while no stage holds more live units than Seq1F1B's order
//! holds there — whatever the order, the unit times or the placement of the `W`s.
//!
//! The argument, with `d(r, a)` the time of compute action `a` on stage r (a unit is live from
//! its `F` to its `W`; the `I`s run in Seq1F1B's backward order, micro-batch ascending and
//! segment descending, the `W`s in the order of the `I`s):
//!
//! 1. Seq1F1B's last stage holds at most k live units (one micro-batch). When its forward of the
//!    step's last unit (m−1, k−1) ends, the k units of micro-batch m−1 are all live (their `I`s
//!    need that forward), so every other unit's `W` — and its `I` — has run. That forward ends no
//!    earlier than the first unit's forwards through stages 0..p−2 plus the last stage's every
//!    `F` and its `I` and `W` of micro-batches 0..m−2.
//! 2. Then `I(m−1, k−1)` runs on the last stage and on every stage down to 0, one after the
//!    other (each needs the gradient of the stage above).
//! 3. Stage 0 still has the other `I`s of micro-batch m−1 and all its `W`s, which come after
//!    that `I` in any order.
//!
//! Also, no stage ends before it starts (the first unit's forwards through the stages before
//! it) plus its own busy time. Both bounds hold for the bytes of live activations too: the last
//! stage's Seq1F1B peak is one micro-batch of forward-live units, which step 1 already holds.
//!
//! With equal unit times (F, I, W on every unit and stage) the bound is `m·k·(F+I+W) +
//! (p−1)·(F+I)` against Seq1F1B's `m·k·(F+I+W) + (p−1)·(F+I+W)`: at Seq1F1B's memory per
//! worker a split backward can take only the `W`s, `(p−1)·W`, out of the idle time (2/3 of
//! Seq1F1B's idle at F = I = W), and an exhaustive search over every order of small shapes finds
//! none shorter (tested). `seq1f1b-zb` does not keep this per-worker rule: under ZB-H1's rule
//! (every stage up to the job's peak, the first stage's) it takes ZB-H1's `(p−1)·F` idle at
//! F = I = W, below this bound, which stays the documented limit of the per-worker rule.

use super::generate::check_parameters;
use super::{Action, Op, ScheduleError, Unit};

/// The least step time any split-backward order (see the module docs) can take on `stages`
/// stages with `microbatches` micro-batches of `splits` segments when no stage holds more live
/// units than Seq1F1B's order does, given the time of every compute action on every stage
/// (`duration(stage, action)` for the `F`, `I` and `W` of every unit on chunk 0).
///
/// Errors with [`ScheduleError::InvalidParameters`] when a count is 0.
pub fn split_backward_bound(
    stages: usize,
    microbatches: usize,
    splits: usize,
    duration: impl Fn(usize, Action) -> f64,
) -> Result<f64, ScheduleError> {
    check_parameters(stages, microbatches, splits)?;
    let (p, m, k) = (stages, microbatches, splits);
    let d = |r: usize, op: Op, i: usize, j: usize| duration(r, Action::new(op, Unit::new(i, j), 0));
    let units = |i_end: usize| (0..i_end).flat_map(move |i| (0..k).map(move |j| (i, j)));
    let last = p - 1;
    // Step 1: the first unit reaches the last stage, which then forwards everything and runs the
    // backward halves of micro-batches 0..m−2 before its forward of (m−1, k−1) ends.
    let arrival: f64 = (0..last).map(|r| d(r, Op::Forward, 0, 0)).sum();
    let mut chain = arrival
        + units(m)
            .map(|(i, j)| d(last, Op::Forward, i, j))
            .sum::<f64>();
    chain += units(m - 1)
        .map(|(i, j)| d(last, Op::BackwardInput, i, j) + d(last, Op::BackwardWeight, i, j))
        .sum::<f64>();
    // Step 2: I(m−1, k−1) down every stage.
    chain += (0..p)
        .map(|r| d(r, Op::BackwardInput, m - 1, k - 1))
        .sum::<f64>();
    // Step 3: stage 0's other input halves and every weight half of micro-batch m−1.
    chain += (0..k - 1)
        .map(|j| d(0, Op::BackwardInput, m - 1, j))
        .sum::<f64>();
    chain += (0..k)
        .map(|j| d(0, Op::BackwardWeight, m - 1, j))
        .sum::<f64>();
    let busiest = (0..p)
        .map(|r| {
            let start: f64 = (0..r).map(|q| d(q, Op::Forward, 0, 0)).sum();
            let busy: f64 = units(m)
                .map(|(i, j)| {
                    [Op::Forward, Op::BackwardInput, Op::BackwardWeight]
                        .into_iter()
                        .map(|op| d(r, op, i, j))
                        .sum::<f64>()
                })
                .sum();
            start + busy
        })
        .fold(0.0, f64::max);
    Ok(chain.max(busiest))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::super::generate::seq1f1b_warmup;
    use super::*;

    /// Per stage: F's, I's and W's run so far (each in its fixed order).
    type State = Vec<[usize; 3]>;

    /// The shortest step (in ticks) of any order with split backwards on (p, m, k) when every
    /// `F`, `I` and `W` takes one tick and stage r holds at most `caps[r]` live units: a
    /// breadth-first search over ticks, each stage running one of its ready actions or idling,
    /// keeping only the states no other state of the tick is ahead of on every count (a state
    /// ahead on every count can follow any continuation of one behind it, idling where the other
    /// catches up).
    fn optimum(p: usize, m: usize, k: usize, caps: &[usize]) -> usize {
        let n = m * k;
        let mut front: Vec<State> = vec![vec![[0; 3]; p]];
        for tick in 0.. {
            if front.iter().any(|s| s.iter().all(|c| *c == [n; 3])) {
                return tick;
            }
            let mut next: HashSet<State> = HashSet::new();
            for s in &front {
                let options: Vec<Vec<[usize; 3]>> =
                    (0..p).map(|r| moves(s, r, k, n, caps)).collect();
                let mut pick = vec![0usize; p];
                loop {
                    next.insert((0..p).map(|r| options[r][pick[r]]).collect());
                    // The next combination of one move per stage (odometer order).
                    let Some(r) = (0..p).find(|&r| pick[r] + 1 < options[r].len()) else {
                        break;
                    };
                    pick[r] += 1;
                    pick[..r].iter_mut().for_each(|x| *x = 0);
                }
            }
            front = pareto(next);
        }
        unreachable!()
    }

    /// Stage r's possible counts after one tick from `s`: idle, or one ready action.
    fn moves(s: &State, r: usize, k: usize, n: usize, caps: &[usize]) -> Vec<[usize; 3]> {
        let [f, i, w] = s[r];
        let mut out = vec![[f, i, w]];
        if f < n && f - w < caps[r] && (r == 0 || s[r - 1][0] > f) {
            out.push([f + 1, i, w]);
        }
        // The i-th backward unit is of micro-batch i / k: it needs that micro-batch's last
        // segment forwarded here, and the gradient from the stage above.
        if i < n && f >= (i / k + 1) * k && (r + 1 == s.len() || s[r + 1][1] > i) {
            out.push([f, i + 1, w]);
        }
        if w < i {
            out.push([f, i, w + 1]);
        }
        out
    }

    /// The states of `all` that no other state is ahead of (or level with) on every count.
    fn pareto(all: HashSet<State>) -> Vec<State> {
        let mut sorted: Vec<State> = all.into_iter().collect();
        let total = |s: &State| s.iter().flatten().sum::<usize>();
        sorted.sort_by_key(|s| std::cmp::Reverse(total(s)));
        let mut keep: Vec<State> = Vec::new();
        for s in sorted {
            let behind = keep.iter().any(|q| {
                q.iter()
                    .zip(&s)
                    .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x >= y))
            });
            if !behind {
                keep.push(s);
            }
        }
        keep
    }

    fn seq1f1b_caps(p: usize, m: usize, k: usize) -> Vec<usize> {
        (0..p)
            .map(|r| (seq1f1b_warmup(p, m, k, r) + 1).min(m * k))
            .collect()
    }

    fn unit_bound(p: usize, m: usize, k: usize) -> usize {
        split_backward_bound(p, m, k, |_, _| 1.0).unwrap() as usize
    }

    #[test]
    fn no_order_of_a_small_shape_beats_the_bound_and_the_bound_is_reached() {
        for (p, m, k) in [
            (1, 2, 2),
            (2, 1, 1),
            (2, 3, 2),
            (3, 2, 1),
            (3, 2, 2),
            (3, 1, 3),
            (4, 2, 1),
            (4, 3, 1),
            (4, 2, 2),
            (4, 1, 3),
        ] {
            let best = optimum(p, m, k, &seq1f1b_caps(p, m, k));
            assert_eq!(best, unit_bound(p, m, k), "p={p} m={m} k={k}");
            // Unit times: 3·m·k busy, idle 2·(p−1) at Seq1F1B's memory.
            assert_eq!(best, 3 * m * k + 2 * (p - 1), "p={p} m={m} k={k}");
        }
    }

    #[test]
    fn the_bound_is_memorys_one_more_live_unit_per_stage_shortens_the_step() {
        // Each stage allowed one more live unit than Seq1F1B's (at most the first stage's
        // peak): one W more fits into the idle time; at the first stage's peak everywhere,
        // ZB-H1's (p−1) idle.
        let (p, m, k) = (4, 3, 2);
        let caps = seq1f1b_caps(p, m, k);
        let bound = unit_bound(p, m, k);
        let plus_one: Vec<usize> = caps.iter().map(|c| (c + 1).min(caps[0])).collect();
        assert_eq!(optimum(p, m, k, &plus_one), bound - 1);
        assert_eq!(
            optimum(p, m, k, &vec![caps[0]; p]),
            3 * m * k + (p - 1),
            "ZB-H1's idle"
        );
    }

    #[test]
    fn the_bound_takes_each_actions_own_time_and_refuses_empty_shapes() {
        // p = 1: the stage's busy time.
        let one = split_backward_bound(1, 2, 2, |_, a| match a.op() {
            Op::Forward => 1.0,
            Op::BackwardInput => 2.0,
            _ => 0.5,
        })
        .unwrap();
        assert_eq!(one, 4.0 * 3.5);
        // Equal unit times: m·k·(F+I+W) + (p−1)·(F+I).
        let (f, i, w) = (1.0, 1.6, 0.2);
        let b = split_backward_bound(4, 8, 2, |_, a| match a.op() {
            Op::Forward => f,
            Op::BackwardInput => i,
            _ => w,
        })
        .unwrap();
        assert!(
            (b - (16.0 * (f + i + w) + 3.0 * (f + i))).abs() < 1e-9,
            "{b}"
        );
        // A slow stage binds through its busy time.
        let slow = split_backward_bound(3, 2, 2, |r, _| if r == 1 { 10.0 } else { 1.0 }).unwrap();
        assert_eq!(slow, 1.0 + 12.0 * 10.0);
        let e = split_backward_bound(0, 2, 2, |_, _| 1.0).unwrap_err();
        assert!(e.to_string().contains("stages must be at least 1"), "{e}");
    }
}
