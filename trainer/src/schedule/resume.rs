//! Mid-step recovery as data: the rest of a step after one stage is lost and replaced.
//!
//! This is the formal model of the runtime's mid-step recovery protocol. Stage f dies in the
//! middle of a step; every other stage r has completed the first `done[r]` actions of its list
//! and keeps its state.
//!
//! * Every stage keeps every boundary tensor it sent in the step (activations to r+1, gradients
//!   to r−1).
//! * Stage f−1 (if any) rebuilds its link to the replacement, tells it which of f's gradients it
//!   has received (its completed `RecvGrad` actions), sends again *all* the activations it sent
//!   to f in the step, in their original order, and goes on with its own list where it stood. A
//!   `SendActivation` to f it was stopped on counts as done (the tensor was kept, so it is part
//!   of the re-send): the caller counts it in `done[f−1]`.
//! * Stage f+1 (if any) likewise tells the replacement which of f's activations it has
//!   received, sends again all the gradients it sent to f, and goes on where it stood.
//! * The replacement starts from f's step-start state and runs f's *whole* list in order, but
//!   skips each `SendActivation(u)` whose unit f+1 already has and each `SendGrad(u)` whose unit
//!   f−1 already has. It still computes those units: that is the replay of f's lost work.
//! * The other stages are untouched, and so are the messages in flight between them. Messages
//!   in flight to f are lost with its links; the re-sends and the replacement's sends make up
//!   for them. What f had sent a neighbour before it died, the neighbour takes off the old link
//!   before it relinks, ahead of the receive actions that use it, and counts as received
//!   ([`neighbour_relink`]'s `ahead`): so the replacement redoes exactly the units whose outputs
//!   f had sent, however far each neighbour had got in its own list. ([`resume_after_loss`]
//!   models neighbours that hold nothing ahead: those whose progress covers what f sent.)
//!
//! **Virtual stages** (`virtual_stages` = v ≥ 2): stage f holds v chunks, chunk c being virtual
//! stage c·p + f, and the stages form a ring (stage p−1's chunk c feeds stage 0's chunk c+1), so
//! f's neighbours are f−1 and f+1 mod p — with p = 2 one survivor on both sides. Everything
//! above holds per (chunk, unit): a neighbour tells which of f's outputs it has as (f's chunk,
//! unit), re-sends every tensor it sent to any of f's chunks, and the replacement rebuilds all
//! v chunks' in-flight state by running f's whole list (every chunk) from the step-start state.
//!
//! **Split backwards** (`seq1f1b-zb`: each backward an input half `I`, whose gradient f sends
//! upstream at once, and a weight half `W`, deferred): nothing above changes, because the
//! replacement runs f's whole list in its order. What f lost with its process is its saved
//! activations, its pending weight halves and its parameter-gradient accumulators; running the
//! whole list from the step-start state redoes every `W` f had done, in the list's order — the
//! original accumulation order — so f's gradients come out bit-identical. A unit whose `I` f had
//! done and whose input gradient f−1 already has is computed again (its `W` needs the `I`'s saved
//! context) but its `SendGrad` is skipped: f−1 counts it once. A `W` sends nothing, so no
//! neighbour proves it by a unit's message; its place does: f runs its list in order, so every
//! action before the last send a neighbour received was done ([`Delivered::replayed`]).
//!
//! [`resume_after_loss`] turns a schedule, the lost stage and the survivors' progress into the
//! rest of the step as a [`Schedule`] (the re-sends are ordinary send actions at the head of the
//! neighbours' lists), after checking that the progress is one an execution can reach.
//! [`validate_resumed`] dry-runs that rest from the state the loss left: done prefixes and
//! messages in flight.
//!
//! The runtime runs the per-stage parts of the same model: a survivor next to f computes what it
//! tells and re-sends the replacement with [`neighbour_relink`], and the replacement decides
//! which sends to skip and which units it redoes with [`Delivered`]. [`resume_after_loss`] is
//! built from those same functions, so its tests cover what the workers do.
//!
//! Progress is taken when the replacement starts. The runtime relinks a neighbour when it next
//! touches the broken link (or at once if it has finished its part of the step) and starts the
//! replacement once both neighbours have relinked; until then a neighbour receives nothing more
//! from f and sends on the new link only what the model counts as re-sends, so the model sends
//! the replacement the same messages in the same order.

