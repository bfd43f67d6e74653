//! The `seqpipe` command line: `train`, `schedule`, `plot`, `data prepare`, and the internal `worker`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

use checkpoint::{CheckpointStore, Manifest, StoreOptions};
use elastic::preemption::NoticeSource;
use trainer::checkpointing::hf;
use trainer::checkpointing::shard::from_tensor_data;
use trainer::checkpointing::state::TrainerState;
use trainer::config::Config;
use trainer::data::prepare;
use trainer::model::params::param_count;
use trainer::plan::{DataSummary, PlanError, RunPlan};
use trainer::plot::{read_metrics, render_plot};
use trainer::runtime::agent::{AgentArgs, run_agent};
use trainer::runtime::control::PEER_FAILURE_EXIT_CODE;
use trainer::runtime::notice_watch::WatchConfig;
use trainer::runtime::recovery::{ResumePoint, Start};
use trainer::runtime::run::{LaunchOptions, RunSummary, run_evaluation, run_training};
use trainer::runtime::worker::{WorkerArgs, WorkerError, run_worker};
use trainer::schedule::{
    Partition, Schedule, ScheduleKind, Simulation, UnitBytes, UnitCosts, formula_bubble,
    generate_within, render_svg, render_text, report_json, segment_lengths, simulate,
};

/// seqpipe: a fault-tolerant Seq1F1B pipeline-parallel GPT trainer.
#[derive(Parser, Debug)]
#[command(name = "seqpipe", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a GPT with one local worker process per pipeline stage.
    Train(TrainArgs),
    /// Continue a run from its newest committed checkpoint (RUN-DIR or a checkpoint URL).
    Resume(ResumeArgs),
    /// Validation loss of a model (from a checkpoint, a Hugging Face directory, or fresh weights).
    Eval(EvalArgs),
    /// Inspect, verify and export checkpoints.
    #[command(subcommand)]
    Ckpt(CkptCommand),
    /// Benchmarks that print numbers.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Print a pipeline schedule: action lists, segment lengths, simulated bubble and memory.
    Schedule(ScheduleArgs),
    /// Draw a run's loss and throughput (from its metrics.jsonl) as an SVG picture.
    Plot(PlotArgs),
    /// Dataset tools.
    #[command(subcommand)]
    Data(DataCommand),
    /// CUDA kernels: check them against the CPU oracle, train a GPT on one GPU.
    #[command(subcommand)]
    Gpu(crate::cuda::GpuCommand),
    /// Join a run as a node: start and watch this node's stage workers (multi-host runs).
    Agent(AgentCli),
    /// Run one pipeline stage (started by an agent; not for direct use).
    #[command(hide = true)]
    Worker(WorkerCli),
}

/// Config file and overrides, shared by the commands that read a config.
#[derive(Args, Debug, Clone)]
struct ConfigArgs {
    /// TOML config file (default: the embedded configs/tiny.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override one config key, e.g. `--set train.steps=100` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
}

impl ConfigArgs {
    fn load(&self) -> Result<Config> {
        Ok(Config::load(self.config.as_deref(), &self.overrides)?)
    }
}

/// Where the model's state comes from, shared by `train` and `eval`.
#[derive(Args, Debug)]
struct StartArgs {
    /// Load a committed checkpoint of the configured store: `latest` or a step number.
    #[arg(long, value_name = "latest|STEP", conflicts_with = "init_from")]
    resume: Option<String>,
    /// Load the weights of a Hugging Face GPT-2 directory (`seqpipe ckpt export` output).
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
}

impl StartArgs {
    fn start(self) -> Result<Start> {
        Ok(match (self.resume, self.init_from) {
            (Some(point), _) => Start::Resume(parse_resume_point(&point)?),
            (None, Some(dir)) => Start::InitFrom(dir),
            (None, None) => Start::Fresh,
        })
    }
}

#[derive(Args, Debug)]
struct TrainArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    start: StartArgs,
    /// Write every step's accumulated gradients (before clipping) to DIR, one safetensors file per stage.
    #[arg(long, value_name = "DIR")]
    dump_grads: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace (JSON) of when every stage computed every unit to FILE.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args, Debug)]
struct ResumeArgs {
    /// A run directory (with config.resolved.toml) or a checkpoint URL.
    target: String,
    /// Override config keys of the resumed run (e.g. `--set train.steps=200 --set pipeline.stages=2`).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
    /// Resume from this step instead of the newest committed one.
    #[arg(long)]
    step: Option<u64>,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args, Debug)]
struct EvalArgs {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    start: StartArgs,
}

