//! Each stage's memory, estimated from the config before any worker starts, so that a model that
//! cannot fit is refused with the numbers instead of dying in an allocation abort (which the
//! launcher only sees as a lost connection).
//!
//! The estimate is deliberately a lower bound: FP32 parameters, gradients and AdamW's two moments
//! (16 bytes per parameter), plus the activations of the micro-batches a stage keeps in flight
//! (about `6·d_model + ffn` floats per token and layer; the last stage also its logits and their
//! gradient). All arithmetic saturates, so absurd sizes give `u64::MAX`, never an overflow.
//!
//! The same per-token sizes give each unit's activation bytes on each stage ([`unit_bytes`]),
//! the byte model `seq1f1b-zb`'s order is capped by; [`training_schedule`] is a run's schedule
//! with it, the one every party generates from the config.

use thiserror::Error;

use crate::config::Config;
use crate::model::params::component_params;
use crate::model::partition::partition_layers;
use crate::schedule::{Schedule, ScheduleKind, SegmentRule, UnitBytes, generate_within};

/// Bytes per parameter: the FP32 weight, its gradient and AdamW's m and v.
pub const STATE_BYTES_PER_PARAM: u64 = 16;
const F32: u64 = 4;

/// One stage's estimated memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageMemory {
    /// Stage index.
    pub stage: usize,
    /// Parameters the stage holds.
    pub params: u64,
    /// Parameters, gradients and AdamW moments.
    pub state_bytes: u64,
    /// Live activations at the schedule's peak (rough).
    pub activation_bytes: u64,
}

impl StageMemory {
    /// State plus activations.
    pub fn total(&self) -> u64 {
        self.state_bytes.saturating_add(self.activation_bytes)
    }
}

/// The run does not fit in memory.
#[derive(Debug, Error)]
#[error(
    "the model does not fit in memory: by a rough lower-bound estimate stage {stage} needs {need} \
     ({params} parameters × {STATE_BYTES_PER_PARAM} bytes for weights, gradients and AdamW m/v = \
     {state}, plus activations {activations}){all}, but {what} is {have}; configured: \
     model.vocab_size = {vocab}, model.d_model = {d_model}, model.layers = {layers}, \
     train.micro_batch_size = {mbs}, train.seq_len = {seq_len}, pipeline.stages = {stages}; \
     make the model smaller (vocab_size, d_model, layers), lower micro_batch_size or seq_len, or \
     spread the stages over more machines",
    need = human(largest.total()),
    stage = largest.stage,
    params = largest.params,
    state = human(largest.state_bytes),
    activations = human(largest.activation_bytes),
    all = match together {
        Some(n) => format!("; the {n} stage(s) on this machine together need {}", human(*total)),
        None => String::new(),
    },
    have = human(*available),
)]
pub struct MemoryError {
    /// The stage that needs the most.
    pub largest: StageMemory,
    /// The sum over the stages on this machine (all of them with `elastic.local_agents`).
    pub total: u64,
    /// How many stages share this machine, when their sum is what did not fit.
    pub together: Option<usize>,
    /// Bytes available.
    pub available: u64,
    /// What `available` is ("this machine's available memory (MemAvailable)", ...).
    pub what: String,
    /// Configured sizes, for the message.
    pub vocab: usize,
    /// `model.d_model`.
    pub d_model: usize,
    /// `model.layers`.
    pub layers: usize,
    /// `train.micro_batch_size`.
    pub mbs: usize,
    /// `train.seq_len`.
    pub seq_len: usize,
    /// `pipeline.stages`.
    pub stages: usize,
}

impl MemoryError {
    /// The error for `cfg`, whose `largest` stage (or `together` stages, `total` bytes) did not
    /// fit in `available` bytes of `what`.
    fn new(
        cfg: &Config,
        largest: StageMemory,
        total: u64,
        together: Option<usize>,
        available: u64,
        what: String,
    ) -> Box<Self> {
        let (m, t) = (&cfg.model, &cfg.train);
        Box::new(Self {
            largest,
            total,
            together,
            available,
            what,
            vocab: m.vocab_size,
            d_model: m.d_model,
            layers: m.layers,
            mbs: t.micro_batch_size,
            seq_len: t.seq_len,
            stages: cfg.pipeline.stages,
        })
    }
}

/// Bytes as GiB (or bytes when small), for messages.
fn human(bytes: u64) -> String {
    if bytes == u64::MAX {
        "more than 16 EiB".into()
    } else if bytes >= 1 << 30 {
        format!(
            "{:.1} GiB ({bytes} bytes)",
            bytes as f64 / (1u64 << 30) as f64
        )
    } else {
        format!("{bytes} bytes")
    }
}

