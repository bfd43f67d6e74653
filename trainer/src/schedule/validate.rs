//! The schedule validator: a dry run of all stages before anything executes.
//!
//! Checks, in this order (the first failure is returned):
//!
//! 1. parameters: p, m, k, v ≥ 1 and one action list per stage (worker);
//! 2. every action is allowed where it is: canonical form, chunk in range, unit in range, no
//!    receive from / send to a neighbour that does not exist (the first virtual stage has no
//!    previous one, the last no next one), no backward-pass action in a forward-only schedule;
//! 3. completeness: on every stage, for every chunk, every unit is forwarded exactly once and
//!    (training) backwarded exactly once — one whole `B`, or one `I` and one `W` — with exactly
//!    one of each communication action its position needs;
//! 4. local order on each stage and chunk: `F(i,j)` after `F(i,j−1)`; a backward (`B` or `I`)
//!    of `(i,j)` after `F(i,j)`, after `F(i,k−1)` (the whole micro-batch's K/V exists) and after
//!    the backward of `(i,j+1)`; `W(i,j)` after `I(i,j)`; receives before the compute that
//!    consumes them, sends after the compute that produces them;
//! 5. cross-stage execution: all stages run in lock-step with one FIFO channel per neighbouring
//!    pair of workers and direction (with virtual stages, worker p−1 and worker 0 are neighbours
//!    too, and the messages of all chunks share their workers' channel). Sends never block; a
//!    receive waits for a message and must find exactly its unit, from the virtual stage before
//!    (activations) or after (gradients) its own, at the head of the channel. This is where
//!    dependencies across chunks and workers are checked. No stage able to progress is a
//!    deadlock, reported with a step × stage grid of what ran. Every message sent must be
//!    received by the end.
//!
//! Steps 2–5 are shared with [`super::validate_resumed`], which checks the rest of a step after a
//! stage loss: there each stage starts with a done prefix (counted for completeness and local
//! order) and the channels start with the messages in flight.

use std::collections::{HashSet, VecDeque};
use std::fmt::Write as _;

use super::generate::{MAX_VIRTUAL_STAGES, check_parameters};
use super::{Action, Op, Schedule, ScheduleError, Unit};

/// How many grid rows a deadlock report shows (the most recent ones).
const GRID_ROWS: usize = 48;

/// Validates `s`: parameters, completeness, per-stage dependencies, communication pairing, and a
/// FIFO-channel dry run for message-order mismatches and deadlocks.
///
/// Returns the first problem found as a [`ScheduleError`] naming the stage, the position in the
/// stage's action list and the action.
pub fn validate(s: &Schedule) -> Result<(), ScheduleError> {
    check_parameters(s.stages, s.microbatches, s.splits)?;
    if s.virtual_stages == 0 || s.virtual_stages > MAX_VIRTUAL_STAGES {
        return Err(ScheduleError::InvalidParameters(format!(
            "virtual_stages must be 1 to {MAX_VIRTUAL_STAGES} (got {})",
            s.virtual_stages
        )));
    }
    if s.actions.len() != s.stages {
        return Err(ScheduleError::StageCount {
            expected: s.stages,
            found: s.actions.len(),
        });
    }
    for r in 0..s.stages {
        check_allowed(s, r)?;
    }
    for r in 0..s.stages {
        check_counts(s, r, &[], true)?;
    }
    for r in 0..s.stages {
        check_local_order(s, r, &[])?;
    }
    let left = dry_run(s, Channels::for_schedule(s))?;
    check_delivered(&left)
}

/// Where an action runs: its virtual stage `chunk·p + r` and whether that is the first or the
/// last of the `p·v`.
struct Place {
    virtual_stage: usize,
    first: bool,
    last: bool,
}

fn place_of(s: &Schedule, r: usize, a: Action) -> Place {
    let virtual_stage = a.chunk() * s.stages + r;
    Place {
        virtual_stage,
        first: virtual_stage == 0,
        last: virtual_stage + 1 == s.stages * s.virtual_stages,
    }
}