#[derive(Subcommand, Debug)]
enum CkptCommand {
    /// Steps found at a checkpoint URL, their sizes, and whether they are committed.
    List {
        /// Checkpoint URL or path.
        url: String,
    },
    /// A checkpoint's manifest: step, topology, shards, tensors.
    Show {
        /// Checkpoint URL or path.
        url: String,
        /// Step (default: newest committed).
        #[arg(long)]
        step: Option<u64>,
    },
    /// Re-hash every shard and tensor; exit status 1 on any mismatch.
    Verify {
        /// Checkpoint URL or path.
        url: String,
        /// Step (default: newest committed).
        #[arg(long)]
        step: Option<u64>,
    },
    /// Consolidate a checkpoint's model into another format.
    Export {
        /// Checkpoint URL or path.
        url: String,
        /// Step (default: newest committed).
        #[arg(long)]
        step: Option<u64>,
        /// Output format.
        #[arg(long, value_parser = ["hf-gpt2"])]
        format: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Checkpoint save/load throughput vs the store's raw write throughput, and the training stall.
    Checkpoint {
        /// Checkpoint locations to measure (repeatable): a path, file://, s3://... (S3 endpoint and
        /// credentials from AWS_* variables). The stall is measured on the first.
        #[arg(long = "url", required = true)]
        urls: Vec<String>,
        /// Stages (shards written concurrently).
        #[arg(long, default_value_t = 4)]
        stages: usize,
        /// Save/load rounds per store.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Training steps of each stall run.
        #[arg(long, default_value_t = 6)]
        stall_steps: u64,
    },
    /// Recovery from a SIGKILLed node, per tier: detection time, time to the next completed step, work lost.
    Recovery(RecoveryBenchArgs),
    /// Training step time, throughput and peak memory of a whole model in one process.
    Step(crate::bench::step::StepBenchArgs),
    /// The runtime's cost around the kernels: a one-stage `train` against `bench step` of the
    /// same model and batch, and the default job's CPU and wall time outside units, per unit.
    Overhead(crate::bench::overhead::OverheadArgs),
    /// GPipe, 1F1B and Seq1F1B on real pipeline runs: peak activation bytes per stage, and step
    /// time and bubble replayed from the measured unit times.
    Schedule(crate::bench::schedule::ScheduleBenchArgs),
    /// A job under random SIGKILLs of workers and whole nodes (Poisson arrivals, replacement nodes
    /// joining) next to the same job undisturbed: effective training time ratio, recoveries by
    /// tier, and a bit-exact check of the final state.
    Goodput(crate::bench::goodput::GoodputArgs),
    /// Data parallelism: d replicas × p stages on the same global batch: the gradient
    /// reduction's bytes and time, its overlap with the backward, the step time replayed from
    /// the measured unit times, the summation tree's memory, and a bit-exact check across d.
    Replicas(crate::bench::replicas::ReplicasBenchArgs),
    /// Training data from an object store next to a local directory: a fresh node's time to its
    /// first unit, step time with a cold and a warm cache, and bytes fetched per token used.
    Data(crate::bench::data::DataBenchArgs),
    /// Document-masked attention on packed documents: slowest/fastest segment time for the
    /// document-aware and the document-blind partition, and the whole sequence with the mask
    /// against without.
    Docmask(crate::bench::docmask::DocmaskBenchArgs),
}

#[derive(Args, Debug)]
struct RecoveryBenchArgs {
    /// Trials per tier (each kills one node of a fresh run).
    #[arg(long, default_value_t = 7)]
    trials: usize,
    /// Checkpoint interval of the runs, in steps.
    #[arg(long, default_value_t = 2)]
    every: u64,
}

#[derive(Args, Debug)]
struct ScheduleArgs {
    /// Pipeline stages p.
    #[arg(long)]
    stages: usize,
    /// Micro-batches m of the global batch.
    #[arg(long)]
    microbatches: usize,
    /// Data-parallel replicas d (default: the config's `pipeline.replicas`): each replica runs
    /// the printed schedule over c = m/d micro-batches.
    #[arg(long)]
    replicas: Option<usize>,
    /// Segments per micro-batch k.
    #[arg(long, default_value_t = 1)]
    splits: usize,
    /// seq1f1b, 1f1b, gpipe, seq1f1b-i, 1f1b-i or seq1f1b-zb.
    #[arg(long, default_value = "seq1f1b")]
    schedule: ScheduleKind,
    /// Layer chunks per stage v (virtual stages) for seq1f1b-i and 1f1b-i (default 2 for them,
    /// 1 for the others).
    #[arg(long)]
    virtual_stages: Option<usize>,
    /// Sequence length (for segment lengths and token counts).
    #[arg(long, default_value_t = 4096)]
    seq_len: usize,
    /// Segment lengths: uniform or compute.
    #[arg(long, default_value = "uniform")]
    partition: Partition,
    /// Unit costs for the simulation: `uniform` (every segment forward 1, backward 2) or `flops`
    /// (from the model's FLOPs per segment).
    #[arg(long, default_value = "uniform", value_parser = ["uniform", "flops"])]
    costs: String,
    /// Model shape for the compute partition and flops costs (its [model] section).
    #[command(flatten)]
    config: ConfigArgs,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also write the simulated timeline as an SVG picture.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct PlotArgs {
    /// A run's metrics.jsonl (or its run directory).
    metrics: PathBuf,
    /// The SVG file to write.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

#[derive(Subcommand, Debug)]
enum DataCommand {
    /// Tokenize text (.txt) or JSONL (.jsonl, field "text") with the GPT-2 BPE into train.bin/val.bin,
    /// or into a sharded dataset (shards + index.json) at an object-store URL.
    Prepare {
        /// Input files.
        #[arg(long, required = true, num_args = 1..)]
        input: Vec<PathBuf>,
        /// Output: a local directory (train.bin, val.bin, meta.json), or a URL (s3://bucket/prefix,
        /// gs://, az://, file:///abs/dir) to write a sharded dataset to; S3 settings come from
        /// AWS_ENDPOINT, AWS_REGION, AWS_ACCESS_KEY_ID, ... as for checkpoints.
        #[arg(long)]
        out: String,
        /// Write a sharded dataset with shards of this many bytes (default 64 MiB), also to a
        /// local directory.
        #[arg(long, value_name = "BYTES")]
        shard_bytes: Option<u64>,
        /// Chunk size of a sharded dataset: the unit of range reads, caching and hash checks
        /// (default 256 KiB; divides --shard-bytes).
        #[arg(long, value_name = "BYTES")]
        chunk_bytes: Option<u64>,
        /// Share of documents (from the end) that go to val.bin; of tokens when there is only one
        /// document (a single .txt file).
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
    },
}

#[derive(Args, Debug)]
struct AgentCli {
    /// The coordinator's address (`host:port`, its `elastic.listen`).
    #[arg(
        long,
        value_name = "HOST:PORT",
        required_unless_present = "rendezvous",
        conflicts_with = "rendezvous"
    )]
    join: Option<String>,
    /// Join through an etcd rendezvous (`etcd://HOST:PORT/PREFIX`) instead: the node also runs the
    /// job's coordinator when it wins the leadership. Every node needs the same job config.
    #[arg(long, value_name = "URL")]
    rendezvous: Option<String>,
    /// The job's config, with an etcd rendezvous.
    #[command(flatten)]
    config: ConfigArgs,
    /// This node's name, unique in the run (default: the host name).
    #[arg(long)]
    name: Option<String>,
    /// Stage workers this node can run (e.g. its GPUs).
    #[arg(long, default_value_t = 1)]
    slots: usize,
    /// The address this node's workers listen on for their neighbours (default: the local address
    /// that reaches the coordinator).
    #[arg(long)]
    host: Option<String>,
    /// Directory for the workers' configs and logs.
    #[arg(long, default_value = "seqpipe-agent")]
    dir: PathBuf,
    /// Seconds to keep trying to reach the coordinator.
    #[arg(long, default_value_t = 60.0)]
    connect_timeout_s: f64,
    /// Started by the coordinator on its own machine (`elastic.local_agents`): honour the paths
    /// it sends.
    #[arg(long, hide = true)]
    local: bool,
    /// Watch this cloud's instance metadata service for a preemption notice (aws spot
    /// instance-action, gcp preempted, azure scheduled Preempt event) and leave the run at the
    /// next step boundary when one comes, as on SIGTERM (default: `elastic.preemption_notice` of
    /// the job config with --rendezvous, else off).
    #[arg(long, value_name = "aws|gcp|azure|off")]
    preemption_notice: Option<NoticeSource>,
    /// The metadata service's address, `http://HOST[:PORT]` (default: the cloud's documented
    /// 169.254.169.254 or metadata.google.internal).
    #[arg(long, value_name = "URL")]
    metadata_endpoint: Option<String>,
    /// Seconds between two polls of the metadata service.
    #[arg(long, value_name = "SECONDS")]
    metadata_poll_s: Option<f64>,
}

#[derive(Args, Debug)]
struct WorkerCli {
    /// Coordinator's control address.
    #[arg(long)]
    control: String,
    /// Stage index.
    #[arg(long)]
    stage: usize,
    /// Plan generation.
    #[arg(long, default_value_t = 0)]
    generation: u64,
    /// Address the stage data port listens on.
    #[arg(long, default_value = "127.0.0.1")]
    bind: String,
    /// Resolved config file.
    #[arg(long)]
    config: PathBuf,
    /// Gradient dump directory.
    #[arg(long)]
    dump_grads: Option<PathBuf>,
    /// Agent snapshot address to copy the state to after every step (repeatable).
    #[arg(long)]
    snapshot_to: Vec<String>,
}

/// Entry point of the `seqpipe` binary: runs the command, prints errors with their causes.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr; colours only when stderr is a terminal, so that log files and pipes (the
/// workers' logs, `2> file`) carry no escape codes.
fn init_logging(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

/// Dispatches a command to the function of its family.
fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Train(args) => train_command(args),
        Command::Resume(args) => resume_command(args),
        Command::Eval(args) => eval(args),
        Command::Ckpt(cmd) => ckpt(cmd),
        Command::Bench(cmd) => bench(cmd).map(|()| ExitCode::SUCCESS),
        Command::Gpu(cmd) => {
            init_logging("warn");
            crate::cuda::run(cmd).map(|()| ExitCode::SUCCESS)
        }
        Command::Schedule(args) => schedule(args).map(|()| ExitCode::SUCCESS),
        Command::Plot(args) => plot(args).map(|()| ExitCode::SUCCESS),
        Command::Data(cmd) => data(cmd).map(|()| ExitCode::SUCCESS),
        Command::Agent(args) => agent(args).map(|()| ExitCode::SUCCESS),
        Command::Worker(args) => worker(args),
    }
}

