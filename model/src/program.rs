//! A pipeline stage's program for one unit (micro-batch, segment), written once for every device:
//! the forward is (first stage: embed the tokens and positions | others: the hidden states that
//! arrived) → every held block's [`block_forward`] in order → (last stage: final norm, LM head and
//! loss | others: the output leaves), and the backward is the same in reverse: (last: the loss's
//! gradient through the head, then the final norm | others: the gradient that arrived) → every
//! held block's [`block_backward`] in reverse → (first: the embeddings' gradients | others: the
//! input's gradient leaves). The CPU stage (`trainer::model::Stage`, over `ops`, the oracle) and
//! the CUDA stage (`gpu::GpuStage`) both run [`forward_unit`] and [`backward_unit`], so a change to
//! a stage's structure (another head, a block type) is made here once.
//!
//! The design follows [`crate::block`]: burn and candle keep the model generic over a device
//! that supplies storage and kernels; seqpipe's kernels are coarse, llm.c's forward/backward
//! pairs (embedding, final norm, head with its loss), so [`StageDevice`] is small. A
//! [`StageDevice`] is a view of the stage for one unit: it borrows that unit's saved activations,
//! its micro-batch's K/V prefixes and (in the backward) the gradient accumulator, and knows the
//! unit's input (tokens, hidden states, a gradient) and mode. So the trait needs no associated
//! storage types or lifetimes, a handle [`StageDevice::X`] may be a plain device address, and
//! what only one device does stays inside it: the CPU keeps the head's context for the backward,
//! the GPU computes the head's weight gradient and d(ln_f) with the loss in the forward (the
//! logits never exist whole) and its [`StageDevice::head_backward`] only hands that gradient on;
//! device links, BF16 weight copies and buffer recycling are the GPU's business. The view of a
//! held block ([`StageDevice::block`]) is the device's [`BlockDevice`] for this unit.
//!
//! Zero-bubble schedules run a unit's backward in two halves: [`backward_unit_input`] (`I`: the
//! input gradient, sent on at once) and later [`backward_unit_weight`] (`W`: the parameter
//! gradients), each the pieces' halves in [`backward_unit`]'s order ([`crate::block`] explains
//! the halves and why they add the same gradients as the whole backward).

use ops::DocumentMask;

use crate::block::{
    BlockDevice, block_backward, block_backward_input, block_backward_weight, block_forward,
};
use crate::error::ModelError;
use crate::partition::StageLayout;

/// The kernels and boundaries of one stage for one unit, as forward/backward pairs. Which pieces
/// run depends on [`StageDevice::layout`]: the embeddings on the first stage, the final norm and
/// the head on the last, the hidden states' arrival and departure between stages.
pub trait StageDevice {
    /// A handle to an activation of the unit's rows, `(N, C)` (`N = B·s`).
    type X;
    /// The device's error; model rules report as [`ModelError`].
    type Err: From<ModelError>;
    /// The device of held block `slot` for this unit, borrowing the view.
    type Block<'b>: BlockDevice<X = Self::X, Err = Self::Err>
    where
        Self: 'b;
    /// What a unit's forward hands on: the hidden states for the next stage, or the last stage's
    /// loss.
    type Output;
    /// What a unit's backward hands back: the gradient of its input for the previous stage, or
    /// nothing on the first stage.
    type InputGrad;

    /// The layers this stage holds (its blocks, and whether it is first or last).
    fn layout(&self) -> &StageLayout;
    /// The device of held block `slot` (`0..layout().layers.len()`, the block
    /// `layout().layers.start + slot`) for this unit.
    fn block(&mut self, slot: usize) -> Result<Self::Block<'_>, Self::Err>;

