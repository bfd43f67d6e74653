//! The coordinator's plans: the first one (once enough nodes joined), a new one after lost nodes
//! (declaring dead exactly the incarnations lost), a change at a step boundary (leaves, joins),
//! and where each new plan's state comes from (the agents' peer snapshots or the newest
//! checkpoint). The plans are [`elastic::decide`]'s, the state's source
//! [`recovery::next_start`]'s, the rest [`super::decide`]'s; this is the shell that asks them,
//! waits for nodes and records the events.

use std::time::{Duration, Instant};

use elastic::{Decision, NodeId, NodeStatus};
use tracing::{info, warn};

use super::super::control::ToAgent;
use super::super::error::{LaunchError, Lost};
use super::super::events::{NodeJoined, NodeLeft, NodeLost, PlanAdopted, RunEvent};
use super::super::recovery::{self, Tier};
use super::super::store;
use super::super::trace::unix_time_s;
use super::decide::{self, Gathering, Member};
use super::{AtBoundary, Coordinator, Recovery, last_metrics_step};

impl Coordinator {
    /// Waits for the nodes of the first plan: every local agent, or (multi-host) `pipeline.stages`
    /// agents — fewer once `elastic.join_timeout_s` passes, as long as `elastic.min_nodes` joined.
    pub(super) fn first_plan(&mut self, wanted: usize) -> Result<(), LaunchError> {
        let deadline = Instant::now() + self.cfg.elastic.join_timeout();
        let mut announced = 0;
        loop {
            let alive = self.state.membership.alive().len();
            let past_deadline = Instant::now() >= deadline;
            match decide::gathering(alive, wanted, self.cfg.elastic.min_nodes, past_deadline) {
                Gathering::Ready => break,
                Gathering::Waiting => {}
                Gathering::TooFew => {
                    return Err(LaunchError::Run(format!(
                        "only {alive} node(s) joined the coordinator at {} within {} s (elastic.join_timeout_s), {} needed (elastic.min_nodes); start agents with `seqpipe agent --join {}`",
                        self.addr,
                        self.cfg.elastic.join_timeout_s,
                        self.cfg.elastic.min_nodes,
                        self.addr
                    )));
                }
            }
            if !self.cfg.elastic.local_agents && alive != announced {
                announced = alive;
                eprintln!(
                    "{alive} of {wanted} node(s) joined; waiting for more at {}",
                    self.addr
                );
            }
            self.check_local_agents()?;
            if let Some(incoming) = self.poll(Instant::now() + Duration::from_millis(50))? {
                self.unexpected(incoming);
            }
        }
        let now = Instant::now();
        let (decision, reason) = elastic::decide(now, &self.state, &self.cfg.elastic);
        let Some(plan) = decision.plan().cloned() else {
            return Err(LaunchError::Run(format!(
                "cannot plan the pipeline: {reason}"
            )));
        };
        self.state.apply(&decision, now);
        self.publish(&plan)?;
        self.layout = self
            .layout
            .with_layout(&self.cfg, plan.num_stages(), plan.replicas)?;
        info!(%reason, "first plan");
        if let Some(r) = &mut self.recovery {
            r.events.push(RunEvent::Plan(PlanAdopted::of(&plan)));
        }
        Ok(())
    }

    /// Nodes were lost during the step after the last one in `metrics.jsonl`: the elastic core plans the pipeline on the
    /// survivors (nodes whose agent survived join again at once), and the run resumes from the
    /// newest committed checkpoint, or fails with the core's reason.
    pub(in crate::runtime) fn recover(&mut self, lost: &[Lost]) -> Result<(), LaunchError> {
        let failed_at = Instant::now();
        let failed_step = last_metrics_step(&self.cfg.run.dir.join("metrics.jsonl")) + 1;
        let detected_at_unix_s = self.failure_seen_at.take().unwrap_or_else(unix_time_s);
        let lost_in_step = self.failure_step.take().unwrap_or(failed_step);
        let stages_before = self.plan().num_stages();
        let mut events = Vec::new();
        for l in lost {
            warn!(node = %l.node, failed_step = lost_in_step, reason = %l.reason, "node lost");
            eprintln!(
                "warning: lost node {} during step {lost_in_step}: {}",
                l.node, l.reason
            );
            events.push(RunEvent::NodeLost(NodeLost {
                node: l.node.clone(),
                failed_step: lost_in_step,
                reason: l.reason.clone(),
                detected_at_unix_s,
                agent_alive: l.agent_alive,
                stage: None,
                mid_step: None,
            }));
            let member = self.state.membership.get(&l.node).map(|m| Member {
                admitted: m.admitted,
                incarnation: m.incarnation,
            });
            let recorded = self.lost_incarnations.get(&l.node).copied();
            let lost_incarnation = decide::lost_incarnation(member, recorded);
            let fenced = self.state.membership.report_failure_of(
                &l.node,
                lost_incarnation,
                l.reason.clone(),
                failed_at,
            );
            if l.agent_alive
                && matches!(fenced, Ok(true))
                && let Some(info) = self.state.membership.get(&l.node).map(|m| m.info.clone())
            {
                // The node itself is fine: it comes back at once with fresh workers.
                let _ = self.state.membership.join(info, failed_at);
            }
        }
        self.lost_incarnations.clear();
        self.state.step = failed_step;
        self.state.at_step_boundary = false;
        let tier = self.replan(&mut events)?;
        self.recovery = Some(Recovery {
            failed_at,
            failed_step,
            stages_before,
            tier,
            events,
        });
        Ok(())
    }