use std::collections::HashSet;

use super::validate::{
    Channels, check_allowed, check_counts, check_delivered, check_local_order, dry_run,
};
use super::{Action, Op, Schedule, ScheduleError, Unit, validate};

/// One of the lost stage's outputs: (its local chunk, unit). Without virtual stages the chunk
/// is always 0.
pub type LostOutput = (usize, Unit);

/// What a neighbour of the lost stage does when it relinks to the replacement
/// ([`neighbour_relink`]): one survivor's part of the protocol, which [`resume_after_loss`] puts
/// together for the whole pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeighbourRelink {
    /// The lost stage's output activations this neighbour has received (it is the stage after
    /// the lost one), in the order received: it tells the replacement over its previous link.
    pub activations: Vec<LostOutput>,
    /// The lost stage's input gradients this neighbour has received (it is the stage before the
    /// lost one), in the order received: it tells the replacement over its next link.
    pub grads: Vec<LostOutput>,
    /// Its sends to the lost stage so far (to any of its chunks), in their original order: it
    /// sends them again.
    pub resend: Vec<Action>,
}

/// The stage before `r` in `s`: r − 1, or with virtual stages r − 1 mod p (the ring).
pub fn stage_before(s: &Schedule, r: usize) -> Option<usize> {
    let p = s.actions.len();
    if s.virtual_stages > 1 {
        Some((r + p - 1) % p)
    } else {
        r.checked_sub(1)
    }
}

/// The stage after `r` in `s`: r + 1, or with virtual stages r + 1 mod p (the ring).
pub fn stage_after(s: &Schedule, r: usize) -> Option<usize> {
    let p = s.actions.len();
    if s.virtual_stages > 1 {
        Some((r + 1) % p)
    } else {
        (r + 1 < p).then_some(r + 1)
    }
}

/// The survivors next to `lost` in `s` (each once: with virtual stages and two stages the one
/// survivor is on both sides; never `lost` itself).
pub fn neighbours_of(s: &Schedule, lost: usize) -> Vec<usize> {
    let mut n: Vec<usize> = [stage_before(s, lost), stage_after(s, lost)]
        .into_iter()
        .flatten()
        .filter(|&r| r != lost)
        .collect();
    n.dedup();
    n
}

