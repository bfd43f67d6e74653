//! How a step's micro-batches are cut into segments: one table for every micro-batch (the
//! `uniform` and `compute` partitions), or each micro-batch its own lengths from its documents
//! (the `documents` partition, [`super::doc_segments`]).
//!
//! A [`SegmentRule`] is a pure function of the config, and its [`SegmentRule::lengths`] a pure
//! function of a micro-batch's document starts: every stage and replica that sees the same data
//! (the first stage from its tokens, the others from the starts its activations carry) cuts the
//! same way, with no message of its own.

use std::fmt;

use super::ScheduleError;
use super::doc_segments::{batch_segment_lengths, longest_segment};
use super::segments::{FlopsModel, Partition, segment_lengths};

/// How each micro-batch's sequence is cut into `splits` segments.
#[derive(Clone, Debug, PartialEq)]
pub enum SegmentRule {
    /// Every micro-batch: these lengths.
    Fixed(Vec<usize>),
    /// Each micro-batch its own lengths: [`batch_segment_lengths`] of its rows' document starts.
    Documents {
        /// Positions per sequence T.
        seq_len: usize,
        /// The FLOPs model the costs come from.
        model: FlopsModel,
        /// The lengths of a micro-batch whose rows are one document each (the compute
        /// partition's).
        one_document: Vec<usize>,
        /// No segment of any micro-batch is longer ([`longest_segment`]).
        longest: usize,
    },
}

impl SegmentRule {
    /// The rule of `partition` for sequences of `seq_len` tokens cut into `splits` segments
    /// under the FLOPs model `m`. Errors as [`segment_lengths`] does (for the document partition,
    /// as the compute partition's).
    pub fn new(
        partition: Partition,
        seq_len: usize,
        splits: usize,
        m: &FlopsModel,
    ) -> Result<Self, ScheduleError> {
        match partition {
            Partition::Uniform | Partition::Compute => Ok(SegmentRule::Fixed(segment_lengths(
                partition, seq_len, splits, m,
            )?)),
            Partition::Documents => Ok(SegmentRule::Documents {
                seq_len,
                model: *m,
                one_document: segment_lengths(Partition::Compute, seq_len, splits, m)?,
                longest: longest_segment(seq_len, splits, m)?,
            }),
        }
    }

    /// Whether micro-batches get lengths of their own (from their documents).
    pub fn per_micro_batch(&self) -> bool {
        matches!(self, SegmentRule::Documents { .. })
    }

    /// Segments per micro-batch k.
    pub fn splits(&self) -> usize {
        self.table().len()
    }

    /// Positions per sequence T (the lengths' sum).
    pub fn seq_len(&self) -> usize {
        self.table().iter().sum()
    }

    /// The lengths every micro-batch gets (fixed), or those of a micro-batch of one document per
    /// row (per micro-batch): what a stage is built with before any micro-batch's own lengths.
    pub fn table(&self) -> &[usize] {
        match self {
            SegmentRule::Fixed(lengths) => lengths,
            SegmentRule::Documents { one_document, .. } => one_document,
        }
    }

    /// The segment lengths of a micro-batch whose rows' documents start at `docs` (one sorted
    /// list per row, beginning with 0). A fixed rule ignores them; the document rule needs them
    /// ([`ScheduleError::InvalidPartition`] without, or when they are malformed).
    pub fn lengths(&self, docs: Option<&[Vec<usize>]>) -> Result<Vec<usize>, ScheduleError> {
        match self {
            SegmentRule::Fixed(lengths) => Ok(lengths.clone()),
            SegmentRule::Documents {
                seq_len,
                model,
                one_document,
                ..
            } => {
                let docs = docs.ok_or_else(|| {
                    ScheduleError::InvalidPartition(
                        "the \"documents\" partition cuts each micro-batch from its document \
                         starts, and none were given (it needs data.document_mask = true)"
                            .into(),
                    )
                })?;
                let rows: Vec<&[usize]> = docs.iter().map(Vec::as_slice).collect();
                batch_segment_lengths(&rows, *seq_len, one_document.len(), model)
            }
        }
    }

    /// The longest segment any micro-batch may get: what the largest unit's memory is sized for.
    pub fn longest(&self) -> usize {
        match self {
            SegmentRule::Fixed(lengths) => lengths.iter().copied().max().unwrap_or(0),
            SegmentRule::Documents { longest, .. } => *longest,
        }
    }
}

impl fmt::Display for SegmentRule {
    /// `[16, 16]` for a fixed table; for the document rule, its one-document table and bound.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SegmentRule::Fixed(lengths) => write!(f, "{lengths:?}"),
            SegmentRule::Documents {
                one_document,
                longest,
                ..
            } => write!(
                f,
                "per micro-batch from its documents ({one_document:?} for one document per row, \
                 none over {longest})"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> FlopsModel {
        FlopsModel {
            layers: 4,
            hidden: 16,
            heads: 2,
            head_dim: 8,
            ffn: 64,
            vocab: 32,
            attention_cost: 1.0,
        }
    }

    #[test]
    fn fixed_rules_are_the_partition_tables() {
        let m = model();
        for p in [Partition::Uniform, Partition::Compute] {
            let rule = SegmentRule::new(p, 64, 4, &m).unwrap();
            let table = segment_lengths(p, 64, 4, &m).unwrap();
            assert!(!rule.per_micro_batch());
            assert_eq!(rule.table(), table.as_slice());
            assert_eq!((rule.splits(), rule.seq_len()), (4, 64));
            assert_eq!(rule.lengths(None).unwrap(), table);
            assert_eq!(rule.lengths(Some(&[vec![0, 3]])).unwrap(), table);
            assert_eq!(rule.longest(), *table.iter().max().unwrap());
            assert_eq!(rule.to_string(), format!("{table:?}"));
        }
    }

    #[test]
    fn the_document_rule_cuts_each_micro_batch_from_its_documents() {
        let m = model();
        let rule = SegmentRule::new(Partition::Documents, 64, 4, &m).unwrap();
        let compute = segment_lengths(Partition::Compute, 64, 4, &m).unwrap();
        assert!(rule.per_micro_batch());
        assert_eq!(rule.table(), compute.as_slice());
        assert_eq!((rule.splits(), rule.seq_len()), (4, 64));
        // One document per row: the compute partition.
        assert_eq!(rule.lengths(Some(&[vec![0], vec![0]])).unwrap(), compute);
        // Many one-token documents, then a long one: less attention than one causal triangle.
        let packed = vec![(0..40).collect::<Vec<_>>(), (0..40).collect()];
        let own = rule.lengths(Some(&packed)).unwrap();
        assert_eq!(own.iter().sum::<usize>(), 64);
        assert_ne!(own, compute, "the layout did not change the lengths");
        assert!(own.iter().all(|&l| l <= rule.longest()));
        // The same starts, the same lengths.
        assert_eq!(rule.lengths(Some(&packed)).unwrap(), own);
        // No starts, or malformed ones: refused.
        let e = rule.lengths(None).unwrap_err().to_string();
        assert!(e.contains("data.document_mask"), "{e}");
        assert!(rule.lengths(Some(&[vec![1, 4]])).is_err());
        assert!(rule.to_string().contains("per micro-batch"), "{rule}");
        // Bad shapes are refused as for the compute partition.
        assert!(SegmentRule::new(Partition::Documents, 4, 5, &m).is_err());
    }
}