    /// Step `step` is complete and its checkpoint scheduled: nodes leave or join here, if any want
    /// to. Returns what changes: the plan (the caller keeps the state of `step` — peer snapshots
    /// or a checkpoint — and restarts the pipeline under the new plan, ready now or after waiting
    /// for nodes), or the run stops because nodes with preemption notices leave and too few
    /// would remain (with their `node_left` events; the caller commits a checkpoint of `step`).
    pub(in crate::runtime) fn at_step_boundary(&mut self, step: u64) -> Option<AtBoundary> {
        let now = Instant::now();
        self.state.step = step + 1;
        self.state.at_step_boundary = true;
        let (decision, reason) = elastic::decide(now, &self.state, &self.cfg.elastic);
        // A node lost mid-step (its stage was replaced for the rest of the step) leaves the plan
        // here too — or, with too few nodes left, the run waits for joiners or stops.
        match decision {
            Decision::Continue => None,
            Decision::Stop { leaving } => {
                let left = leaving
                    .iter()
                    .map(|id| {
                        RunEvent::NodeLeft(NodeLeft {
                            node: id.clone(),
                            step,
                            reason: elastic::preemption::leave_reason(
                                self.notices.remove(id).as_ref(),
                            ),
                        })
                    })
                    .collect();
                Some(AtBoundary::Stop { reason, left })
            }
            decision => Some(AtBoundary::Change {
                reason,
                planned: decision.plan().is_some(),
            }),
        }
    }

    /// Adopts the plan that [`Coordinator::at_step_boundary`] announced, after the state of `step`
    /// was kept (peer snapshots or a committed checkpoint) — or, when notices that came since
    /// leave too few nodes, restarts on the nodes it had (see [`decide::restarts_on_same_nodes`]).
    pub(in crate::runtime) fn change_plan_at_boundary(
        &mut self,
        step: u64,
    ) -> Result<(), LaunchError> {
        let now = Instant::now();
        let stages_before = self.plan().num_stages();
        let before = self.plan().clone();
        let mut events: Vec<RunEvent> = Vec::new();
        for id in &before.nodes {
            if self.state.membership.status(id) == Some(&NodeStatus::Leaving) {
                events.push(RunEvent::NodeLeft(NodeLeft {
                    node: id.clone(),
                    step,
                    reason: elastic::preemption::leave_reason(self.notices.get(id)),
                }));
            }
        }
        for joiner in self.state.membership.pending_joiners() {
            events.push(RunEvent::NodeJoined(NodeJoined {
                node: joiner.id.clone(),
                step,
            }));
        }
        self.replan(&mut events)?;
        // Joiners the plan did not take stay spares, leaving nodes it kept stay: no event for them.
        let nodes = self.plan().nodes.clone();
        decide::as_adopted(&mut events, &nodes);
        for event in &events {
            if let RunEvent::NodeLeft(left) = event {
                self.notices.remove(&left.node);
            }
        }
        self.recovery = Some(Recovery {
            failed_at: now,
            failed_step: step + 1,
            stages_before,
            tier: Tier::Handover,
            events,
        });
        Ok(())
    }

