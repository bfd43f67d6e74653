//! Running a job: the coordinator, then one pipeline after another as nodes come and go. Each
//! pipeline's training loop is a [`Driver`]; when it ends in an error, [`recovery::after_error`]
//! says what the error means and this module carries it out (recover from the losses, hand over
//! to a new plan, or stop). Also evaluation-only runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use tracing::warn;

use super::checkpoint_writer::CheckpointWriter;
use super::coordinator::Coordinator;
use super::driver::Driver;
pub use super::driver::RunSummary;
use super::error::LaunchError;
use super::live_metrics::LiveMetrics;
use super::metrics_endpoint::MetricsEndpoint;
use super::pipeline::{GATHER_QUIET, Pipeline};
use super::recovery::{self, AfterError, Start};
use super::trace::TraceLog;
use crate::config::Config;
use crate::plan::RunPlan;

/// Extra launcher behaviour, from the command line.
#[derive(Clone, Debug, Default)]
pub struct LaunchOptions {
    /// Workers write each step's gradients here (safetensors, one file per stage and step).
    pub dump_grads: Option<PathBuf>,
    /// Hide the progress bar.
    pub quiet: bool,
    /// Where the state comes from.
    pub start: Start,
    /// Write a Chrome trace of every step's units here (see [`super::trace`]).
    pub trace: Option<PathBuf>,
    /// The coordinator sends the address it listens on here once bound: how a program that set
    /// `elastic.listen` to port 0 (free, chosen by the system) learns where its agents connect.
    pub listening: Option<Sender<String>>,
}

/// Trains `cfg` with `plan`, the layout decided from it ([`RunPlan::decide`]: its dataset already
/// checked): an embedded coordinator places the pipeline on the nodes that join it (by default one
/// local agent per worker, each standing for a node). When nodes die, leave or join, the run goes
/// on under a new plan (see [`Coordinator::recover`]) until `elastic.min_nodes` or
/// `elastic.max_restarts` says stop.
pub fn run_training(
    cfg: &Config,
    plan: &RunPlan,
    opts: &LaunchOptions,
) -> Result<RunSummary, LaunchError> {
    let mut trace = opts
        .trace
        .clone()
        .map(|path| TraceLog::new(path, format!("seqpipe {}", cfg.run.dir.display())));
    let (live, endpoint) = serve_metrics(cfg)?;
    let result = train_pipelines(cfg, plan, opts, &mut trace, live);
    if let Some(endpoint) = endpoint {
        linger(endpoint, cfg.elastic.metrics_linger());
    }
    if let Some(trace) = trace {
        let written = trace.write().map_err(|source| LaunchError::Io {
            what: format!("writing the trace {}", trace.path().display()),
            source,
        });
        match (&result, written) {
            (Ok(_), Err(e)) => return Err(e),
            (Err(_), Err(e)) => warn!(error = %e, "the trace of the failed run is lost"),
            (_, Ok(())) => {}
        }
    }
    result
}

/// The pipelines of [`run_training`], one after another as nodes come and go; `trace` collects
/// their steps, `live` their metrics.
fn train_pipelines(
    cfg: &Config,
    plan: &RunPlan,
    opts: &LaunchOptions,
    trace: &mut Option<TraceLog>,
    live: Option<Arc<LiveMetrics>>,
) -> Result<RunSummary, LaunchError> {
    let started = Instant::now();
    let mut coordinator = Coordinator::start(
        cfg.clone(),
        plan.clone(),
        opts.start.clone(),
        "",
        opts.listening.as_ref(),
    )?;
    // Nobody writes this run's store yet: whatever staging objects it holds are of uploads
    // killed earlier. Not after taking over from a lost coordinator, whose workers' uploads may
    // still be running.
    if coordinator.recovery.is_none() && !cfg.checkpoint.read_only {
        CheckpointWriter::open(&coordinator.cfg)?.clean_interrupted_uploads();
    }
    loop {
        // The config the pipeline of the adopted plan reads; the run's own is never changed.
        let cfg = coordinator.layout.pipeline_config(&coordinator.cfg);
        let start = coordinator.start.clone();
        let recovery = coordinator.recovery.take();
        let result = with_pipeline(
            &mut coordinator,
            &cfg,
            opts.dump_grads.as_deref(),
            |driver| {
                driver.recovery = recovery;
                driver.live = live.clone();
                driver.trace = trace.take();
                let result = driver.run(&start, opts.quiet);
                *trace = driver.trace.take();
                result
            },
        );
        match result {
            Ok(mut summary) => {
                coordinator.shutdown();
                summary.elapsed_s = started.elapsed().as_secs_f64();
                return Ok(summary);
            }
            Err(e) => match (recovery::after_error(&e), e) {
                (AfterError::Recover, LaunchError::NodesLost { lost, .. }) => {
                    coordinator.recover(&lost)?
                }
                (AfterError::ChangePlan { step }, _) => {
                    coordinator.change_plan_at_boundary(step)?
                }
                (_, e) => return Err(e),
            },
        }
    }
}

