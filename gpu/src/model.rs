//! A GPT-2 style model trained on one GPU with the kernels of this crate: learned positions,
//! pre-norm blocks (layer or RMS norm), fused QKV, tanh-GELU MLP, untied LM head fused with the
//! softmax cross-entropy in row chunks, global-norm clipping and AdamW — the arithmetic of the CPU
//! stage (`trainer/src/model`), with parameters under the same global names, so weights move
//! between the two unchanged and the CPU stage is the oracle of its gradients.
//!
//! One step = forward and backward of one micro-batch `(B, T)` (one segment), then the update.
//! Every activation buffer is allocated once, sized from the shape (llm.c style): a steady-state
//! step allocates nothing.

use crate::device::{Buf, Gpu};
use crate::error::{Result, shape};
use crate::kernels::AttnShape;

/// The model's shape (the `[model]` section's fields the GPU path uses).
#[derive(Clone, Debug)]
pub struct GptShape {
    /// Vocabulary V.
    pub vocab: usize,
    /// Blocks L.
    pub layers: usize,
    /// Width C.
    pub d_model: usize,
    /// Heads H.
    pub heads: usize,
    /// MLP width F.
    pub ffn: usize,
    /// Rows of the position table.
    pub max_seq_len: usize,
    /// Norm epsilon.
    pub eps: f32,
    /// RMS norm instead of layer norm.
    pub rms: bool,
}

/// Optimizer settings of a step (ops::AdamW's formula).
#[derive(Clone, Copy, Debug)]
pub struct Update {
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay of the decayed parameters.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this.
    pub grad_clip: f64,
    /// `(beta1, beta2, eps)`.
    pub betas: (f64, f64, f64),
}

/// A host tensor `(name, dims, values)`.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// One parameter on the device with its gradient and AdamW moments.
struct Param {
    name: String,
    dims: Vec<usize>,
    value: Buf<f32>,
    grad: Buf<f32>,
    m: Buf<f32>,
    v: Buf<f32>,
    decays: bool,
}

/// Saved activations of one block. // rows N = B·T
struct BlockActs {
    x: Buf<f32>,   // (N, C) block input
    ln1: Buf<f32>, // (N, C)
    ln1_mean: Buf<f32>,
    ln1_rstd: Buf<f32>,
    qkv: Buf<f32>, // (N, 3C)
    y: Buf<f32>,   // (N, C) attention output
    lse: Buf<f32>, // (B, H, T)
    x1: Buf<f32>,  // (N, C) after the attention residual
    ln2: Buf<f32>, // (N, C)
    ln2_mean: Buf<f32>,
    ln2_rstd: Buf<f32>,
    u: Buf<f32>, // (N, F) pre-activation incl. bias
    g: Buf<f32>, // (N, F) GELU output
}

/// The model, its optimizer state and its activation buffers on one GPU.
pub struct GptGpu {
    shape: GptShape,
    batch: usize,
    seq: usize,
    params: Vec<Param>,
    index: std::collections::HashMap<String, usize>,
    acts: Vec<BlockActs>,
    x_final: Buf<f32>, // (N, C) last block's output
    lnf: Buf<f32>,
    lnf_mean: Buf<f32>,
    lnf_rstd: Buf<f32>,
    ids: Buf<u32>,
    targets: Buf<u32>,
    host_ids: Vec<u32>,
    logits: Buf<f32>, // (chunk, V)
    losses: Buf<f32>, // (N,)
    // Backward scratch.
    dx: Buf<f32>,      // (N, C) gradient flowing down the residual stream
    dtmp: Buf<f32>,    // (N, C)
    dln: Buf<f32>,     // (N, C)
    dqkv: Buf<f32>,    // (N, 3C)
    dff: Buf<f32>,     // (N, F)
    delta: Buf<f32>,   // (B, H, T)
    scratch: Buf<f32>, // column-sum partials
    step: u64,
    chunk_rows: usize,
}

/// Rows of logits that exist at once.
const DEFAULT_CHUNK_ROWS: usize = 4096;

