//! Mid-step recovery, step 2: a replacement for a lost stage is started on a live node (its own
//! or a neighbour's, [`decide::replacement_hosts`]), linked to the lost stage's neighbours
//! ([`decide::relinks`]), given its step-start state, and set to run the step.

use std::time::Instant;

use elastic::Generation;
use tracing::info;

use super::super::control::{ToLauncher, ToWorker};
use super::super::coordinator::Incoming;
use super::{LaunchError, Lost, Pipeline, Replacement, decide};

impl Pipeline<'_> {
    /// Mid-step recovery, step 2: starts a replacement for `stage` (on its own node if the agent
    /// lives, else on a neighbour's node), loads its step-start state with `restore` (none: the
    /// initial weights), rebuilds its links to the neighbours — which tell it what they already
    /// have and send again what they sent it — and has it run step `step`, replaying only its own
    /// completed units. With `checkpoint`, the replacement first uploads its shard of that
    /// checkpoint in flight (the state it restored), which the lost worker could not finish.
    /// With `trace`, it reports when each unit ran.
    pub fn replace_stage(
        &mut self,
        stage: usize,
        lost: Lost,
        step: u64,
        restore: Option<ToWorker>,
        checkpoint: Option<u64>,
        trace: bool,
    ) -> Result<Replacement, LaunchError> {
        let host = decide::replacement_hosts(stage, self.conns.len())
            .into_iter()
            .map(|s| self.coordinator.node_of(s))
            .find(|n| self.coordinator.agent_alive(n))
            .ok_or_else(|| LaunchError::Run("no live node to host a replacement".into()))?;
        info!(stage, step, %host, "replacing a lost stage mid-step");
        self.replaced.insert(stage, lost.clone());
        let (config, dump) = (self.worker_config.clone(), self.dump_grads.clone());
        self.coordinator
            .start_replacement(&host, stage, &config, dump.as_deref())?;
        let generation = self.coordinator.plan().generation;
        let deadline = Instant::now() + self.timeout;
        let conn = loop {
            match self.next_incoming(deadline, "the replacement to say hello")? {
                Incoming::Hello(
                    conn,
                    ToLauncher::Hello {
                        stage: s,
                        generation: g,
                        data_addr,
                        ..
                    },
                ) if s == stage && Generation::admits(generation, g) => {
                    self.data_addrs[stage] = data_addr;
                    break conn;
                }
                Incoming::Worker(conn, msg)
                    if self.stage_of(conn).is_some()
                        && !matches!(msg, ToLauncher::Failed { .. }) =>
                {
                    self.keep(conn, msg)
                }
                other => self.fail_on(other)?,
            }
        };
        self.conns[stage] = conn;
        let link_generation = self.next_link_generation();
        let (neighbours, topology) =
            decide::relinks(stage, link_generation, &self.data_addrs, self.ring);
        for (neighbour, relink) in neighbours {
            self.send(neighbour, &relink)?;
        }
        self.send(stage, &topology)?;
        self.await_reply_of(stage, "the replacement to connect", |m| {
            matches!(m, ToLauncher::Ready { .. })
        })?;
        if let Some(restore) = restore {
            self.send(stage, &restore)?;
            let reply = self.await_reply_of(stage, "the replacement to load its state", |m| {
                matches!(
                    m,
                    ToLauncher::Restored { .. } | ToLauncher::RestoreFailed { .. }
                )
            })?;
            if let ToLauncher::RestoreFailed { error, .. } = reply {
                return Err(LaunchError::Run(format!(
                    "the replacement of stage {stage} cannot load its step-start state: {error}"
                )));
            }
        }
        if let Some(c) = checkpoint {
            self.send(stage, &ToWorker::Checkpoint { step: c })?;
        }
        self.send(stage, &ToWorker::RunStep { step, trace })?;
        self.hosts.insert(stage, host.clone());
        Ok(Replacement { stage, lost, host })
    }
}
