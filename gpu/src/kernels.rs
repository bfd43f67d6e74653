//! Safe-shaped wrappers of the kernels in `kernels.cu`: one method per kernel (or per kernel
//! pair), taking device addresses and shapes; every shape is checked to fit the kernel's `int`s.
//! Buffers are the caller's: a method never allocates except for the scratch of its reductions.

use crate::device::{Buf, Gpu, Precision};
use crate::error::{GpuError, Result, shape};
use crate::profile::{LAYERNORM_BWD, Pass};
use crate::types::{Arg, AttentionKernels, Bf16Path, Operands, int};

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// Rows per chunk of the two-pass column sums (bias and norm-parameter gradients).
pub(crate) const ROWS_PER_CHUNK: usize = 64;
/// Blocks of the first pass of a sum of squares (fixed: the result must not depend on the size).
const SUMSQ_BLOCKS: usize = 256;

fn blocks(total: usize) -> u32 {
    total.div_ceil(THREADS as usize) as u32
}

/// Shape of one attention call: `b` sequences, `h` heads of width `d`, `s` queries over a prefix
/// of `p` keys (so `p + s` keys), with the row strides (in floats) of the query and key/value rows
/// and the rows each sequence takes in the key/value buffers (and in dK/dV).
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Sequences B.
    pub b: usize,
    /// Heads H.
    pub h: usize,
    /// Head width D.
    pub d: usize,
    /// Queries per sequence (the segment length).
    pub s: usize,
    /// Keys before the segment (its prefix).
    pub p: usize,
    /// Floats between consecutive query rows.
    pub q_stride: usize,
    /// Floats between consecutive key (and value) rows.
    pub kv_stride: usize,
    /// Rows per sequence in the key/value buffers and in dK/dV: at least `p + s` (more when they
    /// are a K/V cache of whole sequences).
    pub kv_rows: usize,
}

impl AttnShape {
    fn args(&self, op: &'static str) -> Result<[Arg; 7]> {
        if !crate::compile::HEAD_DIMS.contains(&self.d) {
            return shape(
                op,
                format!(
                    "head width {} has no kernel (have {:?})",
                    self.d,
                    crate::compile::HEAD_DIMS
                ),
            );
        }
        if self.kv_rows < self.p + self.s {
            return shape(
                op,
                format!(
                    "{} key/value rows per sequence cannot hold a prefix of {} and {} queries",
                    self.kv_rows, self.p, self.s
                ),
            );
        }
        Ok([
            Arg::I(int(self.b, op, "batch")?),
            Arg::I(int(self.h, op, "heads")?),
            Arg::I(int(self.s, op, "queries")?),
            Arg::I(int(self.p, op, "prefix")?),
            Arg::I(int(self.q_stride, op, "q stride")?),
            Arg::I(int(self.kv_stride, op, "kv stride")?),
            Arg::I(int(self.kv_rows, op, "kv rows")?),
        ])
    }
}

/// The document starts of a micro-batch for the attention kernels' document mask: a device buffer
/// of `u32`, one per position of each sequence, laid out like the K/V cache's rows (position `l`
/// of sequence `b` at `b · kv_rows + l`), holding the start of the document that position belongs
/// to. Query `t` of a segment sees keys `start(p + t)..=p + t` only. One value per position (not
/// the sorted starts) so that a kernel thread finds its query's start with one load, no search,
/// and the same buffer serves every segment and layer of the micro-batch (uploaded once). The
/// values must be what [`position_doc_starts`] makes: non-decreasing along a sequence and at most
/// the position itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DocStarts {
    /// Device address of the `u32`s.
    pub ptr: u64,
    /// How many there are: at least `b · kv_rows` of a call.
    pub len: usize,
}

/// What a norm layer's forward saves for its backward: the input `x (n, c)` and the per-row
/// statistics [`Gpu::norm_forward`] writes (`mean` unused by an RMSNorm), which
/// [`Gpu::norm_backward_input`] and [`Gpu::norm_backward_params`] read.
#[derive(Clone, Copy, Debug)]
pub struct NormSaved {
    /// Device address of the input rows.
    pub x: u64,
    /// Device address of the `n` row means.
    pub mean: u64,
    /// Device address of the `n` reciprocal standard deviations (RMS with `rms`).
    pub rstd: u64,
    /// Rows.
    pub n: usize,
    /// Columns (the layer's width).
    pub c: usize,
    /// An RMSNorm (no mean, no bias) rather than a LayerNorm.
    pub rms: bool,
}

/// Per sequence of `mask` and position `0..seq`, the start of its document (the layout of
/// [`DocStarts`]); positions must fit the kernels' `int`s (checked by the kernel wrappers).
pub fn position_doc_starts(mask: &ops::DocumentMask, seq: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(mask.batch() * seq);
    for b in 0..mask.batch() {
        let starts = mask.starts(b);
        let mut i = 0;
        for pos in 0..seq {
            while i + 1 < starts.len() && starts[i + 1] <= pos {
                i += 1;
            }
            out.push(starts[i] as u32);
        }
    }
    out
}

/// The `docs` argument of an attention kernel: the buffer's address (checked to cover the call's
/// sequences), or null for no mask.
fn doc_arg(docs: Option<DocStarts>, sh: &AttnShape, op: &'static str) -> Result<u64> {
    match docs {
        None => Ok(0),
        Some(d) if d.len >= sh.b * sh.kv_rows => Ok(d.ptr),
        Some(d) => shape(
            op,
            format!(
                "{} document starts cannot cover {} sequences of {} key/value rows",
                d.len, sh.b, sh.kv_rows
            ),
        ),
    }
}

