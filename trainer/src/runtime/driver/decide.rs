//! The driver's decisions, pure: whether a step's peer snapshot is taken, when evaluation is due,
//! what a step boundary does (checkpoint or not, go on, stop, change plan), how long the final
//! checkpoint may take, which committed checkpoints a resume tries, what a replacement does with
//! the lost stage's checkpoint shard, what each survivor is told after a lost replica, and the
//! trainer state a checkpoint records. The driver ([`super::Driver`]) gathers the facts, calls
//! these, and carries the answers out; each is tested here as a table.

use std::time::{Duration, Instant};

use super::super::checkpoint_writer::FinalDeadline;
use super::super::control::{Regroup, ToWorker};
use super::super::error::LaunchError;
use super::super::recovery::{self, ResumePoint};
use crate::checkpointing::state::{DataCursor, LrPosition, Topology, TrainerState, WRITER};
use crate::config::Config;
use crate::model::partition_layers;

/// Whether a step's peer snapshot is taken: always when no worker's previous copy is in flight;
/// otherwise skipped, unless `skipped_in_a_row` already reached `max_skips` (the workers then wait
/// for the copy in flight).
pub(super) fn peer_copy_due(in_flight: bool, skipped_in_a_row: u64, max_skips: u64) -> bool {
    !in_flight || skipped_in_a_row >= max_skips
}

/// The steps in a row whose peer snapshot was skipped, and the choice for the next step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PeerCopies {
    skipped_in_a_row: u64,
}

impl PeerCopies {
    /// Whether this step's state is copied to the peer-snapshot agents (`enabled`:
    /// `elastic.peer_snapshots`; `in_flight`: some worker still copies an earlier step), counting
    /// the skips: at most one copy in flight per worker, skipped (not queued) while one is, up to
    /// `max_skips` steps in a row.
    pub(super) fn decide(&mut self, enabled: bool, in_flight: bool, max_skips: u64) -> bool {
        let copy = enabled && peer_copy_due(in_flight, self.skipped_in_a_row, max_skips);
        self.skipped_in_a_row = if copy || !enabled {
            0
        } else {
            self.skipped_in_a_row + 1
        };
        copy
    }
}

/// Whether step `step` of `steps` ends with an evaluation (`train.eval_every`, 0 = never; the
/// last step always evaluates when evaluation is on).
pub(super) fn eval_due(step: u64, eval_every: u64, steps: u64) -> bool {
    eval_every > 0 && (step.is_multiple_of(eval_every) || step == steps)
}

/// The evaluation's requests: `(first, count)` chunks of at most `chunk` held-out micro-batches
/// covering `0..batches` in order.
pub(super) fn eval_chunks(batches: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..batches)
        .step_by(chunk.max(1))
        .map(move |first| (first, chunk.max(1).min(batches - first)))
}

/// What the run does with the step a checkpoint (or peer snapshot) brought it to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum StartAt {
    /// Train steps `start + 1 ..= train.steps`.
    Train,
    /// Every step is done and a recovery restored the last one (a node lost while its checkpoint
    /// was being written): only that checkpoint is left to commit.
    FinishLastCheckpoint,
    /// Nothing to train: the reason, with the setting that would change it.
    NothingToTrain(String),
}

/// What a pipeline that loaded the state of `start` (of a run of `steps`) does; `recovering`:
/// it replaces a pipeline that lost nodes or changed plan.
pub(super) fn start_at(start: u64, steps: u64, recovering: bool) -> StartAt {
    if start < steps {
        StartAt::Train
    } else if recovering && start == steps {
        StartAt::FinishLastCheckpoint
    } else {
        StartAt::NothingToTrain(format!(
            "the checkpoint is at step {start} and train.steps is {steps}: nothing to train; raise it, e.g. --set train.steps={}",
            start + steps.max(1)
        ))
    }
}

/// The steps a recovery lost: those after the restored `start` up to the one before the failed
/// step.
pub(super) fn lost_steps(failed_step: u64, start: u64) -> u64 {
    failed_step.saturating_sub(1).saturating_sub(start)
}

/// Whether the coordinator is asked about a plan change after `step` of `steps`: not at the
/// run's last step, nor when a signal stops the run.
pub(super) fn boundary_open(step: u64, steps: u64, interrupted: bool) -> bool {
    step < steps && !interrupted
}

