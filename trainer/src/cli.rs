//! The `seqpipe` command line: `train`, `schedule`, `data prepare`, and the internal `worker`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

use crate::config::Config;
use crate::data::{prepare, synthetic_language};
use crate::model::params::param_count;
use crate::model::partition_layers;
use crate::runtime::launcher::{LaunchOptions, run_training};
use crate::runtime::worker::{WorkerArgs, run_worker};
use crate::schedule::{Partition, ScheduleKind, UnitCosts, generate, render_svg, render_text, report_json, segment_lengths, simulate};

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
    /// Print a pipeline schedule: action lists, segment lengths, simulated bubble and memory.
    Schedule(ScheduleArgs),
    /// Dataset tools.
    #[command(subcommand)]
    Data(DataCommand),
    /// Run one pipeline stage (started by `train`; not for direct use).
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

#[derive(Args, Debug)]
struct TrainArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Write every step's accumulated gradients (before clipping) to DIR, one safetensors file per stage.
    #[arg(long, value_name = "DIR")]
    dump_grads: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args, Debug)]
struct ScheduleArgs {
    /// Pipeline stages p.
    #[arg(long)]
    stages: usize,
    /// Micro-batches m.
    #[arg(long)]
    microbatches: usize,
    /// Segments per micro-batch k.
    #[arg(long, default_value_t = 1)]
    splits: usize,
    /// seq1f1b, 1f1b or gpipe.
    #[arg(long, default_value = "seq1f1b")]
    schedule: ScheduleKind,
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

#[derive(Subcommand, Debug)]
enum DataCommand {
    /// Tokenize text (.txt) or JSONL (.jsonl, field "text") with the GPT-2 BPE into train.bin/val.bin.
    Prepare {
        /// Input files.
        #[arg(long, required = true, num_args = 1..)]
        input: Vec<PathBuf>,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Share of documents (from the end) that go to val.bin.
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
    },
}

#[derive(Args, Debug)]
struct WorkerCli {
    /// Launcher's control address.
    #[arg(long)]
    control: String,
    /// Stage index.
    #[arg(long)]
    stage: usize,
    /// Resolved config file.
    #[arg(long)]
    config: PathBuf,
    /// Gradient dump directory.
    #[arg(long)]
    dump_grads: Option<PathBuf>,
}

/// Entry point of the `seqpipe` binary: runs the command, prints errors with their causes.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).try_init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => train(args),
        Command::Schedule(args) => schedule(args),
        Command::Data(DataCommand::Prepare { input, out, val_fraction }) => {
            init_logging("info");
            let report = prepare(&input, &out, val_fraction)?;
            println!("wrote {} ({} tokens, {} documents) and {} ({} tokens, {} documents)", report.train_path.display(), report.train_tokens, report.train_documents, report.val_path.display(), report.val_tokens, report.val_documents);
            println!("train on it with: seqpipe train --set data.source={} --set model.vocab_size=50257", out.display());
            Ok(())
        }
        Command::Worker(w) => {
            init_logging("info");
            let stage = w.stage;
            run_worker(WorkerArgs { control: w.control, stage: w.stage, config: w.config, dump_grads: w.dump_grads }).with_context(|| format!("worker of stage {stage}"))
        }
    }
}

fn train(args: TrainArgs) -> Result<()> {
    let cfg = args.config.load()?;
    init_logging(&cfg.run.log);
    let layouts = partition_layers(&cfg.model, cfg.train.seq_len, cfg.pipeline.stages)?;
    let segments = cfg.segment_lengths()?;
    eprintln!("seqpipe: GPT with {:.2}M parameters ({} layers, d_model {}, {} heads, vocab {})", param_count(&cfg.model) as f64 / 1e6, cfg.model.layers, cfg.model.d_model, cfg.model.heads, cfg.model.vocab_size);
    let ranges: Vec<String> = layouts.iter().map(|l| format!("{:?}", l.layers)).collect();
    eprintln!("pipeline: {} stages (layers {}), schedule {}, {} micro-batches x {} segments {:?}", cfg.pipeline.stages, ranges.join(" "), cfg.pipeline.schedule, cfg.pipeline.microbatches, cfg.pipeline.splits, segments);
    let bound = if cfg.data.is_synthetic() {
        let lang = synthetic_language(&cfg.data, cfg.model.vocab_size)?;
        let bound = lang.loss_lower_bound(cfg.train.seq_len);
        eprintln!("data: synthetic order-{} language, entropy rate {:.4} nats; loss lower bound {bound:.4} (initial ~ ln {} = {:.4})", lang.order(), lang.entropy_rate_nats(), cfg.model.vocab_size, (cfg.model.vocab_size as f64).ln());
        Some(bound)
    } else {
        eprintln!("data: {}", cfg.data.source);
        None
    };
    eprintln!("run directory: {}", cfg.run.dir.display());
    let summary = run_training(&cfg, &LaunchOptions { dump_grads: args.dump_grads, quiet: args.quiet })?;
    let val = summary.val_loss.map_or(String::new(), |v| format!(", val loss {v:.4}"));
    let bound = bound.map_or(String::new(), |b| format!(" (lower bound {b:.4})"));
    eprintln!("done: {} steps in {:.1}s, final loss {:.4}{val}{bound}; metrics in {}", summary.steps, summary.elapsed_s, summary.final_loss, cfg.run.dir.join("metrics.jsonl").display());
    Ok(())
}

fn schedule(args: ScheduleArgs) -> Result<()> {
    let cfg = args.config.load()?;
    if args.stages == 0 || args.microbatches == 0 || args.splits == 0 {
        bail!("--stages, --microbatches and --splits must all be at least 1");
    }
    let lengths = segment_lengths(args.partition, args.seq_len, args.splits, &cfg.flops_model())?;
    let sched = generate(args.schedule, args.stages, args.microbatches, args.splits)?;
    let batch = cfg.train.micro_batch_size;
    let costs = match args.costs.as_str() {
        "flops" => UnitCosts::from_flops(&lengths, batch, &cfg.flops_model()),
        _ => UnitCosts { tokens: lengths.iter().map(|l| l * batch).collect(), ..UnitCosts::uniform(args.splits, 0) },
    };
    let sim = simulate(&sched, &costs)?;
    if let Some(path) = &args.svg {
        std::fs::write(path, render_svg(&sched, &sim)).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report_json(&sched, &sim, &lengths))?);
        return Ok(());
    }
    let (p, m, k) = (args.stages as f64, args.microbatches as f64, args.splits as f64);
    println!("{} schedule: p={} m={} k={}, segment lengths {:?}", args.schedule, args.stages, args.microbatches, args.splits, lengths);
    print!("{}", render_text(&sched));
    println!("simulated bubble fraction: {:.4} (Seq1F1B ideal (p-1)/(mk+p-1) = {:.4}; 1F1B (p-1)/(m+p-1) = {:.4})", sim.bubble_fraction, (p - 1.0) / (m * k + p - 1.0), (p - 1.0) / (m + p - 1.0));
    for st in &sim.stages {
        println!("stage {}: bubble {:.4}, peak in-flight units {}, peak activation tokens {}", st.stage, st.bubble_fraction, st.peak_inflight_units, st.peak_activation_tokens);
    }
    if let Some(path) = &args.svg {
        println!("timeline written to {}", path.display());
    }
    Ok(())
}
