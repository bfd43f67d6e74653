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
//!
//! A backward may also run split in two halves (zero-bubble schedules): [`block_backward_input`]
//! computes every input gradient (the critical path to the previous stage) and keeps what the
//! weight gradients read; [`block_backward_weight`], later, adds the parameter gradients. A
//! device that splits implements the `*_backward_input` / `*_backward_weight` pairs, and its
//! whole backwards are then, by default, each layer's input half followed at once by its weight
//! half: one implementation, so the split and the whole backward add the same gradients, computed
//! by the same operations. A device without the halves implements the whole backwards and refuses
//! the split ([`ModelError::NoSplitBackward`]).

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
    /// `dx (N, in)`; the weight (and bias) gradients are added. By default the input half then
    /// the weight half.
    fn linear_backward(
        &mut self,
        layer: BlockLayer,
        dy: &Self::X,
        with_bias: bool,
    ) -> Result<Self::X, Self::Err> {
        let dx = self.linear_backward_input(layer, dy, with_bias)?;
        self.linear_backward_weight(layer, with_bias)?;
        Ok(dx)
    }
    /// The input half of [`BlockDevice::linear_backward`]: `dy (N, out)` → `dx (N, in)`; keeps
    /// what the weight half reads (the layer's input and `dy`).
    fn linear_backward_input(
        &mut self,
        layer: BlockLayer,
        dy: &Self::X,
        with_bias: bool,
    ) -> Result<Self::X, Self::Err> {
        let _ = (layer, dy, with_bias);
        Err(ModelError::NoSplitBackward {
            kernel: "a linear layer",
        }
        .into())
    }
    /// The weight half of [`BlockDevice::linear_backward`]: the weight (and bias) gradients are
    /// added, from what the input half kept.
    fn linear_backward_weight(
        &mut self,
        layer: BlockLayer,
        with_bias: bool,
    ) -> Result<(), Self::Err> {
        let _ = (layer, with_bias);
        Err(ModelError::NoSplitBackward {
            kernel: "a linear layer",
        }
        .into())
    }
    /// Backward of [`BlockDevice::bias_gelu_forward`]: `dg (N, F)` → `df (N, F)`; the bias
    /// gradient is added. By default the input half then the weight half.
    fn bias_gelu_backward(&mut self, dg: &Self::X) -> Result<Self::X, Self::Err> {
        let df = self.bias_gelu_backward_input(dg)?;
        self.bias_gelu_backward_weight()?;
        Ok(df)
    }
    /// The input half of [`BlockDevice::bias_gelu_backward`]: `dg (N, F)` → `df (N, F)`; keeps
    /// what the bias gradient needs.
    fn bias_gelu_backward_input(&mut self, dg: &Self::X) -> Result<Self::X, Self::Err> {
        let _ = dg;
        Err(ModelError::NoSplitBackward {
            kernel: "the MLP's bias and GELU",
        }
        .into())
    }
    /// The weight half of [`BlockDevice::bias_gelu_backward`]: the bias gradient is added.
    fn bias_gelu_backward_weight(&mut self) -> Result<(), Self::Err> {
        Err(ModelError::NoSplitBackward {
            kernel: "the MLP's bias and GELU",
        }
        .into())
    }
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
    /// gradients are added. By default the input half then the weight half.
    fn norm_backward(&mut self, layer: BlockLayer, dy: &Self::X) -> Result<Self::X, Self::Err> {
        let dx = self.norm_backward_input(layer, dy)?;
        self.norm_backward_weight(layer)?;
        Ok(dx)
    }
    /// The input half of [`BlockDevice::norm_backward`]: `dy (N, C)` → `dx (N, C)`; keeps what
    /// the weight half needs.
    fn norm_backward_input(
        &mut self,
        layer: BlockLayer,
        dy: &Self::X,
    ) -> Result<Self::X, Self::Err> {
        let _ = (layer, dy);
        Err(ModelError::NoSplitBackward { kernel: "a norm" }.into())
    }
    /// The weight half of [`BlockDevice::norm_backward`]: the weight (and bias) gradients are
    /// added.
    fn norm_backward_weight(&mut self, layer: BlockLayer) -> Result<(), Self::Err> {
        let _ = layer;
        Err(ModelError::NoSplitBackward { kernel: "a norm" }.into())
    }
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

