//! The run's plan as a typed value: how many stages and replicas the pipeline has, which layers
//! each stage holds and how every sequence is segmented, decided once from the validated config
//! (and again only when the elastic core adopts another layout), then handed down. The config
//! itself is never changed after validation; what the pipeline's workers read is derived from
//! (config, plan) in one place, [`RunPlan::pipeline_config`].

use crate::config::{Config, ConfigError};
use crate::data::{DataError, TokenSource, check_source, synthetic_documents, synthetic_language};
use crate::model::{PartitionError, StageLayout, partition_layers};
use crate::schedule::{ScheduleKind, SegmentRule, generate_virtual};

/// Why no plan can be made of a validated config.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The layers cannot be split into the stages.
    #[error(transparent)]
    Partition(#[from] PartitionError),
    /// The segment lengths cannot be derived (`pipeline.partition`, `pipeline.splits`).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The dataset cannot be used: a data fault, never a lost node.
    #[error(transparent)]
    Data(#[from] DataError),
}

/// What the launcher found when it checked the configured dataset.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSummary {
    /// The synthetic language (`data.source = "synthetic"`).
    Synthetic {
        /// Its Markov order.
        order: usize,
        /// Its entropy rate in nats per token.
        entropy_rate_nats: f64,
        /// The lowest mean loss a model can reach on sequences of `train.seq_len` tokens.
        loss_lower_bound: f64,
    },
    /// The synthetic language in document mode (`data.synthetic_document_median > 0`). No loss
    /// lower bound is stated: where a document ends follows the log-normal length's hazard at
    /// each position, and the documents' first tokens come from the language's fresh start, so
    /// the plain language's bound does not hold and the exact one is not computed.
    SyntheticDocuments {
        /// The source's own description (lengths, separator, language).
        describe: String,
    },
    /// Token files or objects at `data.source`, checked to hold a training sample and a validation
    /// split that fits the vocabulary.
    Tokens {
        /// `data.source` as configured.
        source: String,
    },
}

impl DataSummary {
    /// Checks the dataset of `cfg` once, before any worker starts, so that an unusable one stops
    /// the run with an error naming it ([`check_source`]).
    pub fn check(cfg: &Config) -> Result<Self, DataError> {
        check_source(&cfg.data, cfg.model.vocab_size, cfg.train.seq_len + 1)?;
        if !cfg.data.is_synthetic() {
            return Ok(Self::Tokens {
                source: cfg.data.source.clone(),
            });
        }
        if cfg.data.synthetic_document_median > 0 {
            let docs = synthetic_documents(&cfg.data, cfg.model.vocab_size)?;
            return Ok(Self::SyntheticDocuments {
                describe: docs.describe(),
            });
        }
        let lang = synthetic_language(&cfg.data, cfg.model.vocab_size)?;
        Ok(Self::Synthetic {
            order: lang.order(),
            entropy_rate_nats: lang.entropy_rate_nats(),
            loss_lower_bound: lang.loss_lower_bound(cfg.train.seq_len),
        })
    }

    /// The loss lower bound of a synthetic language (none for real data).
    pub fn loss_lower_bound(&self) -> Option<f64> {
        match self {
            Self::Synthetic {
                loss_lower_bound, ..
            } => Some(*loss_lower_bound),
            Self::Tokens { .. } | Self::SyntheticDocuments { .. } => None,
        }
    }
}

/// The pipeline's layout: `stages` × `replicas` workers, the layers of each stage and the segment
/// lengths of every micro-batch's sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlan {
    /// Pipeline stages p.
    pub stages: usize,
    /// Data-parallel replicas d of the pipeline.
    pub replicas: usize,
    /// The layers each stage holds, stage by stage (`stages` of them).
    pub layouts: Vec<StageLayout>,
    /// How every micro-batch's sequence is split into segments: one table, or each micro-batch's
    /// own lengths from its documents (the same on every stage and replica either way).
    pub segments: SegmentRule,
    /// The dataset, as checked when the run was planned.
    pub data: DataSummary,
}

