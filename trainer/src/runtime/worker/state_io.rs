//! The stage's state in and out of the process: checkpoint shard uploads (on a background thread),
//! peer-snapshot copies after updates, restores from a checkpoint, from peer snapshots or
//! from a Hugging Face directory, and gradient dumps for tests.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use checkpoint::{CheckpointError, CheckpointStore};
use tracing::info;

use super::{Worker, WorkerError, io_error};
use crate::checkpointing::hf;
use crate::checkpointing::shard::{from_tensor_data, to_tensor_data, with_moments};
use crate::checkpointing::state::TrainerState;
use crate::config::Config;
use crate::model::StateSnapshot;
use crate::runtime::control::{ControlSender, ToLauncher};
use crate::runtime::peer_snapshots;

/// A snapshot waiting for the uploader.
struct UploadJob {
    step: u64,
    snapshot: StateSnapshot,
    snapshot_s: f64,
}

/// The newest state snapshot a worker took (a peer copy and a checkpoint of one step share it).
pub(super) struct TakenSnapshot {
    /// The step the state follows.
    step: u64,
    state: StateSnapshot,
    /// How long taking it held up the worker.
    seconds: f64,
}

/// The worker's checkpoint store and its background uploader.
pub(super) struct Checkpoints {
    store: CheckpointStore,
    /// One runtime for all of the worker's store I/O (restores on the main thread, uploads on the
    /// uploader thread): pooled HTTP connections belong to the runtime that opened them, and a
    /// multi-threaded runtime keeps driving them between calls.
    runtime: Arc<tokio::runtime::Runtime>,
    uploads: std::sync::mpsc::Sender<UploadJob>,
}

impl Checkpoints {
    /// Opens the store and starts the uploader thread, which reports each shard to the launcher.
    pub(super) fn start(
        cfg: &Config,
        stage: usize,
        control: ControlSender,
    ) -> Result<Self, WorkerError> {
        let store = CheckpointStore::open(
            &cfg.checkpoint.resolved_url(&cfg.run.dir),
            &cfg.checkpoint.store_options(),
        )?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("checkpoint-io")
            .enable_all()
            .build()
            .map_err(io_error("starting the checkpoint I/O runtime".into()))?;
        let runtime = Arc::new(runtime);
        let (uploads, jobs) = std::sync::mpsc::channel::<UploadJob>();
        let uploader = Uploader {
            store: store.clone(),
            runtime: Arc::clone(&runtime),
            shard_name: format!("stage-{stage}-of-{}", cfg.pipeline.stages),
            stage,
        };
        std::thread::Builder::new()
            .name("checkpoint-upload".into())
            .spawn(move || {
                for job in jobs {
                    if control.send(&uploader.upload(job)).is_err() {
                        break;
                    }
                }
            })
            .map_err(io_error("starting the checkpoint uploader".into()))?;
        Ok(Self {
            store,
            runtime,
            uploads,
        })
    }
}

/// The uploader thread's end: writes one stage's shards.
struct Uploader {
    store: CheckpointStore,
    runtime: Arc<tokio::runtime::Runtime>,
    shard_name: String,
    stage: usize,
}

impl Uploader {
    /// Writes the shard of `job` and returns the report for the launcher.
    fn upload(&self, job: UploadJob) -> ToLauncher {
        let UploadJob {
            step,
            snapshot,
            snapshot_s,
        } = job;
        let stage = self.stage;
        let started = Instant::now();
        let tensors = match snapshot.tensors() {
            Ok(tensors) => tensors,
            Err(e) => {
                return ToLauncher::ShardFailed {
                    stage,
                    step,
                    error: e.to_string(),
                };
            }
        };
        let copy_s = started.elapsed().as_secs_f64();
        let result = tensors
            .iter()
            .map(|(n, t)| Ok((n.clone(), to_tensor_data(t)?)))
            .collect::<Result<Vec<_>, candle_core::Error>>()
            .map_err(|e| e.to_string())
            .and_then(|data| {
                self.runtime
                    .block_on(self.store.write_shard(step, &self.shard_name, data))
                    .map_err(|e| e.to_string())
            });
        match result {
            Ok(shard) => {
                info!(
                    step,
                    bytes = shard.size,
                    copy_wait_s = copy_s,
                    seconds = started.elapsed().as_secs_f64(),
                    "checkpoint shard uploaded"
                );
                ToLauncher::ShardWritten {
                    stage,
                    step,
                    shard,
                    snapshot_s,
                }
            }
            Err(error) => ToLauncher::ShardFailed { stage, step, error },
        }
    }
}