impl GptGpu {
    /// Uploads `params` (`(name, dims, values)`, every parameter of the model; `decays` says which
    /// get weight decay) and allocates every buffer for micro-batches of `batch` × `seq` tokens.
    pub fn new(
        gpu: &Gpu,
        shape: GptShape,
        params: Vec<NamedTensor>,
        decays: &dyn Fn(&str) -> bool,
        batch: usize,
        seq: usize,
    ) -> Result<GptGpu> {
        const OP: &str = "GptGpu::new";
        let c = shape.d_model;
        if shape.heads == 0 || !c.is_multiple_of(shape.heads) {
            return shape_err(
                OP,
                format!("d_model {c} is not a multiple of heads {}", shape.heads),
            );
        }
        if seq > shape.max_seq_len {
            return shape_err(
                OP,
                format!("seq {seq} exceeds max_seq_len {}", shape.max_seq_len),
            );
        }
        let n = batch * seq;
        let mut uploaded = Vec::new();
        let mut index = std::collections::HashMap::new();
        for (name, dims, values) in params {
            let numel: usize = dims.iter().product();
            if values.len() != numel {
                return shape_err(
                    OP,
                    format!("{name}: {} values for dims {dims:?}", values.len()),
                );
            }
            index.insert(name.clone(), uploaded.len());
            uploaded.push(Param {
                decays: decays(&name),
                value: gpu.upload(&values)?,
                grad: gpu.zeros(numel)?,
                m: gpu.zeros(numel)?,
                v: gpu.zeros(numel)?,
                name,
                dims,
            });
        }
        let z = |len: usize| gpu.zeros::<f32>(len);
        let (h, f) = (shape.heads, shape.ffn);
        let mut acts = Vec::new();
        for _ in 0..shape.layers {
            acts.push(BlockActs {
                x: z(n * c)?,
                ln1: z(n * c)?,
                ln1_mean: z(n)?,
                ln1_rstd: z(n)?,
                qkv: z(n * 3 * c)?,
                y: z(n * c)?,
                lse: z(batch * h * seq)?,
                x1: z(n * c)?,
                ln2: z(n * c)?,
                ln2_mean: z(n)?,
                ln2_rstd: z(n)?,
                u: z(n * f)?,
                g: z(n * f)?,
            });
        }
        let chunk_rows = DEFAULT_CHUNK_ROWS.min(n);
        let widest = f.max(3 * c).max(shape.vocab);
        let model = GptGpu {
            x_final: z(n * c)?,
            lnf: z(n * c)?,
            lnf_mean: z(n)?,
            lnf_rstd: z(n)?,
            ids: gpu.zeros(n)?,
            targets: gpu.zeros(n)?,
            host_ids: Vec::new(),
            logits: z(chunk_rows * shape.vocab)?,
            losses: z(n)?,
            dx: z(n * c)?,
            dtmp: z(n * c)?,
            dln: z(n * c)?,
            dqkv: z(n * 3 * c)?,
            dff: z(n * f)?,
            delta: z(batch * h * seq)?,
            scratch: z(2 * Gpu::column_scratch_len(n.max(chunk_rows), widest))?,
            shape,
            batch,
            seq,
            params: uploaded,
            index,
            acts,
            step: 0,
            chunk_rows,
        };
        for name in model.expected_names() {
            if !model.index.contains_key(&name) {
                return shape_err(OP, format!("parameter {name} is missing"));
            }
        }
        Ok(model)
    }

    fn expected_names(&self) -> Vec<String> {
        let mut names = vec!["wte.weight".to_string(), "wpe.weight".to_string()];
        for l in 0..self.shape.layers {
            for p in [
                "ln_1.weight",
                "attn.c_attn.weight",
                "attn.c_attn.bias",
                "attn.c_proj.weight",
                "attn.c_proj.bias",
                "ln_2.weight",
                "mlp.c_fc.weight",
                "mlp.c_fc.bias",
                "mlp.c_proj.weight",
                "mlp.c_proj.bias",
            ] {
                names.push(format!("h.{l}.{p}"));
            }
            if !self.shape.rms {
                names.push(format!("h.{l}.ln_1.bias"));
                names.push(format!("h.{l}.ln_2.bias"));
            }
        }
        names.push("ln_f.weight".into());
        if !self.shape.rms {
            names.push("ln_f.bias".into());
        }
        names.push("lm_head.weight".into());
        names
    }