/// The input half of [`block_backward`]: every input gradient, in [`block_backward`]'s order
/// (the residuals, the norms', the linear layers' and the attention's with its dK/dV carry),
/// `dy (N, C)` → `dx (N, C)`; each layer keeps what its weight half reads.
pub fn block_backward_input<D: BlockDevice>(
    d: &mut D,
    dy: D::X,
    docs: Option<&DocumentMask>,
) -> Result<D::X, D::Err> {
    // MLP branch: out = x1 + mlp(ln_2(x1)).
    let dg = d.linear_backward_input(BlockLayer::MlpProj, &dy, true)?; // (N, F)
    let df = d.bias_gelu_backward_input(&dg)?;
    let dh2 = d.linear_backward_input(BlockLayer::CFc, &df, false)?; // (N, C)
    let d_mlp = d.norm_backward_input(BlockLayer::Ln2, &dh2)?;
    let dx1 = d.residual_backward(Residual::Mlp, dy, d_mlp)?;
    // Attention branch: x1 = x + c_proj(attn(ln_1(x))).
    let d_y = d.linear_backward_input(BlockLayer::AttnProj, &dx1, true)?; // (N, C)
    let dqkv = d.attention_backward(&d_y, docs)?; // (N, 3C)
    let dh1 = d.linear_backward_input(BlockLayer::CAttn, &dqkv, true)?; // (N, C)
    let d_attn = d.norm_backward_input(BlockLayer::Ln1, &dh1)?;
    d.residual_backward(Residual::Attn, dx1, d_attn)
}

