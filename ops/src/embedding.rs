//! Token/position embedding lookup.

use candle_core::Tensor;

use crate::error::Result;
use crate::util::{check_indices, dims2, shape_err};

/// Looks up rows of `table` `(V, C)` for `ids` `(N,)` (U32, all `< V`); returns `(N, C)`.
pub fn embedding_forward(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    const OP: &str = "embedding_forward";
    let (v, _c) = dims2(table, OP, "table")?;
    check_indices(ids, v, OP, "ids")?;
    Ok(table.index_select(ids, 0)?) // (N, C)
}

/// Gradient of the table for the lookup of `ids` `(N,)`: a dense `(vocab_size, C)` tensor where
/// row `r` is the sum of the rows `dy[i]` with `ids[i] == r`, added in index order
/// (deterministic). `dy` is `(N, C)`.
pub fn embedding_backward(ids: &Tensor, dy: &Tensor, vocab_size: usize) -> Result<Tensor> {
    const OP: &str = "embedding_backward";
    let (n, c) = dims2(dy, OP, "dy")?;
    let nid = check_indices(ids, vocab_size, OP, "ids")?;
    if nid != n {
        return shape_err(format!("{OP}: ids has {nid} entries but dy has {n} rows"));
    }
    let zeros = Tensor::zeros((vocab_size, c), dy.dtype(), dy.device())?; // (V, C)
    Ok(zeros.index_add(ids, &dy.contiguous()?, 0)?)
}