    fn p(&self, name: &str) -> u64 {
        self.params[self.index[name]].value.ptr()
    }

    fn g(&self, name: &str) -> u64 {
        self.params[self.index[name]].grad.ptr()
    }

    /// Address of a parameter that may be absent (norm biases of an RMS-norm model): 0.
    fn p_opt(&self, name: &str) -> u64 {
        self.index
            .get(name)
            .map_or(0, |&i| self.params[i].value.ptr())
    }

    fn g_opt(&self, name: &str) -> u64 {
        self.index
            .get(name)
            .map_or(0, |&i| self.params[i].grad.ptr())
    }

    /// Tokens per step.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Forward and backward of one micro-batch (`inputs`, `targets`: `B·T` token ids each):
    /// the gradients of `loss_scale` × the summed token losses are accumulated into the
    /// parameters' gradients. Returns the summed loss (f64, summed in row order on the host).
    pub fn forward_backward(
        &mut self,
        gpu: &Gpu,
        inputs: &[u32],
        targets: &[u32],
        loss_scale: f64,
    ) -> Result<f64> {
        const OP: &str = "GptGpu::forward_backward";
        let n = self.tokens();
        if inputs.len() != n || targets.len() != n {
            return shape_err(
                OP,
                format!(
                    "{} inputs and {} targets for {n} tokens",
                    inputs.len(),
                    targets.len()
                ),
            );
        }
        let v = self.shape.vocab as u32;
        if let Some(bad) = inputs.iter().chain(targets).find(|&&t| t >= v) {
            return shape_err(
                OP,
                format!("token id {bad} is not below the vocabulary size {v}"),
            );
        }
        gpu.write(&mut self.ids, inputs)?;
        gpu.write(&mut self.targets, targets)?;
        self.host_ids = inputs.to_vec();
        self.forward(gpu)?;
        let loss = self.head(gpu, loss_scale, true)?;
        self.backward(gpu)?;
        Ok(loss)
    }

    /// Forward only: the summed loss of one micro-batch (evaluation).
    pub fn loss(&mut self, gpu: &Gpu, inputs: &[u32], targets: &[u32]) -> Result<f64> {
        gpu.write(&mut self.ids, inputs)?;
        gpu.write(&mut self.targets, targets)?;
        self.forward(gpu)?;
        self.head(gpu, 0.0, false)
    }