/// Step 2: canonical form, chunk and unit in range, communication only with existing
/// neighbours, forward-only purity.
pub(super) fn check_allowed(s: &Schedule, r: usize) -> Result<(), ScheduleError> {
    let (m, k, v) = (s.microbatches, s.splits, s.virtual_stages);
    for (position, &action) in s.actions[r].iter().enumerate() {
        let u = action.unit();
        let c = action.chunk();
        let at = place_of(s, r, action);
        let (this, last_name) = if v == 1 {
            (format!("stage {r}"), format!("the last stage ({r})"))
        } else {
            let here = format!("virtual stage {} (stage {r}'s chunk {c})", at.virtual_stage);
            (here.clone(), format!("the last {here}"))
        };
        let reason = if !action.is_canonical() {
            Some(format!(
                "not in canonical form: write it as {} (one form per action)",
                Action::new(action.op(), u, c)
            ))
        } else if c >= v {
            Some(format!(
                "chunk {c} out of range (the schedule has {v} chunk(s) per stage)"
            ))
        } else if u.micro_batch >= m || u.segment >= k {
            Some(format!(
                "unit out of range (micro-batches 0..{m}, segments 0..{k})"
            ))
        } else if s.forward_only && action.is_backward_pass() {
            Some("backward-pass action in a forward-only schedule".to_string())
        } else {
            match action.op() {
                Op::RecvActivation if at.first => Some(format!(
                    "{this} has no previous stage to receive an activation from"
                )),
                Op::SendGrad if at.first => Some(format!(
                    "{this} has no previous stage to send a gradient to"
                )),
                Op::SendActivation if at.last => Some(format!(
                    "{last_name} has no next stage to send an activation to"
                )),
                Op::RecvGrad if at.last => Some(format!(
                    "{last_name} has no next stage to receive a gradient from"
                )),
                _ => None,
            }
        };
        if let Some(reason) = reason {
            return Err(ScheduleError::InvalidAction {
                stage: r,
                position,
                action,
                reason,
            });
        }
    }
    Ok(())
}

/// The count table's columns: F, B, RF, SF, RB, SB, I, W.
const KINDS: usize = 8;

/// Index of an action's op in the count table.
fn kind_index(a: Action) -> usize {
    match a.op() {
        Op::Forward => 0,
        Op::Backward => 1,
        Op::RecvActivation => 2,
        Op::SendActivation => 3,
        Op::RecvGrad => 4,
        Op::SendGrad => 5,
        Op::BackwardInput => 6,
        Op::BackwardWeight => 7,
    }
}