/// Survivor `r`'s part of the protocol when it relinks to the replacement of its neighbour `lost`,
/// having completed the first `done` actions of its list in `s` (a send to `lost` it was stopped
/// on counts as done: its tensor was kept) and holding the messages of the receive actions
/// `ahead`, further down its list: what `lost` had sent it before it died, taken off the old
/// links before the relink (the runtime's `relink.rs`). Those from `lost` count as received too,
/// after the done prefix's, in list order; those from another stage are ignored.
///
/// Errors: [`ScheduleError::InvalidParameters`] when `r` and `lost` are not neighbouring stages of
/// `s`, or an action of `ahead` is not a receive of `r`'s list after `done`;
/// [`ScheduleError::UnreachableProgress`] when `done` is longer than `r`'s list.
pub fn neighbour_relink(
    s: &Schedule,
    r: usize,
    lost: usize,
    done: usize,
    ahead: &[Action],
) -> Result<NeighbourRelink, ScheduleError> {
    let p = s.actions.len();
    if r >= p || lost >= p || !neighbours_of(s, lost).contains(&r) {
        return Err(ScheduleError::InvalidParameters(format!(
            "stages {r} and {lost} are not neighbours in a {p}-stage schedule{}",
            if s.virtual_stages > 1 {
                " (a ring, with virtual stages)"
            } else {
                ""
            }
        )));
    }
    let list = &s.actions[r];
    if done > list.len() {
        let mut progress = vec![0; p];
        progress[r] = done;
        return Err(ScheduleError::UnreachableProgress {
            done: progress,
            reason: format!(
                "stage {r} claims {done} actions done but has only {}",
                list.len()
            ),
        });
    }
    // r sends activations to, and receives gradients from, `lost` when `lost` comes after it;
    // the reverse when `lost` comes before it (with p = 2 in a ring, both).
    let (lost_after, lost_before) = (
        stage_after(s, r) == Some(lost),
        stage_before(s, r) == Some(lost),
    );
    let (done, rest) = list.split_at(done);
    if let Some(a) = ahead
        .iter()
        .find(|a| !matches!(a.op(), Op::RecvActivation | Op::RecvGrad) || !rest.contains(a))
    {
        return Err(ScheduleError::InvalidParameters(format!(
            "stage {r} claims to hold the message of {a} ahead of its turn, but that is not a \
             receive of its list after its {} done actions",
            done.len()
        )));
    }
    let received = || {
        done.iter()
            .chain(rest.iter().filter(|a| ahead.contains(a)))
            .copied()
    };
    // The lost stage's chunk that a message to or from r's chunk c came from: the virtual stage
    // before (an activation) or after (a gradient) r's, c·p + r.
    let from = |a: Action, delta: isize| -> LostOutput {
        let here = (a.chunk() * p + r) as isize;
        (((here + delta) as usize) / p, a.unit())
    };
    let activations = received()
        .filter(|a| lost_before && a.op() == Op::RecvActivation)
        .map(|a| from(a, -1))
        .collect();
    let grads = received()
        .filter(|a| lost_after && a.op() == Op::RecvGrad)
        .map(|a| from(a, 1))
        .collect();
    let resend = done
        .iter()
        .copied()
        .filter(|a| match a.op() {
            Op::SendActivation => lost_after,
            Op::SendGrad => lost_before,
            _ => false,
        })
        .collect();
    Ok(NeighbourRelink {
        activations,
        grads,
        resend,
    })
}

/// What the lost stage's neighbours told its replacement they have of its outputs
/// ([`NeighbourRelink::activations`], [`NeighbourRelink::grads`]): decides the replacement's part
/// of the protocol.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delivered {
    /// (chunk, unit)s whose output activation the stage after has.
    pub activations: HashSet<LostOutput>,
    /// (chunk, unit)s whose input gradient the stage before has.
    pub grads: HashSet<LostOutput>,
}

impl Delivered {
    /// `a` is a send of the lost stage whose message the neighbour already has: the replacement
    /// computes its unit but does not send it.
    pub fn skips(&self, a: Action) -> bool {
        let out = (a.chunk(), a.unit());
        match a.op() {
            Op::SendActivation => self.activations.contains(&out),
            Op::SendGrad => self.grads.contains(&out),
            _ => false,
        }
    }

    /// `a` is a compute action of the lost stage that a neighbour proves, by one of (c, u)'s
    /// messages, was done before the loss, so the replacement redoes it: the forward of (c, u)
    /// when the stage after has its activation or the stage before its input gradient (sent only
    /// after the forward), the backward of (c, u) — whole, or its input half — when the stage
    /// before has its input gradient. A weight half has no message of its own: see
    /// [`Delivered::replayed`].
    pub fn replays(&self, a: Action) -> bool {
        let out = (a.chunk(), a.unit());
        match a.op() {
            Op::Forward => self.activations.contains(&out) || self.grads.contains(&out),
            Op::Backward | Op::BackwardInput => self.grads.contains(&out),
            _ => false,
        }
    }

    /// The compute actions of `list`, the lost stage's, that its replacement redoes and that the
    /// neighbours prove were done, in the list's order: those [`Delivered::replays`] proves by a
    /// unit's message, and every weight half (`W`) placed before the last send whose message a
    /// neighbour has (the lost stage ran its list in order). Without split backwards exactly the
    /// actions [`Delivered::replays`] proves.
    pub fn replayed(&self, list: &[Action]) -> Vec<Action> {
        let proven = list
            .iter()
            .rposition(|&a| self.skips(a))
            .map_or(0, |i| i + 1);
        list.iter()
            .enumerate()
            .filter(|&(i, &a)| self.replays(a) || (a.op() == Op::BackwardWeight && i < proven))
            .map(|(_, &a)| a)
            .collect()
    }
}

