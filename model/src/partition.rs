//! Which layers each pipeline stage holds: contiguous ranges that balance estimated cost.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::PartitionError;
use crate::params::{Component, component_params};

/// A stage's share of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageLayout {
    /// Stage index r in 0..p.
    pub stage: usize,
    /// Number of stages p.
    pub stages: usize,
    /// Transformer blocks held by this stage.
    pub layers: Range<usize>,
}

impl StageLayout {
    /// The first stage owns the embeddings.
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    /// The last stage owns the final norm, the LM head and the loss.
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// The model components this stage holds, in canonical order.
    pub fn components(&self) -> Vec<Component> {
        let mut components = Vec::new();
        if self.is_first() {
            components.push(Component::Embeddings);
        }
        components.extend(self.layers.clone().map(Component::Block));
        if self.is_last() {
            components.push(Component::Head);
        }
        components
    }

    /// The global names of this stage's parameters, in canonical order.
    pub fn param_names(&self, cfg: &ModelConfig) -> Vec<String> {
        self.components()
            .into_iter()
            .flat_map(|c| component_params(cfg, c))
            .map(|spec| spec.name)
            .collect()
    }
}

/// Estimated training FLOPs per token (forward + backward) of each component.
struct Costs {
    embeddings: f64,
    block: f64,
    head: f64,
}

impl Costs {
    fn new(cfg: &ModelConfig, seq_len: usize) -> Self {
        let c = cfg.d_model as f64;
        let t = seq_len as f64;
        // Forward: QKV, attention output and MLP matmuls (2 FLOPs per multiply-add), attention over
        // on average t/2 keys; backward twice the forward.
        let block_fwd =
            2.0 * (4.0 * c * c + 2.0 * c * cfg.ffn() as f64) + 2.0 * 2.0 * (t / 2.0) * c;
        let head_fwd = 2.0 * c * cfg.vocab_size as f64 + 5.0 * cfg.vocab_size as f64;
        Self {
            embeddings: 3.0 * 2.0 * c,
            block: 3.0 * block_fwd,
            head: 3.0 * head_fwd,
        }
    }
}

/// Splits the blocks into `stages` contiguous ranges minimizing the most expensive stage, counting the
/// embeddings on the first stage and the head (final norm, LM head, loss) on the last.
/// Deterministic: ties go to the split that gives earlier stages fewer layers.
pub fn partition_layers(
    cfg: &ModelConfig,
    seq_len: usize,
    stages: usize,
) -> Result<Vec<StageLayout>, PartitionError> {
    let layers = cfg.layers;
    if stages == 0 {
        return Err(PartitionError::NoStages);
    }
    if stages > layers {
        return Err(PartitionError::TooManyStages { stages, layers });
    }
    let costs = Costs::new(cfg, seq_len);
    let stage_cost = |r: usize, n_layers: usize| {
        let mut cost = n_layers as f64 * costs.block;
        if r == 0 {
            cost += costs.embeddings;
        }
        if r + 1 == stages {
            cost += costs.head;
        }
        cost
    };
    // best[r][l] = minimal max-cost placing the first l layers on stages 0..r (each non-empty).
    let mut best = vec![vec![f64::INFINITY; layers + 1]; stages + 1];
    let mut cut = vec![vec![0usize; layers + 1]; stages + 1];
    best[0][0] = 0.0;
    for r in 1..=stages {
        for l in r..=layers {
            for prev in (r - 1)..l {
                let candidate = best[r - 1][prev].max(stage_cost(r - 1, l - prev));
                if candidate < best[r][l] {
                    best[r][l] = candidate;
                    cut[r][l] = prev;
                }
            }
        }
    }
    let mut bounds = vec![layers];
    let mut l = layers;
    for r in (1..=stages).rev() {
        l = cut[r][l];
        bounds.push(l);
    }
    bounds.reverse();
    Ok((0..stages)
        .map(|r| StageLayout {
            stage: r,
            stages,
            layers: bounds[r]..bounds[r + 1],
        })
        .collect())
}

