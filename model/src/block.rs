//! The transformer block's order of operations, written once for every device: a pre-norm block
//! (`x1 = x + attn(ln_1(x))`, `out = x1 + mlp(ln_2(x1))`, the MLP's bias joined with its GELU) and
//! its backward, the same steps in reverse. A device supplies the paired kernels through
//! [`BlockDevice`]; the CPU stage (`trainer::model`, over `ops`, the oracle) and the CUDA stage
//! (`gpu`, over device buffers) both run these two functions, so a change to the block (a new
//! mask, another block type) is made here once.
//!
//! The design, in llm.c's terms: every layer is a `forward`/`backward` pair, and what a pair saves
//! for the backward is the device's business (llm.c's named activation struct). As in burn or
//! candle the model is generic over the device, but seqpipe's kernels are a layer coarse, so the
//! trait is small. A [`BlockDevice`] is a view of one block for one unit (micro-batch, segment):
//! it borrows that unit's saved activations, the micro-batch's K/V prefix of the block and the
//! gradient accumulator, so the trait needs no associated storage types or lifetimes, and a device
//! that preallocates its activations (the GPU) writes each result into the buffer of its
//! [`BlockLayer`] site: the handles [`BlockDevice::X`] are then plain addresses, with no
//! allocation, copy or sync per operation.

use ops::DocumentMask;

use crate::error::ModelError;
use crate::params::BlockLayer;

/// Which residual connection: `x1 = x + attention branch` or `out = x1 + MLP branch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residual {
    /// Around attention.
    Attn,
    /// Around the MLP.
    Mlp,
}

/// The kernels of one block for one unit (rows `N = B·s` of a segment of `s` positions of `B`
/// sequences), as forward/backward pairs. Parameter names come from the [`BlockLayer`] site
/// ([`crate::params::block_layer`]); forward saves what the paired backward reads; backward adds
/// the parameter gradients to the unit's accumulator.
pub trait BlockDevice {
    /// A handle to an activation of the unit's rows, `(N, width)`.
    type X;
    /// The device's error; model rules report as [`ModelError`].
    type Err: From<ModelError>;

    /// Norm `layer` (`Ln1`, `Ln2`): `x (N, C)` → `(N, C)`.
    fn norm_forward(&mut self, layer: BlockLayer, x: &Self::X) -> Result<Self::X, Self::Err>;
    /// Linear `layer`: `x (N, in) W^T (+ bias when with_bias)` → `(N, out)`.
    fn linear_forward(
        &mut self,
        layer: BlockLayer,
        x: &Self::X,
        with_bias: bool,
    ) -> Result<Self::X, Self::Err>;
    /// Causal attention of the segment's queries over the keys and values of every earlier segment
    /// of the micro-batch and its own: `qkv (N, 3C)` → `(N, C)`. The segment's keys and values
    /// join the micro-batch's K/V prefix of this block. With `docs` (the micro-batch's document
    /// starts, absolute positions) a query attends only to its own document's keys; `None` is
    /// plain causal attention. A device that cannot mask refuses `Some`, never ignores it.
    fn attention_forward(
        &mut self,
        qkv: &Self::X,
        docs: Option<&DocumentMask>,
    ) -> Result<Self::X, Self::Err>;
    /// `gelu(f + c_fc.bias)`: `(N, F)` → `(N, F)`.
    fn bias_gelu_forward(&mut self, f: &Self::X) -> Result<Self::X, Self::Err>;
    /// `x + branch` (the sum may reuse the branch's storage).
    fn residual_forward(
        &mut self,
        at: Residual,
        x: &Self::X,
        branch: Self::X,
    ) -> Result<Self::X, Self::Err>;

