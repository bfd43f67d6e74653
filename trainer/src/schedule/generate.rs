//! Schedule generation: per-worker action lists for GPipe, 1F1B, Seq1F1B, their interleaved
//! forms 1F1B-I and Seq1F1B-I (virtual stages), and the zero-bubble Seq1F1B.
//!
//! All kinds but the zero-bubble one are one algorithm over "groups" of compute actions:
//!
//! * forward groups in order, backward groups in order (on each chunk the backward order is
//!   always micro-batch ascending, segment descending, for every kind and every stage, so
//!   gradient accumulation order never depends on the partition);
//! * worker r first runs `w(r)` forward groups (warm-up), then alternates one forward group and
//!   one backward group (steady state), then runs the remaining backward groups (cool-down).
//!
//! | kind        | group                       | warm-up groups on worker r                   |
//! |-------------|-----------------------------|----------------------------------------------|
//! | `gpipe`     | one unit                    | all m·k                                      |
//! | `1f1b`      | one micro-batch (k units)   | min(p−r−1, m)                                |
//! | `seq1f1b`   | one unit                    | min((p−r−1)+(k−1), m·k)                      |
//! | `1f1b-i`    | one micro-batch on a chunk  | min((v−1)·p + 2·(p−r−1), m·v); all if m = p  |
//! | `seq1f1b-i` | one unit on a chunk         | min((v−1)·p + 2·(p−r−1) + (k−1), m·k·v); all if m = p |
//!
//! In the interleaved kinds the t-th forward group of a worker is on chunk `(t mod p·v) / p` and
//! the t-th backward group on chunk `v−1 − (t mod p·v) / p` (Megatron's `get_model_chunk_id`),
//! each chunk taking its groups in order. `seq1f1b-zb` is built by list scheduling
//! ([`zero_bubble_order`]).
//!
//! Compute actions are then wrapped in their communication actions: a forward is preceded by its
//! `RecvActivation` unless it is on the first virtual stage and followed by its `SendActivation`
//! unless on the last; a backward (`B`, or the input half `I`) is preceded by its `RecvGrad`
//! unless on the last virtual stage and followed by its `SendGrad` unless on the first.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

#[cfg(test)]
use super::formula_bubble;
use super::{Action, Op, ScheduleError, ScheduleKind, Unit, UnitBytes};

/// A whole schedule: one ordered action list per stage (worker), communication actions included.
///
/// Without virtual stages: on stage r>0 every `Forward(u)` is preceded by `RecvActivation(u)`; on
/// r<p−1 it is followed by `SendActivation(u)`. On r<p−1 every `Backward(u)` is preceded by
/// `RecvGrad(u)`; on r>0 it is followed by `SendGrad(u)`. With v chunks per worker the same holds
/// per virtual stage (see the module docs). A `forward_only` schedule (evaluation) has no backward-pass
/// actions. Serializes to JSON with actions as strings (`"RF0.1"`), so a schedule can be saved,
/// edited and loaded; run [`super::validate`] on anything loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Which schedule this is (forward-only schedules say [`ScheduleKind::GPipe`]: their order is
    /// GPipe's forward phase).
    pub kind: ScheduleKind,
    /// Number of pipeline stages p: workers, one action list each.
    pub stages: usize,
    /// Chunks v per worker (virtual stages; 1 without interleaving). Worker r's local chunk c is
    /// virtual stage `c·p + r`. Absent in JSON written before virtual stages existed: 1.
    #[serde(default = "one")]
    pub virtual_stages: usize,
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
    /// Stage `stage`'s compute actions (`F`, `B`, `I`, `W`) in order.
    pub fn compute_actions(&self, stage: usize) -> impl Iterator<Item = Action> + '_ {
        self.actions[stage]
            .iter()
            .copied()
            .filter(|a| a.is_compute())
    }

    /// Stage `stage`'s backward units in execution order: the units of its `B` and `I` actions
    /// (the ones that produce input gradients), on any chunk.
    pub fn backward_order(&self, stage: usize) -> Vec<Unit> {
        self.actions[stage]
            .iter()
            .filter(|a| a.op().is_input_backward())
            .map(|a| a.unit())
            .collect()
    }

    /// Stage `stage`'s parameter-gradient accumulations in execution order: (local chunk, unit)
    /// of every `B` (whole backward) and `W` (weight half). Per chunk, this is the order in which
    /// the chunk's parameter gradients sum over the step's units.
    pub fn gradient_order(&self, stage: usize) -> Vec<(usize, Unit)> {
        self.actions[stage]
            .iter()
            .filter(|a| matches!(a.op(), Op::Backward | Op::BackwardWeight))
            .map(|a| (a.chunk(), a.unit()))
            .collect()
    }
}

/// The most chunks per stage a schedule may have (far above any real model's layers per stage;
/// bounds what a loaded schedule makes the validator allocate).
pub(crate) const MAX_VIRTUAL_STAGES: usize = 1024;