/// `seqpipe train`: a run from the config, fresh, resumed or initialised from Hugging Face weights.
fn train_command(args: TrainArgs) -> Result<ExitCode> {
    let cfg = args.config.load()?;
    trainer::cuda::require_runnable_device(&cfg)?;
    let start = args.start.start()?;
    train(
        cfg,
        LaunchOptions {
            dump_grads: args.dump_grads,
            quiet: args.quiet,
            start,
            trace: args.trace,
            listening: None,
        },
    )
}

/// `seqpipe resume`: the run's own config (from its directory or its checkpoints) and its newest
/// (or the chosen) committed checkpoint.
fn resume_command(args: ResumeArgs) -> Result<ExitCode> {
    let cfg = resume_config(&args.target, &args.overrides, args.step)?;
    trainer::cuda::require_runnable_device(&cfg)?;
    let point = args.step.map_or(ResumePoint::Latest, ResumePoint::Step);
    train(
        cfg,
        LaunchOptions {
            dump_grads: None,
            quiet: args.quiet,
            start: Start::Resume(point),
            trace: None,
            listening: None,
        },
    )
}

/// `seqpipe eval`: prints the validation loss as one JSON line; never changes the store.
fn eval(args: EvalArgs) -> Result<ExitCode> {
    let mut cfg = args.config.load()?;
    let start = args.start.start()?;
    // Evaluation reads checkpoints and never changes the store (no retiring, no cleanup,
    // no directory created).
    cfg.checkpoint.read_only = true;
    let store = cfg.checkpoint.resolved_url(&cfg.run.dir);
    if !matches!(start, Start::Resume(_)) && !store.contains("://") && !Path::new(&store).exists() {
        // Fresh or imported weights need no checkpoint: a run without a store is read
        // through an empty in-memory one rather than creating its directory.
        cfg.checkpoint.url = "memory://".into();
    }
    trainer::cuda::require_runnable_device(&cfg)?;
    init_logging(&cfg.run.log);
    trainer::memory::check(&cfg, None)?;
    let (step, val_loss) = run_evaluation(&cfg, &start)?;
    println!(
        "{}",
        serde_json::json!({"step": step, "val_loss": val_loss, "batches": cfg.train.eval_batches})
    );
    Ok(ExitCode::SUCCESS)
}

/// `seqpipe bench …`: every benchmark logs warnings only, so that its numbers stand out.
fn bench(cmd: BenchCommand) -> Result<()> {
    init_logging("warn");
    match cmd {
        BenchCommand::Recovery(args) => crate::bench::recovery_bench(args.trials, args.every),
        BenchCommand::Checkpoint {
            urls,
            stages,
            rounds,
            stall_steps,
        } => crate::bench::checkpoint_bench(&urls, stages, rounds, stall_steps),
        BenchCommand::Step(args) => crate::bench::step::run(&args),
        BenchCommand::Overhead(args) => crate::bench::overhead::run(&args),
        BenchCommand::Schedule(args) => crate::bench::schedule::run(&args),
        BenchCommand::Goodput(args) => crate::bench::goodput::run(&args),
        BenchCommand::Replicas(args) => crate::bench::replicas::run(&args),
        BenchCommand::Data(args) => crate::bench::data::run(&args),
        BenchCommand::Docmask(args) => crate::bench::docmask::run(&args),
    }
}