    /// Asks the elastic core for the next plan (waiting while it says wait), adopts it, and points
    /// the next pipeline at the newest state: the agents' peer snapshots when they cover the model
    /// and are not older than the newest committed checkpoint, else that checkpoint. Adds the `plan`
    /// event and returns the tier (`peer` or `checkpoint`).
    pub(super) fn replan(&mut self, events: &mut Vec<RunEvent>) -> Result<Tier, LaunchError> {
        let mut waiting_reason = String::new();
        // When the elastic core first said wait (for the plan event's `waited_for_nodes_s`).
        let mut waiting_since: Option<Instant> = None;
        let plan = loop {
            let now = Instant::now();
            let (decision, reason) = match elastic::decide(now, &self.state, &self.cfg.elastic) {
                // A change no longer wanted, or notices that came too late for this boundary's
                // change (the run then stops at the next boundary): the nodes it had.
                (decision, reason) if decide::restarts_on_same_nodes(&decision) => {
                    let (restart, text) = elastic::restart_plan(&self.state).ok_or_else(|| {
                        LaunchError::Protocol(format!(
                            "the pipeline stopped for a plan change but there is no plan to restart: {reason}"
                        ))
                    })?;
                    match decision {
                        Decision::Stop { .. } => (restart, format!("{text}; {reason}")),
                        _ => (restart, text),
                    }
                }
                other => other,
            };
            self.state.apply(&decision, now);
            match decision {
                Decision::Recover { plan, .. }
                | Decision::Grow { plan, .. }
                | Decision::Shrink { plan, .. } => {
                    info!(%reason, "new plan");
                    break plan;
                }
                Decision::Wait { until, .. } => {
                    waiting_since.get_or_insert(now);
                    if reason != waiting_reason {
                        warn!(%reason, "waiting for nodes");
                        waiting_reason = reason;
                    }
                    let deadline = until.min(now + Duration::from_millis(200));
                    if let Some(incoming) = self.poll(deadline)? {
                        self.unexpected(incoming);
                    }
                }
                Decision::Fail { .. } => {
                    return Err(LaunchError::Run(format!(
                        "{reason} (run directory {})",
                        self.cfg.run.dir.display()
                    )));
                }
                Decision::Continue | Decision::Stop { .. } => {
                    return Err(LaunchError::Protocol(format!(
                        "the elastic core kept a plan it was asked to restart: {reason}"
                    )));
                }
            }
        };
        self.publish(&plan)?;
        self.lost_incarnations.clear();
        for stale in self.stale_agents() {
            let reason = format!("left the plan at generation {}", plan.generation);
            if let Some((_, sender)) = self.agents.remove(&stale) {
                sender.send_and_close(&ToAgent::Refused { reason });
            }
        }
        self.layout = self
            .layout
            .with_layout(&self.cfg, plan.num_stages(), plan.replicas)?;
        let latest = store::committed_steps(&self.cfg)?.last().copied();
        let peers = self
            .peer_coverage()
            .map(|(step, nodes)| (step, self.snapshot_addrs(&nodes)));
        let (start, tier, reason) = recovery::next_start(peers, latest, self.state.step);
        info!(%reason, %tier, "state source");
        let resume_from = decide::resume_from(&start, latest);
        self.start = start;
        events.push(RunEvent::Plan(PlanAdopted {
            generation: plan.generation,
            stages: plan.num_stages(),
            replicas: plan.replicas,
            nodes: plan.stages.clone(),
            resume_from,
            tier: Some(tier),
            waited_for_nodes_s: waiting_since.map(|t| t.elapsed().as_secs_f64()),
        }));
        Ok(tier)
    }

    /// The newest step before the one to run next (`state.step`) whose peer snapshots, on the
    /// agents still alive, cover the whole model (parameters and AdamW moments), with the agents
    /// that hold it.
    pub(super) fn peer_coverage(&self) -> Option<(u64, Vec<NodeId>)> {
        self.peer_coverage_before(self.state.step)
    }

    /// The newest step before `next` whose peer snapshots the live agents cover completely, with
    /// the agents that hold it.
    pub(super) fn peer_coverage_before(&self, next: u64) -> Option<(u64, Vec<NodeId>)> {
        if !self.cfg.elastic.peer_snapshots {
            return None;
        }
        let params = self.param_names();
        recovery::peer_coverage(
            &self.held,
            next,
            |step| crate::checkpointing::shard::with_moments(&params, step > 0),
            |n| self.agent_alive(n),
        )
    }

    /// The newest step up to `step` that tier-1 recovery could restart from now (the live
    /// agents hold its peer snapshots completely), for the step's metrics.
    pub(in crate::runtime) fn peer_snapshot_step(&self, step: u64) -> Option<u64> {
        self.peer_coverage_before(step.saturating_add(1))
            .map(|(step, _)| step)
    }

    /// Whether the peer snapshots of `step` cover the whole model on agents that stay past this
    /// step boundary (alive, and not leaving): the next plan can start from them, with no
    /// checkpoint.
    pub(in crate::runtime) fn peers_hold(&self, step: u64) -> bool {
        if !self.cfg.elastic.peer_snapshots {
            return false;
        }
        let names = crate::checkpointing::shard::with_moments(&self.param_names(), step > 0);
        let staying = |n: &NodeId| {
            self.agent_alive(n) && self.state.membership.status(n) != Some(&NodeStatus::Leaving)
        };
        recovery::peer_holders(&self.held, step, &names, staying).is_some()
    }

    /// The model's parameter names.
    pub(super) fn param_names(&self) -> Vec<String> {
        crate::model::params::param_specs(&self.cfg.model)
            .into_iter()
            .map(|s| s.name)
            .collect()
    }
}