    /// First stage: the token embedding plus the position embedding of the unit's tokens →
    /// `(N, C)`.
    fn embed_forward(&mut self) -> Result<Self::X, Self::Err>;
    /// Other stages: the hidden states `(N, C)` that arrived from the previous stage.
    fn receive_hidden(&mut self) -> Result<Self::X, Self::Err>;
    /// Last stage: the final norm, `x (N, C)` → `(N, C)`.
    fn final_norm_forward(&mut self, x: &Self::X) -> Result<Self::X, Self::Err>;
    /// Last stage: the LM head and the cross-entropy of `h (N, C)` against the unit's targets.
    /// In training the device may compute the head's gradients here (the GPU does) or keep what
    /// [`StageDevice::head_backward`] needs (the CPU).
    fn head_loss_forward(&mut self, h: &Self::X) -> Result<Self::Output, Self::Err>;
    /// Other stages: the block output `x (N, C)` leaves for the next stage.
    fn send_hidden(&mut self, x: Self::X) -> Result<Self::Output, Self::Err>;

    /// Last stage: backward of [`StageDevice::head_loss_forward`] from the loss → d(final norm
    /// output) `(N, C)`; the head's weight gradient is added (unless the forward did). By default
    /// the input half then the weight half.
    fn head_backward(&mut self) -> Result<Self::X, Self::Err> {
        let dh = self.head_backward_input()?;
        self.head_backward_weight()?;
        Ok(dh)
    }
    /// The input half of [`StageDevice::head_backward`]: d(final norm output) `(N, C)`.
    fn head_backward_input(&mut self) -> Result<Self::X, Self::Err> {
        Err(ModelError::NoSplitBackward {
            kernel: "the LM head",
        }
        .into())
    }
    /// The weight half of [`StageDevice::head_backward`]: the head's weight gradient is added.
    fn head_backward_weight(&mut self) -> Result<(), Self::Err> {
        Err(ModelError::NoSplitBackward {
            kernel: "the LM head",
        }
        .into())
    }
    /// Last stage: backward of [`StageDevice::final_norm_forward`]: `dy (N, C)` → `dx (N, C)`;
    /// the weight (and bias) gradients are added. By default the input half then the weight
    /// half.
    fn final_norm_backward(&mut self, dy: &Self::X) -> Result<Self::X, Self::Err> {
        let dx = self.final_norm_backward_input(dy)?;
        self.final_norm_backward_weight()?;
        Ok(dx)
    }
    /// The input half of [`StageDevice::final_norm_backward`]: `dy (N, C)` → `dx (N, C)`.
    fn final_norm_backward_input(&mut self, dy: &Self::X) -> Result<Self::X, Self::Err> {
        let _ = dy;
        Err(ModelError::NoSplitBackward {
            kernel: "the final norm",
        }
        .into())
    }
    /// The weight half of [`StageDevice::final_norm_backward`]: its weight (and bias) gradients
    /// are added.
    fn final_norm_backward_weight(&mut self) -> Result<(), Self::Err> {
        Err(ModelError::NoSplitBackward {
            kernel: "the final norm",
        }
        .into())
    }
    /// Other stages: the gradient of the unit's output `(N, C)` that arrived from the next stage.
    fn receive_grad(&mut self) -> Result<Self::X, Self::Err>;
    /// First stage: backward of [`StageDevice::embed_forward`]: the token (and position)
    /// embeddings' gradients from `dx (N, C)` are added. By default the input half then the
    /// weight half.
    fn embed_backward(&mut self, dx: &Self::X) -> Result<Self::InputGrad, Self::Err> {
        let none = self.embed_backward_input(dx)?;
        self.embed_backward_weight()?;
        Ok(none)
    }
    /// The input half of [`StageDevice::embed_backward`]: the embeddings have no input to pass a
    /// gradient to; keeps `dx` for the weight half.
    fn embed_backward_input(&mut self, dx: &Self::X) -> Result<Self::InputGrad, Self::Err> {
        let _ = dx;
        Err(ModelError::NoSplitBackward {
            kernel: "the embeddings",
        }
        .into())
    }
    /// The weight half of [`StageDevice::embed_backward`]: the embeddings' gradients are added.
    fn embed_backward_weight(&mut self) -> Result<(), Self::Err> {
        Err(ModelError::NoSplitBackward {
            kernel: "the embeddings",
        }
        .into())
    }
    /// Other stages: the gradient of the unit's input `dx (N, C)` leaves for the previous stage.
    fn send_grad(&mut self, dx: Self::X) -> Result<Self::InputGrad, Self::Err>;
}