/// The facts of a step boundary (see [`step_end`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct BoundaryFacts {
    /// A signal asked the run to stop.
    pub interrupted: bool,
    /// Nodes with preemption notices leave and too few would remain: the run stops.
    pub preempted: bool,
    /// The plan changes; `Some(true)`: the new plan is ready now (else the run waits for nodes).
    pub plan_change: Option<bool>,
    /// `checkpoint.every` asks for a checkpoint of this step (or it is the last).
    pub due: bool,
    /// The agents that stay hold this step's peer snapshots (only asked when
    /// [`wait_for_peer_snapshots`] says so).
    pub peers_hold: bool,
}

/// What a step boundary does after its checkpoint, if any, was started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Then {
    /// The next step runs.
    Continue,
    /// The run stops on a signal.
    Stop,
    /// The run stops for preemption notices.
    Preempted,
    /// The pipeline restarts under a new plan once the checkpoint (if started) is committed.
    ChangePlan,
}

/// What a step boundary does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StepEnd {
    /// A checkpoint of the step is started.
    pub checkpoint: bool,
    pub then: Then,
}

/// Whether a plan change waits for the peer snapshots of its step (then it needs no checkpoint,
/// whose upload would stall the run): only a plan that is ready now, at a step with no checkpoint
/// due anyway.
pub(super) fn wait_for_peer_snapshots(plan_change: Option<bool>, due: bool) -> bool {
    plan_change == Some(true) && !due
}

/// What a step boundary does: a checkpoint is started when one is due, when the run stops, or
/// before a plan change whose next plan cannot start from peer snapshots of the step (a run that
/// must wait for nodes, or stops, keeps the step in a committed checkpoint).
pub(super) fn step_end(f: BoundaryFacts) -> StepEnd {
    let by_peers = wait_for_peer_snapshots(f.plan_change, f.due) && f.peers_hold;
    let checkpoint =
        f.interrupted || f.preempted || f.due || (f.plan_change.is_some() && !by_peers);
    let then = if f.interrupted {
        Then::Stop
    } else if f.preempted {
        Then::Preempted
    } else if f.plan_change.is_some() {
        Then::ChangePlan
    } else {
        Then::Continue
    };
    StepEnd { checkpoint, then }
}

/// How long the final checkpoint may take: within the signal's grace period (counted from when
/// the driver first saw the signal), until the preempted nodes' grace ends, or a few attempts of
/// `attempt` each at the normal end.
pub(super) fn final_deadline(
    stop_seen: Option<Instant>,
    interrupted: bool,
    preempted: bool,
    signal_grace: Duration,
    preemption_grace: Duration,
    attempt: Duration,
    now: Instant,
) -> FinalDeadline {
    match stop_seen {
        Some(seen) if interrupted => FinalDeadline::Until(seen + signal_grace),
        _ if preempted => FinalDeadline::Until(now + preemption_grace),
        _ => FinalDeadline::Attempts(attempt),
    }
}

/// The committed checkpoints a resume from `point` tries, newest first: the newest (or the one
/// asked for), then — with `fallback` — the older ones, in case it is damaged. An error names
/// the store at `url` and what it holds.
pub(super) fn restore_candidates(
    point: ResumePoint,
    committed: &[u64],
    fallback: bool,
    url: &str,
) -> Result<Vec<u64>, LaunchError> {
    let mut candidates: Vec<u64> = committed
        .iter()
        .rev()
        .copied()
        .filter(|&s| match point {
            ResumePoint::Latest => true,
            ResumePoint::Step(n) => s <= n,
        })
        .collect();
    match (point, candidates.first()) {
        (_, None) => {
            return Err(LaunchError::Run(format!(
                "no committed checkpoint at {url}{}; committed steps: {committed:?}",
                if let ResumePoint::Step(n) = point {
                    format!(" at or before step {n}")
                } else {
                    String::new()
                }
            )));
        }
        (ResumePoint::Step(n), Some(&first)) if first != n => {
            return Err(LaunchError::Run(format!(
                "no committed checkpoint of step {n} at {url}; committed steps: {committed:?}"
            )));
        }
        _ => {}
    }
    if !fallback {
        candidates.truncate(1);
    }
    Ok(candidates)
}

/// What a mid-step replacement of a stage does with that stage's shard of the checkpoint in
/// flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LostShard {
    /// None was missing.
    None,
    /// The shard of the checkpoint of this step (the one before the step being replaced in):
    /// the replacement uploads it, from the same restored state.
    Upload(u64),
    /// The shard of an older checkpoint: the replacement starts from a later state, so that
    /// checkpoint is given up.
    Abandon(u64),
}