/// serde's default for [`Schedule::virtual_stages`].
fn one() -> usize {
    1
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
/// and `splits` segments per micro-batch, without virtual stages (v = 1).
///
/// Errors with [`ScheduleError::InvalidParameters`] when any of them is 0, or for the interleaved
/// kinds (which need v ≥ 2: use [`generate_virtual`]). The result always passes
/// [`super::validate`].
pub fn generate(
    kind: ScheduleKind,
    stages: usize,
    microbatches: usize,
    splits: usize,
) -> Result<Schedule, ScheduleError> {
    generate_virtual(kind, stages, 1, microbatches, splits)
}

/// Generates the training schedule of `kind` for `stages` workers holding `virtual_stages`
/// chunks each (chunk c of worker r is virtual stage `c·p + r`), `microbatches` micro-batches
/// and `splits` segments per micro-batch.
///
/// | kind         | order on worker r                                                      |
/// |--------------|------------------------------------------------------------------------|
/// | `1f1b-i`     | Megatron's interleaved 1F1B over micro-batches: warm-up `(v−1)·p + 2·(p−r−1)` |
/// | `seq1f1b-i`  | the Seq1F1B reference's interleaved order over units: warm-up `(v−1)·p + 2·(p−r−1) + (k−1)` |
/// | `seq1f1b-zb` | Seq1F1B with split backwards, weight halves in the bubbles (see [`zero_bubble_order`]) |
///
/// Shapes refused with [`ScheduleError::InvalidParameters`], saying why: any count 0; v ≠ 1 for a
/// kind without virtual stages; for the interleaved kinds v < 2, p < 2 (one worker has no one to
/// interleave with) or m not a multiple of p (the interleaved order walks every chunk in rounds
/// of p micro-batches — p units for `seq1f1b-i` — and the reference, like Megatron, asserts
/// `m % p == 0`: with a short last round a worker would wait for a chunk its neighbour has not
/// reached); for `seq1f1b-i` also k not dividing p (a round of p units must hold whole
/// micro-batches, or the last virtual stage meets a backward before the micro-batch's last
/// segment is forwarded: the reference's order is invalid there, its code assumes it).
pub fn generate_virtual(
    kind: ScheduleKind,
    stages: usize,
    virtual_stages: usize,
    microbatches: usize,
    splits: usize,
) -> Result<Schedule, ScheduleError> {
    generate_within(kind, stages, virtual_stages, microbatches, splits, None)
}

/// [`generate_virtual`] with the byte model of the run's activations, when known: `seq1f1b-zb`
/// then holds no stage above Seq1F1B's job peak of activation bytes as `bytes` counts them (see
/// [`zero_bubble_order`]); without it, above the job's Seq1F1B peak of live units. The other
/// kinds do not depend on `bytes`. Every party that builds a run's schedule (its workers, their
/// replacements, the bench's replay, `seqpipe schedule`) passes the model derived from the same
/// config ([`crate::memory::unit_bytes`]), so all get the same order.
///
/// Errors as [`generate_virtual`], and with [`ScheduleError::InvalidParameters`] when `bytes`
/// does not size `stages` stages × `splits` segments.
pub fn generate_within(
    kind: ScheduleKind,
    stages: usize,
    virtual_stages: usize,
    microbatches: usize,
    splits: usize,
    bytes: Option<&UnitBytes>,
) -> Result<Schedule, ScheduleError> {
    check_parameters(stages, microbatches, splits)?;
    check_virtual(kind, stages, virtual_stages, microbatches, splits)?;
    if let Some(b) = bytes {
        b.check_shape(stages, splits)?;
    }
    let (p, v, m, k) = (stages, virtual_stages, microbatches, splits);
    let actions: Vec<Vec<Action>> = match kind {
        ScheduleKind::GPipe | ScheduleKind::Seq1F1B | ScheduleKind::OneFOneB => {
            plain_orders(kind, p, m, k)
        }
        ScheduleKind::OneFOneBInterleaved | ScheduleKind::Seq1F1BInterleaved => {
            interleaved_orders(kind == ScheduleKind::Seq1F1BInterleaved, p, v, m, k)
        }
        ScheduleKind::Seq1F1BZeroBubble => zero_bubble_order(p, m, k, bytes)?,
    };
    Ok(Schedule {
        kind,
        stages: p,
        virtual_stages: v,
        microbatches: m,
        splits: k,
        forward_only: false,
        actions: actions
            .iter()
            .enumerate()
            .map(|(r, order)| with_communication(order, r, p, v))
            .collect(),
    })
}

/// Each unit of `units` as a group of its own: one `op` on chunk 0.
fn singles(units: Vec<Unit>, op: Op) -> Vec<Vec<Action>> {
    units.iter().map(|&u| vec![Action::new(op, u, 0)]).collect()
}

/// Each micro-batch's k segments as one group of `op`s on chunk 0: forwards in segment order,
/// backwards in reverse (1F1B's whole micro-batches).
fn whole_microbatches(m: usize, k: usize, op: Op) -> Vec<Vec<Action>> {
    (0..m)
        .map(|i| {
            let segs: Vec<usize> = match op {
                Op::Forward => (0..k).collect(),
                _ => (0..k).rev().collect(),
            };
            segs.into_iter()
                .map(|j| Action::new(op, Unit::new(i, j), 0))
                .collect()
        })
        .collect()
}

/// The compute orders of GPipe, 1F1B (whole micro-batches) and Seq1F1B (units): each stage's
/// warm-up forwards, then one forward and one backward in turn, then the cool-down backwards.
fn plain_orders(kind: ScheduleKind, p: usize, m: usize, k: usize) -> Vec<Vec<Action>> {
    let (fwd, bwd) = if kind == ScheduleKind::OneFOneB {
        (
            whole_microbatches(m, k, Op::Forward),
            whole_microbatches(m, k, Op::Backward),
        )
    } else {
        (
            singles(forward_units(m, k), Op::Forward),
            singles(backward_units(m, k), Op::Backward),
        )
    };
    (0..p)
        .map(|r| {
            let warmup = match kind {
                ScheduleKind::GPipe => m * k,
                ScheduleKind::OneFOneB => (p - r - 1).min(m),
                _ => seq1f1b_warmup(p, m, k, r),
            };
            one_f_one_b(&fwd, &bwd, warmup)
        })
        .collect()
}

/// The compute orders of Seq1F1B-I (`seq`: units) and 1F1B-I (whole micro-batches) on p workers
/// of v chunks each, in Megatron's interleaved order.
fn interleaved_orders(seq: bool, p: usize, v: usize, m: usize, k: usize) -> Vec<Vec<Action>> {
    // The items each chunk works through, in order: units for seq1f1b-i (backward order
    // micro-batch ascending, segment descending: FIFO across micro-batches, LIFO within
    // one), whole micro-batches for 1f1b-i.
    let (fwd_items, bwd_items) = if seq {
        (
            singles(forward_units(m, k), Op::Forward),
            singles(backward_units(m, k), Op::Backward),
        )
    } else {
        (
            whole_microbatches(m, k, Op::Forward),
            whole_microbatches(m, k, Op::Backward),
        )
    };
    let n = fwd_items.len();
    let on = |items: &[Vec<Action>], q: usize, chunk: usize| -> Vec<Action> {
        items[q]
            .iter()
            .map(|a| Action::new(a.op(), a.unit(), chunk))
            .collect()
    };
    // Megatron's `get_model_chunk_id`: the t-th forward of a worker is on chunk
    // (t mod p·v) / p, the t-th backward on chunk v−1 − (t mod p·v) / p; each chunk
    // takes its items in order, in rounds of p.
    let item = |t: usize| (t / (p * v)) * p + t % p;
    let fwd: Vec<Vec<Action>> = (0..n * v)
        .map(|t| on(&fwd_items, item(t), (t % (p * v)) / p))
        .collect();
    let bwd: Vec<Vec<Action>> = (0..n * v)
        .map(|t| on(&bwd_items, item(t), v - 1 - (t % (p * v)) / p))
        .collect();
    (0..p)
        .map(|r| {
            let warmup = interleaved_warmup(p, v, m, if seq { k } else { 1 }, r, n * v);
            one_f_one_b(&fwd, &bwd, warmup)
        })
        .collect()
}

/// Seq1F1B's warm-up forwards on stage r: `min((p−r−1) + (k−1), m·k)`.
pub(crate) fn seq1f1b_warmup(p: usize, m: usize, k: usize, r: usize) -> usize {
    ((p - r - 1) + (k - 1)).min(m * k)
}

/// The interleaved warm-up on worker r, in forward groups (units for seq1f1b-i, where `k` is the
/// split count; micro-batches for 1f1b-i, called with `k = 1`), out of `total` = m·v(·k) groups:
/// everything when m = p (Megatron's `all_warmup_microbatches`), else
/// `min((v−1)·p + 2·(p−r−1) + (k−1), total)`.
fn interleaved_warmup(p: usize, v: usize, m: usize, k: usize, r: usize, total: usize) -> usize {
    if m == p {
        total
    } else {
        ((v - 1) * p + 2 * (p - r - 1) + (k - 1)).min(total)
    }
}

/// The virtual-stage rules of [`generate_virtual`].
fn check_virtual(
    kind: ScheduleKind,
    p: usize,
    v: usize,
    m: usize,
    k: usize,
) -> Result<(), ScheduleError> {
    let bad = |why: String| Err(ScheduleError::InvalidParameters(why));
    if v > MAX_VIRTUAL_STAGES {
        return bad(format!(
            "virtual_stages {v} is out of range: at most {MAX_VIRTUAL_STAGES} chunks per stage"
        ));
    }
    if !kind.is_interleaved() {
        if v != 1 {
            return bad(format!(
                "{kind} has no virtual stages: virtual_stages must be 1 (got {v}); the \
                 interleaved kinds are 1f1b-i and seq1f1b-i"
            ));
        }
        return Ok(());
    }
    if v < 2 {
        return bad(format!(
            "{kind} interleaves v ≥ 2 chunks per worker: virtual_stages must be at least 2 \
             (got {v}); with one chunk use {}",
            if kind == ScheduleKind::Seq1F1BInterleaved {
                "seq1f1b"
            } else {
                "1f1b"
            }
        ));
    }
    if p < 2 {
        return bad(format!(
            "{kind} needs at least 2 stages (got {p}): one worker has no one to interleave with"
        ));
    }
    if !m.is_multiple_of(p) {
        return bad(format!(
            "{kind} needs the micro-batches to be a multiple of the stages (m = {m}, p = {p}): \
             the interleaved order walks each chunk in rounds of p, as Megatron and the \
             Seq1F1B reference require; use m = {} or {}",
            (m / p).max(1) * p,
            (m / p + 1) * p
        ));
    }
    if kind == ScheduleKind::Seq1F1BInterleaved && !p.is_multiple_of(k) {
        return bad(format!(
            "{kind} needs the splits to divide the stages (k = {k}, p = {p}): each chunk takes \
             its units in rounds of p, and only when a round holds whole micro-batches does the \
             last virtual stage forward a micro-batch's last segment before its first backward \
             (the reference's order with p = 2, k = 3 has worker 1 run B0.2@1 before F0.2@1); \
             use k in {:?}",
            (1..=p).filter(|&d| p.is_multiple_of(d)).collect::<Vec<_>>()
        ));
    }
    Ok(())
}

/// The compute order of `seq1f1b-zb` on each stage: Seq1F1B's units with every backward split
/// into `I` (input gradient) and `W` (weight gradient), the `W`s deferred into the bubbles.
///
/// Memory rule (ZB-H1's, Qi et al., "Zero Bubble Pipeline Parallelism"): equal memory is the
/// job's peak, not each stage's. A unit is alive from its `F` until its `W` (which needs the
/// saved inputs and output gradients). Every stage may hold up to Seq1F1B's first stage's peak
/// of live units, `min(p + k − 1, m·k)`, the most any Seq1F1B stage holds, and, given the byte
/// model of the run (`bytes`), up to Seq1F1B's job peak of activation bytes: the most bytes any
/// Seq1F1B stage holds at the same (p, m, k) as `bytes` counts them (its units differ in size
/// between stages — the last keeps the head's logits — and between segments). So the job's
/// peak, in units and in bytes, is Seq1F1B's, while the later stages hold more than under
/// Seq1F1B because their `W`s wait for the idle time. Without a byte model only the unit cap
/// holds, and a stage whose units are larger than the first stage's (the last) may pass
/// Seq1F1B's job peak of bytes by its larger units' excess.
///
/// Built by list scheduling over unit time (every `F`, `I` and `W` takes one tick: the
/// zero-bubble papers' T_F = T_B = T_W, i.e. a whole backward is twice a forward, as in
/// [`super::UnitCosts::uniform`]; communication free). Stage r keeps Seq1F1B's rhythm of
/// forwards and input halves (at most its Seq1F1B peak of units forwarded and not yet through
/// their `I`), and at each tick a free stage runs, in order of preference:
///
/// 1. its oldest pending `W`, when the next `F`'s activation has arrived or arrives at the end
///    of this tick but the stage cannot take that unit under the caps: freeing one now lets
///    that `F` run on time (waiting for the arrival to free it costs the whole pipeline a tick);
/// 2. its next `F`, when the activation has arrived and the rhythm and both caps allow it;
/// 3. its next `I`, when the gradient has arrived (on the last stage: when the micro-batch's
///    last segment is forwarded);
/// 4. its oldest pending `W`.
///
/// Forwards before input halves, as 1F1B's steady state alternates them (an earlier greedy put
/// each `I` first and replayed slower than Seq1F1B on measured unit times, where the input half
/// costs several weight halves).
///
/// It never stalls: with no `W` pending, stage r's live units are a prefix of the forward order
/// less a prefix of the backward order, within its Seq1F1B rhythm — a subset of what Seq1F1B's
/// stage r holds after the same forward — so the next `F` fits both caps.
///
/// At equal unit times (each F, each I and each W the same, here F = I = W) and equal unit
/// bytes (or no byte model) and m·k ≥ p + k − 1 its step is ZB-H1's,
/// `m·k·(F+I+W) + (p−1)·F`, the least any order can take at the job's peak: the first stage's
/// first `I` cannot start before the first unit's last segment has gone up and its gradient come
/// down, and until then it may forward only `p + k − 1` units (tested over p ≤ 8, m ≤ 8,
/// k ≤ 5; bubble `(p−1)/(3·m·k + p−1)`, a third of Seq1F1B's). That is below
/// [`super::split_backward_bound`], the least step at Seq1F1B's per-stage memory.
///
/// The `I`s run in Seq1F1B's backward order (micro-batch ascending, segment descending: the
/// dK/dV carry flows from later to earlier segments), and the `W`s run in the order of the `I`s
/// (a FIFO), which is the order of Seq1F1B's `B`s: every parameter's gradient accumulates over
/// the step's units in exactly Seq1F1B's order.
fn zero_bubble_order(
    p: usize,
    m: usize,
    k: usize,
    bytes: Option<&UnitBytes>,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let n = m * k;
    let idx = |u: Unit| u.micro_batch * k + u.segment;
    let fwd = forward_units(m, k);
    let bwd = backward_units(m, k);
    let caps = ZeroBubbleCaps::new(p, m, k, bytes)?;
    // Seq1F1B's rhythm on stage r: at most its peak of units forwarded and not yet through I.
    let ahead: Vec<usize> = (0..p)
        .map(|r| (seq1f1b_warmup(p, m, k, r) + 1).min(n))
        .collect();
    // End ticks of each stage's F and I of each unit.
    let mut f_end = vec![vec![None::<usize>; n]; p];
    let mut i_end = vec![vec![None::<usize>; n]; p];
    let mut next_f = vec![0usize; p];
    let mut next_i = vec![0usize; p];
    let mut pending_w: Vec<VecDeque<Unit>> = vec![VecDeque::new(); p];
    // Live units and their bytes per stage.
    let mut alive = vec![(0usize, 0u64); p];
    let mut order: Vec<Vec<Action>> = vec![Vec::with_capacity(3 * n); p];
    // Every tick at least one stage can work while any is left (the greedy never waits when an
    // action is ready), so 3·n·p ticks bound a schedule with 3·n actions per stage.
    let limit = 3 * n * p + p + 1;
    let done_by = |end: Option<usize>, t: usize| end.is_some_and(|e| e <= t);
    for t in 0..limit {
        if (0..p).all(|r| order[r].len() == 3 * n) {
            return Ok(order);
        }
        for r in 0..p {
            // What each stage does at tick t depends only on ends ≤ t (and on F's running at
            // t, for rule 1), so the stages of one tick do not see each other's choices.
            let input_ready = bwd.get(next_i[r]).copied().filter(|&u| {
                let local = done_by(f_end[r][idx(u)], t)
                    && done_by(f_end[r][idx(Unit::new(u.micro_batch, k - 1))], t);
                local && (r + 1 == p || done_by(i_end[r + 1][idx(u)], t))
            });
            // The next F within the rhythm, if its activation is here by tick `by`.
            let next_forward = |by: usize| {
                fwd.get(next_f[r]).copied().filter(|&u| {
                    next_f[r] - next_i[r] < ahead[r]
                        && (r == 0 || done_by(f_end[r - 1][idx(u)], by))
                })
            };
            let admit = |u: &Unit| caps.admit(r, alive[r], *u);
            let forward_waits_on_w = next_forward(t + 1).is_some_and(|u| !admit(&u));
            let forward_ready = next_forward(t).filter(admit);
            let w = pending_w[r].front().copied();
            if let Some(u) = w.filter(|_| forward_waits_on_w) {
                pending_w[r].pop_front();
                alive[r] = caps.free(r, alive[r], u);
                order[r].push(Action::new(Op::BackwardWeight, u, 0));
            } else if let Some(u) = forward_ready {
                f_end[r][idx(u)] = Some(t + 1);
                next_f[r] += 1;
                alive[r] = caps.take(r, alive[r], u);
                order[r].push(Action::Forward(u));
            } else if let Some(u) = input_ready {
                i_end[r][idx(u)] = Some(t + 1);
                next_i[r] += 1;
                pending_w[r].push_back(u);
                order[r].push(Action::new(Op::BackwardInput, u, 0));
            } else if let Some(u) = pending_w[r].pop_front() {
                alive[r] = caps.free(r, alive[r], u);
                order[r].push(Action::new(Op::BackwardWeight, u, 0));
            }
        }
    }
    Err(ScheduleError::Deadlock {
        steps: limit,
        blocked: format!("seq1f1b-zb list scheduling stalled for p={p} m={m} k={k}"),
        grid: String::new(),
    })
}

/// What every stage of `seq1f1b-zb` may hold ([`zero_bubble_order`]'s memory rule): Seq1F1B's
/// job peak of live units and, with a byte model, of activation bytes.
struct ZeroBubbleCaps<'a> {
    /// `min(p + k − 1, m·k)`: Seq1F1B's first stage's live units, the most of any stage.
    units: usize,
    /// The byte model and Seq1F1B's job peak in it.
    bytes: Option<(&'a UnitBytes, u64)>,
}

impl<'a> ZeroBubbleCaps<'a> {
    fn new(
        p: usize,
        m: usize,
        k: usize,
        bytes: Option<&'a UnitBytes>,
    ) -> Result<Self, ScheduleError> {
        let bytes = match bytes {
            Some(b) => {
                let seq1f1b = generate_virtual(ScheduleKind::Seq1F1B, p, 1, m, k)?;
                Some((b, b.job_peak(&seq1f1b.actions)))
            }
            None => None,
        };
        Ok(Self {
            units: (seq1f1b_warmup(p, m, k, 0) + 1).min(m * k),
            bytes,
        })
    }

    /// Bytes unit `u` keeps on stage `r` (0 without a byte model).
    fn size(&self, r: usize, u: Unit) -> u64 {
        self.bytes.map_or(0, |(b, _)| b.of(r, u))
    }

    /// Whether stage `r`, holding `(units, bytes)`, may forward `u` too.
    fn admit(&self, r: usize, (units, held): (usize, u64), u: Unit) -> bool {
        units < self.units
            && self
                .bytes
                .is_none_or(|(_, cap)| held.saturating_add(self.size(r, u)) <= cap)
    }

    /// What stage `r` holds after forwarding `u`.
    fn take(&self, r: usize, (units, held): (usize, u64), u: Unit) -> (usize, u64) {
        (units + 1, held.saturating_add(self.size(r, u)))
    }

    /// What stage `r` holds after `u`'s `W`.
    fn free(&self, r: usize, (units, held): (usize, u64), u: Unit) -> (usize, u64) {
        (units - 1, held.saturating_sub(self.size(r, u)))
    }
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
        virtual_stages: 1,
        microbatches,
        splits,
        forward_only: true,
        actions: (0..stages)
            .map(|r| with_communication(&order, r, stages, 1))
            .collect(),
    })
}

