//! The layer chunks a worker holds: one [`StageCompute`] per chunk. Without virtual stages a
//! worker holds one chunk, the whole stage, and everything here passes straight through to it.
//! With `pipeline.virtual_stages = v` worker r holds v chunks, chunk c being virtual stage
//! `c·p + r` (`model::partition::partition_virtual_layers`); each chunk is an ordinary stage over
//! its layers, first only on virtual stage 0 and last only on virtual stage p·v − 1.
//!
//! The schedule's compute actions name their chunk and go to it ([`Chunks::chunk_mut`]); what the
//! runtime does with the whole worker's state — the gradients' sums of squares, the update, the
//! data-parallel gradient vector, checkpoints and restores — is the union of the chunks', in
//! chunk order. Parameter names are global, so a chunk's tensors keep their names wherever they
//! live: the chunks' union in chunk order is the worker's layers in ascending order, the
//! canonical order of a contiguous stage.

use std::collections::HashSet;

use candle_core::Tensor;

use crate::checkpointing::shard::with_moments;
use crate::model::{
    DeviceLinks, ModelError, StageCompute, StageLayout, StateSnapshot, UpdateSettings,
};

/// A worker's chunks, in chunk order (local chunk c is virtual stage `c·p + worker`).
pub(in crate::runtime) struct Chunks {
    chunks: Vec<Box<dyn StageCompute>>,
    /// Each chunk's gradient-vector length (its parameters' elements), to split a reduced
    /// vector back among the chunks.
    lens: Vec<usize>,
    /// With several chunks: the most bytes of live activations the worker held at once since the
    /// last [`Chunks::take_peak_activation_bytes`] (see [`Chunks::computed`]).
    peak: usize,
    /// With several chunks: `train.memory_budget_bytes`, the bytes the worker may hold in all
    /// (see [`Chunks::check_budget`]). One chunk, the whole stage, checks its own.
    budget: Option<usize>,
}

impl Chunks {
    /// The worker's chunks, chunk 0 first; at least one.
    pub(in crate::runtime) fn new(chunks: Vec<Box<dyn StageCompute>>) -> Result<Self, ModelError> {
        let lens = chunks
            .iter()
            .map(|c| {
                let names: HashSet<String> = c.param_names().into_iter().collect();
                Ok(c.state()?
                    .iter()
                    .filter(|(n, _)| names.contains(n))
                    .map(|(_, t)| t.elem_count())
                    .sum())
            })
            .collect::<Result<Vec<usize>, ModelError>>()?;
        assert!(!chunks.is_empty(), "a worker holds at least one chunk");
        Ok(Self {
            chunks,
            lens,
            peak: 0,
            budget: None,
        })
    }

    /// With several chunks, limits what the worker holds — all its chunks' training state plus
    /// their live activations together — to `bytes` (`None`: no limit); each chunk is then built
    /// without a budget of its own, which would hold it alone to all of the worker's. One chunk
    /// (no virtual stages) is the whole stage and checks its own budget.
    pub(in crate::runtime) fn set_memory_budget(&mut self, bytes: Option<usize>) {
        self.budget = bytes.filter(|_| self.chunks.len() > 1);
    }

    /// After the forward of `unit` on any chunk: refuses, with
    /// [`ModelError::OverBudget`] naming the worker's chunks, a worker over its memory budget
    /// (its chunks' state plus the activations they hold now: the joint figure whose peak
    /// [`Chunks::computed`] tracks). The check a single stage makes after each of its forwards,
    /// for the worker as a whole.
    pub(in crate::runtime) fn check_budget(&self, unit: model::Unit) -> Result<(), ModelError> {
        let Some(budget) = self.budget else {
            return Ok(());
        };
        let activations: usize = self.chunks.iter().map(|c| c.activation_bytes()).sum();
        let state = self.state_bytes();
        if state + activations > budget {
            return Err(ModelError::OverBudget {
                unit,
                chunks: self.chunks.len(),
                state,
                activations,
                budget,
            });
        }
        Ok(())
    }