fn mul(values: &[u64]) -> u64 {
    values.iter().fold(1u64, |acc, &v| acc.saturating_mul(v))
}

/// Every stage's estimated memory (see the module docs). `None` when the config cannot be split
/// into stages (validation reports that).
pub fn estimate(cfg: &Config) -> Option<Vec<StageMemory>> {
    let (m, t, p) = (&cfg.model, &cfg.train, &cfg.pipeline);
    let layouts = partition_layers(m, t.seq_len, p.stages).ok()?;
    let tokens_per_mb = mul(&[t.micro_batch_size as u64, t.seq_len as u64]);
    let per_token_layer = bytes_per_token_layer(cfg);
    // The longest segment a micro-batch may get (with the document partition, of any layout).
    let segment = cfg.segment_rule().map_or_else(
        |_| (t.seq_len as u64).div_ceil(p.splits.max(1) as u64),
        |rule| rule.longest() as u64,
    );
    Some(
        layouts
            .iter()
            .map(|layout| {
                let params = layout
                    .components()
                    .into_iter()
                    .flat_map(|comp| component_params(m, comp))
                    .map(|spec| {
                        let dims: Vec<u64> = spec.shape.iter().map(|&d| d as u64).collect();
                        mul(&dims)
                    })
                    .fold(0u64, u64::saturating_add);
                let in_flight = match p.schedule {
                    ScheduleKind::GPipe => p.microbatches,
                    _ => p.microbatches.min(p.stages - layout.stage),
                } as u64;
                let layers = layout.layers.len() as u64;
                let mut activation_bytes =
                    mul(&[in_flight, tokens_per_mb, layers, per_token_layer]);
                if layout.is_last() {
                    // Logits of the longest segment and their gradient.
                    let tokens = mul(&[t.micro_batch_size as u64, segment]);
                    let logits = mul(&[tokens, head_bytes_per_token(cfg)]);
                    activation_bytes = activation_bytes.saturating_add(logits);
                }
                StageMemory {
                    stage: layout.stage,
                    params,
                    state_bytes: params.saturating_mul(STATE_BYTES_PER_PARAM),
                    activation_bytes,
                }
            })
            .collect(),
    )
}

/// Activation bytes a layer keeps per token: about `6·d_model + ffn` floats.
fn bytes_per_token_layer(cfg: &Config) -> u64 {
    let c = cfg.model.d_model as u64;
    let ffn = c.saturating_mul(cfg.model.ffn_mult as u64);
    mul(&[c, 6]).saturating_add(ffn).saturating_mul(F32)
}

/// Bytes the last stage's head keeps per token: its logits and their gradient.
fn head_bytes_per_token(cfg: &Config) -> u64 {
    mul(&[cfg.model.vocab_size as u64, 2 * F32])
}

/// The byte model of `cfg`'s units, by the estimate above: a unit of segment j on stage r keeps
/// `micro_batch_size · len_j` tokens of `6·d_model + ffn` floats per layer the stage holds, and
/// on the last stage also the head's logits and their gradient. The same config gives the same
/// model on every party, so `seq1f1b-zb` generated with it ([`crate::schedule::generate_within`])
/// is the same order everywhere. With the document partition (per-micro-batch lengths) every
/// segment is sized at the longest one may get. `None` when the config cannot be split into
/// stages or segments (validation reports that).
pub fn unit_bytes(cfg: &Config) -> Option<UnitBytes> {
    let (m, t, p) = (&cfg.model, &cfg.train, &cfg.pipeline);
    let layouts = partition_layers(m, t.seq_len, p.stages).ok()?;
    let lengths = match cfg.segment_rule().ok()? {
        SegmentRule::Fixed(lengths) => lengths,
        rule => vec![rule.longest(); rule.splits()],
    };
    let (layer, head) = (bytes_per_token_layer(cfg), head_bytes_per_token(cfg));
    let per_stage = layouts
        .iter()
        .map(|layout| {
            let per_token = mul(&[layout.layers.len() as u64, layer])
                .saturating_add(if layout.is_last() { head } else { 0 });
            lengths
                .iter()
                .map(|&len| mul(&[t.micro_batch_size as u64, len as u64, per_token]))
                .collect()
        })
        .collect();
    UnitBytes::new(per_stage).ok()
}

/// `cfg`'s training schedule for `microbatches` micro-batches per replica: its kind, stages,
/// virtual stages and splits, with the byte model of [`unit_bytes`] (the order `seq1f1b-zb`
/// takes depends on it). What every worker, a replacement and the bench's replay run.
pub fn training_schedule(
    cfg: &Config,
    microbatches: usize,
) -> Result<Schedule, crate::schedule::ScheduleError> {
    let p = &cfg.pipeline;
    generate_within(
        p.schedule,
        p.stages,
        p.virtual_stages,
        microbatches,
        p.splits,
        unit_bytes(cfg).as_ref(),
    )
}