/// The layer chunks of each worker with `virtual_stages` chunks per worker (interleaved
/// schedules): [`partition_layers`] over the `stages · virtual_stages` virtual stages, then worker
/// r's chunk c is virtual stage `c·stages + r` (`result[r][c]`). Each chunk's [`StageLayout`] says
/// its virtual stage and their count, so only virtual stage 0 holds the embeddings and only the
/// last holds the head. With one chunk per worker this is `partition_layers`, one layout each.
pub fn partition_virtual_layers(
    cfg: &ModelConfig,
    seq_len: usize,
    stages: usize,
    virtual_stages: usize,
) -> Result<Vec<Vec<StageLayout>>, PartitionError> {
    if virtual_stages == 0 {
        return Err(PartitionError::NoStages);
    }
    let all = partition_layers(cfg, seq_len, stages.saturating_mul(virtual_stages))?;
    Ok((0..stages)
        .map(|r| {
            (0..virtual_stages)
                .map(|c| all[c * stages + r].clone())
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_all_layers_contiguously() {
        for layers in 1..10 {
            for stages in 1..=layers {
                let cfg = ModelConfig {
                    layers,
                    ..ModelConfig::default()
                };
                let parts = partition_layers(&cfg, 128, stages).unwrap();
                assert_eq!(parts.len(), stages);
                assert_eq!(parts[0].layers.start, 0);
                assert_eq!(parts[stages - 1].layers.end, layers);
                for w in parts.windows(2) {
                    assert_eq!(w[0].layers.end, w[1].layers.start);
                }
                assert!(parts.iter().all(|p| !p.layers.is_empty()));
            }
        }
    }

    #[test]
    fn expensive_head_gets_fewer_layers() {
        // A huge vocabulary makes the head cost several blocks: the last stage must hold fewer layers.
        let cfg = ModelConfig {
            layers: 8,
            vocab_size: 16_384,
            d_model: 64,
            heads: 4,
            ..ModelConfig::default()
        };
        let parts = partition_layers(&cfg, 64, 2).unwrap();
        assert!(parts[1].layers.len() < parts[0].layers.len(), "{parts:?}");
    }

    #[test]
    fn too_many_stages_is_an_error() {
        let cfg = ModelConfig {
            layers: 2,
            ..ModelConfig::default()
        };
        let err = partition_layers(&cfg, 64, 3).unwrap_err();
        assert!(
            err.to_string()
                .contains("every stage needs at least one layer")
        );
    }

    #[test]
    fn virtual_chunks_are_the_partition_of_all_virtual_stages_dealt_round_robin() {
        let cfg = ModelConfig {
            layers: 8,
            ..ModelConfig::default()
        };
        let flat = partition_layers(&cfg, 128, 8).unwrap();
        let chunks = partition_virtual_layers(&cfg, 128, 4, 2).unwrap();
        assert_eq!(chunks.len(), 4);
        for (r, worker) in chunks.iter().enumerate() {
            assert_eq!(worker.len(), 2);
            for (c, layout) in worker.iter().enumerate() {
                assert_eq!(layout, &flat[c * 4 + r]);
                assert_eq!(layout.stage, c * 4 + r);
                assert_eq!(layout.stages, 8);
            }
        }
        // Embeddings only on worker 0's chunk 0, the head only on worker 3's chunk 1.
        let holders = |pick: fn(&StageLayout) -> bool| -> Vec<(usize, usize)> {
            (0..4)
                .flat_map(|r| (0..2).map(move |c| (r, c)))
                .filter(|&(r, c)| pick(&chunks[r][c]))
                .collect()
        };
        assert_eq!(holders(StageLayout::is_first), [(0, 0)]);
        assert_eq!(holders(StageLayout::is_last), [(3, 1)]);
        // One chunk per worker is the plain partition.
        let one = partition_virtual_layers(&cfg, 128, 4, 1).unwrap();
        let plain = partition_layers(&cfg, 128, 4).unwrap();
        assert_eq!(one.into_iter().flatten().collect::<Vec<_>>(), plain);
        assert!(
            partition_virtual_layers(&cfg, 128, 4, 3).is_err(),
            "12 chunks, 8 layers"
        );
        assert!(partition_virtual_layers(&cfg, 128, 4, 0).is_err());
    }
}