    /// Backward of [`BlockDevice::linear_forward`] with the same `with_bias`: `dy (N, out)` →
    /// `dx (N, in)`; the weight (and bias) gradients are added.
    fn linear_backward(
        &mut self,
        layer: BlockLayer,
        dy: &Self::X,
        with_bias: bool,
    ) -> Result<Self::X, Self::Err>;
    /// Backward of [`BlockDevice::bias_gelu_forward`]: `dg (N, F)` → `df (N, F)`; the bias
    /// gradient is added.
    fn bias_gelu_backward(&mut self, dg: &Self::X) -> Result<Self::X, Self::Err>;
    /// Backward of [`BlockDevice::attention_forward`]: `dy (N, C)` → `dqkv (N, 3C)`. The dK/dV of
    /// the earlier segments' positions are added to what later segments left for them (their
    /// backward comes later); this segment's own dK/dV include what later segments left for it,
    /// and its keys and values leave the prefix. `docs` is the forward's: the dK/dV left for other
    /// documents' keys are zero.
    fn attention_backward(
        &mut self,
        dy: &Self::X,
        docs: Option<&DocumentMask>,
    ) -> Result<Self::X, Self::Err>;
    /// Backward of [`BlockDevice::norm_forward`]: `dy (N, C)` → `dx (N, C)`; the weight (and bias)
    /// gradients are added.
    fn norm_backward(&mut self, layer: BlockLayer, dy: &Self::X) -> Result<Self::X, Self::Err>;
    /// Backward of [`BlockDevice::residual_forward`]: `dy + d_branch` (the sum may reuse `dy`'s
    /// storage), the gradient of the residual's input `x`.
    fn residual_backward(
        &mut self,
        at: Residual,
        dy: Self::X,
        d_branch: Self::X,
    ) -> Result<Self::X, Self::Err>;
}

/// Forward of one block for one unit: `x (N, C)` → `(N, C)`; `docs` masks attention to each
/// query's own document (none: plain causal attention).
pub fn block_forward<D: BlockDevice>(
    d: &mut D,
    x: D::X,
    docs: Option<&DocumentMask>,
) -> Result<D::X, D::Err> {
    let h1 = d.norm_forward(BlockLayer::Ln1, &x)?; // (N, C)
    let qkv = d.linear_forward(BlockLayer::CAttn, &h1, true)?; // (N, 3C)
    let y = d.attention_forward(&qkv, docs)?; // (N, C)
    let a = d.linear_forward(BlockLayer::AttnProj, &y, true)?; // (N, C)
    let x1 = d.residual_forward(Residual::Attn, &x, a)?;
    let h2 = d.norm_forward(BlockLayer::Ln2, &x1)?;
    // The bias of c_fc joins in the GELU pass.
    let f = d.linear_forward(BlockLayer::CFc, &h2, false)?; // (N, F)
    let g = d.bias_gelu_forward(&f)?; // (N, F)
    let m = d.linear_forward(BlockLayer::MlpProj, &g, true)?; // (N, C)
    d.residual_forward(Residual::Mlp, &x1, m)
}