/// What the replacement of a stage lost in step `step` does with its missing shard (`missing`:
/// the step of the checkpoint in flight whose shard that stage had not uploaded).
pub(super) fn lost_shard(missing: Option<u64>, step: u64) -> LostShard {
    match missing {
        None => LostShard::None,
        Some(c) if c + 1 == step => LostShard::Upload(c),
        Some(c) => LostShard::Abandon(c),
    }
}

/// The messages that start reduction round `round` of `step` after replica `lost` was retired:
/// per stage, `members[stage]` are the surviving workers' `(slot, reduction address)` in replica
/// order; each is told its place in the regrouped group (link `generation`), and the workers of
/// replica [`recovery::adopter`] adopt the lost share.
pub(super) fn reductions(
    step: u64,
    round: u32,
    lost: usize,
    replicas: usize,
    stages: usize,
    generation: u64,
    members: &[Vec<(usize, String)>],
) -> Vec<(usize, ToWorker)> {
    let adopter = recovery::adopter(lost, replicas);
    let mut out = Vec::new();
    for stage_members in members {
        let addrs: Vec<String> = stage_members.iter().map(|(_, a)| a.clone()).collect();
        for (member, (slot, _)) in stage_members.iter().enumerate() {
            let adopt = if slot / stages == adopter {
                vec![lost]
            } else {
                Vec::new()
            };
            out.push((
                *slot,
                ToWorker::Reduce {
                    step,
                    round,
                    adopt,
                    regroup: Some(Regroup {
                        generation,
                        member,
                        addrs: addrs.clone(),
                    }),
                },
            ));
        }
    }
    out
}

/// The trainer state a checkpoint of `step` records (learning rate `lr`, loss `loss`): the data
/// cursor, the learning-rate position, the topology and the resolved config.
pub(super) fn trainer_state(cfg: &Config, step: u64, lr: f64, loss: f64) -> TrainerState {
    // With virtual stages, the range of each virtual stage (worker r's chunk c is entry c·p + r).
    let virtual_stages = cfg.pipeline.stages * cfg.pipeline.virtual_stages;
    let layers = partition_layers(&cfg.model, cfg.train.seq_len, virtual_stages)
        .map(|ls| ls.iter().map(|l| [l.layers.start, l.layers.end]).collect())
        .unwrap_or_default();
    TrainerState {
        step,
        optimizer_step: step,
        data: DataCursor {
            seed: cfg.train.seed,
            next_step: step + 1,
        },
        lr: LrPosition {
            step,
            total_steps: cfg.lr_schedule_steps(),
            last_lr: lr,
        },
        loss,
        topology: Topology {
            stages: cfg.pipeline.stages,
            replicas: cfg.pipeline.replicas,
            layers,
            schedule: cfg.pipeline.schedule.to_string(),
            microbatches: cfg.pipeline.microbatches,
            splits: cfg.pipeline.splits,
        },
        config: cfg.to_toml(),
        writer: WRITER.to_string(),
    }
}