impl RunPlan {
    /// The plan of a validated config: the layout it asks for (`pipeline.stages`,
    /// `pipeline.replicas`), with the dataset checked. The elastic core may adopt another layout
    /// once nodes join ([`RunPlan::with_layout`]).
    pub fn decide(cfg: &Config) -> Result<Self, PlanError> {
        let data = DataSummary::check(cfg)?;
        Self::layout(cfg, cfg.pipeline.stages, cfg.pipeline.replicas, data)
    }

    /// This plan with `stages` stages and `replicas` replicas (an elastic plan's layout); the
    /// dataset is not checked again.
    pub fn with_layout(
        &self,
        cfg: &Config,
        stages: usize,
        replicas: usize,
    ) -> Result<Self, PlanError> {
        if (stages, replicas) == (self.stages, self.replicas) {
            return Ok(self.clone());
        }
        Self::layout(cfg, stages, replicas, self.data.clone())
    }

    fn layout(
        cfg: &Config,
        stages: usize,
        replicas: usize,
        data: DataSummary,
    ) -> Result<Self, PlanError> {
        Ok(Self {
            stages,
            replicas,
            layouts: partition_layers(&cfg.model, cfg.train.seq_len, stages)?,
            segments: cfg.segment_rule()?,
            data,
        })
    }

    /// Workers of the pipeline: `stages × replicas`.
    pub fn workers(&self) -> usize {
        self.stages * self.replicas
    }

    /// The config the pipeline of this plan and its workers read: `cfg` (never changed itself)
    /// with this plan's stages and replicas. Worker processes take their layout from their config
    /// file, so this is where the plan enters it.
    ///
    /// An interleaved schedule that this plan's shape cannot run (the elastic core chose the
    /// stages from the nodes left: fewer than p·v layers, or micro-batches per replica not a
    /// multiple of the stages, or for `seq1f1b-i` segments not dividing them) runs as its plain
    /// form (`seq1f1b-i` → `seq1f1b`, `1f1b-i` → `1f1b`, one chunk per stage): the same
    /// arithmetic in the same order, so the same weights bit for bit.
    pub fn pipeline_config(&self, cfg: &Config) -> Config {
        let mut pipeline = cfg.clone();
        pipeline.pipeline.stages = self.stages;
        pipeline.pipeline.replicas = self.replicas;
        if let Some(plain) = plain_form_if_not_interleavable(&pipeline) {
            tracing::warn!(
                stages = self.stages,
                replicas = self.replicas,
                schedule = %pipeline.pipeline.schedule,
                virtual_stages = pipeline.pipeline.virtual_stages,
                "this plan's shape cannot interleave; its pipeline runs {plain} (bit-identical)"
            );
            pipeline.pipeline.schedule = plain;
            pipeline.pipeline.virtual_stages = 1;
        }
        pipeline
    }
}