/// The weight half of [`block_backward`], after [`block_backward_input`]: every parameter
/// gradient of the block is added, layer by layer in [`block_backward`]'s order (each parameter
/// gets exactly the one addition the whole backward gives it).
pub fn block_backward_weight<D: BlockDevice>(d: &mut D) -> Result<(), D::Err> {
    d.linear_backward_weight(BlockLayer::MlpProj, true)?;
    d.bias_gelu_backward_weight()?;
    d.linear_backward_weight(BlockLayer::CFc, false)?;
    d.norm_backward_weight(BlockLayer::Ln2)?;
    d.linear_backward_weight(BlockLayer::AttnProj, true)?;
    d.linear_backward_weight(BlockLayer::CAttn, true)?;
    d.norm_backward_weight(BlockLayer::Ln1)
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

    /// A device with split halves only (its whole backwards are the trait's defaults): handles
    /// are expressions, the weight halves read what the input halves kept, and every gradient
    /// addition is recorded as (parameter, expression).
    #[derive(Default)]
    struct Split {
        kept: std::collections::BTreeMap<String, String>,
        adds: Vec<(String, String)>,
    }

    impl Split {
        fn keep(&mut self, key: String, value: String) {
            assert!(self.kept.insert(key, value).is_none(), "kept twice");
        }

        fn take(&mut self, key: &str) -> Result<String, ModelError> {
            self.kept.remove(key).ok_or_else(|| ModelError::NotSaved {
                layer: key.to_string(),
            })
        }
    }

    impl BlockDevice for Split {
        type X = String;
        type Err = ModelError;
        fn norm_forward(&mut self, l: BlockLayer, x: &String) -> Result<String, ModelError> {
            Ok(format!("{}({x})", l.name()))
        }
        fn linear_forward(
            &mut self,
            l: BlockLayer,
            x: &String,
            _: bool,
        ) -> Result<String, ModelError> {
            self.keep(format!("x.{}", l.name()), x.clone());
            Ok(format!("{}({x})", l.name()))
        }
        fn attention_forward(
            &mut self,
            qkv: &String,
            _: Option<&DocumentMask>,
        ) -> Result<String, ModelError> {
            Ok(format!("attn({qkv})"))
        }
        fn bias_gelu_forward(&mut self, f: &String) -> Result<String, ModelError> {
            Ok(format!("gelu({f})"))
        }
        fn residual_forward(
            &mut self,
            _: Residual,
            x: &String,
            br: String,
        ) -> Result<String, ModelError> {
            Ok(format!("[{x}] + {br}"))
        }
        fn linear_backward_input(
            &mut self,
            l: BlockLayer,
            dy: &String,
            _: bool,
        ) -> Result<String, ModelError> {
            self.keep(format!("dy.{}", l.name()), dy.clone());
            Ok(format!("d{}<{dy}>", l.name()))
        }
        fn linear_backward_weight(&mut self, l: BlockLayer, b: bool) -> Result<(), ModelError> {
            let x = self.take(&format!("x.{}", l.name()))?;
            let dy = self.take(&format!("dy.{}", l.name()))?;
            self.adds
                .push((format!("{}.weight", l.name()), format!("{dy}^T·{x}")));
            if b {
                self.adds
                    .push((format!("{}.bias", l.name()), format!("sum({dy})")));
            }
            Ok(())
        }
        fn bias_gelu_backward_input(&mut self, dg: &String) -> Result<String, ModelError> {
            self.keep("gelu.bias".into(), format!("sum(dgelu<{dg}>)"));
            Ok(format!("dgelu<{dg}>"))
        }
        fn bias_gelu_backward_weight(&mut self) -> Result<(), ModelError> {
            let g = self.take("gelu.bias")?;
            self.adds.push(("mlp.c_fc.bias".into(), g));
            Ok(())
        }
        fn attention_backward(
            &mut self,
            dy: &String,
            _: Option<&DocumentMask>,
        ) -> Result<String, ModelError> {
            Ok(format!("dattn<{dy}>"))
        }
        fn norm_backward_input(
            &mut self,
            l: BlockLayer,
            dy: &String,
        ) -> Result<String, ModelError> {
            self.keep(format!("norm.{}", l.name()), format!("dnorm_w<{dy}>"));
            Ok(format!("d{}<{dy}>", l.name()))
        }
        fn norm_backward_weight(&mut self, l: BlockLayer) -> Result<(), ModelError> {
            let g = self.take(&format!("norm.{}", l.name()))?;
            self.adds.push((format!("{}.weight", l.name()), g));
            Ok(())
        }
        fn residual_backward(
            &mut self,
            _: Residual,
            dy: String,
            d: String,
        ) -> Result<String, ModelError> {
            Ok(format!("({dy} | {d})"))
        }
    }

    #[test]
    fn the_split_backward_computes_the_whole_backwards_input_gradient_and_additions() {
        let mut whole = Split::default();
        block_forward(&mut whole, "x".into(), None).unwrap();
        let dx = block_backward(&mut whole, "dy".into(), None).unwrap();
        assert!(whole.kept.is_empty(), "{:?}", whole.kept);

        let mut split = Split::default();
        block_forward(&mut split, "x".into(), None).unwrap();
        let dx_split = block_backward_input(&mut split, "dy".into(), None).unwrap();
        assert_eq!(dx_split, dx);
        assert!(split.adds.is_empty(), "the input half adds no gradient");
        // What the weight half needs is kept: every linear's input and output gradient.
        assert_eq!(split.kept.len(), 4 + 4 + 2 + 1, "{:?}", split.kept);
        block_backward_weight(&mut split).unwrap();
        assert_eq!(
            split.adds, whole.adds,
            "the same additions, in the same order"
        );
        assert_eq!(split.adds.len(), 4 * 2 - 1 + 1 + 2, "{:?}", split.adds);
        assert!(split.kept.is_empty());
        // The weight half again finds nothing kept.
        let e = block_backward_weight(&mut split).unwrap_err();
        assert!(matches!(e, ModelError::NotSaved { .. }), "{e}");
    }

    #[test]
    fn a_device_without_halves_refuses_the_split_and_keeps_its_whole_backward() {
        let mut t = Trace::default();
        block_forward(&mut t, "x".into(), None).unwrap();
        let e = block_backward_input(&mut t, "dy".into(), None).unwrap_err();
        assert!(matches!(e, ModelError::NoSplitBackward { .. }), "{e}");
        assert!(e.to_string().contains("seq1f1b-zb"), "{e}");
        assert!(block_backward(&mut t, "dy".into(), None).is_ok());
    }
}