/// `MemAvailable` of `/proc/meminfo` in bytes, if it can be read.
pub fn available_memory() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// `MemTotal` of `/proc/meminfo` in bytes, if it can be read.
pub fn total_memory() -> Option<u64> {
    meminfo("MemTotal:")
}

/// A `/proc/meminfo` line's value (kB) in bytes.
fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Refuses a run whose estimated memory exceeds what is available: with `elastic.local_agents`
/// (every stage on this machine) the sum over the stages against `available` (this machine's
/// `MemAvailable` when `None` is given and it can be read); otherwise the largest stage against
/// [`crate::config::MAX_BYTES`], the most any single machine could hold.
pub fn check(cfg: &Config, available: Option<u64>) -> Result<Vec<StageMemory>, Box<MemoryError>> {
    let Some(stages) = estimate(cfg) else {
        return Ok(Vec::new());
    };
    let largest = stages
        .iter()
        .max_by_key(|s| s.total())
        .cloned()
        .expect("at least one stage");
    let total = stages
        .iter()
        .map(StageMemory::total)
        .fold(0u64, u64::saturating_add);
    let local = cfg.elastic.local_agents;
    let (need, available, what) = match (local, available.or_else(available_memory)) {
        (true, Some(bytes)) => (
            total,
            bytes,
            "this machine's available memory (MemAvailable)".to_string(),
        ),
        _ => (
            largest.total(),
            crate::config::MAX_BYTES,
            "the most seqpipe accepts for one stage (1 PiB)".to_string(),
        ),
    };
    if need <= available {
        return Ok(stages);
    }
    let together = local.then_some(stages.len());
    Err(MemoryError::new(
        cfg, largest, total, together, available, what,
    ))
}