/// `seqpipe data prepare`.
fn data(cmd: DataCommand) -> Result<()> {
    let DataCommand::Prepare {
        input,
        out,
        val_fraction,
        shard_bytes,
        chunk_bytes,
    } = cmd;
    init_logging("info");
    if trainer::data::prepare::looks_like_mangled_url(&out) {
        anyhow::bail!(
            "--out {out} looks like a URL without `//` (it would create a local directory named \
             `{}`); write a URL as scheme://bucket/prefix (e.g. s3://bucket/ds), or a local path \
             as ./{out}",
            out.split(':').next().unwrap_or_default().to_string() + ":"
        );
    }
    if trainer::data::remote::is_url(&out) || shard_bytes.is_some() || chunk_bytes.is_some() {
        let defaults = trainer::data::shards::ShardLayout::default();
        let layout = trainer::data::shards::ShardLayout::with_default_blocks(
            shard_bytes.unwrap_or(defaults.shard_bytes),
            chunk_bytes.unwrap_or(defaults.chunk_bytes),
        );
        let report = trainer::data::prepare::prepare_sharded(
            &input,
            &out,
            val_fraction,
            layout,
            &std::env::temp_dir(),
        )?;
        let (train, val) = (&report.index.train, &report.index.val);
        println!(
            "wrote {}/index.json: train {} tokens ({} documents) in {} shards, val {} tokens ({} \
             documents) in {} shards",
            report.url,
            train.tokens,
            report.prepared.train_documents,
            train.shards.len(),
            val.tokens,
            report.prepared.val_documents,
            val.shards.len()
        );
        println!(
            "train on it with: seqpipe train --set data.source={} --set model.vocab_size=50257",
            report.url
        );
        return Ok(());
    }
    let out = PathBuf::from(out);
    let report = prepare(&input, &out, val_fraction)?;
    println!(
        "wrote {} ({} tokens, {} documents) and {} ({} tokens, {} documents)",
        report.train_path.display(),
        report.train_tokens,
        report.train_documents,
        report.val_path.display(),
        report.val_tokens,
        report.val_documents
    );
    println!(
        "train on it with: seqpipe train --set data.source={} --set model.vocab_size=50257",
        out.display()
    );
    Ok(())
}

/// `seqpipe agent`: this node's name, the job config with an etcd rendezvous, then the agent.
fn agent(a: AgentCli) -> Result<()> {
    init_logging("info");
    let name = match a.name {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .context("reading the host name; name the node with --name")?,
    };
    let connect_timeout = elastic::checked_seconds(a.connect_timeout_s, elastic::Zero::Allowed)
        .context("--connect-timeout-s")?;
    let job = match &a.rendezvous {
        Some(url) => {
            let mut cfg = a.config.load()?;
            cfg.elastic.rendezvous = url.clone();
            cfg.validate()?;
            Some(Box::new(cfg))
        }
        None => None,
    };
    // The flags override the job config's `[elastic]` keys, which override the defaults.
    let mut notices = job
        .as_ref()
        .map_or_else(elastic::ElasticConfig::default, |cfg| cfg.elastic.clone());
    if let Some(source) = a.preemption_notice {
        notices.preemption_notice = source;
    }
    if let Some(url) = a.metadata_endpoint {
        notices.metadata_endpoint = url;
    }
    if let Some(s) = a.metadata_poll_s {
        notices.metadata_poll_s = s;
    }
    notices
        .validate()
        .context("--preemption-notice, --metadata-endpoint, --metadata-poll-s")?;
    run_agent(&AgentArgs {
        preemption: WatchConfig::from_elastic(&notices),
        join: a.join.unwrap_or_default(),
        job,
        name,
        slots: a.slots,
        host: a.host,
        dir: a.dir,
        connect_timeout,
        local: a.local,
    })?;
    Ok(())
}

/// `seqpipe worker` (started by an agent): a transport failure exits with
/// [`PEER_FAILURE_EXIT_CODE`], any other error with 1.
fn worker(w: WorkerCli) -> Result<ExitCode> {
    init_logging("info");
    let stage = w.stage;
    match run_worker(WorkerArgs {
        control: w.control,
        stage: w.stage,
        generation: w.generation,
        bind: w.bind,
        snapshot_to: w.snapshot_to,
        config: w.config,
        dump_grads: w.dump_grads,
        kill_switch: None,
    }) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        // This node is healthy; a neighbour is not. The launcher tells the two apart by this code.
        Err(e @ (WorkerError::Transport(_) | WorkerError::Collective(_))) => {
            eprintln!("error: worker of stage {stage}: {e}");
            Ok(ExitCode::from(PEER_FAILURE_EXIT_CODE))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("worker of stage {stage}"))),
    }
}

fn parse_resume_point(s: &str) -> Result<ResumePoint> {
    match s {
        "latest" => Ok(ResumePoint::Latest),
        n => n
            .parse()
            .map(ResumePoint::Step)
            .map_err(|_| anyhow::anyhow!("--resume takes `latest` or a step number, got `{n}`")),
    }
}