/// Warm-up / steady / cool-down over groups: `warmup` forward groups, then alternately one
/// forward group and one backward group, then the remaining backward groups.
fn one_f_one_b(fwd: &[Vec<Action>], bwd: &[Vec<Action>], warmup: usize) -> Vec<Action> {
    debug_assert_eq!(fwd.len(), bwd.len());
    let n = fwd.len();
    let warmup = warmup.min(n);
    let mut out = Vec::new();
    for g in &fwd[..warmup] {
        out.extend(g);
    }
    for t in 0..n - warmup {
        out.extend(&fwd[warmup + t]);
        out.extend(&bwd[t]);
    }
    for g in &bwd[n - warmup..] {
        out.extend(g);
    }
    out
}

/// Wraps worker `r`'s compute order in its receives and sends. An action on local chunk c is
/// on virtual stage `s = c·p + r` of `p·v`: a forward receives unless s is the first and sends
/// unless it is the last; a `B` or `I` receives unless s is the last and sends unless it is the
/// first; a `W` neither receives nor sends.
fn with_communication(compute: &[Action], r: usize, p: usize, v: usize) -> Vec<Action> {
    let mut out = Vec::with_capacity(compute.len() * 3);
    for &a in compute {
        let (u, c) = (a.unit(), a.chunk());
        let s = c * p + r;
        let first = s == 0;
        let last = s + 1 == p * v;
        match a.op() {
            Op::Forward => {
                if !first {
                    out.push(Action::new(Op::RecvActivation, u, c));
                }
                out.push(a);
                if !last {
                    out.push(Action::new(Op::SendActivation, u, c));
                }
            }
            Op::Backward | Op::BackwardInput => {
                if !last {
                    out.push(Action::new(Op::RecvGrad, u, c));
                }
                out.push(a);
                if !first {
                    out.push(Action::new(Op::SendGrad, u, c));
                }
            }
            Op::BackwardWeight => out.push(a),
            other => unreachable!("compute order holds only compute actions, got {other:?}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{render_text, validate};
    use super::*;

    /// Rank `r`'s compute actions on one line, as the golden orders are written.
    pub(super) fn compute_line(s: &Schedule, r: usize) -> String {
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
        for kind in ScheduleKind::ALL
            .into_iter()
            .filter(|k| !k.is_interleaved())
        {
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
                    for kind in ScheduleKind::ALL
                        .into_iter()
                        .filter(|k| !k.is_interleaved())
                    {
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

/// The interleaved and zero-bubble kinds.
#[cfg(test)]
mod family_tests {
    use std::collections::HashMap;

    use super::super::{UnitCosts, render_text, simulate, split_backward_bound, validate};
    use super::tests::compute_line;
    use super::*;

    /// Golden orders derived by hand from the reference's
    /// `forward_backward_pipelining_with_interleaving` (thunlp/Seq1F1B,
    /// megatron/core/pipeline_parallel/schedules.py), not by running this code:
    ///
    /// * `total = m·v·k` iterations per worker; warm-up `(v−1)·p + 2·(p−r−1) + (k−1)`, capped at
    ///   `total`, or all of them when `m == p`;
    /// * forward iteration t runs on chunk `get_model_chunk_id(t) = (t mod p·v) / p`, backward
    ///   iteration t on chunk `v−1 − (t mod p·v) / p`;
    /// * each chunk's inputs are an `sp_queue`: forwards take the chunk's next unit in order
    ///   (micro-batch, then segment), backwards `pop` the head micro-batch's *last* segment
    ///   (FIFO across micro-batches, LIFO within one);
    /// * warm-up forwards, then `total − warm-up` pairs (forward t+w, backward t), then the
    ///   remaining backwards.
    ///
    /// For p=2, v=2, m=4, k=2, worker 0: warm-up 2+2+1 = 5; forwards t=0..7 visit chunk
    /// 0,0,1,1,0,0,1,1 on units 0.0 0.1 0.0 0.1 1.0 1.1 1.0 1.1; backwards t=0..7 visit chunk
    /// 1,1,0,0,1,1,0,0 on units 0.1 0.0 0.1 0.0 1.1 1.0 1.1 1.0. Worker 1: warm-up 2+0+1 = 3.
    #[test]
    fn seq1f1b_i_golden_orders_p2_v2_m4_k2() {
        let s = generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 4, 2).unwrap();
        assert_eq!(
            compute_line(&s, 0),
            "F0.0 F0.1 F0.0@1 F0.1@1 F1.0 \
             F1.1 B0.1@1 F1.0@1 B0.0@1 F1.1@1 B0.1 F2.0 B0.0 F2.1 B1.1@1 F2.0@1 B1.0@1 \
             F2.1@1 B1.1 F3.0 B1.0 F3.1 B2.1@1 F3.0@1 B2.0@1 F3.1@1 B2.1 \
             B2.0 B3.1@1 B3.0@1 B3.1 B3.0"
        );
        assert_eq!(
            compute_line(&s, 1),
            "F0.0 F0.1 F0.0@1 \
             F0.1@1 B0.1@1 F1.0 B0.0@1 F1.1 B0.1 F1.0@1 B0.0 F1.1@1 B1.1@1 F2.0 B1.0@1 \
             F2.1 B1.1 F2.0@1 B1.0 F2.1@1 B2.1@1 F3.0 B2.0@1 F3.1 B2.1 F3.0@1 B2.0 F3.1@1 \
             B3.1@1 B3.0@1 B3.1 B3.0"
        );
        validate(&s).unwrap();
        // m == p: Megatron's all-warm-up case, every forward before any backward.
        let w = generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 2, 2).unwrap();
        for r in 0..2 {
            assert_eq!(
                compute_line(&w, r),
                "F0.0 F0.1 F0.0@1 F0.1@1 F1.0 F1.1 F1.0@1 F1.1@1 \
                 B0.1@1 B0.0@1 B0.1 B0.0 B1.1@1 B1.0@1 B1.1 B1.0"
            );
        }
        validate(&w).unwrap();
    }

    /// Megatron's interleaved 1F1B (k = 1 in the reference's terms, whole micro-batches here),
    /// derived as above: p=2, v=2, m=4, worker 0 warm-up (v−1)·p + 2·(p−1) = 4, worker 1: 2.
    /// Forward micro-batches 0 1 0 1 2 3 2 3 on chunks 0 0 1 1 0 0 1 1; backward on chunks
    /// 1 1 0 0 1 1 0 0. With k = 2 each group is a micro-batch's segments (backward reversed).
    #[test]
    fn one_f_one_b_i_golden_orders_p2_v2_m4() {
        let s = generate_virtual(ScheduleKind::OneFOneBInterleaved, 2, 2, 4, 1).unwrap();
        assert_eq!(
            compute_line(&s, 0),
            "F0.0 F1.0 F0.0@1 F1.0@1 F2.0 B0.0@1 F3.0 B1.0@1 F2.0@1 B0.0 F3.0@1 B1.0 \
             B2.0@1 B3.0@1 B2.0 B3.0"
        );
        assert_eq!(
            compute_line(&s, 1),
            "F0.0 F1.0 F0.0@1 B0.0@1 F1.0@1 B1.0@1 F2.0 B0.0 F3.0 B1.0 F2.0@1 B2.0@1 \
             F3.0@1 B3.0@1 B2.0 B3.0"
        );
        let s2 = generate_virtual(ScheduleKind::OneFOneBInterleaved, 2, 2, 4, 2).unwrap();
        assert!(
            compute_line(&s2, 0).starts_with(
                "F0.0 F0.1 F1.0 F1.1 F0.0@1 F0.1@1 F1.0@1 F1.1@1 F2.0 F2.1 B0.1@1 B0.0@1"
            ),
            "{}",
            compute_line(&s2, 0)
        );
        validate(&s).unwrap();
        validate(&s2).unwrap();
    }

    #[test]
    fn interleaved_warmup_counts_follow_the_reference() {
        for (p, v, m, k) in [(4, 2, 8, 2), (4, 3, 8, 4), (6, 2, 12, 3), (3, 2, 9, 1)] {
            let s = generate_virtual(ScheduleKind::Seq1F1BInterleaved, p, v, m, k).unwrap();
            let total = m * k * v;
            for r in 0..p {
                let before = s
                    .compute_actions(r)
                    .take_while(|a| a.op() == Op::Forward)
                    .count();
                let w = ((v - 1) * p + 2 * (p - r - 1) + (k - 1)).min(total);
                // Warm-up, plus the first steady-state forward unless the warm-up is everything.
                assert_eq!(before, (w + 1).min(total), "p={p} v={v} m={m} k={k} r={r}");
            }
        }
    }

    /// The interleaved shapes the property tests cover: p ∈ 2..=6, v ∈ 2..=4, m ∈ {p, 2p, 3p},
    /// k ∈ 1..=p dividing p (the shapes `seq1f1b-i` accepts; `1f1b-i` takes them too).
    fn interleaved_shapes() -> impl Iterator<Item = (usize, usize, usize, usize)> {
        (2..=6usize).flat_map(|p| {
            (2..=4).flat_map(move |v| {
                [p, 2 * p, 3 * p].into_iter().flat_map(move |m| {
                    (1..=p)
                        .filter(move |&k| p.is_multiple_of(k))
                        .map(move |k| (p, v, m, k))
                })
            })
        })
    }

    #[test]
    fn every_interleaved_schedule_validates_and_keeps_each_chunks_backward_order() {
        let mut n = 0;
        for kind in [
            ScheduleKind::OneFOneBInterleaved,
            ScheduleKind::Seq1F1BInterleaved,
        ] {
            for (p, v, m, k) in interleaved_shapes() {
                let s = generate_virtual(kind, p, v, m, k).unwrap();
                if let Err(e) = validate(&s) {
                    panic!("{kind} p={p} v={v} m={m} k={k}: {e}\n{}", render_text(&s));
                }
                let expected = backward_units(m, k);
                for r in 0..p {
                    for c in 0..v {
                        let order: Vec<Unit> = s
                            .gradient_order(r)
                            .into_iter()
                            .filter(|&(chunk, _)| chunk == c)
                            .map(|(_, u)| u)
                            .collect();
                        assert_eq!(
                            order, expected,
                            "{kind} p={p} v={v} m={m} k={k} r={r} c={c}"
                        );
                    }
                }
                n += 1;
            }
        }
        // Divisors of 2..=6: 2 + 2 + 3 + 2 + 4 = 13 (p, k) pairs, × 3 v × 3 m × 2 kinds.
        assert_eq!(n, 2 * 13 * 3 * 3);
    }

    #[test]
    fn invalid_shapes_are_refused_with_the_reason() {
        use ScheduleKind::*;
        let cases: [(ScheduleKind, usize, usize, usize, &str); 7] = [
            (Seq1F1BInterleaved, 4, 2, 6, "multiple of the stages"),
            (Seq1F1BInterleaved, 3, 2, 6, "splits to divide the stages"),
            (OneFOneBInterleaved, 4, 1, 8, "at least 2"),
            (Seq1F1BInterleaved, 1, 2, 4, "at least 2 stages"),
            (Seq1F1B, 4, 2, 8, "virtual_stages must be 1"),
            (Seq1F1BZeroBubble, 4, 2, 8, "virtual_stages must be 1"),
            (Seq1F1BInterleaved, 4, 2, 0, "at least 1"),
        ];
        for (kind, p, v, m, why) in cases {
            let e = generate_virtual(kind, p, v, m, 2).unwrap_err();
            assert!(matches!(e, ScheduleError::InvalidParameters(_)), "{e}");
            assert!(e.to_string().contains(why), "{kind} p={p} v={v} m={m}: {e}");
        }
        // The v = 1 entry point says where to go for the interleaved kinds.
        let e = generate(Seq1F1BInterleaved, 4, 8, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("seq1f1b-i") && e.contains("at least 2"), "{e}");
    }

    /// Peak of the live units' summed `size` per stage along its own order: `F` allocates, `B`
    /// or `W` frees. (The sum along the order is the sum in every execution: a stage runs its
    /// actions one at a time.)
    fn peak_live(s: &Schedule, r: usize, size: impl Fn(Unit) -> usize) -> usize {
        let (mut live, mut peak) = (0usize, 0usize);
        for a in s.compute_actions(r) {
            match a.op() {
                Op::Forward => live += size(a.unit()),
                Op::Backward | Op::BackwardWeight => live -= size(a.unit()),
                _ => {}
            }
            peak = peak.max(live);
        }
        peak
    }

    /// Live units per stage along its own order.
    fn peak_live_units(s: &Schedule, r: usize) -> usize {
        peak_live(s, r, |_| 1)
    }

    /// The job's peak under Seq1F1B: the most any of its stages holds (the first stage's).
    fn job_peak(s: &Schedule, size: impl Fn(Unit) -> usize) -> usize {
        (0..s.stages).map(|r| peak_live(s, r, &size)).max().unwrap()
    }

    /// ZB-H1's memory rule: every worker may hold up to the job's Seq1F1B peak (its first
    /// stage's), in live units and in tokens, so the later workers hold more than under Seq1F1B
    /// but the job fits where Seq1F1B's fits; the first stage holds no more than under Seq1F1B.
    #[test]
    fn zero_bubble_validates_at_the_jobs_seq1f1b_peak_with_seq1f1b_gradient_order() {
        for p in 1..=6 {
            for m in 1..=6 {
                for k in 1..=5 {
                    let z = generate(ScheduleKind::Seq1F1BZeroBubble, p, m, k).unwrap();
                    if let Err(e) = validate(&z) {
                        panic!("p={p} m={m} k={k}: {e}\n{}", render_text(&z));
                    }
                    let s = generate(ScheduleKind::Seq1F1B, p, m, k).unwrap();
                    // Segments of unequal length (the compute partition's first segments are
                    // the longest).
                    let tokens = |u: Unit| 10 * (k - u.segment) + 3;
                    let (units_peak, tokens_peak) = (job_peak(&s, |_| 1), job_peak(&s, tokens));
                    assert_eq!(units_peak, peak_live_units(&s, 0), "p={p} m={m} k={k}");
                    assert_eq!(units_peak, (p + k - 1).min(m * k), "p={p} m={m} k={k}");
                    assert!(peak_live_units(&z, 0) <= peak_live_units(&s, 0));
                    for r in 0..p {
                        // Every backward is split, I before W (the validator checks the order).
                        assert!(z.compute_actions(r).all(|a| a.op() != Op::Backward));
                        // The same units accumulate into the parameter gradients in the same
                        // order as Seq1F1B's B's: W's follow Seq1F1B's backward order.
                        assert_eq!(
                            z.gradient_order(r),
                            s.gradient_order(r),
                            "p={p} m={m} k={k} r={r}"
                        );
                        assert_eq!(z.backward_order(r), s.backward_order(r));
                        assert!(
                            peak_live_units(&z, r) <= units_peak,
                            "p={p} m={m} k={k} r={r}: zb {} > the job's seq1f1b peak {units_peak}\n{}",
                            peak_live_units(&z, r),
                            render_text(&z)
                        );
                        assert!(
                            peak_live(&z, r, tokens) <= tokens_peak,
                            "p={p} m={m} k={k} r={r}: tokens {} > {tokens_peak}",
                            peak_live(&z, r, tokens)
                        );
                    }
                }
            }
        }
    }

    /// Byte models to test the zero-bubble order's byte cap with, for p stages and k segments:
    /// unequal segment lengths (the compute partition's first segments are the longest) on
    /// stages of equal layers; a last stage with the head's logits on top; stages of unequal
    /// layer counts; and a last stage far heavier than the rest.
    fn byte_models(p: usize, k: usize) -> Vec<(&'static str, UnitBytes)> {
        let tokens = |j: usize| (10 * (k - j) + 3) as u64;
        let model = |per_token: &dyn Fn(usize) -> u64| {
            let rows = (0..p)
                .map(|r| (0..k).map(|j| tokens(j) * per_token(r)).collect())
                .collect();
            UnitBytes::new(rows).unwrap()
        };
        let last = |r: usize| r + 1 == p;
        vec![
            ("equal stages", model(&|_| 100)),
            (
                "head on the last",
                model(&|r| 100 + 40 * u64::from(last(r))),
            ),
            ("unequal layers", model(&|r| 100 * (r as u64 % 3 + 1))),
            ("heavy last", model(&|r| if last(r) { 350 } else { 100 })),
        ]
    }

    /// The memory rule in bytes: given the run's byte model, no `seq1f1b-zb` worker
    /// holds more activation bytes than Seq1F1B's job peak (its most loaded stage's) at the same
    /// (p, m, k), each counted independently by the simulator on the timelines, while the I's
    /// and W's keep Seq1F1B's backward and gradient order and the unit cap holds. Without the
    /// byte model (today's unit rule) some of these shapes go over, so the cap is what holds
    /// them.
    #[test]
    fn zero_bubble_within_a_byte_model_holds_no_worker_above_seq1f1bs_job_peak_of_bytes() {
        let (mut checked, mut over_without) = (0, 0);
        for p in 1..=6 {
            for m in 1..=6 {
                for k in 1..=4 {
                    let costs = UnitCosts::uniform(k, 1);
                    let s = generate(ScheduleKind::Seq1F1B, p, m, k).unwrap();
                    let seq = simulate(&s, &costs).unwrap();
                    let units = (p + k - 1).min(m * k);
                    let zb = ScheduleKind::Seq1F1BZeroBubble;
                    let units_only = generate(zb, p, m, k).unwrap();
                    let units_only_sim = simulate(&units_only, &costs).unwrap();
                    for (name, bytes) in byte_models(p, k) {
                        let what = format!("{name} p={p} m={m} k={k}");
                        let z = generate_within(zb, p, 1, m, k, Some(&bytes)).unwrap();
                        validate(&z).unwrap_or_else(|e| panic!("{what}: {e}\n{}", render_text(&z)));
                        let job = *seq.peak_bytes(&s, &bytes).unwrap().iter().max().unwrap();
                        let sim = simulate(&z, &costs).unwrap();
                        for (r, peak) in sim.peak_bytes(&z, &bytes).unwrap().into_iter().enumerate()
                        {
                            assert!(
                                peak <= job,
                                "{what} r={r}: zb holds {peak} bytes, seq1f1b's job peak {job}\n{}",
                                render_text(&z)
                            );
                            assert!(sim.stages[r].peak_inflight_units <= units, "{what} r={r}");
                            assert_eq!(z.gradient_order(r), s.gradient_order(r), "{what} r={r}");
                            assert_eq!(z.backward_order(r), s.backward_order(r), "{what} r={r}");
                            assert!(z.compute_actions(r).all(|a| a.op() != Op::Backward));
                        }
                        let before = units_only_sim.peak_bytes(&units_only, &bytes).unwrap();
                        over_without += usize::from(before.into_iter().any(|b| b > job));
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 6 * 6 * 4 * 4);
        assert!(
            over_without > 50,
            "only {over_without} shapes need the byte cap"
        );
    }

    /// Equal unit bytes on every stage and segment cap nothing the unit cap does not: the order
    /// is the unit rule's, so ZB-H1's step (below) holds with the byte model too.
    #[test]
    fn zero_bubble_with_equal_unit_bytes_is_the_unit_rules_order() {
        for p in 1..=6 {
            for m in 1..=6 {
                for k in 1..=5 {
                    let zb = ScheduleKind::Seq1F1BZeroBubble;
                    let bytes = UnitBytes::uniform(p, k, 4096).unwrap();
                    assert_eq!(
                        generate_within(zb, p, 1, m, k, Some(&bytes)).unwrap(),
                        generate(zb, p, m, k).unwrap(),
                        "p={p} m={m} k={k}"
                    );
                }
            }
        }
        // A model of the wrong shape is refused, saying what it sizes.
        let bytes = UnitBytes::uniform(3, 2, 1).unwrap();
        let e = generate_within(ScheduleKind::Seq1F1BZeroBubble, 4, 1, 4, 2, Some(&bytes))
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 stages × 2 segments"), "{e}");
    }

    #[test]
    fn zero_bubble_golden_order_p4_m3_k2() {
        // Every stage may hold Seq1F1B's first-stage peak, 5 live units (ZB-H1's rule; this
        // order changed when the rule went from each stage's own Seq1F1B peak, 5 4 3 2, to the
        // job's). Each stage keeps Seq1F1B's rhythm of F's and I's (at most 5 4 3 2 units
        // forwarded and not through their I) and defers W's: the last stage holds up to 5 live
        // units where Seq1F1B holds 2, its W's filling the idle time the first stage's
        // forwards leave. The first stage is Seq1F1B's order with each B split into I W.
        let z = generate(ScheduleKind::Seq1F1BZeroBubble, 4, 3, 2).unwrap();
        assert_eq!(
            compute_line(&z, 3),
            "F0.0 F0.1 I0.1 F1.0 I0.0 F1.1 I1.1 F2.0 I1.0 W0.1 F2.1 I2.1 I2.0 W0.0 W1.1 W1.0 \
             W2.1 W2.0"
        );
        assert_eq!(
            compute_line(&z, 0),
            "F0.0 F0.1 F1.0 F1.1 F2.0 I0.1 W0.1 F2.1 I0.0 W0.0 I1.1 W1.1 I1.0 W1.0 I2.1 I2.0 \
             W2.1 W2.0"
        );
    }

    /// The unit-time step of `seq1f1b-zb` at the job's peak: ZB-H1's `3·m·k + (p−1)` when the
    /// first stage may forward p + k − 1 units before its first I, else (m·k < p + k − 1, every
    /// unit fits) `2·m·k + 2·p + k − 2`. Either way the first stage's first I cannot start
    /// before tick 2p + k − 2 (the first micro-batch's last segment up all p stages, its
    /// gradient down to stage 1), it may forward at most the job's peak before that, and then
    /// it has the rest of its 3·m·k ticks of work: no order at that memory is shorter.
    fn job_peak_unit_step(p: usize, m: usize, k: usize) -> usize {
        3 * m * k + 2 * p + k - 2 - (p + k - 1).min(m * k)
    }

    #[test]
    fn zero_bubble_takes_zb_h1s_step_at_equal_unit_times() {
        for p in 1..=8 {
            for m in 1..=8 {
                for k in 1..=5 {
                    let costs = UnitCosts::uniform(k, 1);
                    let z = simulate(
                        &generate(ScheduleKind::Seq1F1BZeroBubble, p, m, k).unwrap(),
                        &costs,
                    )
                    .unwrap();
                    let s = simulate(&generate(ScheduleKind::Seq1F1B, p, m, k).unwrap(), &costs)
                        .unwrap();
                    let what = format!("p={p} m={m} k={k}");
                    assert_eq!(z.step_time, job_peak_unit_step(p, m, k) as f64, "{what}");
                    let busy = 3.0 * (m * k) as f64;
                    assert_eq!(s.step_time, busy + 3.0 * (p - 1) as f64, "{what}");
                    if m * k >= p + k - 1 {
                        // ZB-H1's idle, a third of Seq1F1B's; the goal, ≤ 0.5 of its
                        // bubble fraction, holds (it does whenever m·k ≥ p − 1).
                        assert_eq!(z.step_time, busy + (p - 1) as f64, "{what}");
                        let zb = ScheduleKind::Seq1F1BZeroBubble;
                        let formula = formula_bubble(zb, p, 1, m, k);
                        assert!((z.bubble_fraction - formula).abs() < 1e-9, "{what}");
                        assert!(
                            z.bubble_fraction <= 0.5 * s.bubble_fraction + 1e-12,
                            "{what}: zb {} vs seq1f1b {}",
                            z.bubble_fraction,
                            s.bubble_fraction
                        );
                    }
                }
            }
        }
        // The shapes: a third of Seq1F1B's idle, (n + p − 1)/(3n + p − 1) of its bubble
        // fraction (0.35–0.41).
        for (m, k) in [(4, 2), (4, 4), (8, 2), (8, 4)] {
            let costs = UnitCosts::uniform(k, 1);
            let bubble = |kind| {
                simulate(&generate(kind, 4, m, k).unwrap(), &costs)
                    .unwrap()
                    .bubble_fraction
            };
            let ratio = bubble(ScheduleKind::Seq1F1BZeroBubble) / bubble(ScheduleKind::Seq1F1B);
            let n = (m * k) as f64;
            assert!(
                (ratio - (n + 3.0) / (3.0 * n + 3.0)).abs() < 1e-9,
                "m={m} k={k}"
            );
            assert!((0.35..=0.42).contains(&ratio), "m={m} k={k}: {ratio}");
        }
    }

    #[test]
    fn interleaving_shrinks_the_bubble_as_its_formula_says() {
        // Equal-cost units, chunks of 1/v the time: the simulated bubble follows
        // (p−1)/(v·m·k + p−1) when m > p (m = p runs all forwards first).
        for (p, v, m, k) in [(4, 2, 8, 2), (4, 2, 8, 4), (4, 4, 8, 1), (6, 3, 12, 2)] {
            let costs = UnitCosts::uniform(k, 1);
            let si = simulate(
                &generate_virtual(ScheduleKind::Seq1F1BInterleaved, p, v, m, k).unwrap(),
                &costs,
            )
            .unwrap();
            let formula = formula_bubble(ScheduleKind::Seq1F1BInterleaved, p, v, m, k);
            assert!(
                (si.bubble_fraction - formula).abs() < 0.01,
                "p={p} v={v} m={m} k={k}: simulated {} vs formula {formula}",
                si.bubble_fraction
            );
            let seq = simulate(&generate(ScheduleKind::Seq1F1B, p, m, k).unwrap(), &costs).unwrap();
            assert!(si.bubble_fraction < seq.bubble_fraction);
        }
    }

    #[test]
    fn chunk_actions_name_their_virtual_stage_neighbours() {
        // p=2, v=2: worker 1's chunk 0 (virtual stage 1) sends to worker 0's chunk 1 (virtual
        // stage 2); virtual stage 3 (worker 1's chunk 1) is the last and sends nothing on.
        let s = generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 2, 1).unwrap();
        let ops: HashMap<String, usize> = s.actions[1].iter().map(|a| (a.to_string(), 1)).collect();
        for present in ["RF0.0", "SF0.0", "RF0.0@1", "RB0.0", "SB0.0", "SB0.0@1"] {
            assert!(ops.contains_key(present), "{present}: {:?}", s.actions[1]);
        }
        for absent in ["SF0.0@1", "RB0.0@1"] {
            assert!(!ops.contains_key(absent), "{absent}: {:?}", s.actions[1]);
        }
        let w0: Vec<String> = s.actions[0].iter().map(|a| a.to_string()).collect();
        assert_eq!(&w0[..3], ["F0.0", "SF0.0", "F1.0"]);
        assert!(w0.contains(&"RF0.0@1".to_string()) && !w0.contains(&"RF0.0".to_string()));
    }

    /// The time of `op` when every F takes f, I takes i and W takes w (a whole B: i + w).
    fn op_time(op: Op, (f, i, w): (f64, f64, f64)) -> f64 {
        match op {
            Op::Forward => f,
            Op::BackwardInput => i,
            Op::BackwardWeight => w,
            _ => i + w,
        }
    }

    /// Replays `s` with every stage taking (F, I, W) per op (a whole B: I + W).
    fn replay_with(s: &Schedule, costs: (f64, f64, f64)) -> f64 {
        let durations = (0..s.stages)
            .map(|r| {
                s.compute_actions(r)
                    .map(|a| (a, op_time(a.op(), costs)))
                    .collect::<HashMap<_, _>>()
            })
            .collect();
        let measured = super::super::MeasuredCosts {
            durations,
            tokens: vec![1; s.splits],
        };
        super::super::replay(s, &measured).unwrap().step_time
    }

    /// On measured unit times the input half costs several weight halves (attention's backward
    /// is all input half): there the zero-bubble order must not be slower than Seq1F1B's, as its
    /// first greedy (each I first) was (1.1–1.3× Seq1F1B's step at these costs).
    #[test]
    fn zero_bubble_is_never_slower_than_seq1f1b_when_input_halves_cost_more() {
        for costs in [
            (1.0, 1.6, 0.2),
            (1.0, 1.4, 0.4),
            (1.0, 1.2, 0.6),
            (1.0, 1.0, 1.0),
        ] {
            for (p, m, k) in [
                (2, 4, 2),
                (4, 4, 2),
                (4, 4, 4),
                (4, 8, 4),
                (3, 5, 3),
                (6, 8, 2),
            ] {
                let zb = generate(ScheduleKind::Seq1F1BZeroBubble, p, m, k).unwrap();
                let seq = generate(ScheduleKind::Seq1F1B, p, m, k).unwrap();
                let (t_zb, t_seq) = (replay_with(&zb, costs), replay_with(&seq, costs));
                assert!(
                    t_zb <= t_seq + 1e-9,
                    "costs {costs:?} p={p} m={m} k={k}: zb {t_zb} > seq1f1b {t_seq}"
                );
            }
        }
    }

    /// With equal unit times, whatever the ratio of F, I and W, the zero-bubble order is never
    /// slower than the least step at Seq1F1B's per-stage memory ([`split_backward_bound`], which
    /// its first greedy reached): it holds more on the later stages, and once the first stage
    /// can hold its p + k − 1 units it takes ZB-H1's `m·k·(F+I+W) + (p−1)·max(F+I−W, F, I)`.
    #[test]
    fn zero_bubble_is_at_or_below_the_per_stage_memory_bound_at_equal_unit_times() {
        for costs in [
            (1.0, 1.0, 1.0),
            (1.0, 1.6, 0.2),
            (1.0, 1.2, 0.6),
            (1.0, 0.8, 0.8),
            (1.0, 2.0, 1.0),
            (2.0, 1.0, 1.0),
        ] {
            let (f, i, w) = costs;
            for p in 1..=6 {
                for m in 1..=6 {
                    for k in 1..=5 {
                        let zb = generate(ScheduleKind::Seq1F1BZeroBubble, p, m, k).unwrap();
                        let bound =
                            split_backward_bound(p, m, k, |_, a| op_time(a.op(), costs)).unwrap();
                        let t_zb = replay_with(&zb, costs);
                        let what = format!("costs {costs:?} p={p} m={m} k={k}");
                        assert!(t_zb <= bound * (1.0 + 1e-9), "{what}: {t_zb} vs {bound}");
                        if m * k >= p + k - 1 {
                            let busy = (m * k) as f64 * (f + i + w);
                            let idle = (p - 1) as f64 * (f + i - w).max(f).max(i);
                            let h1 = busy + idle;
                            assert!((t_zb - h1).abs() < 1e-9 * h1, "{what}: {t_zb} vs {h1}");
                        }
                    }
                }
            }
        }
    }
}
