//! What a pipeline makes of failures: the error each report means (a worker's own failure with
//! its cause, a closed connection, an exit its agent saw, a lost node), gathering the reports of
//! one failure until they are all in, and asking [`recovery`] which stage or replica was lost, or
//! which nodes, once the workers are stopped.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tracing::warn;

use super::super::control::{FailureCause, ToLauncher};
use super::super::coordinator::Incoming;
use super::super::recovery::{self, Sign};
use super::{LaunchError, LossCause, Lost, Pipeline, decide};

impl Pipeline<'_> {
    /// Turns what the coordinator heard into the error it means (or ignores a stale worker).
    pub(super) fn fail_on(&mut self, incoming: Incoming) -> Result<(), LaunchError> {
        match incoming {
            Incoming::Worker(
                conn,
                ToLauncher::Failed {
                    stage,
                    error,
                    suspect,
                    cause,
                },
            ) if self.stage_of(conn).is_some() => {
                match cause {
                    FailureCause::OverBudget => {
                        return Err(LaunchError::OverBudget { stage, error });
                    }
                    FailureCause::Permanent => {
                        self.permanent.get_or_insert((stage, error.clone()));
                        return Err(LaunchError::Permanent { stage, error });
                    }
                    FailureCause::Transient => {}
                }
                self.suspects.extend(suspect);
                Err(LaunchError::WorkerFailed {
                    stage,
                    error,
                    log: self.log_of(stage),
                })
            }
            Incoming::WorkerClosed(conn, reason) => match self.stage_of(conn) {
                Some(stage) => Err(LaunchError::WorkerDisconnected {
                    stage,
                    reason,
                    log: self.log_of(stage),
                }),
                None => Ok(()),
            },
            Incoming::WorkerExited { stage, .. } if self.retired.contains(&stage) => Ok(()),
            Incoming::WorkerExited {
                stage,
                status,
                log,
                log_tail,
                ..
            } => {
                // The worker's own report of why it stops travels on its control connection, the
                // agent's report of its exit on another: what it said decides, whichever came first.
                self.last_words(stage)?;
                Err(LaunchError::WorkerExited {
                    stage,
                    status,
                    log,
                    tail: log_tail,
                })
            }
            Incoming::NodeLost(node, reason, cause) => {
                let lost = Lost {
                    node,
                    reason: reason.clone(),
                    cause,
                    agent_alive: false,
                };
                self.lost.push(lost.clone());
                Err(LaunchError::NodesLost {
                    lost: vec![lost],
                    cause: reason,
                })
            }
            Incoming::CannotStart {
                node,
                stages,
                error,
            } => Err(LaunchError::NodeTooSmall {
                node,
                stages,
                error,
            }),
            Incoming::Hello(conn, msg) | Incoming::Worker(conn, msg) => {
                warn!(
                    conn,
                    ?msg,
                    "ignored a message from a worker of another pipeline"
                );
                Ok(())
            }
        }
    }

    /// Reads what the exited worker of `stage` still sent before its control connection closed
    /// (at most a second): a failure it reported is the error, with its cause (permanent or not);
    /// other messages and events are kept, in order, for later.
    pub(super) fn last_words(&mut self, stage: usize) -> Result<(), LaunchError> {
        let Some(&conn) = self.conns.get(stage) else {
            return Ok(());
        };
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.coordinator.worker_connected(conn) {
            let Some(incoming) = self.coordinator.poll(deadline)? else {
                break;
            };
            match incoming {
                Incoming::Worker(c, msg @ ToLauncher::Failed { .. }) if c == conn => {
                    return self.fail_on(Incoming::Worker(c, msg));
                }
                Incoming::WorkerClosed(c, _) if c == conn => break,
                other => self.deferred.push_back(other),
            }
        }
        Ok(())
    }

    /// Mid-step recovery, step 1: after `failure` in step `step`, gathers every sign of what was
    /// lost (see [`Pipeline::later_failures`]), and asks [`recovery::mid_step_stage`] for the one
    /// stage to replace; `Err` says why mid-step recovery cannot help.
    pub fn lost_stage(
        &mut self,
        failure: &LaunchError,
        finished: &BTreeSet<usize>,
    ) -> Result<(usize, Lost), String> {
        let mut signs = self.signs(failure);
        for e in self.later_failures(failure)? {
            signs.extend(self.signs(&e));
        }
        if let Some((stage, _)) = &self.permanent {
            return Err(format!(
                "stage {stage} failed with an error that would recur on any node"
            ));
        }
        recovery::mid_step_stage(&signs, finished)
    }

    /// The failure a worker reported as permanent while this pipeline ran (see
    /// [`recovery::after_reports`]), if any.
    pub fn permanent_failure(&self) -> Option<LaunchError> {
        self.permanent
            .as_ref()
            .map(|(stage, error)| LaunchError::Permanent {
                stage: *stage,
                error: error.clone(),
            })
    }

    /// Data parallelism, after `failure` during a step's forward and backward: gathers every
    /// report (see [`Pipeline::later_failures`]) and asks [`recovery::lost_replica`] for the one
    /// replica to take out of the step; `Err` says why the step cannot go on.
    pub fn lost_replica(&mut self, failure: &LaunchError) -> Result<usize, String> {
        let later = self.later_failures(failure)?;
        if let Some((stage, _)) = &self.permanent {
            return Err(format!(
                "stage {stage} failed with an error that would recur on any node"
            ));
        }
        let plan = self.coordinator.plan();
        let failed: Vec<_> = std::iter::once(failure)
            .chain(&later)
            .map(|e| recovery::failed_slots(e, |node| plan.slots_of(node)))
            .collect();
        recovery::lost_replica(&failed, self.stages(), self.replicas)
    }

    /// The failures reported after `first`, until they are all in ([`Pipeline::gathered`]: a
    /// few tens of milliseconds after a SIGKILL, once every stage shown lost is known dead); the
    /// workers' other replies are kept for later. `Err` when the coordinator itself failed.
    pub(super) fn later_failures(
        &mut self,
        first: &LaunchError,
    ) -> Result<Vec<LaunchError>, String> {
        let mut failures = Vec::new();
        let mut signs = self.signs(first);
        let mut quiet_since = Instant::now();
        while !self.gathered(&signs, quiet_since.elapsed()) {
            match self.poll(Instant::now() + Duration::from_millis(5)) {
                Ok(Some(incoming)) => {
                    quiet_since = Instant::now();
                    match incoming {
                        Incoming::Worker(conn, msg)
                            if self.stage_of(conn).is_some()
                                && !matches!(msg, ToLauncher::Failed { .. }) =>
                        {
                            self.keep(conn, msg)
                        }
                        other => {
                            if let Err(e) = self.fail_on(other) {
                                signs.extend(self.signs(&e));
                                failures.push(e);
                            }
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(format!("the coordinator failed: {e}")),
            }
        }
        Ok(failures)
    }

    /// Whether the reports of a failure are all in, `quiet` after the last one: [`decide::SETTLED_QUIET`]
    /// once they settle what was lost ([`recovery::signs_settled`]; a few more milliseconds let
    /// the signs of losses at the same moment, such as a node and its buddy, arrive too), else
    /// [`decide::GATHER_QUIET`].
    pub(super) fn gathered(&self, signs: &[Sign], quiet: Duration) -> bool {
        decide::gathered(quiet, recovery::signs_settled(signs, &self.open_stages()))
    }

    /// The signs of what this pipeline already knows is gone: nodes declared lost (only their
    /// stages whose worker is not connected: a stage replaced mid-step is not lost), and workers
    /// whose exit their agent reported.
    pub(super) fn known_losses(&self) -> Vec<Sign> {
        let open = self.open_stages();
        let plan = self.coordinator.plan();
        let mut signs: Vec<Sign> = self
            .lost
            .iter()
            .map(|l| Sign::Lost {
                stages: plan
                    .stages_of(&l.node)
                    .into_iter()
                    .filter(|s| !open.contains(s))
                    .collect(),
                lost: l.clone(),
            })
            .collect();
        for &stage in self.coordinator.exits.keys() {
            if !self.retired.contains(&stage) && !open.contains(&stage) {
                let node = self.coordinator.node_of(stage);
                signs.push(Sign::Lost {
                    stages: vec![stage],
                    lost: Lost {
                        agent_alive: self.coordinator.agent_alive(&node),
                        node,
                        reason: format!("the worker of stage {stage} exited"),
                        cause: LossCause::WorkerExited,
                    },
                });
            }
        }
        signs
    }

    /// The stages (slots) whose worker's control connection is open.
    pub(super) fn open_stages(&self) -> BTreeSet<usize> {
        (0..self.conns.len())
            .filter(|&w| self.coordinator.worker_connected(self.conns[w]))
            .collect()
    }

    /// What `error` says about which stages are gone.
    pub(super) fn signs(&self, error: &LaunchError) -> Vec<Sign> {
        let coordinator = &*self.coordinator;
        Sign::of(
            error,
            |node| coordinator.plan().stages_of(node),
            |stage, cause| {
                let node = coordinator.node_of(stage);
                Lost {
                    agent_alive: coordinator.agent_alive(&node),
                    node,
                    reason: error.to_string(),
                    cause,
                }
            },
        )
    }

    /// After `failure`: waits up to `grace` for the workers' exits to be reported (until they are
    /// all in, see [`Pipeline::gathered`]), then has the agents stop the rest. Returns the nodes lost: those whose
    /// agent is gone, and those whose worker died by itself (killed, or failed) — as opposed to
    /// workers that stopped only because a neighbour failed (exit code
    /// [`PEER_FAILURE_EXIT_CODE`]), whose nodes are healthy. When nothing died, the stages a
    /// neighbour found silent are the lost ones (hung or cut off).
    pub fn stop_after_failure(&mut self, failure: &LaunchError, grace: Duration) -> Vec<Lost> {
        let deadline = Instant::now() + grace;
        let mut signs = self.signs(failure);
        signs.extend(self.known_losses());
        let mut quiet_since = Instant::now();
        while Instant::now() < deadline && !self.gathered(&signs, quiet_since.elapsed()) {
            match self.poll(Instant::now() + Duration::from_millis(5)) {
                Ok(Some(incoming)) => {
                    quiet_since = Instant::now();
                    if let Err(e) = self.fail_on(incoming) {
                        signs.extend(self.signs(&e));
                    }
                }
                Ok(None) => {}
                Err(_) => break,
            }
        }
        self.coordinator.stop_workers(Duration::from_secs(5));
        let reported = std::mem::take(&mut self.lost);
        self.coordinator.losses(
            &failure.to_string(),
            &reported,
            &self.suspects,
            &self.replaced,
        )
    }
}