/// Refuses to start the workers of `slots` (worker slots: replica · stages + stage) of `cfg` on
/// this machine when, by the estimate, they need more than `available` bytes together (a remote
/// node's `MemAvailable`): what an agent checks before it starts its workers, so that a node too
/// small for its stages says so instead of dying in an allocation abort that looks like a lost
/// node. `Ok` when the config cannot be split (the workers report that themselves).
pub fn check_node(cfg: &Config, slots: &[usize], available: u64) -> Result<(), Box<MemoryError>> {
    let Some(all) = estimate(cfg) else {
        return Ok(());
    };
    let p = all.len();
    let mine: Vec<&StageMemory> = slots
        .iter()
        .filter_map(|&s| all.get(s % p.max(1)))
        .collect();
    let Some(largest) = mine.iter().max_by_key(|s| s.total()).map(|s| (*s).clone()) else {
        return Ok(());
    };
    let total = mine
        .iter()
        .map(|s| s.total())
        .fold(0u64, u64::saturating_add);
    if total <= available {
        return Ok(());
    }
    let what = "this node's available memory (MemAvailable)".to_string();
    Err(MemoryError::new(
        cfg,
        largest,
        total,
        Some(mine.len()),
        available,
        what,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_model_is_small_and_fits() {
        let cfg = Config::default();
        let stages = check(&cfg, Some(1 << 30)).unwrap();
        assert_eq!(stages.len(), cfg.pipeline.stages);
        let params: u64 = stages.iter().map(|s| s.params).sum();
        assert_eq!(params, crate::model::params::param_count(&cfg.model) as u64);
        assert!(stages.iter().all(|s| s.activation_bytes > 0));
    }

    #[test]
    fn the_last_stage_holds_the_logits_of_its_longest_segment() {
        let sets = |partition: &str| {
            Config::default()
                .with_overrides(&[
                    format!("pipeline.partition=\"{partition}\""),
                    "data.document_mask=true".into(),
                ])
                .unwrap()
        };
        let (compute, documents) = (sets("compute"), sets("documents"));
        let logits = |cfg: &Config, tokens: usize| {
            (cfg.train.micro_batch_size * tokens * cfg.model.vocab_size * 8) as u64
        };
        let (a, b) = (estimate(&compute).unwrap(), estimate(&documents).unwrap());
        let longest_compute = *compute.segment_lengths().unwrap().iter().max().unwrap();
        let longest = documents.segment_rule().unwrap().longest();
        assert!(longest > longest_compute, "{longest} vs {longest_compute}");
        // Only the last stage's logits differ: sized for the longest segment of any layout.
        let last = a.len() - 1;
        assert_eq!(a[..last], b[..last]);
        assert_eq!(
            b[last].activation_bytes - a[last].activation_bytes,
            logits(&documents, longest) - logits(&compute, longest_compute)
        );
    }

    /// A unit's bytes: its segment's tokens × the stage's layers × the per-token size, the last
    /// stage also the logits and their gradient; the document partition sizes every segment at
    /// the longest. The run's schedule is the zero-bubble order within that model.
    #[test]
    fn unit_bytes_follow_segments_layers_and_the_head() {
        let cfg = Config::default()
            .with_overrides(&[
                "pipeline.partition=\"compute\"".into(),
                "pipeline.schedule=\"seq1f1b-zb\"".into(),
            ])
            .unwrap();
        let (m, t, p) = (&cfg.model, &cfg.train, &cfg.pipeline);
        let bytes = unit_bytes(&cfg).unwrap();
        assert_eq!((bytes.stages(), bytes.splits()), (p.stages, p.splits));
        let lengths = cfg.segment_lengths().unwrap();
        let layouts = partition_layers(m, t.seq_len, p.stages).unwrap();
        let per_token_layer = ((6 + m.ffn_mult) * m.d_model * 4) as u64;
        for (r, layout) in layouts.iter().enumerate() {
            let head = if layout.is_last() {
                m.vocab_size as u64 * 8
            } else {
                0
            };
            for (j, &len) in lengths.iter().enumerate() {
                let tokens = (t.micro_batch_size * len) as u64;
                let want = tokens * (layout.layers.len() as u64 * per_token_layer + head);
                assert_eq!(
                    bytes.of(r, crate::schedule::Unit::new(0, j)),
                    want,
                    "r={r} j={j}"
                );
            }
        }
        let expected = generate_within(
            ScheduleKind::Seq1F1BZeroBubble,
            p.stages,
            1,
            p.microbatches,
            p.splits,
            Some(&bytes),
        )
        .unwrap();
        assert_eq!(training_schedule(&cfg, p.microbatches).unwrap(), expected);
        let documents = cfg
            .with_overrides(&[
                "pipeline.partition=\"documents\"".into(),
                "data.document_mask=true".into(),
            ])
            .unwrap();
        let longest = documents.segment_rule().unwrap().longest();
        let b = unit_bytes(&documents).unwrap();
        let unit = |j| b.of(0, crate::schedule::Unit::new(3, j));
        assert!((0..p.splits).all(|j| unit(j) == unit(0)));
        let stage0 = layouts[0].layers.len() as u64 * per_token_layer;
        assert_eq!(unit(0), (t.micro_batch_size * longest) as u64 * stage0);
    }

    #[test]
    fn huge_vocabulary_is_refused_with_the_numbers() {
        let cfg = Config::default()
            .with_overrides(&["model.vocab_size=1000000000".into()])
            .unwrap();
        let err = check(&cfg, Some(64 << 30)).unwrap_err().to_string();
        assert!(
            err.contains("memory") && err.contains("model.vocab_size = 1000000000"),
            "{err}"
        );
        assert!(err.contains("GiB") && err.contains("parameters"), "{err}");
    }

    #[test]
    fn a_node_checks_the_sum_of_its_own_stages() {
        let cfg = Config::default();
        let stages = estimate(&cfg).unwrap();
        let (one, two) = (stages[1].total(), stages[1].total() + stages[2].total());
        assert!(check_node(&cfg, &[1], one).is_ok());
        assert!(check_node(&cfg, &[1, 2], two).is_ok());
        let err = check_node(&cfg, &[1, 2], two - 1).unwrap_err();
        assert_eq!(
            (err.total, err.together, err.available),
            (two, Some(2), two - 1)
        );
        let text = err.to_string();
        assert!(
            text.contains("the 2 stage(s) on this machine together need")
                && text.contains("this node's available memory"),
            "{text}"
        );
        // Worker slots of a second replica map to their stages.
        let p = cfg.pipeline.stages;
        assert!(check_node(&cfg, &[p + 1], one).is_ok());
        assert!(check_node(&cfg, &[p + 1], one - 1).is_err());
        assert!(check_node(&cfg, &[], 0).is_ok());
    }

    #[test]
    fn absurd_sizes_saturate_instead_of_overflowing() {
        let mut cfg = Config::default();
        cfg.model.d_model = 1 << 40;
        cfg.model.heads = 1;
        cfg.model.vocab_size = usize::MAX / 2;
        let stages = estimate(&cfg).unwrap();
        assert!(stages.iter().any(|s| s.total() == u64::MAX));
        assert!(check(&cfg, Some(u64::MAX - 1)).is_err());
    }
}