    fn forward(&mut self, gpu: &Gpu) -> Result<()> {
        let (b, t, c, f) = (self.batch, self.seq, self.shape.d_model, self.shape.ffn);
        let n = b * t;
        let (h, rms, eps) = (self.shape.heads, self.shape.rms, self.shape.eps);
        let d = c / h;
        gpu.embed_forward(
            self.acts_x(0),
            self.ids.ptr(),
            self.p("wte.weight"),
            self.p("wpe.weight"),
            n,
            c,
            t,
            0,
        )?;
        for l in 0..self.shape.layers {
            let pre = format!("h.{l}");
            let a = &self.acts[l];
            gpu.norm_forward(
                a.ln1.ptr(),
                a.ln1_mean.ptr(),
                a.ln1_rstd.ptr(),
                a.x.ptr(),
                self.p(&format!("{pre}.ln_1.weight")),
                self.p_opt(&format!("{pre}.ln_1.bias")),
                n,
                c,
                eps,
                rms,
            )?;
            gpu.linear_forward(
                a.qkv.ptr(),
                a.ln1.ptr(),
                self.p(&format!("{pre}.attn.c_attn.weight")),
                self.p(&format!("{pre}.attn.c_attn.bias")),
                n,
                c,
                3 * c,
            )?;
            let sh = AttnShape {
                b,
                h,
                d,
                s: t,
                p: 0,
                q_stride: 3 * c,
                kv_stride: 3 * c,
            };
            gpu.attention_forward(
                a.y.ptr(),
                a.lse.ptr(),
                a.qkv.ptr(),
                a.qkv.at(c),
                a.qkv.at(2 * c),
                sh,
                1.0 / (d as f32).sqrt(),
            )?;
            // x1 = x + y W^T + b (the projection lands in x1, then the residual is added).
            gpu.linear_forward(
                a.x1.ptr(),
                a.y.ptr(),
                self.p(&format!("{pre}.attn.c_proj.weight")),
                self.p(&format!("{pre}.attn.c_proj.bias")),
                n,
                c,
                c,
            )?;
            gpu.add_assign(a.x1.ptr(), a.x.ptr(), n * c)?;
            gpu.norm_forward(
                a.ln2.ptr(),
                a.ln2_mean.ptr(),
                a.ln2_rstd.ptr(),
                a.x1.ptr(),
                self.p(&format!("{pre}.ln_2.weight")),
                self.p_opt(&format!("{pre}.ln_2.bias")),
                n,
                c,
                eps,
                rms,
            )?;
            gpu.linear_forward(
                a.u.ptr(),
                a.ln2.ptr(),
                self.p(&format!("{pre}.mlp.c_fc.weight")),
                0,
                n,
                c,
                f,
            )?;
            gpu.bias_gelu_forward(
                a.g.ptr(),
                a.u.ptr(),
                self.p(&format!("{pre}.mlp.c_fc.bias")),
                n,
                f,
            )?;
            let out = self.acts_x(l + 1);
            gpu.linear_forward(
                out,
                a.g.ptr(),
                self.p(&format!("{pre}.mlp.c_proj.weight")),
                self.p(&format!("{pre}.mlp.c_proj.bias")),
                n,
                f,
                c,
            )?;
            gpu.add_assign(out, a.x1.ptr(), n * c)?;
        }
        gpu.norm_forward(
            self.lnf.ptr(),
            self.lnf_mean.ptr(),
            self.lnf_rstd.ptr(),
            self.x_final.ptr(),
            self.p("ln_f.weight"),
            self.p_opt("ln_f.bias"),
            n,
            c,
            eps,
            rms,
        )
    }

    /// Input of block `l` (`l == layers`: the final hidden states).
    fn acts_x(&self, l: usize) -> u64 {
        if l < self.acts.len() {
            self.acts[l].x.ptr()
        } else {
            self.x_final.ptr()
        }
    }

    /// LM head + cross-entropy in row chunks; with `grad`, `dln` receives d(lnf) and the head's
    /// weight gradient is accumulated.
    fn head(&mut self, gpu: &Gpu, loss_scale: f64, grad: bool) -> Result<f64> {
        let (c, v) = (self.shape.d_model, self.shape.vocab);
        let n = self.tokens();
        let w = self.p("lm_head.weight");
        let dw = self.g("lm_head.weight");
        for r0 in (0..n).step_by(self.chunk_rows) {
            let rows = self.chunk_rows.min(n - r0);
            let h = self.lnf.at(r0 * c);
            gpu.gemm(self.logits.ptr(), h, w, (rows, v, c), false, true, 0.0)?;
            gpu.softmax_cross_entropy(
                self.logits.ptr(),
                self.losses.at(r0),
                self.targets.at(r0),
                rows,
                v,
                loss_scale as f32,
                grad,
            )?;
            if grad {
                // dh = dlogits W (rows, C); dW += dlogits^T h.
                gpu.gemm(
                    self.dln.at(r0 * c),
                    self.logits.ptr(),
                    w,
                    (rows, c, v),
                    false,
                    false,
                    0.0,
                )?;
                gpu.gemm(dw, self.logits.ptr(), h, (v, c, rows), true, false, 1.0)?;
            }
        }
        let losses = gpu.download(&self.losses)?;
        Ok(losses.iter().map(|&x| x as f64).sum())
    }