/// Backward of one block for one unit, [`block_forward`] in reverse: `dy (N, C)` (the gradient of
/// its output) → `dx (N, C)`, with the forward's `docs`.
pub fn block_backward<D: BlockDevice>(
    d: &mut D,
    dy: D::X,
    docs: Option<&DocumentMask>,
) -> Result<D::X, D::Err> {
    // MLP branch: out = x1 + mlp(ln_2(x1)).
    let dg = d.linear_backward(BlockLayer::MlpProj, &dy, true)?; // (N, F)
    let df = d.bias_gelu_backward(&dg)?;
    let dh2 = d.linear_backward(BlockLayer::CFc, &df, false)?; // (N, C)
    let d_mlp = d.norm_backward(BlockLayer::Ln2, &dh2)?;
    let dx1 = d.residual_backward(Residual::Mlp, dy, d_mlp)?;
    // Attention branch: x1 = x + c_proj(attn(ln_1(x))).
    let d_y = d.linear_backward(BlockLayer::AttnProj, &dx1, true)?; // (N, C)
    let dqkv = d.attention_backward(&d_y, docs)?; // (N, 3C)
    let dh1 = d.linear_backward(BlockLayer::CAttn, &dqkv, true)?; // (N, C)
    let d_attn = d.norm_backward(BlockLayer::Ln1, &dh1)?;
    d.residual_backward(Residual::Attn, dx1, d_attn)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device whose handles are the expressions that computed them, so the test sees which value
    /// flowed into which kernel.
    #[derive(Default)]
    struct Trace {
        calls: Vec<String>,
    }

    impl Trace {
        fn log(&mut self, s: String) -> Result<String, ModelError> {
            self.calls.push(s.clone());
            Ok(s)
        }
    }

    impl BlockDevice for Trace {
        type X = String;
        type Err = ModelError;
        fn norm_forward(&mut self, l: BlockLayer, x: &String) -> Result<String, ModelError> {
            self.log(format!("{}({x})", l.name()))
        }
        fn linear_forward(
            &mut self,
            l: BlockLayer,
            x: &String,
            b: bool,
        ) -> Result<String, ModelError> {
            self.log(format!("{}{}({x})", l.name(), if b { "+b" } else { "" }))
        }
        fn attention_forward(
            &mut self,
            qkv: &String,
            docs: Option<&DocumentMask>,
        ) -> Result<String, ModelError> {
            let m = if docs.is_some() { "masked_" } else { "" };
            self.log(format!("{m}attn({qkv})"))
        }
        fn bias_gelu_forward(&mut self, f: &String) -> Result<String, ModelError> {
            self.log(format!("gelu({f})"))
        }
        fn residual_forward(
            &mut self,
            _: Residual,
            x: &String,
            br: String,
        ) -> Result<String, ModelError> {
            self.log(format!("[{x}] + {br}"))
        }
        fn linear_backward(
            &mut self,
            l: BlockLayer,
            dy: &String,
            b: bool,
        ) -> Result<String, ModelError> {
            self.log(format!("d{}{}<{dy}>", l.name(), if b { "+b" } else { "" }))
        }
        fn bias_gelu_backward(&mut self, dg: &String) -> Result<String, ModelError> {
            self.log(format!("dgelu<{dg}>"))
        }
        fn attention_backward(
            &mut self,
            dy: &String,
            docs: Option<&DocumentMask>,
        ) -> Result<String, ModelError> {
            let m = if docs.is_some() { "masked_" } else { "" };
            self.log(format!("{m}dattn<{dy}>"))
        }
        fn norm_backward(&mut self, l: BlockLayer, dy: &String) -> Result<String, ModelError> {
            self.log(format!("d{}<{dy}>", l.name()))
        }
        fn residual_backward(
            &mut self,
            _: Residual,
            dy: String,
            d: String,
        ) -> Result<String, ModelError> {
            self.log(format!("({dy} | {d})"))
        }
    }

    #[test]
    fn the_block_is_pre_norm_and_its_backward_walks_the_same_layers_in_reverse() {
        let mut t = Trace::default();
        let out = block_forward(&mut t, "x".into(), None).unwrap();
        let x1 = "[x] + attn.c_proj+b(attn(attn.c_attn+b(ln_1(x))))";
        assert_eq!(
            out,
            format!("[{x1}] + mlp.c_proj+b(gelu(mlp.c_fc(ln_2({x1}))))")
        );
        let forward_calls = t.calls.len();
        t.calls.clear();
        let dx = block_backward(&mut t, "dy".into(), None).unwrap();
        let dx1 = "(dy | dln_2<dmlp.c_fc<dgelu<dmlp.c_proj+b<dy>>>>)";
        assert_eq!(
            dx,
            format!("({dx1} | dln_1<dattn.c_attn+b<dattn<dattn.c_proj+b<{dx1}>>>>)")
        );
        // Every forward kernel has its backward.
        assert_eq!(t.calls.len(), forward_calls);
    }

    #[test]
    fn a_document_mask_reaches_the_attention_of_both_passes_and_nothing_else() {
        let docs = DocumentMask::new(vec![vec![0, 3]]).unwrap();
        let mut t = Trace::default();
        block_forward(&mut t, "x".into(), Some(&docs)).unwrap();
        block_backward(&mut t, "dy".into(), Some(&docs)).unwrap();
        let masked: Vec<&String> = t
            .calls
            .iter()
            .filter(|c| c.starts_with("masked_"))
            .collect();
        assert_eq!(masked.len(), 2, "{masked:#?}");
        assert!(masked[0].starts_with("masked_attn(") && masked[1].starts_with("masked_dattn<"));
    }
}