impl Worker {
    /// The state after `step` (taken now, or the snapshot a peer copy of `step` already took)
    /// and the seconds taking it held up the worker. On a GPU the copy runs behind the next
    /// step's compute: taking it only queues the copy.
    fn snapshot(&mut self, step: u64) -> Result<(StateSnapshot, f64), WorkerError> {
        if let Some(taken) = &self.snapshot
            && taken.step == step
        {
            return Ok((taken.state.clone(), taken.seconds));
        }
        let started = Instant::now();
        let state = self.stage.snapshot()?;
        let seconds = started.elapsed().as_secs_f64();
        self.snapshot = Some(TakenSnapshot {
            step,
            state: state.clone(),
            seconds,
        });
        Ok((state, seconds))
    }

    /// Replaces the stage's state (`StageCompute::load_state`), forgetting the last snapshot.
    fn load_state(
        &mut self,
        tensors: Vec<(String, Tensor)>,
        optimizer_step: u64,
    ) -> Result<(), WorkerError> {
        self.snapshot = None;
        Ok(self.stage.load_state(tensors, optimizer_step)?)
    }

    /// Snapshots the state after `step` and hands it to the uploader (the step's only stall).
    pub(super) fn queue_checkpoint(&mut self, step: u64) -> Result<(), WorkerError> {
        let (snapshot, snapshot_s) = self.snapshot(step)?;
        let checkpoints = self
            .checkpoints
            .as_ref()
            .ok_or_else(|| WorkerError::Protocol("no checkpoint store".into()))?;
        checkpoints
            .uploads
            .send(UploadJob {
                step,
                snapshot,
                snapshot_s,
            })
            .map_err(|_| WorkerError::Protocol("the checkpoint uploader stopped".into()))
    }

    /// Copies the state after `step` to the agents' memory behind the training (when peer
    /// snapshots are on). The launcher asks for it when this worker reported no copy in flight,
    /// or when too many steps in a row went uncopied: then the copy in flight is waited for (at
    /// most the pipeline timeout; a copy still in flight after it skips this one).
    pub(super) fn copy_to_peers(&mut self, step: u64) -> Result<(), WorkerError> {
        let Some(copier) = &self.peer_copier else {
            return Ok(());
        };
        if !copier.wait_idle(self.cfg.pipeline.timeout()) {
            copier.skip(step);
            return Ok(());
        }
        let (snapshot, _) = self.snapshot(step)?;
        if let Some(copier) = &self.peer_copier {
            copier.copy(step, snapshot);
        }
        Ok(())
    }