    /// How many chunks (v).
    pub(in crate::runtime) fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Chunk `c`, if the worker holds it.
    pub(in crate::runtime) fn chunk(&self, c: usize) -> Option<&dyn StageCompute> {
        self.chunks.get(c).map(|b| b.as_ref())
    }

    /// Chunk `c` to compute on, if the worker holds it.
    pub(in crate::runtime) fn chunk_mut(&mut self, c: usize) -> Option<&mut dyn StageCompute> {
        match self.chunks.get_mut(c) {
            Some(b) => Some(b.as_mut()),
            None => None,
        }
    }

    /// Whether one of the chunks is the first virtual stage (the embeddings: reads inputs).
    pub(in crate::runtime) fn holds_first(&self) -> bool {
        self.chunks.iter().any(|c| c.layout().is_first())
    }

    /// Whether one of the chunks is the last virtual stage (the head: reads targets, has losses).
    pub(in crate::runtime) fn holds_last(&self) -> bool {
        self.chunks.iter().any(|c| c.layout().is_last())
    }

    /// Each chunk's layers, in chunk order.
    pub(in crate::runtime) fn layouts(&self) -> Vec<StageLayout> {
        self.chunks.iter().map(|c| c.layout().clone()).collect()
    }

    /// Chunk 0's layout: its `stage` is the worker's index r (virtual stage 0·p + r).
    pub(in crate::runtime) fn layout(&self) -> &StageLayout {
        self.chunks[0].layout()
    }

    /// Every chunk's parameter names, chunk after chunk (ascending layers).
    pub(in crate::runtime) fn param_names(&self) -> Vec<String> {
        self.chunks.iter().flat_map(|c| c.param_names()).collect()
    }

    /// Starts a training step on every chunk.
    pub(in crate::runtime) fn begin_step(&mut self, micro_batches: usize) {
        for c in &mut self.chunks {
            c.begin_step(micro_batches);
        }
    }

    /// Sums each chunk's gradients over the step's units, in its fixed tree order.
    pub(in crate::runtime) fn finish_gradients(&mut self) -> Result<(), ModelError> {
        self.chunks
            .iter_mut()
            .try_for_each(|c| c.finish_gradients())
    }

    /// The chunks' gradient vectors, one after the other (what the data-parallel collective
    /// reduces element by element).
    pub(in crate::runtime) fn gradient_vector(&self) -> Result<Vec<f32>, ModelError> {
        if let [one] = &self.chunks[..] {
            return one.gradient_vector();
        }
        let mut all = Vec::with_capacity(self.lens.iter().sum());
        for c in &self.chunks {
            all.extend(c.gradient_vector()?);
        }
        Ok(all)
    }

    /// Gives each chunk its part of `v` (laid out as [`Chunks::gradient_vector`]).
    pub(in crate::runtime) fn set_gradient_vector(&mut self, v: &[f32]) -> Result<(), ModelError> {
        if let [one] = &mut self.chunks[..] {
            return one.set_gradient_vector(v);
        }
        let total: usize = self.lens.iter().sum();
        if v.len() != total {
            return Err(ModelError::GradientLength {
                expected: total,
                got: v.len(),
            });
        }
        let mut rest = v;
        for (c, &len) in self.chunks.iter_mut().zip(&self.lens) {
            let (mine, after) = rest.split_at(len);
            c.set_gradient_vector(mine)?;
            rest = after;
        }
        Ok(())
    }

    /// The step's summed gradients by name, chunk after chunk.
    pub(in crate::runtime) fn gradients(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        let mut all = Vec::new();
        for c in &self.chunks {
            all.extend(c.gradients()?);
        }
        Ok(all)
    }

    /// Per-parameter sums of squared gradients, chunk after chunk (the launcher adds them up in
    /// the canonical order of all the model's parameters, wherever they live).
    pub(in crate::runtime) fn grad_sums_of_squares(
        &mut self,
    ) -> Result<Vec<(String, f64)>, ModelError> {
        let mut all = Vec::new();
        for c in &mut self.chunks {
            all.extend(c.grad_sums_of_squares()?);
        }
        Ok(all)
    }