/// Step 3: exactly one of each expected action per (chunk, unit), none of the others, counting
/// stage r's `done` actions followed by `s.actions[r]`. A unit's backward is either one whole `B`
/// or one `I` and one `W` (the form is read from the unit's actions). With `sends` false the two
/// send kinds are not counted (a resumed step sends some messages twice and some not at all; the
/// dry run checks that what is received is sent).
pub(super) fn check_counts(
    s: &Schedule,
    r: usize,
    done: &[Action],
    sends: bool,
) -> Result<(), ScheduleError> {
    const NAMES: [&str; KINDS] = [
        "forward (F)",
        "backward (B)",
        "receive-activation (RF)",
        "send-activation (SF)",
        "receive-gradient (RB)",
        "send-gradient (SB)",
        "input-gradient backward (I)",
        "weight-gradient backward (W)",
    ];
    let (m, k, p, v) = (s.microbatches, s.splits, s.stages, s.virtual_stages);
    let train = !s.forward_only;
    let mut counts = vec![[0usize; KINDS]; v * m * k];
    let slot = |c: usize, u: Unit| (c * m + u.micro_batch) * k + u.segment;
    for &a in done.iter().chain(&s.actions[r]) {
        counts[slot(a.chunk(), a.unit())][kind_index(a)] += 1;
    }
    let checked = |t: usize| sends || !matches!(t, 3 | 5);
    for c in 0..v {
        let virtual_stage = c * p + r;
        let (first, last) = (virtual_stage == 0, virtual_stage + 1 == p * v);
        for i in 0..m {
            for j in 0..k {
                let unit = Unit::new(i, j);
                let n = &counts[slot(c, unit)];
                let split = n[6] + n[7] > 0;
                let expected = [
                    true,
                    train && !split,
                    !first,
                    !last,
                    train && !last,
                    train && !first,
                    train && split,
                    train && split,
                ]
                .map(usize::from);
                for t in (0..KINDS).filter(|&t| checked(t)) {
                    if n[t] != expected[t] {
                        return Err(ScheduleError::Incomplete {
                            stage: r,
                            unit,
                            chunk: c,
                            what: NAMES[t],
                            count: n[t],
                            expected: expected[t],
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// Step 4: dependencies and communication pairing within one stage, for `s.actions[r]` run after
/// the stage's `done` actions (assumed in order themselves; positions are in `s.actions[r]`).
pub(super) fn check_local_order(
    s: &Schedule,
    r: usize,
    done: &[Action],
) -> Result<(), ScheduleError> {
    // The (chunk, unit)s whose backward is split into I and W on this stage.
    let split: HashSet<(usize, Unit)> = done
        .iter()
        .chain(&s.actions[r])
        .filter(|a| a.op() == Op::BackwardInput)
        .map(|a| (a.chunk(), a.unit()))
        .collect();
    let mut done: HashSet<Action> = done.iter().copied().collect();
    for (position, &action) in s.actions[r].iter().enumerate() {
        let at = place_of(s, r, action);
        match missing_before(action, at, s.splits, &done, &split) {
            None => {}
            Some(Missing::Dependency(needs, why)) => {
                return Err(ScheduleError::Dependency {
                    stage: r,
                    position,
                    action,
                    needs,
                    why,
                });
            }
            Some(Missing::Message(needs)) => {
                return Err(ScheduleError::Unpaired {
                    stage: r,
                    position,
                    action,
                    needs,
                });
            }
        }
        done.insert(action);
    }
    Ok(())
}

/// What an action lacks before it on its stage ([`missing_before`]).
enum Missing {
    /// An action it depends on, and why.
    Dependency(Action, &'static str),
    /// The other end of its message: the receive before a compute action, the compute action
    /// before a send.
    Message(Action),
}

/// The first action `action` needs before it on its stage (at `at`, with `k` segments per
/// micro-batch) that is not in `done`. `split` holds the (chunk, unit)s whose backward is split
/// into I and W.
fn missing_before(
    action: Action,
    at: Place,
    k: usize,
    done: &HashSet<Action>,
    split: &HashSet<(usize, Unit)>,
) -> Option<Missing> {
    let (u, c) = (action.unit(), action.chunk());
    let (i, j) = (u.micro_batch, u.segment);
    // The action that completes a unit's input gradient: its I where split, else its B.
    let input_backward = |u: Unit| {
        let op = if split.contains(&(c, u)) {
            Op::BackwardInput
        } else {
            Op::Backward
        };
        Action::new(op, u, c)
    };
    let lacks = |needs: &Action| !done.contains(needs);
    match action.op() {
        Op::Forward => {
            let prev = Action::new(Op::Forward, Unit::new(i, j.wrapping_sub(1)), c);
            if j > 0 && lacks(&prev) {
                return Some(Missing::Dependency(
                    prev,
                    "a segment attends to the K/V of the previous segments of its micro-batch",
                ));
            }
            let recv = action.with_op(Op::RecvActivation);
            if !at.first && lacks(&recv) {
                return Some(Missing::Message(recv));
            }
        }
        Op::Backward | Op::BackwardInput => {
            let fwd = action.with_op(Op::Forward);
            if lacks(&fwd) {
                return Some(Missing::Dependency(
                    fwd,
                    "a backward needs the unit's forward context",
                ));
            }
            let last_fwd = Action::new(Op::Forward, Unit::new(i, k - 1), c);
            if lacks(&last_fwd) {
                return Some(Missing::Dependency(
                    last_fwd,
                    "no backward of a micro-batch before all of its segments are forwarded \
                     (later segments' K/V)",
                ));
            }
            let later = input_backward(Unit::new(i, j + 1));
            if j + 1 < k && lacks(&later) {
                return Some(Missing::Dependency(
                    later,
                    "segments of a micro-batch are backwarded last to first (dK/dV of the \
                     prefix flows backwards)",
                ));
            }
            let recv = action.with_op(Op::RecvGrad);
            if !at.last && lacks(&recv) {
                return Some(Missing::Message(recv));
            }
        }
        Op::BackwardWeight => {
            let input = action.with_op(Op::BackwardInput);
            if lacks(&input) {
                return Some(Missing::Dependency(
                    input,
                    "the weight half of a backward needs the output gradients its input \
                     half completed (dK/dV from later segments included)",
                ));
            }
        }
        Op::SendActivation => {
            let fwd = action.with_op(Op::Forward);
            if lacks(&fwd) {
                return Some(Missing::Message(fwd));
            }
        }
        Op::SendGrad => {
            let bwd = input_backward(u);
            if lacks(&bwd) {
                return Some(Missing::Message(bwd));
            }
        }
        Op::RecvActivation | Op::RecvGrad => {}
    }
    None
}

/// A message in flight: the unit and the send action that put it in the channel.
pub(super) type Msg = (Unit, Action);

/// The messages in flight between neighbouring stages, one FIFO channel per pair and direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Channels {
    /// `act[r]`: activations from stage r to stage r+1 (mod p with virtual stages).
    pub(super) act: Vec<VecDeque<Msg>>,
    /// `grad[r]`: gradients from stage r+1 (mod p with virtual stages) to stage r.
    pub(super) grad: Vec<VecDeque<Msg>>,
    /// True with virtual stages: the channels form a ring of p pairs (stage p−1's chunk c feeds
    /// stage 0's chunk c+1); false: a line of p−1 pairs.
    ring: bool,
}

impl Channels {
    /// Empty channels for `stages` stages without virtual stages: p−1 pairs of neighbours.
    pub(super) fn new(stages: usize) -> Self {
        Self::with_pairs(stages.saturating_sub(1), false)
    }

    /// Empty channels for `s`: with virtual stages the last worker's chunk c feeds the first
    /// worker's chunk c+1, so the p workers form a ring of p pairs.
    pub(super) fn for_schedule(s: &Schedule) -> Self {
        if s.virtual_stages > 1 {
            Self::with_pairs(s.stages, true)
        } else {
            Self::new(s.stages)
        }
    }

    fn with_pairs(pairs: usize, ring: bool) -> Self {
        let none = vec![VecDeque::new(); pairs];
        Channels {
            act: none.clone(),
            grad: none,
            ring,
        }
    }

    /// The stage after `r` (`act[r]` goes to it, `grad[r]` comes from it).
    pub(super) fn after(&self, r: usize) -> usize {
        if self.ring && r + 1 == self.act.len() {
            0
        } else {
            r + 1
        }
    }

    /// The stage before `r` (`act` of it comes to r, `grad` of it is where r's gradients go).
    fn before(&self, r: usize) -> usize {
        if r == 0 { self.act.len() - 1 } else { r - 1 }
    }
}

/// Step 5: lock-step execution with FIFO channels, starting with the messages in `channels`;
/// returns the messages still in flight when every stage has run its whole list.
///
/// Each step, every stage that has actions left tries its next one; messages sent during a step
/// are delivered at its end. A receive on an empty channel waits; a receive that finds another
/// message at the head is a [`ScheduleError::ChannelMismatch`].
pub(super) fn dry_run(s: &Schedule, channels: Channels) -> Result<Channels, ScheduleError> {
    let p = s.stages;
    let mut ch = channels;
    let mut pc = vec![0usize; p];
    let mut grid: Vec<Vec<Option<Action>>> = Vec::new();
    loop {
        if (0..p).all(|r| pc[r] == s.actions[r].len()) {
            return Ok(ch);
        }
        let mut row: Vec<Option<Action>> = vec![None; p];
        let mut sent_act: Vec<(usize, Msg)> = Vec::new();
        let mut sent_grad: Vec<(usize, Msg)> = Vec::new();
        for r in 0..p {
            let Some(&action) = s.actions[r].get(pc[r]) else {
                continue;
            };
            let u = action.unit();
            let ran = match action.op() {
                Op::RecvActivation => {
                    let from = ch.before(r);
                    let expects = sender(s, r, action);
                    receive(&mut ch.act[from], r, pc[r], action, expects, from)?
                }
                Op::RecvGrad => {
                    let from = ch.after(r);
                    let expects = sender(s, r, action);
                    receive(&mut ch.grad[r], r, pc[r], action, expects, from)?
                }
                Op::SendActivation => {
                    sent_act.push((r, (u, action)));
                    true
                }
                Op::SendGrad => {
                    sent_grad.push((ch.before(r), (u, action)));
                    true
                }
                Op::Forward | Op::Backward | Op::BackwardInput | Op::BackwardWeight => true,
            };
            if ran {
                row[r] = Some(action);
                pc[r] += 1;
            }
        }
        if row.iter().all(Option::is_none) {
            return Err(deadlock(s, &pc, &grid, &ch));
        }
        for (c, msg) in sent_act {
            ch.act[c].push_back(msg);
        }
        for (c, msg) in sent_grad {
            ch.grad[c].push_back(msg);
        }
        grid.push(row);
    }
}

/// The send that a receive on stage `r` must find: `SF` from the virtual stage before for an
/// `RF`, `SB` from the virtual stage after for an `RB`.
fn sender(s: &Schedule, r: usize, recv: Action) -> Action {
    let p = s.stages;
    let here = recv.chunk() * p + r;
    let (op, from) = match recv.op() {
        Op::RecvActivation => (Op::SendActivation, here - 1),
        _ => (Op::SendGrad, here + 1),
    };
    Action::new(op, recv.unit(), from / p)
}

/// The end of step 5: a message still in a channel was sent and never received.
pub(super) fn check_delivered(left: &Channels) -> Result<(), ScheduleError> {
    let down = left
        .act
        .iter()
        .enumerate()
        .map(|(c, q)| (c, left.after(c), q));
    let up = left
        .grad
        .iter()
        .enumerate()
        .map(|(c, q)| (left.after(c), c, q));
    match down
        .chain(up)
        .find_map(|(from, to, q)| q.front().map(|&(_, action)| (from, to, action)))
    {
        Some((from, to, action)) => Err(ScheduleError::Undelivered { from, to, action }),
        None => Ok(()),
    }
}

/// Tries a receive: `Ok(true)` if the expected send's message was at the head (consumed),
/// `Ok(false)` if the channel is empty, an error if another message is at the head.
fn receive(
    chan: &mut VecDeque<Msg>,
    stage: usize,
    position: usize,
    action: Action,
    expects: Action,
    from: usize,
) -> Result<bool, ScheduleError> {
    match chan.front() {
        None => Ok(false),
        Some(&(_, sent)) if sent == expects => {
            chan.pop_front();
            Ok(true)
        }
        Some(&(found, found_action)) => Err(ScheduleError::ChannelMismatch {
            stage,
            position,
            action,
            from,
            found,
            found_action,
        }),
    }
}

/// Builds the deadlock error: who waits for what, and the step × stage grid.
fn deadlock(
    s: &Schedule,
    pc: &[usize],
    grid: &[Vec<Option<Action>>],
    ch: &Channels,
) -> ScheduleError {
    let mut blocked = Vec::new();
    for (r, &at) in pc.iter().enumerate() {
        if let Some(&a) = s.actions[r].get(at) {
            let (what, from, empty) = match a.op() {
                Op::RecvActivation => {
                    let from = ch.before(r);
                    ("an activation", from, ch.act[from].is_empty())
                }
                Op::RecvGrad => ("a gradient", ch.after(r), ch.grad[r].is_empty()),
                _ => unreachable!("only receives block"),
            };
            debug_assert!(empty);
            blocked.push(format!(
                "stage {r} waits at #{at} {a} for {what} from stage {from}"
            ));
        }
    }
    ScheduleError::Deadlock {
        steps: grid.len(),
        blocked: blocked.join("; "),
        grid: render_grid(s, pc, grid),
    }
}

/// The step × stage grid of executed actions, plus a final row with the blocked actions
/// (`*RB0.0*`) and finished stages (`done`).
fn render_grid(s: &Schedule, pc: &[usize], grid: &[Vec<Option<Action>>]) -> String {
    let p = s.stages;
    let skip = grid.len().saturating_sub(GRID_ROWS);
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    rows.push((
        "step".to_string(),
        (0..p).map(|r| format!("stage {r}")).collect(),
    ));
    for (t, row) in grid.iter().enumerate().skip(skip) {
        rows.push((
            t.to_string(),
            row.iter()
                .map(|a| a.map(|a| a.to_string()).unwrap_or_else(|| ".".into()))
                .collect(),
        ));
    }
    rows.push((
        "blocked".to_string(),
        (0..p)
            .map(|r| match s.actions[r].get(pc[r]) {
                Some(a) => format!("*{a}*"),
                None => "done".to_string(),
            })
            .collect(),
    ));
    let w0 = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..p)
        .map(|c| {
            rows.iter()
                .map(|(_, cells)| cells[c].len())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    if skip > 0 {
        let _ = writeln!(out, "({skip} earlier steps not shown)");
    }
    for (label, cells) in rows {
        let _ = write!(out, "{label:>w0$} |");
        for (cell, w) in cells.iter().zip(&widths) {
            let _ = write!(out, " {cell:<w$}");
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    }
    out.push_str("(. = idle or waiting; *X* = blocked action)");
    out
}

#[cfg(test)]
mod tests {
    use super::super::{ScheduleKind, generate, generate_forward_only};
    use super::*;

    fn a(s: &str) -> Action {
        s.parse().unwrap()
    }

    fn stage(line: &str) -> Vec<Action> {
        line.split_whitespace().map(a).collect()
    }

    fn pos(s: &Schedule, r: usize, x: &str) -> usize {
        let x = a(x);
        s.actions[r].iter().position(|&y| y == x).unwrap()
    }

    #[test]
    fn swapped_stage_orders_deadlock_with_a_grid() {
        // p=2, m=2, k=1: stage 0 runs 1F1B's last-stage order (F0 B0 F1 B1), stage 1 runs
        // GPipe's (F0 F1 B0 B1). Each is fine locally; together stage 0 waits for B0's gradient
        // while stage 1 waits for F1's activation.
        let s = Schedule {
            kind: ScheduleKind::OneFOneB,
            stages: 2,
            virtual_stages: 1,
            microbatches: 2,
            splits: 1,
            forward_only: false,
            actions: vec![
                stage("F0.0 SF0.0 RB0.0 B0.0 F1.0 SF1.0 RB1.0 B1.0"),
                stage("RF0.0 F0.0 RF1.0 F1.0 B0.0 SB0.0 B1.0 SB1.0"),
            ],
        };
        let e = validate(&s).unwrap_err();
        let ScheduleError::Deadlock {
            ref blocked,
            ref grid,
            ..
        } = e
        else {
            panic!("expected a deadlock, got {e}");
        };
        assert!(
            blocked.contains("stage 0 waits at #2 RB0.0 for a gradient from stage 1"),
            "{e}"
        );
        assert!(
            blocked.contains("stage 1 waits at #2 RF1.0 for an activation from stage 0"),
            "{e}"
        );
        assert!(
            grid.contains("*RB0.0*") && grid.contains("*RF1.0*"),
            "{grid}"
        );
        assert!(grid.contains("stage 0") && grid.contains("SF0.0"), "{grid}");
        let msg = e.to_string();
        assert!(msg.starts_with("deadlock after"), "{msg}");
    }

    #[test]
    fn swapped_receive_order_is_a_channel_mismatch() {
        // Stage 1 takes micro-batch 1 before micro-batch 0 (locally valid: forwards of different
        // micro-batches are independent), but stage 0 sends 0 first.
        let mut s = generate(ScheduleKind::GPipe, 2, 2, 1).unwrap();
        s.actions[1] = stage("RF1.0 F1.0 RF0.0 F0.0 B0.0 SB0.0 B1.0 SB1.0");
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::ChannelMismatch { stage: 1, position: 0, from: 0, found, .. }
                    if found == Unit::new(0, 0)
            ),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("stage 1, action #0 RF1.0") && msg.contains("0.0"),
            "{msg}"
        );

        // Swapping only the two receives leaves F0.0 without its input.
        let mut s = generate(ScheduleKind::GPipe, 2, 2, 1).unwrap();
        let (x, y) = (pos(&s, 1, "RF0.0"), pos(&s, 1, "RF1.0"));
        s.actions[1].swap(x, y);
        let e = validate(&s).unwrap_err();
        assert_eq!(
            e,
            ScheduleError::Unpaired {
                stage: 1,
                position: 1,
                action: a("F0.0"),
                needs: a("RF0.0"),
            }
        );
    }

    #[test]
    fn gradient_order_mismatch() {
        // Stage 0 takes micro-batch 1's gradient first; stage 1 sends micro-batch 0's first.
        let mut s = generate(ScheduleKind::GPipe, 2, 2, 1).unwrap();
        s.actions[0] = stage("F0.0 SF0.0 F1.0 SF1.0 RB1.0 B1.0 RB0.0 B0.0");
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::ChannelMismatch {
                    stage: 0,
                    from: 1,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn missing_backward_is_incomplete() {
        let mut s = generate(ScheduleKind::Seq1F1B, 3, 2, 2).unwrap();
        let x = pos(&s, 2, "B0.1");
        s.actions[2].remove(x);
        let e = validate(&s).unwrap_err();
        assert_eq!(
            e,
            ScheduleError::Incomplete {
                stage: 2,
                unit: Unit::new(0, 1),
                chunk: 0,
                what: "backward (B)",
                count: 0,
                expected: 1,
            }
        );
        assert!(e.to_string().contains("stage 2: incomplete"), "{e}");

        let mut s = generate(ScheduleKind::Seq1F1B, 3, 2, 2).unwrap();
        s.actions[1].push(a("F1.1"));
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::Incomplete {
                    stage: 1,
                    count: 2,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn backward_segments_out_of_order_is_a_dependency_error() {
        let mut s = generate(ScheduleKind::Seq1F1B, 3, 2, 2).unwrap();
        let (x, y) = (pos(&s, 2, "B0.0"), pos(&s, 2, "B0.1"));
        s.actions[2].swap(x, y);
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::Dependency { stage: 2, action, needs, .. }
                    if action == a("B0.0") && needs == a("B0.1")
            ),
            "{e}"
        );
        assert!(e.to_string().contains("dependency violated"), "{e}");
    }

    #[test]
    fn backward_before_the_whole_microbatch_is_forwarded() {
        // Last stage: F0.0 B0.0 F0.1 B0.1 would backward segment 0 before segment 1 exists.
        let s = Schedule {
            kind: ScheduleKind::Seq1F1B,
            stages: 1,
            virtual_stages: 1,
            microbatches: 1,
            splits: 2,
            forward_only: false,
            actions: vec![stage("F0.0 B0.0 F0.1 B0.1")],
        };
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(e, ScheduleError::Dependency { needs, .. } if needs == a("F0.1")),
            "{e}"
        );
        let s = Schedule {
            actions: vec![stage("F0.1 F0.0 B0.1 B0.0")],
            ..s
        };
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(e, ScheduleError::Dependency { position: 0, needs, .. } if needs == a("F0.0")),
            "{e}"
        );
    }

    #[test]
    fn send_before_compute_is_unpaired() {
        let mut s = generate(ScheduleKind::OneFOneB, 2, 1, 1).unwrap();
        s.actions[0] = stage("SF0.0 F0.0 RB0.0 B0.0");
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::Unpaired {
                    stage: 0,
                    position: 0,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn misplaced_actions_are_rejected() {
        let mut s = generate(ScheduleKind::Seq1F1B, 2, 1, 1).unwrap();
        s.actions[0].insert(0, a("RF0.0"));
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::InvalidAction {
                    stage: 0,
                    position: 0,
                    ..
                }
            ),
            "{e}"
        );

        let mut s = generate(ScheduleKind::Seq1F1B, 2, 1, 1).unwrap();
        s.actions[1].push(a("F3.0"));
        let e = validate(&s).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");

        let mut s = generate_forward_only(2, 1, 1).unwrap();
        s.actions[1].push(a("B0.0"));
        let e = validate(&s).unwrap_err();
        assert!(e.to_string().contains("forward-only"), "{e}");

        let mut s = generate(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        s.actions.pop();
        assert_eq!(
            validate(&s).unwrap_err(),
            ScheduleError::StageCount {
                expected: 2,
                found: 1
            }
        );

        let s = Schedule {
            kind: ScheduleKind::GPipe,
            stages: 0,
            virtual_stages: 1,
            microbatches: 1,
            splits: 1,
            forward_only: false,
            actions: vec![],
        };
        assert!(matches!(
            validate(&s),
            Err(ScheduleError::InvalidParameters(_))
        ));
    }

    #[test]
    fn big_deadlock_grid_is_truncated() {
        // Stage 1 waits for an activation that stage 0 only sends after a gradient.
        let mut s = generate(ScheduleKind::GPipe, 2, 40, 1).unwrap();
        let mut st0 = Vec::new();
        for i in 0..40 {
            st0.extend(stage(&format!("F{i}.0 SF{i}.0")));
        }
        // Move F39's forward after B0's backward on stage 0.
        let tail = st0.split_off(78);
        st0.extend(stage("RB0.0 B0.0"));
        st0.extend(tail);
        for i in 1..40 {
            st0.extend(stage(&format!("RB{i}.0 B{i}.0")));
        }
        s.actions[0] = st0;
        let e = validate(&s).unwrap_err();
        let ScheduleError::Deadlock { grid, .. } = e else {
            panic!("{e}")
        };
        assert!(grid.contains("earlier steps not shown"), "{grid}");
        assert!(grid.lines().count() <= GRID_ROWS + 4, "{grid}");
    }

    #[test]
    fn split_backward_rules() {
        let z = generate(ScheduleKind::Seq1F1BZeroBubble, 3, 2, 2).unwrap();
        validate(&z).unwrap();
        // W before its I.
        let mut s = z.clone();
        let (i, w) = (pos(&s, 1, "I0.1"), pos(&s, 1, "W0.1"));
        let wa = s.actions[1].remove(w);
        s.actions[1].insert(i, wa);
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(e, ScheduleError::Dependency { stage: 1, needs, .. } if needs == a("I0.1")),
            "{e}"
        );
        // A split unit without its W.
        let mut s = z.clone();
        let w = pos(&s, 2, "W1.0");
        s.actions[2].remove(w);
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::Incomplete {
                    stage: 2,
                    what: "weight-gradient backward (W)",
                    count: 0,
                    ..
                }
            ),
            "{e}"
        );
        // Both a whole B and an I for one unit.
        let mut s = z.clone();
        s.actions[0].push(a("B1.1"));
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::Incomplete {
                    stage: 0,
                    what: "backward (B)",
                    count: 1,
                    expected: 0,
                    ..
                }
            ),
            "{e}"
        );
        // The input halves keep the dK/dV order: I(i,j) after I(i,j+1).
        let mut s = z.clone();
        let (hi, lo) = (pos(&s, 2, "I0.1"), pos(&s, 2, "I0.0"));
        s.actions[2].swap(hi, lo);
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(e, ScheduleError::Dependency { stage: 2, needs, .. } if needs == a("I0.1")),
            "{e}"
        );
        // The gradient sent back is the input half's: SB after I.
        let mut s = z;
        let (i, sb) = (pos(&s, 1, "I0.0"), pos(&s, 1, "SB0.0"));
        let x = s.actions[1].remove(sb);
        s.actions[1].insert(i, x);
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(e, ScheduleError::Unpaired { stage: 1, needs, .. } if needs == a("I0.0")),
            "{e}"
        );
    }

    #[test]
    fn chunk_rules() {
        let g =
            super::super::generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 2, 2).unwrap();
        validate(&g).unwrap();
        // A chunk the schedule does not have.
        let mut s = g.clone();
        s.actions[0].push(a("F0.0@2"));
        let e = validate(&s).unwrap_err();
        assert!(e.to_string().contains("chunk 2 out of range"), "{e}");
        // The last virtual stage (worker 1's chunk 1) sends no activation on.
        let mut s = g.clone();
        s.actions[1].push(a("SF0.0@1"));
        let e = validate(&s).unwrap_err();
        assert!(e.to_string().contains("the last virtual stage 3"), "{e}");
        // A non-canonical spelling of a plain action.
        let mut s = g.clone();
        s.actions[0][0] = Action::Extended {
            op: super::super::Op::Forward,
            unit: Unit::new(0, 0),
            chunk: 0,
        };
        let e = validate(&s).unwrap_err();
        assert!(e.to_string().contains("canonical"), "{e}");
        // Worker 0 receiving its chunk-1 inputs in another order than worker 1 sent its chunk-0
        // outputs: the ring channel from worker 1 to worker 0 is FIFO.
        let mut s = g.clone();
        let (x, y) = (pos(&s, 0, "RF0.0@1"), pos(&s, 0, "RF0.1@1"));
        s.actions[0].swap(x, y);
        let (fx, fy) = (pos(&s, 0, "F0.0@1"), pos(&s, 0, "F0.1@1"));
        s.actions[0].swap(fx, fy);
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::Dependency { .. } | ScheduleError::ChannelMismatch { .. }
            ),
            "{e}"
        );
        // Missing a chunk's backward names the chunk.
        let mut s = g;
        let b = pos(&s, 1, "B1.0@1");
        s.actions[1].remove(b);
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::Incomplete {
                    stage: 1,
                    chunk: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("unit 1.0 on chunk 1"), "{e}");
    }

    #[test]
    fn a_chunk_order_mismatch_across_the_ring_is_a_channel_mismatch() {
        // p=2, v=2, m=2, k=1: worker 1 sends its chunk-0 outputs F0 then F1 to worker 0's chunk
        // 1. Worker 0 receiving F1 first (and forwarding it first) finds F0 at the channel head.
        let g =
            super::super::generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 2, 1).unwrap();
        let mut s = g;
        let swap = |s: &mut Schedule, x: &str, y: &str| {
            let (i, j) = (pos(s, 0, x), pos(s, 0, y));
            s.actions[0].swap(i, j);
        };
        swap(&mut s, "RF0.0@1", "RF1.0@1");
        swap(&mut s, "F0.0@1", "F1.0@1");
        swap(&mut s, "SF0.0@1", "SF1.0@1");
        let e = validate(&s).unwrap_err();
        assert!(
            matches!(
                e,
                ScheduleError::ChannelMismatch {
                    stage: 0,
                    from: 1,
                    ..
                }
            ),
            "{e}"
        );
    }
}