/// Forward of one unit on stage device `d`: the input (embedded or received), every held block in
/// order, then the head and loss (last stage) or the output leaving. `docs` masks attention to
/// each query's own document (none: plain causal attention).
pub fn forward_unit<D: StageDevice>(
    d: &mut D,
    docs: Option<&DocumentMask>,
) -> Result<D::Output, D::Err> {
    let layout = d.layout();
    let (first, last, blocks) = (layout.is_first(), layout.is_last(), layout.layers.len());
    let mut x = if first {
        d.embed_forward()?
    } else {
        d.receive_hidden()?
    }; // (N, C)
    for slot in 0..blocks {
        x = block_forward(&mut d.block(slot)?, x, docs)?;
    }
    if last {
        let h = d.final_norm_forward(&x)?; // (N, C)
        d.head_loss_forward(&h)
    } else {
        d.send_hidden(x)
    }
}

/// Backward of one unit on stage device `d`, [`forward_unit`] in reverse: the gradient of the
/// output (from the loss on the last stage, received on the others), every held block in reverse,
/// then the embeddings' gradients (first stage) or the input's gradient leaving. `docs` is the
/// forward's.
pub fn backward_unit<D: StageDevice>(
    d: &mut D,
    docs: Option<&DocumentMask>,
) -> Result<D::InputGrad, D::Err> {
    let layout = d.layout();
    let (first, last, blocks) = (layout.is_first(), layout.is_last(), layout.layers.len());
    let mut dx = if last {
        let dh = d.head_backward()?; // (N, C)
        d.final_norm_backward(&dh)?
    } else {
        d.receive_grad()?
    }; // (N, C)
    for slot in (0..blocks).rev() {
        dx = block_backward(&mut d.block(slot)?, dx, docs)?;
    }
    if first {
        d.embed_backward(&dx)
    } else {
        d.send_grad(dx)
    }
}

/// The input half of [`backward_unit`] (a zero-bubble `I`): the gradient of the output, every
/// held block's [`block_backward_input`] in reverse, then the input's gradient leaving (or, on
/// the first stage, the embeddings' input half). Each piece keeps what its weight half reads.
pub fn backward_unit_input<D: StageDevice>(
    d: &mut D,
    docs: Option<&DocumentMask>,
) -> Result<D::InputGrad, D::Err> {
    let layout = d.layout();
    let (first, last, blocks) = (layout.is_first(), layout.is_last(), layout.layers.len());
    let mut dx = if last {
        let dh = d.head_backward_input()?; // (N, C)
        d.final_norm_backward_input(&dh)?
    } else {
        d.receive_grad()?
    }; // (N, C)
    for slot in (0..blocks).rev() {
        dx = block_backward_input(&mut d.block(slot)?, dx, docs)?;
    }
    if first {
        d.embed_backward_input(&dx)
    } else {
        d.send_grad(dx)
    }
}

