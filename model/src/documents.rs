//! Document masks of a micro-batch, written once for every device: the per-row document starts a
//! stage receives (from its own tokens on the first stage, from the previous stage's message on the
//! others) checked as untrusted input and turned into an [`ops::DocumentMask`], and the position
//! ids of a segment when positions restart at each document (`data.reset_positions`).
//!
//! The starts are a pure function of the micro-batch's input tokens, so every stage and replica
//! holds the same mask; a malformed list (a peer's bug or a hostile peer) is refused with the
//! reason, never a panic.

use ops::DocumentMask;
use thiserror::Error;

/// Why a micro-batch's document starts cannot be used.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DocumentError {
    /// Another number of rows than the micro-batch has.
    #[error("document starts for {got} rows, the micro-batch has {expected}")]
    Rows { expected: usize, got: usize },
    /// A row that is not a valid list of starts.
    #[error(
        "document starts of row {row}: {reason} (each row must start with 0, increase strictly and stay below seq_len = {seq_len})"
    )]
    Row {
        row: usize,
        seq_len: usize,
        reason: String,
    },
}

/// The document mask of a micro-batch of `batch` rows of `seq_len` positions from its per-row
/// document starts: each row non-empty, beginning with 0, strictly increasing and below `seq_len`
/// (so at most `seq_len` starts a row).
pub fn document_mask(
    rows: Vec<Vec<usize>>,
    batch: usize,
    seq_len: usize,
) -> Result<DocumentMask, DocumentError> {
    check_starts(&rows, batch, seq_len)?;
    DocumentMask::new(rows).map_err(|e| DocumentError::Row {
        row: 0,
        seq_len,
        reason: e.to_string(),
    })
}

/// The checks of [`document_mask`], without building the mask.
pub fn check_starts(
    rows: &[Vec<usize>],
    batch: usize,
    seq_len: usize,
) -> Result<(), DocumentError> {
    if rows.len() != batch {
        return Err(DocumentError::Rows {
            expected: batch,
            got: rows.len(),
        });
    }
    for (row, starts) in rows.iter().enumerate() {
        let bad = |reason: String| DocumentError::Row {
            row,
            seq_len,
            reason,
        };
        if starts.len() > seq_len {
            return Err(bad(format!("{} starts", starts.len())));
        }
        if starts.first() != Some(&0) {
            return Err(bad(format!("the first start is {:?}", starts.first())));
        }
        if let Some(w) = starts.windows(2).find(|w| w[0] >= w[1]) {
            return Err(bad(format!("{} is followed by {}", w[0], w[1])));
        }
        if let Some(&last) = starts.last().filter(|&&s| s >= seq_len) {
            return Err(bad(format!("start {last} is past the sequence")));
        }
    }
    Ok(())
}

/// Position ids of positions `start..start + len` of every row, row-major `(B·len,)`: the absolute
/// position, or with `reset` the offset within its document (`pos − doc_start(pos)`).
pub fn position_ids(
    mask: Option<&DocumentMask>,
    batch: usize,
    start: usize,
    len: usize,
    reset: bool,
) -> Vec<u32> {
    (0..batch)
        .flat_map(|b| {
            (start..start + len).map(move |p| match mask {
                Some(m) if reset => (p - m.doc_start(b, p)) as u32,
                _ => p as u32,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_are_checked_as_untrusted_input() {
        assert!(document_mask(vec![vec![0, 3], vec![0]], 2, 8).is_ok());
        let err = |rows: Vec<Vec<usize>>| document_mask(rows, 2, 8).unwrap_err().to_string();
        assert!(err(vec![vec![0]]).contains("for 1 rows, the micro-batch has 2"));
        assert!(err(vec![vec![0], vec![]]).contains("row 1: the first start is None"));
        assert!(err(vec![vec![1], vec![0]]).contains("row 0: the first start is Some(1)"));
        assert!(err(vec![vec![0, 4, 4], vec![0]]).contains("4 is followed by 4"));
        assert!(err(vec![vec![0, 5, 2], vec![0]]).contains("5 is followed by 2"));
        assert!(err(vec![vec![0, 8], vec![0]]).contains("start 8 is past the sequence"));
        assert!(err(vec![(0..9).collect(), vec![0]]).contains("9 starts"));
        // One-token documents everywhere: seq_len starts.
        assert!(document_mask(vec![(0..8).collect(), vec![0, 7]], 2, 8).is_ok());
    }

    #[test]
    fn positions_restart_at_each_document_only_when_asked() {
        let mask = document_mask(vec![vec![0, 3], vec![0, 1, 5]], 2, 8).unwrap();
        assert_eq!(
            position_ids(Some(&mask), 2, 2, 4, true),
            vec![2, 0, 1, 2, 1, 2, 3, 0]
        );
        assert_eq!(
            position_ids(Some(&mask), 2, 2, 4, false),
            vec![2, 3, 4, 5, 2, 3, 4, 5]
        );
        assert_eq!(position_ids(None, 1, 0, 3, true), vec![0, 1, 2]);
    }
}