/// The config of the run to resume: `TARGET/config.resolved.toml` for a run directory, else the
/// config stored in the newest committed checkpoint at URL `TARGET` (at or before `step`) whose
/// manifest is readable, minus the output locations ([`trainer::config::LOCAL_ONLY_KEYS`]), which come from the
/// defaults; then the overrides.
fn resume_config(target: &str, overrides: &[String], step: Option<u64>) -> Result<Config> {
    let resolved = PathBuf::from(target).join("config.resolved.toml");
    let cfg = if resolved.is_file() {
        Config::load(Some(&resolved), &[])?
    } else {
        let local = Config::load(None, &[])?;
        // The store is read with the S3 options of the command line, as the run will write it.
        let mut options = local.with_overrides(overrides)?.checkpoint.store_options();
        options.read_only = true;
        let (at, stored) = stored_config(target, &options, step)?;
        let adopted = Config::adopt_stored(&local, &stored)?;
        eprintln!(
            "resume: config of checkpoint {at} at {target}; stored keys applied: {}",
            if adopted.applied.is_empty() {
                "none (all as the defaults)".to_string()
            } else {
                adopted.applied.join(", ")
            }
        );
        if !adopted.ignored.is_empty() {
            let ignored: Vec<String> = adopted
                .ignored
                .iter()
                .map(|(k, v)| format!("{k} (stored: {v})"))
                .collect();
            eprintln!(
                "resume: stored output locations ignored, taken from the command line and defaults instead: {}",
                ignored.join(", ")
            );
        }
        let mut cfg = adopted.config;
        cfg.checkpoint.url = target.to_string();
        cfg
    };
    let cfg = cfg.with_overrides(overrides)?;
    cfg.validate()?;
    Ok(cfg)
}