/// With `elastic.metrics_listen`: the run's live metrics and the endpoint serving them (it stops
/// when dropped).
fn serve_metrics(
    cfg: &Config,
) -> Result<(Option<Arc<LiveMetrics>>, Option<MetricsEndpoint>), LaunchError> {
    let listen = &cfg.elastic.metrics_listen;
    if listen.is_empty() {
        return Ok((None, None));
    }
    let live = Arc::new(LiveMetrics::new());
    let endpoint =
        MetricsEndpoint::start(listen, live.clone()).map_err(|source| LaunchError::Io {
            what: format!(
                "serving Prometheus metrics on {listen} (elastic.metrics_listen; pick a free port, or \"\" for none)"
            ),
            source,
        })?;
    eprintln!(
        "metrics: http://{}/metrics (Prometheus)",
        endpoint.local_addr()
    );
    Ok((Some(live), Some(endpoint)))
}

/// Keeps serving the final metrics for `elastic.metrics_linger_s` after the run ended (a scraper
/// that comes every few seconds still sees the last step, checkpoint and recoveries); a SIGINT or
/// SIGTERM ends the wait.
fn linger(endpoint: MetricsEndpoint, linger: Duration) {
    if linger.is_zero() {
        return;
    }
    let signal = match stop_signal() {
        Ok(signal) => signal,
        Err(error) => {
            warn!(%error, "cannot watch for signals: not serving the final metrics");
            return;
        }
    };
    eprintln!(
        "metrics: serving the final metrics on http://{}/metrics for {:.0} s (elastic.metrics_linger_s; SIGTERM ends it)",
        endpoint.local_addr(),
        linger.as_secs_f64()
    );
    let until = Instant::now() + linger;
    while Instant::now() < until && signal.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(endpoint);
}

/// The validation loss of the model that `start` loads; returns (checkpoint step or 0, loss).
/// Its workers' config and logs go to `<run.dir>/eval/`.
pub fn run_evaluation(cfg: &Config, start: &Start) -> Result<(u64, f64), LaunchError> {
    let plan = RunPlan::decide(cfg)?;
    let mut coordinator = Coordinator::start(cfg.clone(), plan, start.clone(), "eval", None)?;
    let cfg = coordinator.layout.pipeline_config(&coordinator.cfg);
    let result = with_pipeline(&mut coordinator, &cfg, None, |driver| {
        let step = driver.load(start)?;
        Ok((step, driver.evaluate()?))
    });
    coordinator.shutdown();
    result
}

/// Starts the pipeline of the coordinator's plan (`cfg`: the config its workers read), runs `body`,
/// and stops the workers. A failure that cost nodes becomes [`LaunchError::NodesLost`] naming
/// them. The dataset was checked once, when the run was planned.
fn with_pipeline<T>(
    coordinator: &mut Coordinator,
    cfg: &Config,
    dump_grads: Option<&Path>,
    body: impl FnOnce(&mut Driver) -> Result<T, LaunchError>,
) -> Result<T, LaunchError> {
    let io = |what: String| {
        move |source| LaunchError::Io {
            what: what.clone(),
            source,
        }
    };
    let session_dir = coordinator.session_dir();
    std::fs::create_dir_all(&session_dir).map_err(io(format!(
        "creating the run directory {}",
        session_dir.display()
    )))?;
    let config_path = session_dir.join("config.resolved.toml");
    std::fs::write(&config_path, cfg.to_toml())
        .map_err(io(format!("writing {}", config_path.display())))?;
    // Fail early, in the launcher, on an unusable checkpoint location.
    let checkpoints = CheckpointWriter::open(cfg)?;
    let signal = stop_signal().map_err(io("installing signal handlers".into()))?;
    let mut pipeline = match Pipeline::start(coordinator, cfg, dump_grads) {
        Ok(pipeline) => pipeline,
        Err(e) => {
            // A node that fails while the pipeline starts is lost like one that fails later.
            let recover = recovery::after_error(&e) == AfterError::Recover;
            let reported = if recover {
                coordinator.gather_failure_reports(GATHER_QUIET, Duration::from_secs(2))
            } else {
                Vec::new()
            };
            coordinator.stop_workers(Duration::from_secs(5));
            let lost = if recover {
                coordinator.losses(
                    &e.to_string(),
                    &reported,
                    &Default::default(),
                    &Default::default(),
                )
            } else {
                Vec::new()
            };
            return Err(if lost.is_empty() {
                e
            } else {
                LaunchError::NodesLost {
                    cause: e.to_string(),
                    lost,
                }
            });
        }
    };
    let result = body(&mut Driver::new(cfg, &mut pipeline, checkpoints, signal));
    match result {
        Ok(value) => {
            pipeline.shutdown();
            Ok(value)
        }
        Err(e) if recovery::after_error(&e) == AfterError::Recover => {
            pipeline.coordinator().failure_seen();
            let cause = e.to_string();
            let lost = pipeline.stop_after_failure(&e, Duration::from_secs(2));
            Err(recovery::after_reports(
                e,
                cause,
                pipeline.permanent_failure(),
                lost,
            ))
        }
        Err(e) => {
            pipeline.shutdown();
            Err(e)
        }
    }
}

/// The SIGINT/SIGTERM flag (the signal number, 0 while none came), installed once per process.
fn stop_signal() -> std::io::Result<Arc<AtomicUsize>> {
    static SIGNAL: std::sync::OnceLock<Arc<AtomicUsize>> = std::sync::OnceLock::new();
    if let Some(flag) = SIGNAL.get() {
        return Ok(Arc::clone(flag));
    }
    let flag = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, Arc::clone(&flag), sig as usize)?;
    }
    Ok(Arc::clone(SIGNAL.get_or_init(|| flag)))
}