    fn backward(&mut self, gpu: &Gpu) -> Result<()> {
        let (b, t, c, f) = (self.batch, self.seq, self.shape.d_model, self.shape.ffn);
        let n = b * t;
        let (h, rms) = (self.shape.heads, self.shape.rms);
        let d = c / h;
        let s = &self.scratch;
        // Final norm: dx = d(ln_f input).
        gpu.norm_backward(
            self.dx.ptr(),
            self.g("ln_f.weight"),
            self.g_opt("ln_f.bias"),
            self.dln.ptr(),
            self.x_final.ptr(),
            self.lnf_mean.ptr(),
            self.lnf_rstd.ptr(),
            self.p("ln_f.weight"),
            n,
            c,
            rms,
            s,
        )?;
        for l in (0..self.shape.layers).rev() {
            let pre = format!("h.{l}");
            let a = &self.acts[l];
            let name = |x: &str| format!("{pre}.{x}");
            // MLP branch: out = x1 + mlp(ln2(x1)); dx holds d(out).
            gpu.linear_backward(
                self.dff.ptr(),
                self.g(&name("mlp.c_proj.weight")),
                self.g(&name("mlp.c_proj.bias")),
                self.dx.ptr(),
                a.g.ptr(),
                self.p(&name("mlp.c_proj.weight")),
                n,
                f,
                c,
                s,
            )?;
            gpu.gelu_backward(self.dff.ptr(), self.dff.ptr(), a.u.ptr(), n * f)?;
            gpu.column_sum(
                self.g(&name("mlp.c_fc.bias")),
                self.dff.ptr(),
                n,
                f,
                true,
                s,
            )?;
            gpu.linear_backward(
                self.dln.ptr(),
                self.g(&name("mlp.c_fc.weight")),
                0,
                self.dff.ptr(),
                a.ln2.ptr(),
                self.p(&name("mlp.c_fc.weight")),
                n,
                c,
                f,
                s,
            )?;
            gpu.norm_backward(
                self.dtmp.ptr(),
                self.g(&name("ln_2.weight")),
                self.g_opt(&name("ln_2.bias")),
                self.dln.ptr(),
                a.x1.ptr(),
                a.ln2_mean.ptr(),
                a.ln2_rstd.ptr(),
                self.p(&name("ln_2.weight")),
                n,
                c,
                rms,
                s,
            )?;
            gpu.add_assign(self.dx.ptr(), self.dtmp.ptr(), n * c)?; // d(x1)
            // Attention branch: x1 = x + proj(attn(ln1(x))).
            gpu.linear_backward(
                self.dln.ptr(),
                self.g(&name("attn.c_proj.weight")),
                self.g(&name("attn.c_proj.bias")),
                self.dx.ptr(),
                a.y.ptr(),
                self.p(&name("attn.c_proj.weight")),
                n,
                c,
                c,
                s,
            )?;
            let sh = AttnShape {
                b,
                h,
                d,
                s: t,
                p: 0,
                q_stride: 3 * c,
                kv_stride: 3 * c,
            };
            // dq, dk, dv land in the (N, 3C) layout's thirds through row strides: the kernels write
            // rows of width H·D = C, so they go to separate (N, C) planes of dqkv and are
            // interleaved by the gemm's layout below.
            gpu.attention_backward(
                self.dqkv.ptr(),
                self.dqkv.at(n * c),
                self.dqkv.at(2 * n * c),
                a.qkv.ptr(),
                a.qkv.at(c),
                a.qkv.at(2 * c),
                a.y.ptr(),
                self.dln.ptr(),
                a.lse.ptr(),
                self.delta.ptr(),
                sh,
                1.0 / (d as f32).sqrt(),
            )?;
            // c_attn backward with dqkv as three (N, C) planes: dW rows [0, C), [C, 2C), [2C, 3C)
            // and the bias thirds get one product each; dln = sum of the three dy_i W_i.
            let w = self.p(&name("attn.c_attn.weight"));
            let dw = self.g(&name("attn.c_attn.weight"));
            let db = self.g(&name("attn.c_attn.bias"));
            for i in 0..3 {
                let dy = self.dqkv.at(i * n * c);
                let w_i = w + (i * c * c * 4) as u64;
                gpu.gemm(
                    self.dln.ptr(),
                    dy,
                    w_i,
                    (n, c, c),
                    false,
                    false,
                    if i == 0 { 0.0 } else { 1.0 },
                )?;
                gpu.gemm(
                    dw + (i * c * c * 4) as u64,
                    dy,
                    a.ln1.ptr(),
                    (c, c, n),
                    true,
                    false,
                    1.0,
                )?;
                gpu.column_sum(db + (i * c * 4) as u64, dy, n, c, true, s)?;
            }
            gpu.norm_backward(
                self.dtmp.ptr(),
                self.g(&name("ln_1.weight")),
                self.g_opt(&name("ln_1.bias")),
                self.dln.ptr(),
                a.x.ptr(),
                a.ln1_mean.ptr(),
                a.ln1_rstd.ptr(),
                self.p(&name("ln_1.weight")),
                n,
                c,
                rms,
                s,
            )?;
            gpu.add_assign(self.dx.ptr(), self.dtmp.ptr(), n * c)?; // d(x)
        }
        gpu.embed_backward_tokens(self.g("wte.weight"), self.dx.ptr(), &self.host_ids, c)?;
        gpu.embed_backward_positions(self.g("wpe.weight"), self.dx.ptr(), b, t, c, 0)
    }