/// The weight half of [`backward_unit`] (a zero-bubble `W`), after [`backward_unit_input`]: the
/// head's and final norm's (last stage), every held block's [`block_backward_weight`] in
/// reverse, then the embeddings' (first stage) parameter gradients are added — the pieces in
/// [`backward_unit`]'s order, each parameter getting the one addition the whole backward gives
/// it.
pub fn backward_unit_weight<D: StageDevice>(d: &mut D) -> Result<(), D::Err> {
    let layout = d.layout();
    let (first, last, blocks) = (layout.is_first(), layout.is_last(), layout.layers.len());
    if last {
        d.head_backward_weight()?;
        d.final_norm_backward_weight()?;
    }
    for slot in (0..blocks).rev() {
        block_backward_weight(&mut d.block(slot)?)?;
    }
    if first {
        d.embed_backward_weight()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::Residual;
    use crate::params::BlockLayer;

    /// A stage device whose handles are the expressions that computed them, recording every
    /// kernel it runs, so a test sees which value flowed where.
    struct Trace {
        layout: StageLayout,
        calls: Vec<String>,
    }

    impl Trace {
        fn new(stage: usize, stages: usize, layers: std::ops::Range<usize>) -> Self {
            Trace {
                layout: StageLayout {
                    stage,
                    stages,
                    layers,
                },
                calls: Vec::new(),
            }
        }

        fn log(&mut self, s: String) -> Result<String, ModelError> {
            self.calls.push(s.clone());
            Ok(s)
        }
    }

    /// Block `layer`'s device: records `h{layer}` kernels into the stage's trace (its own kernels
    /// are checked in [`crate::block`]'s tests; here only which block ran, in which direction).
    struct TraceBlock<'b> {
        layer: usize,
        calls: &'b mut Vec<String>,
    }

    impl TraceBlock<'_> {
        fn log(&mut self, s: String) -> Result<String, ModelError> {
            self.calls.push(format!("h{}.{s}", self.layer));
            Ok(s)
        }
    }

    impl BlockDevice for TraceBlock<'_> {
        type X = String;
        type Err = ModelError;
        fn norm_forward(&mut self, _: BlockLayer, x: &String) -> Result<String, ModelError> {
            Ok(x.clone())
        }
        fn linear_forward(
            &mut self,
            _: BlockLayer,
            x: &String,
            _: bool,
        ) -> Result<String, ModelError> {
            Ok(x.clone())
        }
        fn attention_forward(
            &mut self,
            qkv: &String,
            docs: Option<&DocumentMask>,
        ) -> Result<String, ModelError> {
            let m = if docs.is_some() { "masked " } else { "" };
            self.log(format!("{m}attn"))?;
            Ok(qkv.clone())
        }
        fn bias_gelu_forward(&mut self, f: &String) -> Result<String, ModelError> {
            Ok(f.clone())
        }
        fn residual_forward(
            &mut self,
            at: Residual,
            x: &String,
            _: String,
        ) -> Result<String, ModelError> {
            match at {
                Residual::Attn => Ok(x.clone()),
                Residual::Mlp => {
                    let layer = self.layer;
                    self.log("fwd".into())?;
                    Ok(format!("h{layer}({x})"))
                }
            }
        }
        fn linear_backward(
            &mut self,
            _: BlockLayer,
            dy: &String,
            _: bool,
        ) -> Result<String, ModelError> {
            Ok(dy.clone())
        }
        fn bias_gelu_backward(&mut self, dg: &String) -> Result<String, ModelError> {
            Ok(dg.clone())
        }
        fn attention_backward(
            &mut self,
            dy: &String,
            docs: Option<&DocumentMask>,
        ) -> Result<String, ModelError> {
            let m = if docs.is_some() { "masked " } else { "" };
            self.log(format!("{m}dattn"))?;
            Ok(dy.clone())
        }
        fn norm_backward(&mut self, _: BlockLayer, dy: &String) -> Result<String, ModelError> {
            Ok(dy.clone())
        }
        fn residual_backward(
            &mut self,
            at: Residual,
            dy: String,
            _: String,
        ) -> Result<String, ModelError> {
            match at {
                Residual::Mlp => Ok(dy),
                Residual::Attn => {
                    let layer = self.layer;
                    self.log("bwd".into())?;
                    Ok(format!("dh{layer}<{dy}>"))
                }
            }
        }
    }

    impl StageDevice for Trace {
        type X = String;
        type Err = ModelError;
        type Block<'b> = TraceBlock<'b>;
        type Output = String;
        type InputGrad = Option<String>;

        fn layout(&self) -> &StageLayout {
            &self.layout
        }
        fn block(&mut self, slot: usize) -> Result<TraceBlock<'_>, ModelError> {
            Ok(TraceBlock {
                layer: self.layout.layers.start + slot,
                calls: &mut self.calls,
            })
        }
        fn embed_forward(&mut self) -> Result<String, ModelError> {
            self.log("embed".into())
        }
        fn receive_hidden(&mut self) -> Result<String, ModelError> {
            self.log("received".into())
        }
        fn final_norm_forward(&mut self, x: &String) -> Result<String, ModelError> {
            self.log(format!("ln_f({x})"))
        }
        fn head_loss_forward(&mut self, h: &String) -> Result<String, ModelError> {
            self.log(format!("loss(lm_head({h}))"))
        }
        fn send_hidden(&mut self, x: String) -> Result<String, ModelError> {
            self.log(format!("send({x})"))
        }
        fn head_backward(&mut self) -> Result<String, ModelError> {
            self.log("dlm_head".into())
        }
        fn final_norm_backward(&mut self, dy: &String) -> Result<String, ModelError> {
            self.log(format!("dln_f<{dy}>"))
        }
        fn receive_grad(&mut self) -> Result<String, ModelError> {
            self.log("dreceived".into())
        }
        fn embed_backward(&mut self, dx: &String) -> Result<Option<String>, ModelError> {
            self.log(format!("dembed<{dx}>"))?;
            Ok(None)
        }
        fn send_grad(&mut self, dx: String) -> Result<Option<String>, ModelError> {
            self.log(format!("dsend<{dx}>")).map(Some)
        }
    }

    #[test]
    fn a_whole_model_embeds_runs_its_blocks_in_order_and_ends_in_the_loss() {
        let mut t = Trace::new(0, 1, 0..2);
        let loss = forward_unit(&mut t, None).unwrap();
        assert_eq!(loss, "loss(lm_head(ln_f(h1(h0(embed)))))");
        assert_eq!(
            t.calls,
            [
                "embed",
                "h0.attn",
                "h0.fwd",
                "h1.attn",
                "h1.fwd",
                "ln_f(h1(h0(embed)))",
                "loss(lm_head(ln_f(h1(h0(embed)))))"
            ]
        );
        t.calls.clear();
        let dx = backward_unit(&mut t, None).unwrap();
        assert_eq!(dx, None);
        assert_eq!(
            t.calls,
            [
                "dlm_head",
                "dln_f<dlm_head>",
                "h1.dattn",
                "h1.bwd",
                "h0.dattn",
                "h0.bwd",
                "dembed<dh0<dh1<dln_f<dlm_head>>>>"
            ]
        );
    }

    #[test]
    fn a_middle_stage_runs_its_own_blocks_between_what_arrives_and_what_leaves() {
        let mut t = Trace::new(1, 3, 2..4);
        assert_eq!(
            forward_unit(&mut t, None).unwrap(),
            "send(h3(h2(received)))"
        );
        assert!(
            t.calls
                .iter()
                .all(|c| !c.contains("embed") && !c.contains("ln_f")),
            "{:?}",
            t.calls
        );
        t.calls.clear();
        let dx = backward_unit(&mut t, None).unwrap();
        assert_eq!(dx.as_deref(), Some("dsend<dh2<dh3<dreceived>>>"));
        // The blocks in reverse: h3's backward before h2's.
        let blocks: Vec<&str> = t
            .calls
            .iter()
            .map(String::as_str)
            .filter(|c| c.starts_with('h'))
            .collect();
        assert_eq!(blocks, ["h3.dattn", "h3.bwd", "h2.dattn", "h2.bwd"]);
    }

    #[test]
    fn the_first_and_last_stages_own_only_their_end_and_the_mask_reaches_every_block() {
        let docs = DocumentMask::new(vec![vec![0, 2]]).unwrap();
        let mut first = Trace::new(0, 2, 0..1);
        assert_eq!(
            forward_unit(&mut first, Some(&docs)).unwrap(),
            "send(h0(embed))"
        );
        assert_eq!(backward_unit(&mut first, Some(&docs)).unwrap(), None);
        assert_eq!(
            first.calls.last().map(String::as_str),
            Some("dembed<dh0<dreceived>>")
        );
        // A last stage with no blocks of its own only adds the head.
        let mut last = Trace::new(1, 2, 1..1);
        assert_eq!(
            forward_unit(&mut last, Some(&docs)).unwrap(),
            "loss(lm_head(ln_f(received)))"
        );
        assert_eq!(
            backward_unit(&mut last, Some(&docs)).unwrap().as_deref(),
            Some("dsend<dln_f<dlm_head>>")
        );
        let masked = first.calls.iter().filter(|c| c.contains("masked")).count();
        assert_eq!(masked, 2, "{:?}", first.calls);
        assert!(
            first
                .calls
                .iter()
                .all(|c| !c.contains("attn") || c.contains("masked"))
        );
    }
}