    /// Clips and applies AdamW on every chunk (the clip coefficient is the global one).
    pub(in crate::runtime) fn apply_update(&mut self, u: UpdateSettings) -> Result<(), ModelError> {
        self.chunks.iter_mut().try_for_each(|c| c.apply_update(u))
    }

    /// The state of every chunk, chunk after chunk.
    pub(in crate::runtime) fn state(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        let mut all = Vec::new();
        for c in &self.chunks {
            all.extend(c.state()?);
        }
        Ok(all)
    }

    /// The state after the last update (see [`StageCompute::snapshot`]); with several chunks
    /// (CPU stages only) taken on the host at once.
    pub(in crate::runtime) fn snapshot(&mut self) -> Result<StateSnapshot, ModelError> {
        if let [one] = &mut self.chunks[..] {
            return one.snapshot();
        }
        Ok(StateSnapshot::ready(self.state()?))
    }

    /// Gives each chunk the tensors of its parameters (and their moments); a tensor that no
    /// chunk holds is refused, naming it.
    pub(in crate::runtime) fn load_state(
        &mut self,
        tensors: Vec<(String, Tensor)>,
        optimizer_step: u64,
    ) -> Result<(), ModelError> {
        if let [one] = &mut self.chunks[..] {
            return one.load_state(tensors, optimizer_step);
        }
        let owners: Vec<HashSet<String>> = self
            .chunks
            .iter()
            .map(|c| with_moments(&c.param_names(), true).into_iter().collect())
            .collect();
        let mut parts: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); self.chunks.len()];
        for (name, t) in tensors {
            let c = owners
                .iter()
                .position(|o| o.contains(&name))
                .ok_or_else(|| ModelError::MissingParam(name.clone()))?;
            parts[c].push((name, t));
        }
        for (c, part) in self.chunks.iter_mut().zip(parts) {
            c.load_state(part, optimizer_step)?;
        }
        Ok(())
    }

    /// Bytes of the training state of all chunks.
    pub(in crate::runtime) fn state_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.state_bytes()).sum()
    }

    /// Records that chunk `c` just ran a forward or backward: the worker's live activations at
    /// the chunk's peak during it are that peak plus what the other chunks hold (they did not run
    /// meanwhile). One chunk measures its own peak; this is for several.
    pub(in crate::runtime) fn computed(&mut self, c: usize) {
        if self.chunks.len() < 2 || c >= self.chunks.len() {
            return;
        }
        let others: usize = (self.chunks.iter().enumerate())
            .filter(|&(i, _)| i != c)
            .map(|(_, chunk)| chunk.activation_bytes())
            .sum();
        let at_peak = self.chunks[c].take_peak_activation_bytes() + others;
        self.peak = self.peak.max(at_peak);
    }

    /// The most bytes of live activations the worker held at once since the last call (measured
    /// after every forward and backward, as a stage measures its own), starting the next
    /// measurement from what is held now.
    pub(in crate::runtime) fn take_peak_activation_bytes(&mut self) -> usize {
        if let [one] = &mut self.chunks[..] {
            return one.take_peak_activation_bytes();
        }
        let now: usize = (self.chunks.iter_mut())
            .map(|c| {
                c.take_peak_activation_bytes();
                c.activation_bytes()
            })
            .sum();
        std::mem::replace(&mut self.peak, now).max(now)
    }

    /// The most full-gradient buffers held at once since the last call, summed over the chunks.
    pub(in crate::runtime) fn take_peak_gradient_buffers(&mut self) -> usize {
        self.chunks
            .iter_mut()
            .map(|c| c.take_peak_gradient_buffers())
            .sum()
    }

    /// The device links of chunk `c` (`pipeline.transport = "nccl"`): each chunk has its own, to
    /// the chunks of the neighbouring virtual stages (see `links.rs`). `None` for a chunk the
    /// worker does not hold or a stage without device links (CPU).
    pub(in crate::runtime) fn device_links(&mut self, c: usize) -> Option<&mut dyn DeviceLinks> {
        self.chunks.get_mut(c)?.device_links()
    }
}