/// The rest of a step after stage `lost` was lost and replaced mid-step ([`resume_after_loss`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumedStep {
    /// The lost stage f.
    pub lost: usize,
    /// `done[r]`: how many actions of the original list stage r had completed. For a survivor,
    /// the progress it reported; for f, the least progress that explains what its neighbours
    /// received from it (f's real progress is unknown, and its replacement starts over anyway).
    pub done: Vec<usize>,
    /// `resent[r]`: how many actions at the head of `rest.actions[r]` are re-sends to the
    /// replacement (non-zero only on f−1 and f+1).
    pub resent: Vec<usize>,
    /// What every stage runs from now to the end of the step: for a survivor r, its re-sends
    /// (if a neighbour of f) followed by its original actions from `done[r]` on; for f, its
    /// whole original list minus the sends whose message the neighbour already has. Not a whole
    /// step's schedule: check it with [`validate_resumed`], not [`validate`].
    pub rest: Schedule,
    /// The compute actions of f, in f's order, that its replacement redoes and that a neighbour
    /// proves had been done ([`Delivered::replayed`]): `Forward(u)` when f+1 has u's activation
    /// or f−1 has u's input gradient (f sends that only after its forward of u), `Backward(u)` or
    /// `BackwardInput(u)` when f−1 has u's input gradient, `BackwardWeight(u)` when it comes
    /// before a send a neighbour received. This is the runtime's count of redone units; f may
    /// have done more before it died.
    pub replayed: Vec<Action>,
}

/// The rest of the step after stage `lost` died, given the survivors' progress: `done[r]` is how
/// many of stage r's actions in `s` have completed (a prefix; `done[lost]` is ignored).
///
/// Returns the survivors' remaining actions (f−1 and f+1 first re-send everything they sent to f
/// in the step), the replacement's list (f's whole list minus the sends whose message a neighbour
/// already received) and the replayed compute (see [`ResumedStep`] and the module docs).
///
/// Errors: [`validate`]'s errors for `s`; [`ScheduleError::InvalidParameters`] when `lost` is not
/// a stage or `done` does not have one entry per stage; [`ScheduleError::UnreachableProgress`]
/// when no execution of `s` reaches the claimed progress (a stage claims more actions than it
/// has, or a receive of a message its sender cannot have sent by then).
pub fn resume_after_loss(
    s: &Schedule,
    lost: usize,
    done: &[usize],
) -> Result<ResumedStep, ScheduleError> {
    validate(s)?;
    let p = s.stages;
    check_shape(p, lost, done)?;
    let claimed: Vec<usize> = (0..p)
        .map(|r| if r == lost { 0 } else { done[r] })
        .collect();
    check_lengths(s, &claimed)?;
    let delivered = neighbours_have(s, lost, &claimed);
    let lost_list = &s.actions[lost];
    let lost_done = lost_list
        .iter()
        .rposition(|&a| delivered.skips(a))
        .map_or(0, |i| i + 1);
    let done: Vec<usize> = (0..p)
        .map(|r| if r == lost { lost_done } else { done[r] })
        .collect();
    // Only the check matters here: the in-flight messages are `validate_resumed`'s business.
    reach(s, lost, &done)?;

    let mut resent = vec![0; p];
    let mut actions = Vec::with_capacity(p);
    for r in 0..p {
        let list = &s.actions[r];
        if r == lost {
            actions.push(
                lost_list
                    .iter()
                    .copied()
                    .filter(|&a| !delivered.skips(a))
                    .collect(),
            );
            continue;
        }
        let again = if neighbours_of(s, lost).contains(&r) {
            neighbour_relink(s, r, lost, done[r], &[])?.resend
        } else {
            Vec::new()
        };
        resent[r] = again.len();
        actions.push(
            again
                .into_iter()
                .chain(list[done[r]..].iter().copied())
                .collect(),
        );
    }
    let replayed = delivered.replayed(lost_list);
    Ok(ResumedStep {
        lost,
        done,
        resent,
        rest: Schedule {
            actions,
            ..without_actions(s)
        },
        replayed,
    })
}

