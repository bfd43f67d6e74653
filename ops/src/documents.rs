//! Document layouts of packed sequences, for document-masked attention.
//!
//! A packed sequence holds several documents back to back; with a document mask a token attends
//! only to the earlier tokens of its own document. A layout is stored compactly: per sequence
//! (batch row), the sorted positions where documents start, the first one 0 — `[0, 517, 1300]`
//! is three documents, positions `0..517`, `517..1300` and `1300..` (up to the sequence's end).
//! Positions are absolute within the sequence (not within a Seq1F1B segment), so the same layout
//! serves every segment of a micro-batch.

use crate::error::Result;
use crate::util::shape_err;

/// The document starts of each sequence of a batch: row `b` holds the sorted, distinct positions
/// where the documents of sequence `b` start, beginning with 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocumentMask {
    rows: Vec<Vec<usize>>,
}

impl DocumentMask {
    /// A layout from per-row document starts. Errors unless every row is non-empty, starts at 0
    /// and is strictly increasing (starts past a sequence's end are allowed and never used).
    pub fn new(rows: Vec<Vec<usize>>) -> Result<Self> {
        for (b, row) in rows.iter().enumerate() {
            if row.first() != Some(&0) {
                return shape_err(format!(
                    "document mask: row {b} must start with a document at position 0, got {:?}",
                    &row[..row.len().min(4)]
                ));
            }
            if let Some(w) = row.windows(2).find(|w| w[0] >= w[1]) {
                return shape_err(format!(
                    "document mask: row {b}'s document starts must be strictly increasing, \
                     got {} then {}",
                    w[0], w[1]
                ));
            }
        }
        Ok(Self { rows })
    }

    /// Every one of `batch` sequences is one document: the mask of plain causal attention.
    pub fn single(batch: usize) -> Self {
        Self {
            rows: vec![vec![0]; batch],
        }
    }

    /// Number of sequences (batch rows).
    pub fn batch(&self) -> usize {
        self.rows.len()
    }

    /// The document starts of row `b`.
    pub fn starts(&self, b: usize) -> &[usize] {
        &self.rows[b]
    }

    /// Start of the document holding position `pos` of row `b`.
    pub fn doc_start(&self, b: usize, pos: usize) -> usize {
        doc_start(&self.rows[b], pos)
    }

    /// The first key position any query at `seg_start..` of any row may attend to: keys before it
    /// are not needed by this segment (nor any later one), so a K/V prefix may begin there.
    pub fn prefix_start(&self, seg_start: usize) -> usize {
        (0..self.batch())
            .map(|b| self.doc_start(b, seg_start))
            .min()
            .unwrap_or(seg_start)
    }
}

/// Start of the document holding `pos`, given sorted document `starts` beginning with 0.
pub fn doc_start(starts: &[usize], pos: usize) -> usize {
    let i = starts.partition_point(|&s| s <= pos);
    if i == 0 { 0 } else { starts[i - 1] }
}