/// The config stored in the newest committed checkpoint at `url` (at or before `step`) whose
/// manifest is readable, and that checkpoint's step. A damaged manifest is skipped with a
/// warning, as resume itself falls back past it; a store that cannot be read is an error.
fn stored_config(url: &str, options: &StoreOptions, step: Option<u64>) -> Result<(u64, Config)> {
    let store = CheckpointStore::open(url, options)?;
    let rt = runtime()?;
    let committed = rt.block_on(store.committed_steps())?;
    let candidates: Vec<u64> = committed
        .iter()
        .rev()
        .copied()
        .filter(|&s| step.is_none_or(|n| s <= n))
        .collect();
    if candidates.is_empty() {
        bail!(
            "{url} is neither a run directory (no config.resolved.toml) nor a checkpoint location with a committed checkpoint{}; committed steps: {committed:?}",
            step.map_or(String::new(), |n| format!(" at or before step {n}"))
        );
    }
    let mut last_error = String::new();
    for at in candidates {
        let damage = match rt.block_on(store.read_manifest(at)) {
            Ok(manifest) => match serde_json::from_value::<TrainerState>(manifest.state) {
                Ok(state) => match state.config() {
                    Ok(cfg) => return Ok((at, cfg)),
                    Err(e) => e.to_string(),
                },
                Err(e) => format!("its trainer state is unreadable: {e}"),
            },
            Err(e) if e.is_damaged_checkpoint() => e.to_string(),
            Err(e) => return Err(e.into()),
        };
        eprintln!(
            "warning: the manifest of checkpoint {at} at {url} is unreadable ({damage}); reading the run's config from the previous committed checkpoint"
        );
        last_error = damage;
    }
    bail!(
        "no committed checkpoint at {url} has a readable manifest (committed steps: {committed:?}); last error: {last_error}"
    )
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// The exit status of a run stopped at a step boundary, with a committed checkpoint, because
/// preemption notices took (nearly) all its nodes: EX_TEMPFAIL, try again (`seqpipe resume`)
/// once nodes are back.
const PREEMPTED_EXIT_CODE: u8 = 75;

fn train(cfg: Config, opts: LaunchOptions) -> Result<ExitCode> {
    if cfg.checkpoint.read_only {
        bail!(
            "checkpoint.read_only = true: training writes checkpoints; set checkpoint.read_only = false (only read-only commands such as eval open the store read-only)"
        );
    }
    init_logging(&cfg.run.log);
    // Before any worker starts: a model that cannot fit is refused with the numbers.
    trainer::memory::check(&cfg, None)?;
    eprintln!(
        "seqpipe: GPT with {:.2}M parameters ({} layers, d_model {}, {} heads, vocab {})",
        param_count(&cfg.model) as f64 / 1e6,
        cfg.model.layers,
        cfg.model.d_model,
        cfg.model.heads,
        cfg.model.vocab_size
    );
    // The layout and the checked dataset, decided once: what is printed is what the run is given.
    let plan = match RunPlan::decide(&cfg) {
        Ok(plan) => plan,
        // An unusable dataset ends the run like any failure: say which state survives it.
        Err(PlanError::Data(e)) => bail!("{e}\n{}", newest_checkpoint_note(&cfg)),
        Err(e) => return Err(e.into()),
    };
    describe_plan(&cfg, &plan)?;
    let bound = plan.data.loss_lower_bound();
    eprintln!("run directory: {}", cfg.run.dir.display());
    let summary = match run_training(&cfg, &plan, &opts) {
        Ok(summary) => summary,
        // Whatever ended the run, say which state survives it and how to continue from there.
        Err(e) => bail!("{e}\n{}", newest_checkpoint_note(&cfg)),
    };
    Ok(report_summary(&cfg, &summary, bound))
}

/// Prints the run's layout (stages, their layers, the schedule) and its data.
fn describe_plan(cfg: &Config, plan: &RunPlan) -> Result<()> {
    let v = cfg.pipeline.virtual_stages;
    let (stages, ranges): (String, Vec<String>) = if v > 1 {
        // Each stage's chunks: virtual stages c·p + r, c = 0..v.
        let chunks = trainer::model::partition::partition_virtual_layers(
            &cfg.model,
            cfg.train.seq_len,
            plan.stages,
            v,
        )?;
        (
            format!("{} stages x {v} virtual stages", plan.stages),
            chunks
                .iter()
                .map(|c| {
                    let c: Vec<String> = c.iter().map(|l| format!("{:?}", l.layers)).collect();
                    c.join("+")
                })
                .collect(),
        )
    } else {
        (
            format!("{} stages", plan.stages),
            plan.layouts
                .iter()
                .map(|l| format!("{:?}", l.layers))
                .collect(),
        )
    };
    eprintln!(
        "pipeline: {stages} (layers {}), schedule {}, {} micro-batches x {} segments {}",
        ranges.join(" "),
        cfg.pipeline.schedule,
        cfg.pipeline.microbatches,
        cfg.pipeline.splits,
        plan.segments
    );
    match &plan.data {
        DataSummary::Synthetic {
            order,
            entropy_rate_nats,
            loss_lower_bound,
        } => eprintln!(
            "data: synthetic order-{order} language, entropy rate {entropy_rate_nats:.4} nats; loss lower bound {loss_lower_bound:.4} (initial ~ ln {} = {:.4})",
            cfg.model.vocab_size,
            (cfg.model.vocab_size as f64).ln()
        ),
        DataSummary::SyntheticDocuments { describe } => eprintln!(
            "data: synthetic {describe}; no loss lower bound (document ends follow the length distribution's hazard, not the language's)"
        ),
        DataSummary::Tokens { source } => eprintln!("data: {source}"),
    }
    Ok(())
}

/// Prints how the run ended and where its outputs are; the exit status: success, or that of a
/// run stopped at a step boundary with a final checkpoint (preemption, a signal).
fn report_summary(cfg: &Config, summary: &RunSummary, bound: Option<f64>) -> ExitCode {
    let val = summary
        .val_loss
        .map_or(String::new(), |v| format!(", val loss {v:.4}"));
    let bound = bound.map_or(String::new(), |b| format!(" (lower bound {b:.4})"));
    let resumed = summary
        .resumed_from
        .map_or(String::new(), |s| format!(" (resumed from step {s})"));
    eprintln!(
        "done: step {}/{}{resumed} in {:.1}s, final loss {:.4}{val}{bound}; metrics in {}",
        summary.last_step,
        cfg.train.steps,
        summary.elapsed_s,
        summary.final_loss,
        cfg.run.dir.join("metrics.jsonl").display()
    );
    eprintln!(
        "checkpoints: {} (newest committed: {})",
        cfg.checkpoint.resolved_url(&cfg.run.dir),
        match newest_committed(cfg) {
            Ok(Some(step)) => format!("step {step}"),
            Ok(None) => "none".into(),
            Err(e) => format!("unknown: {e:#}"),
        }
    );
    if let Some(reason) = &summary.preempted {
        // The driver returns a summary only once the final checkpoint is committed.
        eprintln!(
            "stopped for preemption after step {} with a final checkpoint of step {}: {reason}; continue with: seqpipe resume {}",
            summary.last_step,
            summary.last_step,
            cfg.run.dir.display()
        );
        return ExitCode::from(PREEMPTED_EXIT_CODE);
    }
    if let Some(sig) = summary.interrupted_by {
        // The driver returns a summary only once the final checkpoint is committed.
        eprintln!(
            "stopped by signal {sig} after step {} with a final checkpoint of step {}; continue with: seqpipe resume {}",
            summary.last_step,
            summary.last_step,
            cfg.run.dir.display()
        );
        return ExitCode::from(128 + sig as u8);
    }
    ExitCode::SUCCESS
}

/// The newest committed checkpoint step of `cfg`'s store (read-only), `None` when it holds none.
fn newest_committed(cfg: &Config) -> Result<Option<u64>> {
    let url = cfg.checkpoint.resolved_url(&cfg.run.dir);
    let store = CheckpointStore::open(&url, &read_only())?;
    Ok(runtime()?
        .block_on(store.committed_steps())?
        .last()
        .copied())
}

/// For a run that failed: the newest committed checkpoint it leaves and how to continue from it.
fn newest_checkpoint_note(cfg: &Config) -> String {
    let url = cfg.checkpoint.resolved_url(&cfg.run.dir);
    match newest_committed(cfg) {
        Ok(Some(step)) => format!(
            "the newest committed checkpoint is step {step} (at {url}); continue from it with: seqpipe resume {}",
            cfg.run.dir.display()
        ),
        Ok(None) => format!("no checkpoint is committed at {url}: a new run starts from step 0"),
        Err(e) => format!("the checkpoints at {url} cannot be listed: {e:#}"),
    }
}

/// Options of a store that read-only commands open: nothing is created, written or deleted.
fn read_only() -> StoreOptions {
    StoreOptions {
        read_only: true,
        ..StoreOptions::default()
    }
}

/// The checkpoint stores a `seqpipe ckpt` command reads: opened read-only, on one runtime.
struct Ckpts {
    rt: tokio::runtime::Runtime,
}

impl Ckpts {
    fn open(&self, url: &str) -> Result<CheckpointStore> {
        Ok(CheckpointStore::open(url, &read_only())?)
    }

    /// `step` if it is committed in `store`, else its newest committed step.
    fn pick(&self, store: &CheckpointStore, step: Option<u64>) -> Result<u64> {
        let committed = self.rt.block_on(store.committed_steps())?;
        match step {
            Some(s) if committed.contains(&s) => Ok(s),
            Some(s) => bail!(
                "no committed checkpoint of step {s} at {}; committed steps: {committed:?}",
                store.url()
            ),
            None => committed
                .last()
                .copied()
                .with_context(|| format!("no committed checkpoint at {}", store.url())),
        }
    }

    /// The store at `url` and its manifest of `step` (default: the newest committed).
    fn manifest(&self, url: &str, step: Option<u64>) -> Result<(CheckpointStore, u64, Manifest)> {
        let store = self.open(url)?;
        let step = self.pick(&store, step)?;
        let manifest = self.rt.block_on(store.read_manifest(step))?;
        Ok((store, step, manifest))
    }
}

/// `seqpipe ckpt …`.
fn ckpt(cmd: CkptCommand) -> Result<ExitCode> {
    let ckpts = Ckpts { rt: runtime()? };
    match cmd {
        CkptCommand::List { url } => ckpt_list(&ckpts, &url)?,
        CkptCommand::Show { url, step } => ckpt_show(&ckpts, &url, step)?,
        CkptCommand::Verify { url, step } => return ckpt_verify(&ckpts, &url, step),
        CkptCommand::Export {
            url,
            step,
            format,
            out,
        } => {
            debug_assert_eq!(format, "hf-gpt2");
            ckpt_export(&ckpts, &url, step, &out)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn ckpt_list(ckpts: &Ckpts, url: &str) -> Result<()> {
    let store = ckpts.open(url)?;
    let steps = ckpts.rt.block_on(store.list())?;
    if steps.is_empty() {
        println!("no checkpoints at {url}");
    }
    for s in steps {
        println!(
            "step {:>8}  {:>12} bytes  {:>3} objects  {}",
            s.step,
            s.bytes,
            s.objects,
            if s.committed {
                "committed"
            } else {
                "NOT committed (incomplete upload)"
            }
        );
    }
    Ok(())
}

fn ckpt_show(ckpts: &Ckpts, url: &str, step: Option<u64>) -> Result<()> {
    let (_, step, manifest) = ckpts.manifest(url, step)?;
    println!(
        "checkpoint {url} step {step}: {} bytes in {} shards, {} tensors",
        manifest.total_bytes(),
        manifest.shards.len(),
        manifest.tensor_names().count()
    );
    if let Ok(state) = serde_json::from_value::<TrainerState>(manifest.state.clone()) {
        let t = &state.topology;
        println!(
            "written by {} after step {} (loss {:.4}, lr {:.3e}); next data step {}",
            state.writer, state.step, state.loss, state.lr.last_lr, state.data.next_step
        );
        println!(
            "topology: {} stages {:?}, schedule {}, {} micro-batches x {} segments",
            t.stages, t.layers, t.schedule, t.microbatches, t.splits
        );
    }
    let problems = model_problems(&manifest);
    if !problems.is_empty() {
        println!(
            "MODEL CHECK FAILED: the model cannot load this checkpoint ({} problems)",
            problems.len()
        );
        for problem in &problems {
            println!("  {problem}");
        }
        eprintln!(
            "warning: checkpoint of step {step} at {url} cannot be loaded by its model ({} problems; see above)",
            problems.len()
        );
    }
    for shard in &manifest.shards {
        println!(
            "shard {} ({} bytes, blake3 {})",
            shard.key, shard.size, shard.blake3
        );
        for t in &shard.tensors {
            println!("  {:<40} {:<4} {:?}", t.name, t.dtype, t.shape);
        }
    }
    Ok(())
}

/// Why the model stored in a checkpoint cannot load its tensors: the check a resume makes
/// ([`trainer::model::params::check_state`]) over the whole model, nothing unexpected allowed.
/// Empty when it can.
fn model_problems(manifest: &Manifest) -> Vec<String> {
    use trainer::model::params::{check_state, param_specs, state_tensors};
    let state = match serde_json::from_value::<TrainerState>(manifest.state.clone()) {
        Ok(state) => state,
        Err(e) => return vec![format!("its trainer state is unreadable ({e})")],
    };
    let cfg = match state.config() {
        Ok(cfg) => cfg,
        Err(e) => return vec![format!("its stored config is unusable ({e})")],
    };
    let expected = state_tensors(&param_specs(&cfg.model), state.optimizer_step > 0);
    let found = manifest
        .shards
        .iter()
        .flat_map(|shard| &shard.tensors)
        .map(|t| (t.name.as_str(), t.dtype.as_str(), t.shape.as_slice()));
    check_state(&expected, found, true)
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// Exit status 1 (with the problems on stderr) when a shard or tensor does not match its hash, or
/// the checkpoint's model could not load its tensors (missing, misshapen or unexpected ones).
fn ckpt_verify(ckpts: &Ckpts, url: &str, step: Option<u64>) -> Result<ExitCode> {
    let (store, step, manifest) = ckpts.manifest(url, step)?;
    let report = ckpts.rt.block_on(store.verify(&manifest))?;
    let model = model_problems(&manifest);
    if report.is_ok() && model.is_empty() {
        println!(
            "ok: step {step}, {} shards, {} bytes re-hashed, every tensor of the model present with its shape",
            report.shards_checked, report.bytes_checked
        );
        return Ok(ExitCode::SUCCESS);
    }
    for problem in &report.problems {
        eprintln!("{problem}");
    }
    for problem in &model {
        eprintln!("model check: {problem}");
    }
    if !report.is_ok() {
        eprintln!(
            "error: checkpoint of step {step} at {url} is corrupt ({} problems)",
            report.problems.len()
        );
    }
    if !model.is_empty() {
        eprintln!(
            "error: checkpoint of step {step} at {url} cannot be loaded by its model ({} problems); \
             resume would refuse it too",
            model.len()
        );
    }
    Ok(ExitCode::FAILURE)
}

/// Writes the checkpoint's model as a Hugging Face GPT-2 directory.
fn ckpt_export(ckpts: &Ckpts, url: &str, step: Option<u64>, out: &Path) -> Result<()> {
    let (store, step, manifest) = ckpts.manifest(url, step)?;
    let problems = model_problems(&manifest);
    if !problems.is_empty() {
        bail!(
            "refusing to export step {step} of {url}: its model cannot load it ({} problems; \
             `seqpipe ckpt verify` lists them):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    let state: TrainerState = serde_json::from_value(manifest.state.clone())
        .context("reading the checkpoint's trainer state")?;
    let cfg = state.config()?;
    let names: Vec<String> = trainer::model::params::param_specs(&cfg.model)
        .into_iter()
        .map(|s| s.name)
        .collect();
    let tensors = ckpts.rt.block_on(store.read_tensors(&manifest, &names))?;
    let params = tensors
        .iter()
        .map(|(n, d)| Ok((n.clone(), from_tensor_data(d)?)))
        .collect::<Result<_>>()?;
    hf::export(&cfg.model, &params, out)?;
    println!(
        "exported step {step} to {} (model.safetensors, config.json)",
        out.display()
    );
    Ok(())
}

fn plot(args: PlotArgs) -> Result<()> {
    let path = if args.metrics.is_dir() {
        args.metrics.join("metrics.jsonl")
    } else {
        args.metrics
    };
    let m = read_metrics(&path)?;
    let absolute = std::path::absolute(&path).unwrap_or_else(|_| path.clone());
    let run_dir = absolute.parent().unwrap_or(&absolute);
    std::fs::write(
        &args.out,
        render_plot(&m, &format!("seqpipe {}", run_dir.display())),
    )
    .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "wrote {} ({} steps, {} events)",
        args.out.display(),
        m.steps.len(),
        m.events.len()
    );
    Ok(())
}

fn schedule(args: ScheduleArgs) -> Result<()> {
    let cfg = args.config.load()?;
    let d = schedule_replicas(&args, &cfg)?;
    // Each replica runs the pipeline schedule over its own c = m/d micro-batches.
    let c = args.microbatches / d;
    let lengths = segment_lengths(
        args.partition,
        args.seq_len,
        args.splits,
        &cfg.flops_model(),
    )?;
    let v = args
        .virtual_stages
        .unwrap_or(if args.schedule.is_interleaved() { 2 } else { 1 });
    let bytes = schedule_byte_model(&args, &cfg, v, d);
    let sched = generate_within(
        args.schedule,
        args.stages,
        v,
        c,
        args.splits,
        bytes.as_ref(),
    )?;
    let batch = cfg.train.micro_batch_size;
    let costs = match args.costs.as_str() {
        "flops" => UnitCosts::from_flops(&lengths, batch, &cfg.flops_model()),
        _ => UnitCosts {
            tokens: lengths.iter().map(|l| l * batch).collect(),
            ..UnitCosts::uniform(args.splits, 0)
        },
    };
    let sim = simulate(&sched, &costs)?;
    if let Some(path) = &args.svg {
        std::fs::write(path, render_svg(&sched, &sim))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        let mut report = report_json(&sched, &sim, &lengths);
        report["replicas"] = serde_json::json!(d);
        report["global_microbatches"] = serde_json::json!(args.microbatches);
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_schedule(&args, (d, c, v), &lengths, &sched, &sim, bytes.as_ref())
}

/// `seqpipe schedule`'s replica count d: `--replicas`, or the config's; refused (with the valid
/// counts) when it cannot split the micro-batches so that every replica count trains to the same
/// bits, and when a count is 0.
fn schedule_replicas(args: &ScheduleArgs, cfg: &Config) -> Result<usize> {
    if args.stages == 0 || args.microbatches == 0 || args.splits == 0 {
        bail!("--stages, --microbatches and --splits must all be at least 1");
    }
    let d = args.replicas.unwrap_or(cfg.pipeline.replicas);
    let valid = {
        let mut c = cfg.clone();
        c.pipeline.microbatches = args.microbatches;
        c.valid_replicas()
    };
    if !valid.contains(&d) {
        bail!(
            "{d} replicas cannot split {} micro-batches so that every replica count trains to the \
             same bits; valid replica counts: {valid:?}",
            args.microbatches
        );
    }
    Ok(d)
}

/// The byte model of the config's model at the shape `seqpipe schedule` was asked for (v chunks,
/// d replicas): seq1f1b-zb's order depends on it. `None` where the model cannot be split so.
fn schedule_byte_model(args: &ScheduleArgs, cfg: &Config, v: usize, d: usize) -> Option<UnitBytes> {
    let mut run = cfg.clone();
    let pl = &mut run.pipeline;
    (pl.schedule, pl.stages, pl.virtual_stages) = (args.schedule, args.stages, v);
    (pl.microbatches, pl.replicas, pl.splits) = (args.microbatches, d, args.splits);
    pl.partition = args.partition;
    run.train.seq_len = args.seq_len;
    trainer::memory::unit_bytes(&run)
}

/// `seqpipe schedule`'s text: the shape, the action lists, the simulated bubble against the
/// formulas, and each stage's bubble and peaks (activation bytes by `bytes`, when known).
fn print_schedule(
    args: &ScheduleArgs,
    (d, c, v): (usize, usize, usize),
    lengths: &[usize],
    sched: &Schedule,
    sim: &Simulation,
    bytes: Option<&UnitBytes>,
) -> Result<()> {
    let (p, c_f, k) = (args.stages as f64, c as f64, args.splits as f64);
    println!(
        "{} schedule: p={} m={} k={}, segment lengths {:?}",
        args.schedule, args.stages, args.microbatches, args.splits, lengths
    );
    println!(
        "data parallelism: {d} replicas × {} stages; each replica runs c = m/d = {}/{d} = {c} micro-batches (the schedule below is one replica's)",
        args.stages, args.microbatches
    );
    if v > 1 {
        println!(
            "virtual stages: {v} layer chunks per stage; `@c` marks an action on a stage's chunk c (virtual stage c·p + stage)"
        );
    }
    print!("{}", render_text(sched));
    println!(
        "simulated bubble fraction per replica: {:.4} (Seq1F1B ideal (p-1)/(ck+p-1) = {:.4}; 1F1B (p-1)/(c+p-1) = {:.4}; {} formula {:.4})",
        sim.bubble_fraction,
        (p - 1.0) / (c_f * k + p - 1.0),
        (p - 1.0) / (c_f + p - 1.0),
        args.schedule,
        formula_bubble(args.schedule, args.stages, v, c, args.splits)
    );
    let peak_bytes = match bytes.filter(|_| v == 1) {
        Some(b) => {
            println!(
                "activation bytes per unit from the config's model (memory estimate); seq1f1b-zb holds no stage above seq1f1b's job peak of them"
            );
            sim.peak_bytes(sched, b)?
        }
        None => {
            println!(
                "no byte model (the config's model cannot be split into {} stages, or chunks): seq1f1b-zb holds each stage to seq1f1b's job peak of live units only",
                args.stages
            );
            vec![0; args.stages]
        }
    };
    for (st, bytes) in sim.stages.iter().zip(peak_bytes) {
        println!(
            "stage {}: bubble {:.4}, peak in-flight units {}, peak activation tokens {}, peak activation MiB {:.1}",
            st.stage,
            st.bubble_fraction,
            st.peak_inflight_units,
            st.peak_activation_tokens,
            bytes as f64 / (1u64 << 20) as f64
        );
    }
    if let Some(path) = &args.svg {
        println!("timeline written to {}", path.display());
    }
    Ok(())
}