/// Validates the rest of a step after a stage loss, as [`validate`] does a whole step, but from
/// the state the loss left.
///
/// The starting state: each survivor r has run the first `resumed.done[r]` actions of `s`; the
/// replacement of f has run nothing; the channels between survivors hold what was sent on them
/// and not yet received; the rebuilt channels to and from f start empty. Then:
///
/// 1. `resumed.rest` has the parameters of `s` and every action in it is allowed where it is;
/// 2. completeness, counting the done prefix and the rest: every stage forwards and (training)
///    backwards every unit exactly once and receives each of its inputs exactly once;
/// 3. local order of the rest after the done prefix (dependencies, communication pairing);
/// 4. a FIFO dry run of the rest from the starting channels: every receive finds its unit, no
///    deadlock, and no message is left unreceived at the end, so each message received after the
///    loss was sent exactly once on its channel.
///
/// Errors: [`validate`]'s errors for `s`, [`ScheduleError::UnreachableProgress`] when
/// `resumed.done` cannot be reached, and the first problem of the rest as a [`ScheduleError`]
/// (positions are in `resumed.rest`'s lists).
pub fn validate_resumed(s: &Schedule, resumed: &ResumedStep) -> Result<(), ScheduleError> {
    validate(s)?;
    let (p, lost, rest) = (s.stages, resumed.lost, &resumed.rest);
    check_shape(p, lost, &resumed.done)?;
    if without_actions(rest) != without_actions(s) || rest.actions.len() != p {
        let describe = |x: &Schedule| {
            format!(
                "{} stages, {} micro-batches, {} segments, forward-only {}, {} action lists",
                x.stages,
                x.microbatches,
                x.splits,
                x.forward_only,
                x.actions.len()
            )
        };
        return Err(ScheduleError::InvalidParameters(format!(
            "the rest of the step ({}) does not fit the schedule ({})",
            describe(rest),
            describe(s)
        )));
    }
    check_lengths(s, &resumed.done)?;
    let mut channels = reach(s, lost, &resumed.done)?;
    // The links to the lost stage are rebuilt: what was in flight on them is gone (pair c links
    // stage c and the stage after it).
    for c in 0..channels.act.len() {
        if c == lost || channels.after(c) == lost {
            channels.act[c].clear();
            channels.grad[c].clear();
        }
    }
    let done = |r: usize| {
        if r == lost {
            &[][..]
        } else {
            &s.actions[r][..resumed.done[r]]
        }
    };
    for r in 0..p {
        check_allowed(rest, r)?;
    }
    for r in 0..p {
        check_counts(rest, r, done(r), false)?;
    }
    for r in 0..p {
        check_local_order(rest, r, done(r))?;
    }
    let left = dry_run(rest, channels)?;
    check_delivered(&left)
}

/// `s`'s parameters with no actions.
fn without_actions(s: &Schedule) -> Schedule {
    Schedule {
        actions: Vec::new(),
        ..*s
    }
}

/// `lost` is a stage and `done` has one entry per stage.
fn check_shape(p: usize, lost: usize, done: &[usize]) -> Result<(), ScheduleError> {
    let mut bad = Vec::new();
    if lost >= p {
        bad.push(format!("lost stage {lost} is not one of the {p} stages"));
    }
    if done.len() != p {
        bad.push(format!(
            "progress has {} entries, the schedule has {p} stages",
            done.len()
        ));
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(ScheduleError::InvalidParameters(bad.join("; ")))
    }
}

/// No stage claims more actions done than it has.
fn check_lengths(s: &Schedule, done: &[usize]) -> Result<(), ScheduleError> {
    match (0..s.stages).find(|&r| done[r] > s.actions[r].len()) {
        Some(r) => Err(ScheduleError::UnreachableProgress {
            done: done.to_vec(),
            reason: format!(
                "stage {r} claims {} actions done but has only {}",
                done[r],
                s.actions[r].len()
            ),
        }),
        None => Ok(()),
    }
}