/// The address of `docs` for a kernel reading `rows` rows of `seq` positions, positions below `end`
/// of each: an error unless the buffer covers them and `end <= seq`.
fn checked_docs(
    docs: DocStarts,
    rows: usize,
    seq: usize,
    end: usize,
    op: &'static str,
) -> Result<u64> {
    if end > seq || docs.len < rows * seq {
        return shape(
            op,
            format!(
                "{} document starts for {rows} rows of {seq} positions, read up to position {end}",
                docs.len
            ),
        );
    }
    Ok(docs.ptr)
}

/// Query (or key) rows per attention block: `BR` and `TC_ROWS` of kernels.cu.
const ATTN_ROWS: usize = 64;

/// How one attention call is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AttnLaunch {
    /// The kernels' name prefix (`attn_`, `attn_tc_`, `attn_tc2_`).
    prefix: &'static str,
    /// Threads per block of the forward, dQ and dK/dV kernels.
    threads: u32,
    /// Queries per block of the forward (those of dQ, and the keys of dK/dV: [`ATTN_ROWS`]).
    forward_rows: usize,
    /// The delta kernel: `attn_tc2_backward_delta` (a warp per row) instead of
    /// `attn_backward_delta` (a thread per row).
    warp_delta: bool,
    /// The kernels read rows with 16-byte loads: the rows must be 16-byte aligned.
    aligned_rows: bool,
    /// The kernels take document starts (a `docs` argument): all but the v1 tensor-core ones.
    masks: bool,
}

/// The attention kernels of a call: FP32 on CUDA cores (a thread per row), or BF16 on tensor
/// cores (four warps of 16 rows) in version 1 or 2 (`V2Shape` of kernels.cu: the forward's
/// warps take 32 queries each for head widths up to 64).
fn attention_launch(tensor_cores: bool, kernels: AttentionKernels, d: usize) -> AttnLaunch {
    match (tensor_cores, kernels) {
        (false, _) => AttnLaunch {
            prefix: "attn_",
            threads: ATTN_ROWS as u32,
            forward_rows: ATTN_ROWS,
            warp_delta: false,
            aligned_rows: false,
            masks: true,
        },
        (true, AttentionKernels::V1) => AttnLaunch {
            prefix: "attn_tc_",
            threads: 128,
            forward_rows: ATTN_ROWS,
            warp_delta: false,
            aligned_rows: false,
            masks: false,
        },
        (true, AttentionKernels::V2) => AttnLaunch {
            prefix: "attn_tc2_",
            threads: 128,
            forward_rows: if d <= 64 { 2 * ATTN_ROWS } else { ATTN_ROWS },
            warp_delta: true,
            aligned_rows: true,
            masks: true,
        },
    }
}

/// For kernels that read rows with 16-byte loads: every matrix's address and row stride (in
/// floats) must keep each row 16-byte aligned (device allocations are 256-byte aligned, the
/// stage's row offsets multiples of 4 floats); an error naming the first that does not.
fn rows_aligned(op: &'static str, matrices: &[(&str, u64, usize)]) -> Result<()> {
    for &(name, addr, stride) in matrices {
        if addr % 16 != 0 || stride % 4 != 0 {
            return shape(
                op,
                format!(
                    "{name} at {addr:#x} with rows {stride} floats apart is not 16-byte aligned, \
                     which the v2 attention kernels need: set {}=v1 to use v1",
                    AttentionKernels::ENV
                ),
            );
        }
    }
    Ok(())
}