    /// Per-parameter sums of squares of the gradients, in the model's parameter order.
    pub fn grad_sums_of_squares(&self, gpu: &Gpu) -> Result<Vec<(String, f64)>> {
        let list: Vec<(u64, usize)> = self
            .params
            .iter()
            .map(|p| (p.grad.ptr(), p.grad.len()))
            .collect();
        let sums = gpu.sums_of_squares(&list)?;
        Ok(self
            .params
            .iter()
            .map(|p| p.name.clone())
            .zip(sums)
            .collect())
    }

    /// Clips by the global norm (summed over parameter names in sorted order, as the CPU
    /// stage's caller does), applies AdamW and clears the gradients. Returns the norm.
    pub fn update(&mut self, gpu: &Gpu, upd: &Update) -> Result<f64> {
        let mut sums = self.grad_sums_of_squares(gpu)?;
        sums.sort_by(|a, b| a.0.cmp(&b.0));
        let norm = sums.iter().map(|(_, s)| s).sum::<f64>().sqrt();
        let clip = if norm > upd.grad_clip {
            upd.grad_clip / (norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let t = self.step as f64;
        let (b1, b2, eps) = upd.betas;
        let inv_bc2 = 1.0 / (1.0 - b2.powf(t));
        let lr_bc1 = upd.lr / (1.0 - b1.powf(t));
        for p in &mut self.params {
            let wd = if p.decays { upd.weight_decay } else { 0.0 };
            let decay = 1.0 - upd.lr * wd;
            gpu.adamw(
                p.value.ptr(),
                p.m.ptr(),
                p.v.ptr(),
                p.grad.ptr(),
                p.value.len(),
                clip as f32,
                (b1 as f32, b2 as f32, eps as f32),
                (inv_bc2 as f32, lr_bc1 as f32, decay as f32),
            )?;
        }
        for p in &mut self.params {
            gpu.clear(&mut p.grad)?;
        }
        Ok(norm)
    }

    /// Host copies of every parameter `(name, dims, values)`.
    pub fn download_params(&self, gpu: &Gpu) -> Result<Vec<NamedTensor>> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), p.dims.clone(), gpu.download(&p.value)?)))
            .collect()
    }

    /// Host copies of every gradient `(name, dims, values)`.
    pub fn download_grads(&self, gpu: &Gpu) -> Result<Vec<NamedTensor>> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), p.dims.clone(), gpu.download(&p.grad)?)))
            .collect()
    }

    /// Bytes of device memory held for parameters, gradients and AdamW moments.
    pub fn state_bytes(&self) -> usize {
        self.params.iter().map(|p| 16 * p.value.len()).sum()
    }
}

fn shape_err<T>(op: &'static str, reason: String) -> Result<T> {
    shape(op, reason)
}