    /// Loads this stage's tensors (by name, whatever the partition that wrote them) from the
    /// committed checkpoint of `step`.
    pub(super) fn restore_checkpoint(&mut self, step: u64) -> Result<(), WorkerError> {
        let ckpt = self
            .checkpoints
            .as_ref()
            .ok_or_else(|| WorkerError::Protocol("no checkpoint store".into()))?;
        let manifest = ckpt.runtime.block_on(ckpt.store.read_manifest(step))?;
        // A manifest whose trainer state does not parse is as damaged as one that does not.
        let state: TrainerState = serde_json::from_value(manifest.state.clone()).map_err(|e| {
            CheckpointError::InvalidManifest {
                url: ckpt.store.url().to_string(),
                step,
                detail: format!(
                    "its trainer state is unreadable ({e}); resume from another committed step"
                ),
            }
        })?;
        let names = with_moments(&self.stage.param_names(), state.optimizer_step > 0);
        // The check `seqpipe ckpt verify` makes, for the tensors this stage loads: before any
        // shard is read, every one is there with the model's shape and a loadable dtype.
        let mine: std::collections::HashSet<String> =
            self.stage.param_names().into_iter().collect();
        let specs: Vec<_> = crate::model::params::param_specs(&self.cfg.model)
            .into_iter()
            .filter(|s| mine.contains(&s.name))
            .collect();
        let expected = crate::model::params::state_tensors(&specs, state.optimizer_step > 0);
        let found = manifest
            .shards
            .iter()
            .flat_map(|shard| &shard.tensors)
            .map(|t| (t.name.as_str(), t.dtype.as_str(), t.shape.as_slice()));
        if let Some(problem) = crate::model::params::check_state(&expected, found, false)
            .into_iter()
            .next()
        {
            return Err(crate::model::ModelError::from(problem).into());
        }
        let tensors = ckpt
            .runtime
            .block_on(ckpt.store.read_tensors(&manifest, &names))?;
        let tensors = tensors
            .iter()
            .map(|(n, d)| Ok((n.clone(), from_tensor_data(d)?)))
            .collect::<Result<Vec<_>, candle_core::Error>>()?;
        self.load_state(tensors, state.optimizer_step)?;
        info!(step, tensors = names.len(), "restored from checkpoint");
        Ok(())
    }

    /// Loads this stage's tensors of the state after `step` from the agents' peer snapshots.
    pub(super) fn restore_from_peers(
        &mut self,
        step: u64,
        sources: &[String],
    ) -> Result<(), WorkerError> {
        let names = with_moments(&self.stage.param_names(), step > 0);
        // Each tensor with the model's shape: what an agent may send back, and no more.
        let mine: std::collections::HashSet<String> =
            self.stage.param_names().into_iter().collect();
        let specs: Vec<_> = crate::model::params::param_specs(&self.cfg.model)
            .into_iter()
            .filter(|s| mine.contains(&s.name))
            .collect();
        let wanted = crate::model::params::state_tensors(&specs, step > 0);
        let timeout = self.cfg.pipeline.timeout();
        let tensors = peer_snapshots::fetch(sources, step, &wanted, &self.token, timeout)
            .map_err(WorkerError::Protocol)?;
        let tensors = tensors
            .iter()
            .map(|(n, d)| Ok((n.clone(), from_tensor_data(d)?)))
            .collect::<Result<Vec<_>, candle_core::Error>>()?;
        self.load_state(tensors, step)?;
        info!(step, tensors = names.len(), "restored from peer snapshots");
        // Under this plan the copies sit on other agents than the ones just read: copy the state
        // there at once, so that a loss in the next step finds its step-start state even when
        // it takes out an agent that served this restore.
        self.copy_to_peers(step)
    }

    /// Loads initial parameters from a Hugging Face GPT-2 directory (fresh optimizer).
    pub(super) fn init_from(&mut self, dir: &Path) -> Result<(), WorkerError> {
        let names = with_moments(&self.stage.param_names(), false);
        let tensors = hf::import(&self.cfg.model, dir, &names)?;
        self.load_state(tensors, 0)?;
        info!(dir = %dir.display(), "initialized from a Hugging Face directory");
        Ok(())
    }

    /// Writes the step's accumulated gradients to `dir` (before the update; tests compare them).
    pub(super) fn dump_gradients(&self, dir: &Path, step: u64) -> Result<(), WorkerError> {
        let io = io_error(format!("writing gradients to {}", dir.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        let grads: HashMap<String, Tensor> = self.stage.gradients()?.into_iter().collect();
        candle_core::safetensors::save(
            &grads,
            dir.join(format!("step-{step}-stage-{}.safetensors", self.index())),
        )?;
        Ok(())
    }
}