impl Gpu {
    /// Row-major `C (m, n) = alpha · op(A) op(B) + beta · C` with `op(A)` `(m, k)` and `op(B)`
    /// `(k, n)`; `ta`/`tb` say that `A` is stored `(k, m)` / `B` is stored `(n, k)`, and the rows
    /// are stored as narrow as the shapes allow. `C` is FP32; FP32 operands compute as the
    /// precision says, BF16 ones with FP32 accumulation. Both backends (cuBLAS and the emulation)
    /// implement only `gemm_ld_of`, which takes the stored row widths.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_of(
        &self,
        c: u64,
        a: u64,
        b: u64,
        (m, n, k): (usize, usize, usize),
        (ta, tb): (bool, bool),
        beta: f32,
        operands: Operands,
    ) -> Result<()> {
        let lds = (if ta { m } else { k }, if tb { k } else { n });
        self.gemm_ld_of(c, a, b, (m, n, k), (ta, tb), lds, beta, operands)
    }

    /// Row-major `C (m, n) = op(A) op(B) + beta · C` (see `gemm_of` for the layout), the entry
    /// point of the stage's products on FP32 operands. In BF16 mode cuBLAS reads the FP32 operands
    /// and rounds them itself, or — with [`Bf16Path::Operands`] — the operands are first rounded
    /// into BF16 copies by [`Gpu::to_bf16`] and multiplied as BF16 ([`Operands::Bf16`]); both
    /// accumulate in FP32. (With [`Bf16Path::CachedWeights`] the stage passes BF16 operands itself,
    /// through [`Gpu::gemm_bf16`]; FP32 operands reaching here are read as in FP32 operands mode.)
    /// `seqpipe gpu gemm` times the ways.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        c: u64,
        a: u64,
        b: u64,
        (m, n, k): (usize, usize, usize),
        ta: bool,
        tb: bool,
        beta: f32,
    ) -> Result<()> {
        if !self.bf16_operands() || m == 0 || n == 0 || k == 0 {
            return self.gemm_of(c, a, b, (m, n, k), (ta, tb), beta, Operands::F32);
        }
        let mut bufs = self.operands.bufs.borrow_mut();
        for (slot, len) in bufs.iter_mut().zip([m * k, k * n]) {
            if slot.as_ref().is_none_or(|buf| buf.len() < len) {
                *slot = Some(self.zeros(len)?);
            }
        }
        let [Some(a16), Some(b16)] = &*bufs else {
            unreachable!("both operand copies were just made")
        };
        self.to_bf16(a16.ptr(), a, m * k)?;
        self.to_bf16(b16.ptr(), b, k * n)?;
        let (a16, b16) = (a16.ptr(), b16.ptr());
        self.gemm_of(c, a16, b16, (m, n, k), (ta, tb), beta, Operands::Bf16)
    }

    /// Row-major `C (m, n) = op(A) op(B) + beta · C` of BF16 operands (16-bit words, as
    /// [`Gpu::to_bf16`] writes them) with FP32 accumulation, `A` and `B` stored in rows of `lda`
    /// and `ldb` values (at least what the shapes imply).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_bf16(
        &self,
        c: u64,
        a16: u64,
        b16: u64,
        mnk: (usize, usize, usize),
        transposed: (bool, bool),
        lds: (usize, usize),
        beta: f32,
    ) -> Result<()> {
        self.gemm_ld_of(c, a16, b16, mnk, transposed, lds, beta, Operands::Bf16)
    }

    /// How BF16 mode feeds its products ([`Bf16Path::CachedWeights`] unless set). A stage reads
    /// it when it is built: set it before.
    pub fn set_bf16_path(&mut self, path: Bf16Path) {
        self.operands.path = path;
    }

    /// BF16 mode's path (whatever the precision).
    pub fn bf16_path(&self) -> Bf16Path {
        self.operands.path
    }

    /// Whether products run on per-product BF16 copies of both operands: BF16 mode with
    /// [`Bf16Path::Operands`].
    pub fn bf16_operands(&self) -> bool {
        self.operands.path == Bf16Path::Operands && self.precision() == Precision::Bf16
    }

    /// Whether a stage keeps BF16 copies of its weights: BF16 mode with
    /// [`Bf16Path::CachedWeights`].
    pub fn bf16_weight_copies(&self) -> bool {
        self.operands.path == Bf16Path::CachedWeights && self.precision() == Precision::Bf16
    }

    /// `out (n, c) = wte[ids] + wpe[pos0 + i % t]` (`wpe` 0: no position table); with `docs`
    /// (positions restart at each document, `data.reset_positions`) the position row is that of
    /// `pos0 + i % t` minus its document's start in row `i / t` ([`DocStarts`], rows of `seq`
    /// positions).
    #[allow(clippy::too_many_arguments)]
    pub fn embed_forward(
        &self,
        out: u64,
        ids: u64,
        wte: u64,
        wpe: u64,
        n: usize,
        c: usize,
        (t, pos0): (usize, usize),
        docs: Option<(DocStarts, usize)>,
    ) -> Result<()> {
        const OP: &str = "embed_forward";
        let (docs_ptr, seq) = match docs {
            None => (0, 0),
            Some((d, seq)) => (
                checked_docs(d, n.div_ceil(t.max(1)), seq, pos0 + t, OP)?,
                seq,
            ),
        };
        self.launch(
            OP,
            (int(n, OP, "tokens")? as u32, 1, 1),
            128,
            &[
                Arg::P(out),
                Arg::P(ids),
                Arg::P(wte),
                Arg::P(wpe),
                Arg::I(int(n, OP, "n")?),
                Arg::I(int(c, OP, "c")?),
                Arg::I(int(t, OP, "t")?),
                Arg::I(int(pos0, OP, "pos0")?),
                Arg::P(docs_ptr),
                Arg::I(int(seq, OP, "seq")?),
            ],
        )
    }

    /// `dwte[ids[i]] += dy[i]` with each table row's sum taken in position order (no atomics):
    /// `ids` is the host copy of the token ids.
    pub fn embed_backward_tokens(&self, dwte: u64, dy: u64, ids: &[u32], c: usize) -> Result<()> {
        const OP: &str = "embed_backward_tokens";
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&i| (ids[i as usize], i));
        let mut uniq = Vec::new();
        let mut starts = Vec::new();
        for (s, &i) in order.iter().enumerate() {
            let id = ids[i as usize];
            if uniq.last() != Some(&id) {
                uniq.push(id);
                starts.push(s as u32);
            }
        }
        starts.push(order.len() as u32);
        if uniq.is_empty() {
            return Ok(());
        }
        let (order_d, starts_d, uniq_d) = (
            self.upload(&order)?,
            self.upload(&starts)?,
            self.upload(&uniq)?,
        );
        self.launch(
            OP,
            (uniq.len() as u32, 1, 1),
            128,
            &[
                Arg::P(dwte),
                Arg::P(dy),
                Arg::P(order_d.ptr()),
                Arg::P(starts_d.ptr()),
                Arg::P(uniq_d.ptr()),
                Arg::I(int(c, OP, "c")?),
            ],
        )?;
        // The index buffers must outlive the launch.
        self.sync()
    }

    /// `dwpe[pos0 + p] += sum_b dy[b * t + p]`.
    pub fn embed_backward_positions(
        &self,
        dwpe: u64,
        dy: u64,
        b: usize,
        t: usize,
        c: usize,
        pos0: usize,
    ) -> Result<()> {
        const OP: &str = "embed_backward_positions";
        self.launch(
            OP,
            (int(t, OP, "t")? as u32, 1, 1),
            128,
            &[
                Arg::P(dwpe),
                Arg::P(dy),
                Arg::I(int(b, OP, "b")?),
                Arg::I(int(t, OP, "t")?),
                Arg::I(int(c, OP, "c")?),
                Arg::I(int(pos0, OP, "pos0")?),
            ],
        )
    }

    /// `dwpe[q] += sum of dy[i]` over the tokens `i` of position id `q` when positions restart at
    /// each document (`data.reset_positions`): `dy` holds `b` rows of positions `pos0..pos0 + t`,
    /// the id of position `p` of row `r` is `p` minus its document's start ([`DocStarts`], rows of
    /// `seq` positions), and `ids` (`q < ids`) bounds the ids that occur. Each id's sum runs in
    /// token order, as the CPU's `ops::embedding_backward` adds; no atomics.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_backward_positions_reset(
        &self,
        dwpe: u64,
        dy: u64,
        (b, t, c, pos0): (usize, usize, usize, usize),
        docs: DocStarts,
        seq: usize,
        ids: usize,
    ) -> Result<()> {
        const OP: &str = "embed_backward_positions_reset";
        let docs = checked_docs(docs, b, seq, pos0 + t, OP)?;
        if ids == 0 || t == 0 || b == 0 {
            return Ok(());
        }
        if ids > pos0 + t {
            return shape(
                OP,
                format!(
                    "{ids} position ids for a segment ending at position {}",
                    pos0 + t
                ),
            );
        }
        self.launch(
            OP,
            (int(ids, OP, "ids")? as u32, 1, 1),
            128,
            &[
                Arg::P(dwpe),
                Arg::P(dy),
                Arg::P(docs),
                Arg::I(int(b, OP, "b")?),
                Arg::I(int(t, OP, "t")?),
                Arg::I(int(c, OP, "c")?),
                Arg::I(int(pos0, OP, "pos0")?),
                Arg::I(int(seq, OP, "seq")?),
            ],
        )
    }

    /// `out (c,) (+)= column sums of x (n, c)`, deterministic; `scratch` holds at least
    /// [`Gpu::column_scratch_len`] floats.
    pub fn column_sum(
        &self,
        out: u64,
        x: u64,
        n: usize,
        c: usize,
        accumulate: bool,
        scratch: &Buf<f32>,
    ) -> Result<()> {
        const OP: &str = "column_sum";
        let chunks = n.div_ceil(ROWS_PER_CHUNK).max(1);
        if scratch.len() < chunks * c {
            return shape(
                OP,
                format!("scratch of {} floats, need {}", scratch.len(), chunks * c),
            );
        }
        let (ni, ci) = (int(n, OP, "n")?, int(c, OP, "c")?);
        self.launch(
            "column_sum_partial",
            (blocks(c), chunks as u32, 1),
            THREADS,
            &[
                Arg::P(scratch.ptr()),
                Arg::P(x),
                Arg::I(ni),
                Arg::I(ci),
                Arg::I(ROWS_PER_CHUNK as i32),
            ],
        )?;
        self.launch(
            "column_sum_finish",
            (blocks(c), 1, 1),
            THREADS,
            &[
                Arg::P(out),
                Arg::P(scratch.ptr()),
                Arg::I(chunks as i32),
                Arg::I(ci),
                Arg::I(accumulate as i32),
            ],
        )
    }

    /// Floats of scratch a column sum (or norm-parameter gradient) of `(n, c)` needs.
    pub fn column_scratch_len(n: usize, c: usize) -> usize {
        n.div_ceil(ROWS_PER_CHUNK).max(1) * c
    }

    /// Launches the elementwise kernel `name` with one thread per element of `total`.
    fn launch_over(&self, name: &str, total: usize, args: &[Arg]) -> Result<()> {
        self.launch(name, (blocks(total), 1, 1), THREADS, args)
    }

    /// `y (n, c) += b`.
    pub fn add_bias(&self, y: u64, b: u64, n: usize, c: usize) -> Result<()> {
        let total = n * c;
        self.launch_over(
            "add_bias",
            total,
            &[
                Arg::P(y),
                Arg::P(b),
                Arg::L(total as i64),
                Arg::I(int(c, "add_bias", "c")?),
            ],
        )
    }

    /// `out = a + b` over `total` floats.
    pub fn add(&self, out: u64, a: u64, b: u64, total: usize) -> Result<()> {
        self.launch_over(
            "add",
            total,
            &[Arg::P(out), Arg::P(a), Arg::P(b), Arg::L(total as i64)],
        )
    }

    /// Copies `n` floats from `src` to `dst` (device to device, on the compute stream).
    pub fn copy_values(&self, dst: u64, src: u64, n: usize) -> Result<()> {
        self.copy_rows(dst, (1, 0), src, (1, 0), 1, 1, n)
    }

    /// Copies `b` blocks of `rows` rows of `width` floats: block `i` from rows `src_row0..` of the
    /// `i`-th group of `src_rows` rows of `src` to rows `dst_row0..` of the `i`-th group of
    /// `dst_rows` rows of `dst` (a segment's rows into or out of a K/V cache of whole sequences).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_rows(
        &self,
        dst: u64,
        (dst_rows, dst_row0): (usize, usize),
        src: u64,
        (src_rows, src_row0): (usize, usize),
        b: usize,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        const OP: &str = "copy_rows";
        if dst_row0 + rows > dst_rows || src_row0 + rows > src_rows {
            return shape(
                OP,
                format!(
                    "{rows} rows from row {src_row0} of {src_rows} to row {dst_row0} of {dst_rows}"
                ),
            );
        }
        self.launch(
            OP,
            (blocks(b * rows * width), 1, 1),
            THREADS,
            &[
                Arg::P(dst),
                Arg::P(src),
                Arg::I(int(b, OP, "b")?),
                Arg::I(int(rows, OP, "rows")?),
                Arg::I(int(width, OP, "width")?),
                Arg::I(int(dst_rows, OP, "dst rows")?),
                Arg::I(int(dst_row0, OP, "dst row")?),
                Arg::I(int(src_rows, OP, "src rows")?),
                Arg::I(int(src_row0, OP, "src row")?),
            ],
        )
    }

    /// `out = bf16(x)` over `total` floats (round to nearest even), as 16-bit words.
    pub fn to_bf16(&self, out: u64, x: u64, total: usize) -> Result<()> {
        self.launch_over(
            "to_bf16",
            total,
            &[Arg::P(out), Arg::P(x), Arg::L(total as i64)],
        )
    }

    /// `out += a` over `total` floats.
    pub fn add_assign(&self, out: u64, a: u64, total: usize) -> Result<()> {
        self.launch_over(
            "add_assign",
            total,
            &[Arg::P(out), Arg::P(a), Arg::L(total as i64)],
        )
    }

    /// `x += b` (kept for the backward), `y = gelu_tanh(x)`; `b` 0: no bias.
    pub fn bias_gelu_forward(&self, y: u64, x: u64, b: u64, n: usize, c: usize) -> Result<()> {
        let total = n * c;
        self.launch_over(
            "bias_gelu_forward",
            total,
            &[
                Arg::P(y),
                Arg::P(x),
                Arg::P(b),
                Arg::L(total as i64),
                Arg::I(int(c, "bias_gelu_forward", "c")?),
            ],
        )
    }

    /// `du = dy * gelu'(u)`.
    pub fn gelu_backward(&self, du: u64, dy: u64, u: u64, total: usize) -> Result<()> {
        self.launch_over(
            "gelu_backward",
            total,
            &[Arg::P(du), Arg::P(dy), Arg::P(u), Arg::L(total as i64)],
        )
    }

    /// Layer norm (`b` non-zero) or RMS norm (`saved.rms`) of the rows of `saved.x (n, c)` into
    /// `y`, writing each row's mean and reciprocal standard deviation to `saved.mean` and
    /// `saved.rstd` for the backward.
    pub fn norm_forward(
        &self,
        y: u64,
        (w, b): (u64, u64),
        saved: &NormSaved,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "norm_forward";
        let &NormSaved {
            x,
            mean,
            rstd,
            n,
            c,
            rms,
        } = saved;
        self.launch(
            OP,
            (int(n, OP, "rows")? as u32, 1, 1),
            128,
            &[
                Arg::P(y),
                Arg::P(mean),
                Arg::P(rstd),
                Arg::P(x),
                Arg::P(w),
                Arg::P(b),
                Arg::I(int(c, OP, "c")?),
                Arg::F(eps),
                Arg::I(rms as i32),
            ],
        )
    }

    /// Backward of [`Gpu::norm_forward`] with weight `w`: `dx` written; `dw` (and `db` unless
    /// RMS) accumulated. [`Gpu::norm_backward_input`], then [`Gpu::norm_backward_params`].
    pub fn norm_backward(
        &self,
        dx: u64,
        (dw, db): (u64, u64),
        dy: u64,
        w: u64,
        saved: &NormSaved,
        scratch: &Buf<f32>,
    ) -> Result<()> {
        self.norm_backward_input(dx, dy, w, saved)?;
        self.norm_backward_params((dw, db), dy, saved, (scratch, true))
    }

    /// The input half of [`Gpu::norm_backward`]: `dx` written from `dy`, the forward's input and
    /// statistics (`saved`) and the weight `w`.
    pub fn norm_backward_input(&self, dx: u64, dy: u64, w: u64, saved: &NormSaved) -> Result<()> {
        const OP: &str = "norm_backward";
        let &NormSaved {
            x,
            mean,
            rstd,
            n,
            c,
            rms,
        } = saved;
        let (ni, ci) = (int(n, OP, "rows")?, int(c, OP, "c")?);
        self.launch(
            "norm_backward_input",
            (ni as u32, 1, 1),
            128,
            &[
                Arg::P(dx),
                Arg::P(dy),
                Arg::P(x),
                Arg::P(mean),
                Arg::P(rstd),
                Arg::P(w),
                Arg::I(ci),
                Arg::I(rms as i32),
            ],
        )
    }

    /// The parameter half of [`Gpu::norm_backward`]: the weight's (and, unless an RMSNorm, the
    /// bias's) gradients `(dw, db)` over the rows of `dy` and the forward's input (`saved`, with
    /// its statistics), added to what is there with `accumulate`, else written; `scratch` holds
    /// twice [`Gpu::column_scratch_len`] floats.
    pub fn norm_backward_params(
        &self,
        (dw, db): (u64, u64),
        dy: u64,
        saved: &NormSaved,
        (scratch, accumulate): (&Buf<f32>, bool),
    ) -> Result<()> {
        const OP: &str = "norm_backward";
        let &NormSaved {
            x,
            mean,
            rstd,
            n,
            c,
            rms,
        } = saved;
        let (ni, ci) = (int(n, OP, "rows")?, int(c, OP, "c")?);
        let chunks = n.div_ceil(ROWS_PER_CHUNK).max(1);
        if scratch.len() < 2 * chunks * c {
            return shape(
                OP,
                format!(
                    "scratch of {} floats, need {}",
                    scratch.len(),
                    2 * chunks * c
                ),
            );
        }
        let pw = scratch.ptr();
        let pb = if rms { 0 } else { scratch.at(chunks * c) };
        self.launch(
            "norm_backward_params_partial",
            (blocks(c), chunks as u32, 1),
            THREADS,
            &[
                Arg::P(pw),
                Arg::P(pb),
                Arg::P(dy),
                Arg::P(x),
                Arg::P(mean),
                Arg::P(rstd),
                Arg::I(ni),
                Arg::I(ci),
                Arg::I(ROWS_PER_CHUNK as i32),
            ],
        )?;
        let _scope = self.profile_scope(LAYERNORM_BWD);
        let finish = |out: u64, part: u64| {
            self.launch(
                "column_sum_finish",
                (blocks(c), 1, 1),
                THREADS,
                &[
                    Arg::P(out),
                    Arg::P(part),
                    Arg::I(chunks as i32),
                    Arg::I(ci),
                    Arg::I(accumulate as i32),
                ],
            )
        };
        finish(dw, pw)?;
        if !rms {
            finish(db, pb)?;
        }
        Ok(())
    }

    /// Rotates (or, `inverse`, rotates back) pairs `(i, i + d/2)` of every head of rows
    /// `(b, s, h, d)` with row stride `stride`, at positions `offset..offset + s`, in place.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: u64,
        cos: u64,
        sin: u64,
        (b, s, h, d): (usize, usize, usize, usize),
        stride: usize,
        offset: usize,
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "rope";
        let total = b * s * h * (d / 2);
        self.launch(
            OP,
            (blocks(total), 1, 1),
            THREADS,
            &[
                Arg::P(x),
                Arg::P(cos),
                Arg::P(sin),
                Arg::I(int(b, OP, "b")?),
                Arg::I(int(s, OP, "s")?),
                Arg::I(int(h, OP, "h")?),
                Arg::I(int(d, OP, "d")?),
                Arg::I(int(stride, OP, "stride")?),
                Arg::I(int(offset, OP, "offset")?),
                Arg::I(inverse as i32),
            ],
        )
    }

    /// The attention kernels this `Gpu` launches for head width `d`, with the rows of `matrices`
    /// checked for alignment when those kernels need it ([`rows_aligned`]), and document starts
    /// refused by kernels that take none.
    fn attention_launch_checked(
        &self,
        op: &'static str,
        d: usize,
        matrices: &[(&str, u64, usize)],
        docs: Option<DocStarts>,
    ) -> Result<AttnLaunch> {
        let l = attention_launch(
            self.attention_on_tensor_cores(),
            self.attention_kernels(),
            d,
        );
        if l.aligned_rows {
            rows_aligned(op, matrices)?;
        }
        if docs.is_some() && !l.masks {
            return Err(GpuError::MaskUnsupported {
                op,
                kernels: "tensor-core v1",
            });
        }
        Ok(l)
    }

    /// Causal prefix attention: `y (b·s, h·d)` and `lse (b, h, s)` from queries `q` and keys/values
    /// `k`, `v` laid out as [`AttnShape`] says; with `docs`, each query sees only the keys of its
    /// own document ([`DocStarts`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward(
        &self,
        y: u64,
        lse: u64,
        q: u64,
        k: u64,
        v: u64,
        docs: Option<DocStarts>,
        sh: AttnShape,
        scale: f32,
    ) -> Result<()> {
        const OP: &str = "attention_forward";
        let a = sh.args(OP)?;
        let l = self.attention_launch_checked(
            OP,
            sh.d,
            &[
                ("q", q, sh.q_stride),
                ("k", k, sh.kv_stride),
                ("v", v, sh.kv_stride),
            ],
            docs,
        )?;
        let mut args = vec![Arg::P(y), Arg::P(lse), Arg::P(q), Arg::P(k), Arg::P(v)];
        if l.masks {
            args.push(Arg::P(doc_arg(docs, &sh, OP)?));
        }
        args.extend(a);
        args.push(Arg::F(scale));
        self.launch(
            &format!("{}forward_d{}", l.prefix, sh.d),
            (
                sh.s.div_ceil(l.forward_rows) as u32,
                (sh.b * sh.h) as u32,
                1,
            ),
            l.threads,
            &args,
        )
    }

    /// Backward of [`Gpu::attention_forward`]: writes `dq (b·s, h·d)` and `dk`, `dv` (rows of
    /// `h·d`, `kv_rows` per sequence; rows `0..p+s` of each, rows `0..p` being this segment's
    /// gradient for the prefix), or adds to them with `accumulate_kv` (a K/V cache's gradient gathering every later
    /// segment's share). `delta` holds `b·h·s` floats of scratch. `docs` is the forward's: the
    /// rows of keys no query of theirs sees get zero (or are left as they were, when added to).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        dq: u64,
        dk: u64,
        dv: u64,
        q: u64,
        k: u64,
        v: u64,
        y: u64,
        dy: u64,
        lse: u64,
        delta: u64,
        docs: Option<DocStarts>,
        sh: AttnShape,
        scale: f32,
        accumulate_kv: bool,
    ) -> Result<()> {
        const OP: &str = "attention_backward";
        let a = sh.args(OP)?;
        let l = self.attention_launch_checked(
            OP,
            sh.d,
            &[
                ("q", q, sh.q_stride),
                ("k", k, sh.kv_stride),
                ("v", v, sh.kv_stride),
                ("dy", dy, sh.h * sh.d),
            ],
            docs,
        )?;
        let rows = sh.b * sh.h * sh.s;
        let (delta_kernel, delta_grid, delta_threads) = if l.warp_delta {
            // A warp per row, four per block.
            ("attn_tc2_backward_delta", rows.div_ceil(4) as u32, 128)
        } else {
            ("attn_backward_delta", blocks(rows), THREADS)
        };
        self.launch(
            delta_kernel,
            (delta_grid, 1, 1),
            delta_threads,
            &[
                Arg::P(delta),
                Arg::P(dy),
                Arg::P(y),
                a[0],
                a[1],
                a[2],
                Arg::I(int(sh.d, OP, "d")?),
            ],
        )?;
        let mut common = vec![
            Arg::P(q),
            Arg::P(k),
            Arg::P(v),
            Arg::P(dy),
            Arg::P(lse),
            Arg::P(delta),
        ];
        if l.masks {
            common.push(Arg::P(doc_arg(docs, &sh, OP)?));
        }
        common.extend(a);
        let mut args = vec![Arg::P(dq)];
        args.extend(common.iter().copied());
        args.push(Arg::F(scale));
        self.launch(
            &format!("{}backward_dq_d{}", l.prefix, sh.d),
            (sh.s.div_ceil(ATTN_ROWS) as u32, (sh.b * sh.h) as u32, 1),
            l.threads,
            &args,
        )?;
        let mut args = vec![Arg::P(dk), Arg::P(dv)];
        args.extend(common);
        args.push(Arg::I(accumulate_kv as i32));
        args.push(Arg::F(scale));
        self.launch(
            &format!("{}backward_dkdv_d{}", l.prefix, sh.d),
            (
                (sh.p + sh.s).div_ceil(ATTN_ROWS) as u32,
                (sh.b * sh.h) as u32,
                1,
            ),
            l.threads,
            &args,
        )
    }

    /// Softmax cross-entropy of `rows` rows of `logits (rows, v)` in place: per-row losses into
    /// `loss`, and (`want_grad`) the logits replaced by `grad_scale · (softmax − onehot)`.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_cross_entropy(
        &self,
        logits: u64,
        loss: u64,
        targets: u64,
        rows: usize,
        v: usize,
        grad_scale: f32,
        want_grad: bool,
    ) -> Result<()> {
        self.softmax_cross_entropy_rows(logits, loss, targets, rows, (v, v), grad_scale, want_grad)
    }

    /// [`Gpu::softmax_cross_entropy`] of logits rows `ld >= v` floats apart (a padded vocabulary):
    /// only the first `v` columns are read; with `want_grad` the columns `v..ld` are set to 0.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_cross_entropy_rows(
        &self,
        logits: u64,
        loss: u64,
        targets: u64,
        rows: usize,
        (v, ld): (usize, usize),
        grad_scale: f32,
        want_grad: bool,
    ) -> Result<()> {
        const OP: &str = "softmax_cross_entropy";
        if ld < v {
            return shape(
                OP,
                format!("rows of {ld} logits cannot hold a vocabulary of {v}"),
            );
        }
        self.launch(
            OP,
            (int(rows, OP, "rows")? as u32, 1, 1),
            256,
            &[
                Arg::P(logits),
                Arg::P(loss),
                Arg::P(targets),
                Arg::I(int(v, OP, "vocab")?),
                Arg::I(int(ld, OP, "row stride")?),
                Arg::F(grad_scale),
                Arg::I(want_grad as i32),
            ],
        )
    }

    /// One AdamW update of `n` parameters (ops/src/adamw.rs's formula, with its precomputed
    /// `inv_bc2`, `lr_bc1` and `decay`).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        &self,
        p: u64,
        m: u64,
        v: u64,
        g: u64,
        n: usize,
        grad_scale: f32,
        (beta1, beta2, eps): (f64, f64, f64),
        (inv_bc2, lr_bc1, decay): (f32, f32, f32),
    ) -> Result<()> {
        self.launch(
            "adamw",
            (blocks(n), 1, 1),
            THREADS,
            &[
                Arg::P(p),
                Arg::P(m),
                Arg::P(v),
                Arg::P(g),
                Arg::L(n as i64),
                Arg::F(grad_scale),
                Arg::F(beta1 as f32),
                Arg::F(beta2 as f32),
                Arg::F((1.0 - beta1) as f32),
                Arg::F((1.0 - beta2) as f32),
                Arg::F(eps as f32),
                Arg::F(inv_bc2),
                Arg::F(lr_bc1),
                Arg::F(decay),
            ],
        )
    }

    /// Sums of squares of several tensors `(address, length)`, in f64, each reduced in a fixed
    /// order; one copy to the host for all of them.
    pub fn sums_of_squares(&self, tensors: &[(u64, usize)]) -> Result<Vec<f64>> {
        if tensors.is_empty() {
            return Ok(Vec::new());
        }
        let partial = self.zeros::<f64>(SUMSQ_BLOCKS * tensors.len())?;
        let out = self.zeros::<f64>(tensors.len())?;
        for (i, &(x, n)) in tensors.iter().enumerate() {
            self.launch(
                "sum_squares_partial",
                (SUMSQ_BLOCKS as u32, 1, 1),
                256,
                &[
                    Arg::P(partial.at(i * SUMSQ_BLOCKS)),
                    Arg::P(x),
                    Arg::L(n as i64),
                ],
            )?;
            self.launch(
                "sum_squares_finish",
                (1, 1, 1),
                256,
                &[
                    Arg::P(out.at(i)),
                    Arg::P(partial.at(i * SUMSQ_BLOCKS)),
                    Arg::I(SUMSQ_BLOCKS as i32),
                ],
            )?;
        }
        self.download(&out)
    }

    /// Row-major `y (n, out) = x (n, in) · W^T` (+ `b` when non-zero) for a linear layer with
    /// weight `W (out, in)`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_forward(
        &self,
        y: u64,
        x: u64,
        w: u64,
        b: u64,
        n: usize,
        d_in: usize,
        d_out: usize,
    ) -> Result<()> {
        self.gemm(y, x, w, (n, d_out, d_in), false, true, 0.0)?;
        if b != 0 {
            self.add_bias(y, b, n, d_out)?;
        }
        Ok(())
    }

    /// Backward of a linear layer of `(n, d_in, d_out)` (as [`Gpu::linear_forward`]'s): `dx = dy
    /// W` (when `dx` is non-zero; written), `dW += dy^T x`, `db += column sums of dy` (when `db` is
    /// non-zero): [`Gpu::linear_backward_input`], then [`Gpu::linear_backward_weight`].
    pub fn linear_backward(
        &self,
        (dx, dw, db): (u64, u64, u64),
        dy: u64,
        (x, w): (u64, u64),
        dims: (usize, usize, usize),
        scratch: &Buf<f32>,
    ) -> Result<()> {
        self.linear_backward_input(dx, dy, w, dims)?;
        self.linear_backward_weight((dw, db), dy, x, dims, scratch)
    }

    /// The input half of [`Gpu::linear_backward`]: `dx (n, in) = dy (n, out) W` (when `dx` is
    /// non-zero; written).
    pub fn linear_backward_input(
        &self,
        dx: u64,
        dy: u64,
        w: u64,
        (n, d_in, d_out): (usize, usize, usize),
    ) -> Result<()> {
        if dx != 0 {
            self.label_pass(Pass::Dx);
            self.gemm(dx, dy, w, (n, d_in, d_out), false, false, 0.0)?;
        }
        Ok(())
    }

    /// The weight half of [`Gpu::linear_backward`]: `dW += dy^T x`, `db += column sums of dy`
    /// (when `db` is non-zero).
    pub fn linear_backward_weight(
        &self,
        (dw, db): (u64, u64),
        dy: u64,
        x: u64,
        (n, d_in, d_out): (usize, usize, usize),
        scratch: &Buf<f32>,
    ) -> Result<()> {
        self.label_pass(Pass::Dw);
        self.gemm(dw, dy, x, (d_out, d_in, n), true, false, 1.0)?;
        if db != 0 {
            self.column_sum(db, dy, n, d_out, true, scratch)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_launches_name_the_chosen_kernels_and_their_block_shapes() {
        use AttentionKernels::{V1, V2};
        // FP32 attention has one version, whatever SEQPIPE_ATTENTION says.
        for kernels in [V1, V2] {
            let l = attention_launch(false, kernels, 64);
            assert_eq!((l.prefix, l.threads, l.forward_rows), ("attn_", 64, 64));
            assert!(!l.warp_delta && !l.aligned_rows && l.masks);
        }
        let v1 = attention_launch(true, V1, 64);
        assert_eq!(
            (v1.prefix, v1.threads, v1.forward_rows),
            ("attn_tc_", 128, 64)
        );
        // v1 takes no document starts (it is kept for comparison, not extended).
        assert!(!v1.warp_delta && !v1.aligned_rows && !v1.masks);
        // v2's forward: two m-tiles of 16 queries per warp up to D = 64 (V2Shape of kernels.cu).
        for (d, rows) in [(16, 128), (32, 128), (64, 128), (128, 64)] {
            let v2 = attention_launch(true, V2, d);
            assert_eq!(
                (v2.prefix, v2.threads, v2.forward_rows),
                ("attn_tc2_", 128, rows)
            );
            assert!(v2.warp_delta && v2.aligned_rows && v2.masks);
        }
    }

    #[test]
    fn document_starts_are_one_per_position_and_must_cover_the_call() {
        let mask = ops::DocumentMask::new(vec![vec![0, 3, 4], vec![0], vec![0, 5]]).unwrap();
        assert_eq!(
            position_doc_starts(&mask, 6),
            [[0, 0, 0, 3, 4, 4], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 5]].concat()
        );
        let sh = AttnShape {
            b: 3,
            h: 1,
            d: 16,
            s: 2,
            p: 4,
            q_stride: 16,
            kv_stride: 16,
            kv_rows: 6,
        };
        let docs = |len| Some(DocStarts { ptr: 0x100, len });
        assert_eq!(doc_arg(None, &sh, "op").unwrap(), 0);
        assert_eq!(doc_arg(docs(18), &sh, "op").unwrap(), 0x100);
        let err = doc_arg(docs(17), &sh, "op").unwrap_err().to_string();
        assert!(
            err.contains("17 document starts cannot cover 3 sequences of 6"),
            "{err}"
        );
    }

    #[test]
    fn v2_refuses_rows_that_are_not_16_byte_aligned_naming_the_matrix() {
        assert!(rows_aligned("op", &[("q", 0x1000, 2304), ("k", 0x2000 + 16 * 768, 2304)]).is_ok());
        let err = rows_aligned("op", &[("q", 0x1000, 2304), ("k", 0x1004, 2304)])
            .expect_err("an address 4 bytes past alignment");
        let msg = err.to_string();
        assert!(
            msg.contains("k at 0x1004") && msg.contains("SEQPIPE_ATTENTION"),
            "{msg}"
        );
        let err = rows_aligned("op", &[("dy", 0x1000, 66)]).expect_err("rows 66 floats apart");
        assert!(
            err.to_string()
                .contains("dy at 0x1000 with rows 66 floats apart"),
            "{err}"
        );
    }
}