/// The lines of a `metrics.jsonl` text that a run resumed at `step` keeps: records up to `step`
/// and lines with no step (events of other kinds, unreadable lines).
pub(super) fn kept_metrics(text: &str, step: u64) -> String {
    text.lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_none_or(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step is copied when no copy is in flight; while one is, up to `max_skips` steps in a
    /// row are skipped, then the next waits for it (0: never skip).
    #[test]
    fn peer_copies_are_skipped_while_one_is_in_flight_up_to_the_limit() {
        assert!(peer_copy_due(false, 0, 3));
        assert!(peer_copy_due(false, 7, 3));
        assert!(!peer_copy_due(true, 0, 3));
        assert!(!peer_copy_due(true, 2, 3));
        assert!(peer_copy_due(true, 3, 3));
        assert!(peer_copy_due(true, 0, 0));
    }

    /// The counter: two skips in a row with `max_skips = 2`, then a copy that waits, then it
    /// starts counting again; with peer snapshots off nothing is copied and nothing counted.
    #[test]
    fn the_skip_counter_resets_after_a_copy_and_never_counts_when_off() {
        let mut c = PeerCopies::default();
        let seen: Vec<bool> = [false, true, true, true, true, false]
            .into_iter()
            .map(|in_flight| c.decide(true, in_flight, 2))
            .collect();
        assert_eq!(seen, [true, false, false, true, false, true]);
        let mut off = PeerCopies::default();
        assert!(!off.decide(false, true, 0));
        assert!(!off.decide(false, false, 0));
        assert_eq!(off, PeerCopies::default());
    }

    #[test]
    fn evaluation_is_due_every_n_steps_and_at_the_last() {
        assert!(!eval_due(3, 0, 3), "eval_every = 0 never evaluates");
        assert!(eval_due(4, 2, 5));
        assert!(!eval_due(3, 2, 5));
        assert!(eval_due(5, 2, 5), "the last step evaluates");
        let chunks: Vec<_> = eval_chunks(37, 16).collect();
        assert_eq!(chunks, [(0, 16), (16, 16), (32, 5)]);
        assert_eq!(eval_chunks(0, 16).count(), 0);
    }

    #[test]
    fn a_loaded_state_at_or_past_the_end_trains_nothing() {
        assert_eq!(start_at(3, 10, false), StartAt::Train);
        assert_eq!(start_at(10, 10, true), StartAt::FinishLastCheckpoint);
        let StartAt::NothingToTrain(why) = start_at(10, 10, false) else {
            panic!("a fresh pipeline at the last step has nothing to train");
        };
        assert!(why.contains("train.steps=20"), "{why}");
        assert!(matches!(start_at(12, 10, true), StartAt::NothingToTrain(_)));
        assert_eq!(lost_steps(8, 5), 2, "steps 6 and 7 are redone");
        assert_eq!(lost_steps(6, 5), 0);
        assert_eq!(lost_steps(1, 5), 0);
    }

    /// The step boundary as a table: (interrupted, preempted, plan change, due, peers hold) →
    /// (checkpoint started, then).
    #[test]
    fn step_boundaries_checkpoint_when_due_stopping_or_changing_plan_without_peers() {
        use Then::*;
        let cases = [
            ((false, false, None, false, false), (false, Continue)),
            ((false, false, None, true, false), (true, Continue)),
            ((true, false, None, false, false), (true, Stop)),
            ((false, true, None, false, false), (true, Preempted)),
            // A ready plan whose nodes hold the step's peer snapshots: no checkpoint.
            ((false, false, Some(true), false, true), (false, ChangePlan)),
            ((false, false, Some(true), false, false), (true, ChangePlan)),
            // A plan that waits for nodes keeps the step in a checkpoint.
            ((false, false, Some(false), false, true), (true, ChangePlan)),
            ((false, false, Some(true), true, true), (true, ChangePlan)),
        ];
        for ((interrupted, preempted, plan_change, due, peers_hold), (checkpoint, then)) in cases {
            let facts = BoundaryFacts {
                interrupted,
                preempted,
                plan_change,
                due,
                peers_hold,
            };
            assert_eq!(step_end(facts), StepEnd { checkpoint, then }, "{facts:?}");
        }
        assert!(wait_for_peer_snapshots(Some(true), false));
        assert!(!wait_for_peer_snapshots(Some(true), true));
        assert!(!wait_for_peer_snapshots(Some(false), false));
        assert!(!wait_for_peer_snapshots(None, false));
        assert!(boundary_open(3, 10, false));
        assert!(!boundary_open(10, 10, false));
        assert!(!boundary_open(3, 10, true));
    }

    #[test]
    fn the_final_checkpoint_has_the_signals_grace_or_the_preemption_grace_or_attempts() {
        let now = Instant::now();
        let seen = now - Duration::from_secs(3);
        let (sig, pre, att) = (
            Duration::from_secs(30),
            Duration::from_secs(20),
            Duration::from_secs(60),
        );
        let d = |seen, interrupted, preempted| {
            final_deadline(seen, interrupted, preempted, sig, pre, att, now)
        };
        assert_eq!(d(Some(seen), true, false), FinalDeadline::Until(seen + sig));
        assert_eq!(d(None, false, true), FinalDeadline::Until(now + pre));
        assert_eq!(d(Some(seen), false, true), FinalDeadline::Until(now + pre));
        assert_eq!(d(None, false, false), FinalDeadline::Attempts(att));
        // A signal seen during an evaluation of a run that then ended normally.
        assert_eq!(d(Some(seen), false, false), FinalDeadline::Attempts(att));
    }

    #[test]
    fn a_resume_tries_the_newest_matching_checkpoint_then_older_ones_with_fallback() {
        let committed = [2, 4, 6];
        let url = "file:///ckpt";
        let c = |point, fallback| restore_candidates(point, &committed, fallback, url);
        assert_eq!(c(ResumePoint::Latest, true).unwrap(), [6, 4, 2]);
        assert_eq!(c(ResumePoint::Latest, false).unwrap(), [6]);
        assert_eq!(c(ResumePoint::Step(4), true).unwrap(), [4, 2]);
        let missing = c(ResumePoint::Step(5), true).unwrap_err().to_string();
        assert!(
            missing.contains("no committed checkpoint of step 5 at file:///ckpt")
                && missing.contains("[2, 4, 6]"),
            "{missing}"
        );
        let none = restore_candidates(ResumePoint::Step(1), &committed, true, url)
            .unwrap_err()
            .to_string();
        assert!(none.contains("at or before step 1"), "{none}");
        let empty = restore_candidates(ResumePoint::Latest, &[], true, url)
            .unwrap_err()
            .to_string();
        assert!(
            empty.contains("no committed checkpoint at file:///ckpt;"),
            "{empty}"
        );
    }

    #[test]
    fn a_replacement_uploads_the_lost_shard_of_the_previous_step_only() {
        assert_eq!(lost_shard(None, 7), LostShard::None);
        assert_eq!(lost_shard(Some(6), 7), LostShard::Upload(6));
        assert_eq!(lost_shard(Some(4), 7), LostShard::Abandon(4));
    }

    /// 3 replicas of 2 stages, replica 1 lost: the survivors of each stage (slots 0, 4 and 1, 5)
    /// regroup in replica order, and replica 1's adopter's workers take its share.
    #[test]
    fn after_a_lost_replica_every_survivor_regroups_and_the_adopter_adopts() {
        let (p, d, lost) = (2, 3, 1);
        let members = vec![
            vec![(0, "a0".to_string()), (4, "c0".to_string())],
            vec![(1, "a1".to_string()), (5, "c1".to_string())],
        ];
        let sent = reductions(9, 1, lost, d, p, 42, &members);
        let adopter = recovery::adopter(lost, d);
        assert_eq!(
            sent.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            [0, 4, 1, 5]
        );
        for (slot, msg) in &sent {
            let ToWorker::Reduce {
                step,
                round,
                adopt,
                regroup: Some(g),
            } = msg
            else {
                panic!("slot {slot}: {msg:?}");
            };
            assert_eq!((*step, *round, g.generation), (9, 1, 42));
            let stage = slot % p;
            assert_eq!(
                g.addrs,
                members[stage]
                    .iter()
                    .map(|(_, a)| a.clone())
                    .collect::<Vec<_>>()
            );
            assert_eq!(members[stage][g.member].0, *slot);
            let expected: Vec<usize> = if slot / p == adopter {
                vec![lost]
            } else {
                vec![]
            };
            assert_eq!(adopt, &expected, "slot {slot}");
        }
        assert!(
            sent.iter()
                .any(|(_, m)| matches!(m, ToWorker::Reduce { adopt, .. } if !adopt.is_empty()))
        );
    }

    #[test]
    fn a_resumed_run_keeps_the_metrics_lines_up_to_its_step() {
        let text = "{\"step\":1,\"loss\":2.0}\n{\"event\":\"plan\"}\n{\"step\":2}\nnot json\n{\"step\":3}\n";
        assert_eq!(
            kept_metrics(text, 2),
            "{\"step\":1,\"loss\":2.0}\n{\"event\":\"plan\"}\n{\"step\":2}\nnot json\n"
        );
        assert_eq!(kept_metrics(text, 0), "{\"event\":\"plan\"}\nnot json\n");
    }

    #[test]
    fn the_checkpointed_state_points_the_data_and_lr_at_the_next_step() {
        let cfg =
            Config::load(None, &["pipeline.stages=2".to_string()]).expect("the default config");
        let s = trainer_state(&cfg, 7, 1e-3, 2.5);
        assert_eq!((s.step, s.optimizer_step, s.data.next_step), (7, 7, 8));
        assert_eq!((s.lr.step, s.lr.last_lr, s.loss), (7, 1e-3, 2.5));
        assert_eq!(s.topology.stages, 2);
        assert_eq!(s.topology.layers.len(), cfg.pipeline.stages);
        assert_eq!(
            s.topology.layers.last().map(|l| l[1]),
            Some(cfg.model.layers),
            "the stages' layers cover the model"
        );
    }
}