#[cfg(test)]
mod tests {
    use ops::adamw::AdamWConfig;

    use super::*;
    use crate::model::partition::partition_virtual_layers;
    use crate::model::{ModelConfig, StageSpec, build_stage};

    /// Worker 0 of 2 with 2 chunks of a 4-layer model: virtual stages 0 (embeddings, layer 0)
    /// and 2 (layer 2).
    fn worker0(seed: u64) -> Chunks {
        let model = ModelConfig {
            vocab_size: 32,
            layers: 4,
            d_model: 16,
            heads: 2,
            max_seq_len: 16,
            ..ModelConfig::default()
        };
        let layouts = partition_virtual_layers(&model, 16, 2, 2).unwrap();
        let chunks = layouts[0]
            .iter()
            .map(|layout| {
                build_stage(
                    &model,
                    StageSpec {
                        layout: layout.clone(),
                        segment_lengths: vec![16],
                        longest_segment: None,
                        seed,
                        adamw: AdamWConfig {
                            beta1: 0.9,
                            beta2: 0.95,
                            eps: 1e-8,
                        },
                        memory_budget: None,
                    },
                )
                .unwrap()
            })
            .collect();
        Chunks::new(chunks).unwrap()
    }

    #[test]
    fn the_state_is_the_union_of_the_chunks_and_goes_back_to_its_owners_by_name() {
        let a = worker0(1);
        assert_eq!(a.len(), 2);
        assert!(a.holds_first() && !a.holds_last());
        assert_eq!(a.layout().stage, 0, "chunk 0 names the worker");
        let names = a.param_names();
        assert!(names.iter().any(|n| n.starts_with("wte")));
        assert!(
            names.iter().any(|n| n.starts_with("h.0."))
                && names.iter().any(|n| n.starts_with("h.2."))
        );
        assert!(
            !names
                .iter()
                .any(|n| n.starts_with("h.1.") || n.starts_with("h.3."))
        );
        // Another worker's chunks (another seed) take the state over, tensor by tensor.
        let mut b = worker0(2);
        b.load_state(a.state().unwrap(), 0).unwrap();
        let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
        assert_eq!(sa.len(), sb.len());
        for ((na, ta), (nb, tb)) in sa.iter().zip(&sb) {
            assert_eq!(na, nb);
            let (va, vb) = (
                ta.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                tb.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(
                va.iter().zip(&vb).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{na}"
            );
        }
        // A tensor that no chunk holds is refused, named.
        let mut state = a.state().unwrap();
        let stray = state
            .iter()
            .position(|(n, _)| n.starts_with("h.0."))
            .unwrap();
        state[stray].0 = state[stray].0.replace("h.0.", "h.1.");
        let err = b.load_state(state, 0).unwrap_err().to_string();
        assert!(err.contains("h.1."), "{err}");
        // A reduced gradient vector must cover every chunk's parameters.
        let total: usize = a.lens.iter().sum();
        assert!(a.lens.iter().all(|&l| l > 0));
        let err = b.set_gradient_vector(&vec![0.0; total - 1]).unwrap_err();
        assert!(matches!(err, ModelError::GradientLength { .. }), "{err}");
    }

    /// Runs unit (0, 0) forward on chunk `c` of worker 0 (16 positions, width 16), telling the
    /// chunks; returns the chunk's live activation bytes after it.
    fn forward(w: &mut Chunks, c: usize) -> usize {
        use candle_core::{DType, Device};

        use crate::model::{Mode, StageInput};
        let dev = Device::Cpu;
        let input = if c == 0 {
            StageInput::Tokens(
                Tensor::arange(0u32, 16, &dev)
                    .unwrap()
                    .reshape((1, 16))
                    .unwrap(),
            )
        } else {
            StageInput::Hidden(Tensor::ones((16, 16), DType::F32, &dev).unwrap())
        };
        let unit = model::Unit::new(0, 0);
        (w.chunk_mut(c).unwrap())
            .forward(unit, input, None, 1.0, Mode::Train)
            .unwrap();
        w.computed(c);
        w.chunk(c).unwrap().activation_bytes()
    }

    /// Runs unit (0, 0)'s backward on chunk `c` of worker 0, telling the chunks.
    fn backward(w: &mut Chunks, c: usize) {
        let d_out = Tensor::ones((16, 16), candle_core::DType::F32, &candle_core::Device::Cpu);
        (w.chunk_mut(c).unwrap())
            .backward(model::Unit::new(0, 0), Some(d_out.unwrap()))
            .unwrap();
        w.computed(c);
    }

    #[test]
    fn the_workers_peak_is_what_its_chunks_hold_at_once_not_the_sum_of_their_peaks() {
        // One after the other: the worker never holds both chunks' activations.
        let mut w = worker0(1);
        w.begin_step(1);
        let a0 = forward(&mut w, 0);
        backward(&mut w, 0);
        let a1 = forward(&mut w, 1);
        backward(&mut w, 1);
        assert!(a0 > 0 && a1 > 0, "{a0} {a1}");
        assert_eq!(w.take_peak_activation_bytes(), a0.max(a1));
        assert_eq!(
            w.take_peak_activation_bytes(),
            0,
            "nothing is held after the backwards"
        );
        // Overlapping: both forwards before either backward.
        let mut w = worker0(1);
        w.begin_step(1);
        let a0 = forward(&mut w, 0);
        let a1 = forward(&mut w, 1);
        backward(&mut w, 1);
        backward(&mut w, 0);
        assert_eq!(w.take_peak_activation_bytes(), a0 + a1);
    }

    /// The worker's both forwards, then both backwards, under `budget`: the first forward whose
    /// check refuses it, if any, with the error.
    fn overlapped(budget: Option<usize>) -> (Chunks, Option<(usize, ModelError)>) {
        let mut w = worker0(1);
        w.set_memory_budget(budget);
        w.begin_step(1);
        for c in 0..2 {
            forward(&mut w, c);
            if let Err(e) = w.check_budget(model::Unit::new(0, 0)) {
                return (w, Some((c, e)));
            }
        }
        (w, None)
    }

    #[test]
    fn a_memory_budget_holds_the_chunks_state_and_live_activations_together() {
        let (w, refused) = overlapped(None);
        assert!(refused.is_none());
        let per_chunk: Vec<(usize, usize)> = (0..2)
            .map(|c| {
                let chunk = w.chunk(c).unwrap();
                (chunk.state_bytes(), chunk.activation_bytes())
            })
            .collect();
        let (state, activations) = (w.state_bytes(), per_chunk[0].1 + per_chunk[1].1);
        assert_eq!(state, per_chunk[0].0 + per_chunk[1].0);
        // Exactly the worker's total fits.
        let total = state + activations;
        assert!(overlapped(Some(total)).1.is_none());
        // One byte less: refused after the second forward, although each chunk alone — its own
        // state and activations — is far below the budget.
        assert!(
            per_chunk.iter().all(|(s, a)| s + a < total - 1),
            "{per_chunk:?}"
        );
        let (_, refused) = overlapped(Some(total - 1));
        let (c, e) = refused.expect("over the budget");
        assert_eq!(c, 1, "the first forward alone fits: {e}");
        assert!(
            matches!(
                e,
                ModelError::OverBudget { chunks: 2, state: s, activations: a, budget: b, .. }
                    if s == state && a == activations && b == total - 1
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(
            text.contains("the worker's 2 virtual-stage chunks hold together")
                && text.contains("pipeline.schedule = \"seq1f1b-i\""),
            "{text}"
        );
        // A single chunk (no virtual stages) checks its own budget in the stage.
        let mut one = Chunks::new(vec![worker0(1).chunks.remove(0)]).unwrap();
        one.set_memory_budget(Some(1));
        assert_eq!(one.budget, None);
    }
}