/// The plain form of `cfg`'s interleaved schedule when its (stages, replicas) cannot run it with
/// its virtual stages; `None` when it can, or the schedule is not interleaved.
fn plain_form_if_not_interleavable(cfg: &Config) -> Option<ScheduleKind> {
    let p = &cfg.pipeline;
    let plain = match p.schedule {
        ScheduleKind::Seq1F1BInterleaved => ScheduleKind::Seq1F1B,
        ScheduleKind::OneFOneBInterleaved => ScheduleKind::OneFOneB,
        _ => return None,
    };
    let fits = p.replicas > 0
        && p.stages.saturating_mul(p.virtual_stages) <= cfg.model.layers
        && generate_virtual(
            p.schedule,
            p.stages,
            p.virtual_stages,
            p.microbatches / p.replicas,
            p.splits,
        )
        .is_ok();
    (!fits).then_some(plain)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(stages: usize, replicas: usize) -> Config {
        Config::load(
            None,
            &[
                format!("pipeline.stages={stages}"),
                format!("pipeline.replicas={replicas}"),
            ],
        )
        .unwrap()
    }

    #[test]
    fn decide_lays_out_what_the_config_asks_for() {
        let cfg = config(2, 1);
        let plan = RunPlan::decide(&cfg).unwrap();
        assert_eq!((plan.stages, plan.replicas, plan.workers()), (2, 1, 2));
        assert_eq!(
            plan.layouts,
            partition_layers(&cfg.model, cfg.train.seq_len, 2).unwrap()
        );
        assert_eq!(plan.segments, cfg.segment_rule().unwrap());
        assert!(matches!(plan.data, DataSummary::Synthetic { .. }));
        assert!(plan.data.loss_lower_bound().unwrap() > 0.0);
    }

    #[test]
    fn an_interleaved_run_on_a_shape_that_cannot_interleave_runs_its_plain_form() {
        let cfg = Config::load(
            None,
            &[
                "model.layers=8".into(),
                "pipeline.schedule=seq1f1b-i".into(),
                "pipeline.virtual_stages=2".into(),
                "pipeline.stages=4".into(),
                "pipeline.microbatches=4".into(),
                "pipeline.splits=2".into(),
                "elastic.mid_step=false".into(),
                "elastic.peer_snapshots=false".into(),
            ],
        )
        .unwrap();
        let plan = RunPlan::decide(&cfg).unwrap();
        let at = |stages, replicas| {
            let c = plan
                .with_layout(&cfg, stages, replicas)
                .unwrap()
                .pipeline_config(&cfg);
            c.validate().unwrap();
            (c.pipeline.schedule.as_str(), c.pipeline.virtual_stages)
        };
        assert_eq!(at(4, 1), ("seq1f1b-i", 2));
        assert_eq!(at(2, 1), ("seq1f1b-i", 2));
        assert_eq!(at(2, 2), ("seq1f1b-i", 2));
        // 3 stages: 4 micro-batches are not rounds of 3, and 2 segments do not divide 3.
        assert_eq!(at(3, 1), ("seq1f1b", 1));
        // 1 stage has no one to interleave with; 4 replicas of 2 leave 1 micro-batch each.
        assert_eq!(at(1, 1), ("seq1f1b", 1));
        assert_eq!(at(2, 4), ("seq1f1b", 1));
        // The config itself is never changed.
        assert_eq!(cfg.pipeline.schedule.as_str(), "seq1f1b-i");
    }

    #[test]
    fn another_layout_changes_the_plan_and_never_the_config() {
        let cfg = config(2, 1);
        let before = cfg.to_toml();
        let plan = RunPlan::decide(&cfg).unwrap();
        let one = plan.with_layout(&cfg, 1, 1).unwrap();
        assert_eq!(one.stages, 1);
        assert_eq!(one.layouts.len(), 1);
        assert_eq!(one.layouts[0].layers, 0..cfg.model.layers);
        assert_eq!(one.data, plan.data);
        let derived = one.pipeline_config(&cfg);
        assert_eq!((derived.pipeline.stages, derived.pipeline.replicas), (1, 1));
        // Everything but the layout is the validated config's.
        let mut back = derived.clone();
        (back.pipeline.stages, back.pipeline.replicas) = (2, 1);
        assert_eq!(back, cfg);
        assert_eq!(cfg.to_toml(), before);
    }

    #[test]
    fn an_impossible_layout_is_refused_with_the_reason() {
        let cfg = config(2, 1);
        let plan = RunPlan::decide(&cfg).unwrap();
        let err = plan.with_layout(&cfg, cfg.model.layers + 1, 1).unwrap_err();
        assert!(matches!(err, PlanError::Partition(_)), "{err}");
        assert!(
            err.to_string()
                .contains("every stage needs at least one layer")
        );
    }
}