/// The units of the lost stage's outputs that its neighbours have received, given each
/// survivor's progress (each neighbour's [`NeighbourRelink::have`]).
fn neighbours_have(s: &Schedule, lost: usize, done: &[usize]) -> Delivered {
    let mut delivered = Delivered::default();
    for r in neighbours_of(s, lost) {
        let relink = neighbour_relink(s, r, lost, done[r], &[])
            .expect("a neighbour of the lost stage, progress within its list");
        delivered.activations.extend(relink.activations);
        delivered.grads.extend(relink.grads);
    }
    delivered
}

/// Runs every stage r of `s` through its first `done[r]` actions (the lost stage through the
/// `done[lost]` its neighbours prove; all within their lists) and returns the messages then in
/// flight, or [`ScheduleError::UnreachableProgress`] when no execution gets every stage that far.
///
/// Sends never block and a receive only waits, so running every stage greedily up to its bound
/// gets each one there exactly when some execution does.
fn reach(s: &Schedule, lost: usize, done: &[usize]) -> Result<Channels, ScheduleError> {
    let prefixes = Schedule {
        actions: (0..s.stages)
            .map(|r| s.actions[r][..done[r]].to_vec())
            .collect(),
        ..without_actions(s)
    };
    dry_run(&prefixes, Channels::for_schedule(s)).map_err(|e| match e {
        ScheduleError::Deadlock { blocked, .. } => ScheduleError::UnreachableProgress {
            done: done.to_vec(),
            reason: format!(
                "no execution runs every stage through its done actions: {blocked} (never sent \
                 within the sender's done actions; the lost stage {lost} is counted as having \
                 done the {} actions its neighbours' receipts prove)",
                done[lost]
            ),
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::super::{ScheduleKind, generate};
    use super::*;

    #[test]
    fn only_a_neighbour_of_the_lost_stage_relinks_within_its_list() {
        let s = generate(ScheduleKind::Seq1F1B, 4, 2, 2).unwrap();
        for (r, lost) in [(0, 2), (1, 1), (3, 4), (4, 3)] {
            let e = neighbour_relink(&s, r, lost, 0, &[]).unwrap_err();
            assert!(
                matches!(e, ScheduleError::InvalidParameters(_)),
                "{r} {lost}: {e}"
            );
        }
        let len = s.actions[1].len();
        assert!(neighbour_relink(&s, 1, 2, len, &[]).is_ok());
        let e = neighbour_relink(&s, 1, 2, len + 1, &[]).unwrap_err();
        assert!(
            matches!(e, ScheduleError::UnreachableProgress { .. }),
            "{e}"
        );
    }

    /// Two workers in a ring, the survivor stopped early in its list: the messages it holds ahead
    /// of their receives count as received from the lost worker, after its done prefix's and in
    /// list order, so it tells the replacement everything the lost worker had sent it; they
    /// change nothing it re-sends. A claim that is not a receive after the done prefix is refused.
    #[test]
    fn a_survivor_counts_the_messages_it_holds_ahead_of_their_receives() {
        let s =
            super::super::generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 4, 2).unwrap();
        let (r, lost) = (1, 0);
        let list = &s.actions[r];
        let receives: Vec<usize> = (0..list.len())
            .filter(|&i| matches!(list[i].op(), Op::RecvActivation | Op::RecvGrad))
            .collect();
        // Stopped at its fourth receive; holds the next activation and the next gradient.
        let done = receives[3];
        let later = |op: Op| *list[done..].iter().find(|a| a.op() == op).unwrap();
        let ahead = [later(Op::RecvGrad), later(Op::RecvActivation)];
        let plain = neighbour_relink(&s, r, lost, done, &[]).unwrap();
        let held = neighbour_relink(&s, r, lost, done, &ahead).unwrap();
        assert_eq!(held.resend, plain.resend);
        let named = |a: Action, delta: usize| (a.chunk() + delta, a.unit());
        let mut activations = plain.activations.clone();
        activations.push(named(ahead[1], 0));
        let mut grads = plain.grads.clone();
        grads.push(named(ahead[0], 1));
        assert_eq!((held.activations, held.grads), (activations, grads));
        // With all its later receives held, it has everything: as if it had run to the end.
        let all: Vec<Action> = list[done..]
            .iter()
            .copied()
            .filter(|a| matches!(a.op(), Op::RecvActivation | Op::RecvGrad))
            .collect();
        let full = neighbour_relink(&s, r, lost, done, &all).unwrap();
        let end = neighbour_relink(&s, r, lost, list.len(), &[]).unwrap();
        assert_eq!((full.activations, full.grads), (end.activations, end.grads));
        // Not a receive, or one already done: refused, named.
        for bad in [
            list[done..].iter().find(|a| a.op() == Op::Forward).unwrap(),
            &list[receives[0]],
        ] {
            let e = neighbour_relink(&s, r, lost, done, &[*bad]).unwrap_err();
            assert!(
                matches!(&e, ScheduleError::InvalidParameters(m) if m.contains(&bad.to_string())),
                "{e}"
            );
        }
    }

    /// The survivors' part of [`resume_after_loss`] is [`neighbour_relink`]: what the rest of the
    /// step re-sends, and what the replacement skips, come from it.
    #[test]
    fn the_resumed_step_is_made_of_the_neighbours_relinks() {
        let s = generate(ScheduleKind::OneFOneB, 3, 3, 2).unwrap();
        let lost = 1;
        // Stage 0 has done all its forwards' sends; stage 2 nothing.
        let done0 = s.actions[0]
            .iter()
            .rposition(|a| matches!(a, Action::SendActivation(_)))
            .unwrap()
            + 1;
        let resumed = resume_after_loss(&s, lost, &[done0, 0, 0]).unwrap();
        let before = neighbour_relink(&s, 0, lost, done0, &[]).unwrap();
        assert_eq!(
            resumed.rest.actions[0][..resumed.resent[0]],
            before.resend[..]
        );
        assert!(before.grads.is_empty() && before.activations.is_empty());
        let after = neighbour_relink(&s, 2, lost, 0, &[]).unwrap();
        assert!(after.activations.is_empty() && after.resend.is_empty());
        assert_eq!(resumed.resent[2], 0);
        // Nothing of stage 1's reached a neighbour: its replacement runs its whole list.
        assert_eq!(resumed.rest.actions[lost], s.actions[lost]);
        validate_resumed(&s, &resumed).unwrap();
    }

    /// Split backwards: the last stage lost after stage 0 received every input gradient from it.
    /// Its replacement redoes every F, I and W — the W's in the list's order — and sends no input
    /// gradient again; the W's before its last `SendGrad` count as replayed (the stage ran its
    /// list in order), the ones after it do not.
    #[test]
    fn a_zero_bubble_replacement_redoes_its_weight_halves_in_order_and_sends_no_gradient_twice() {
        let s = generate(ScheduleKind::Seq1F1BZeroBubble, 2, 2, 2).unwrap();
        let (list0, list1) = (&s.actions[0], &s.actions[1]);
        let done0 = list0.iter().rposition(|a| a.op() == Op::RecvGrad).unwrap() + 1;
        let resumed = resume_after_loss(&s, 1, &[done0, 0]).unwrap();
        validate_resumed(&s, &resumed).unwrap();
        let not_sends: Vec<Action> = list1
            .iter()
            .copied()
            .filter(|a| a.op() != Op::SendGrad)
            .collect();
        assert_eq!(resumed.rest.actions[1], not_sends);
        let last_sb = list1.iter().rposition(|a| a.op() == Op::SendGrad).unwrap();
        assert_eq!(resumed.done[1], last_sb + 1);
        let (before, after): (Vec<usize>, Vec<usize>) = (0..list1.len())
            .filter(|&i| list1[i].op() == Op::BackwardWeight)
            .partition(|&i| i < last_sb);
        assert!(!before.is_empty() && !after.is_empty(), "{list1:?}");
        let want: Vec<Action> = list1
            .iter()
            .enumerate()
            .filter(|&(i, a)| {
                matches!(a.op(), Op::Forward | Op::BackwardInput) || before.contains(&i)
            })
            .map(|(_, &a)| a)
            .collect();
        assert_eq!(resumed.replayed, want);
        // Stage 0 sends its activations again, and has nothing of the replacement's to wait for.
        assert_eq!(resumed.resent, [4, 0]);
    }
}
