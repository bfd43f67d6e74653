//! Rotary position embedding, "rotate_half" convention (GPT-NeoX / LLaMA / candle `rope`).
//!
//! Dimension `i < D/2` is paired with `i + D/2` and the pair at position `p` is rotated by
//! `theta = p * inv_freq_i`, `inv_freq_i = base^(-2i/D)`:
//! `out_i = x_i cos - x_{i+D/2} sin`, `out_{i+D/2} = x_{i+D/2} cos + x_i sin`.

use candle_core::{DType, Device, Tensor};

use crate::error::Result;
use crate::util::{dims4, shape_err};

/// Precomputed cos/sin tables for positions `0..max_len`.
#[derive(Clone, Debug)]
pub struct RopeTable {
    /// cos(theta). // (max_len, D/2)
    cos: Tensor,
    /// sin(theta). // (max_len, D/2)
    sin: Tensor,
    /// [cos, cos] along the last dim. // (max_len, D)
    cos_full: Tensor,
    /// [-sin, sin] along the last dim. // (max_len, D)
    sin_signed: Tensor,
    max_len: usize,
    head_dim: usize,
}

impl RopeTable {
    /// Builds the tables for `max_len` positions and an even `head_dim`; the angles are computed
    /// in f64 and then converted to `dtype`.
    pub fn new(
        max_len: usize,
        head_dim: usize,
        base: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return shape_err(format!(
                "RopeTable::new: head_dim must be even and positive, got {head_dim}"
            ));
        }
        if !dtype.is_float() {
            return shape_err(format!(
                "RopeTable::new: dtype must be a float type, got {dtype:?}"
            ));
        }
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| base.powf(-((2 * i) as f64) / head_dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(max_len * half);
        let mut sin = Vec::with_capacity(max_len * half);
        for p in 0..max_len {
            for &f in &inv_freq {
                let theta = p as f64 * f;
                cos.push(theta.cos());
                sin.push(theta.sin());
            }
        }
        let mut cos_full = Vec::with_capacity(max_len * head_dim);
        let mut sin_signed = Vec::with_capacity(max_len * head_dim);
        for p in 0..max_len {
            let row = p * half..(p + 1) * half;
            cos_full.extend_from_slice(&cos[row.clone()]);
            cos_full.extend_from_slice(&cos[row.clone()]);
            sin_signed.extend(sin[row.clone()].iter().map(|s| -s));
            sin_signed.extend_from_slice(&sin[row]);
        }
        let mk = |v: Vec<f64>, d: usize| -> Result<Tensor> {
            Ok(Tensor::from_vec(v, (max_len, d), device)?.to_dtype(dtype)?)
        };
        Ok(Self {
            cos: mk(cos, half)?,
            sin: mk(sin, half)?,
            cos_full: mk(cos_full, head_dim)?,
            sin_signed: mk(sin_signed, head_dim)?,
            max_len,
            head_dim,
        })
    }

    /// Number of positions covered by the table.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Head dimension `D` the table was built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// cos(theta) table. // (max_len, D/2)
    pub fn cos(&self) -> &Tensor {
        &self.cos
    }

    /// sin(theta) table. // (max_len, D/2)
    pub fn sin(&self) -> &Tensor {
        &self.sin
    }

    /// Rotates `x` `(B, H, s, D)` holding positions `offset..offset+s` by `+theta`.
    pub fn forward(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        self.rotate(x, offset, false, "RopeTable::forward")
    }

    /// Backward of [`RopeTable::forward`]: the transpose of a rotation is the rotation by
    /// `-theta`, applied to `dy` `(B, H, s, D)` holding positions `offset..offset+s`.
    pub fn backward(&self, dy: &Tensor, offset: usize) -> Result<Tensor> {
        self.rotate(dy, offset, true, "RopeTable::backward")
    }

    /// `x * [cos, cos] ± [x2, x1] * [-sin, sin]` (`+` for forward, `-` for the inverse).
    fn rotate(&self, x: &Tensor, offset: usize, inverse: bool, op: &str) -> Result<Tensor> {
        let (_b, _h, s, d) = dims4(x, op, "x")?;
        if d != self.head_dim {
            return shape_err(format!(
                "{op}: last dim is {d} but the table was built for head_dim {}",
                self.head_dim
            ));
        }
        if offset + s > self.max_len {
            return shape_err(format!(
                "{op}: positions {offset}..{} exceed the table length {}",
                offset + s,
                self.max_len
            ));
        }
        if x.dtype() != self.cos.dtype() {
            return shape_err(format!(
                "{op}: x has dtype {:?} but the table has dtype {:?}",
                x.dtype(),
                self.cos.dtype()
            ));
        }
        let half = d / 2;
        let cos = self.cos_full.narrow(0, offset, s)?; // (s, D)
        let sin = self.sin_signed.narrow(0, offset, s)?; // (s, D)
        let swapped = Tensor::cat(&[x.narrow(3, half, half)?, x.narrow(3, 0, half)?], 3)?; // (B, H, s, D)
        let a = x.broadcast_mul(&cos)?; // (B, H, s, D)
        let b = swapped.broadcast_mul(&sin)?; // (B, H, s, D)
        Ok(if inverse { (a - b)? } else { (a + b)? })
    }
}
