//! Where a step's GPU time goes: every kernel launch, cuBLAS product, copy, memset and host sync
//! that a [`crate::Gpu`] issues on its compute stream, timed and put in a category, then summed
//! into a [`Profile`] (a table and one JSON object).
//!
//! Off by default, and then free: each operation checks one flag. Between
//! [`crate::Gpu::profile_begin`] and [`crate::Gpu::profile_end`] each operation is timed twice:
//! on the GPU by a pair of CUDA events recorded on the stream around it (the emulation: the wall
//! time of the synchronous call), and on the host by the time spent in the call. The host time of
//! a launch is its API cost; that of a copy to the host or a sync is mostly waiting.
//!
//! How it perturbs what it measures: each operation gets two event records more (~1-2 us of host
//! time each), so a launch-bound step runs slower profiled than not (compare `wall_ms` with the
//! unprofiled median). And when the GPU has drained its queue (launch-bound stretches), an
//! operation's start event is timestamped when it reaches the GPU, before the launch that follows
//! it does: its GPU time then includes up to one launch call of host latency. Small kernels whose
//! mean time is near the per-launch host cost are the sign of that.
//!
//! The decisions here are pure: which category a kernel belongs to ([`kernel_category`]), and how
//! timed operations sum into a [`Profile`] ([`summarize`]). The backends only time.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde::Serialize;

/// The group a category sums into (the second table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// cuBLAS matrix products.
    Gemm,
    /// Attention kernels.
    Attention,
    /// Layer norm (or RMS norm), forward and backward.
    Norm,
    /// Element-wise kernels: bias adds, residual adds, GELU, K/V cache copies, RoPE.
    Elementwise,
    /// Column sums of the bias gradients.
    BiasGrad,
    /// Roundings into BF16 copies.
    Cast,
    /// Token and position embeddings.
    Embedding,
    /// Softmax cross-entropy.
    Loss,
    /// Gradient norm and AdamW.
    Optimizer,
    /// The micro-batches' gradients summed in the tree.
    GradAccumulation,
    /// Allocations, memsets, copies between host and device.
    Memory,
    /// The host waiting for the stream.
    Sync,
    /// A kernel with no category: a defect of [`kernel_category`].
    Unknown,
}

impl Group {
    /// The group's name in the table (as in the JSON).
    pub fn name(self) -> &'static str {
        match self {
            Group::Gemm => "gemm",
            Group::Attention => "attention",
            Group::Norm => "norm",
            Group::Elementwise => "elementwise",
            Group::BiasGrad => "bias_grad",
            Group::Cast => "cast",
            Group::Embedding => "embedding",
            Group::Loss => "loss",
            Group::Optimizer => "optimizer",
            Group::GradAccumulation => "grad_accumulation",
            Group::Memory => "memory",
            Group::Sync => "sync",
            Group::Unknown => "unknown",
        }
    }
}

/// What was timed: a kernel (by its symbol), a product, or a memory operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind<'a> {
    /// A kernel of kernels.cu.
    Kernel(&'a str),
    /// A cuBLAS product.
    Gemm,
    /// A zeroed allocation.
    Alloc,
    /// A memset of a live buffer.
    Memset,
    /// Host to device.
    Upload,
    /// Device to host (blocking).
    Download,
    /// The host waiting for the stream.
    Sync,
}

/// The category (and group) of a kernel symbol; `None` for a kernel nobody categorised.
pub fn kernel_category(name: &str) -> Option<(&'static str, Group)> {
    use Group::*;
    // Attention kernels: `attn_forward_d64`, `attn_tc_backward_dkdv_d128`, `attn_tc2_forward_d64`, …
    if let Some(rest) = name.strip_prefix("attn_") {
        let rest = (rest.strip_prefix("tc_"))
            .or_else(|| rest.strip_prefix("tc2_"))
            .unwrap_or(rest);
        // The head width's suffix (`_d64`), not `_delta`'s.
        let base = match rest.rsplit_once("_d") {
            Some((b, d)) if !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()) => b,
            _ => rest,
        };
        return match base {
            "forward" => Some(("attention fwd", Attention)),
            "backward_dq" => Some(("attention bwd dq", Attention)),
            "backward_dkdv" => Some(("attention bwd dk dv", Attention)),
            "backward_delta" => Some(("attention bwd delta", Attention)),
            _ => None,
        };
    }
    Some(match name {
        "embed_forward" => ("embedding fwd", Embedding),
        "embed_backward_tokens" | "embed_backward_positions" | "embed_backward_positions_reset" => {
            ("embedding bwd", Embedding)
        }
        "column_sum_partial" | "column_sum_finish" => ("bias grad (column sums)", BiasGrad),
        "add_bias" => ("bias add", Elementwise),
        "add" => ("add", Elementwise),
        "add_assign" => ("residual add", Elementwise),
        "copy_rows" => ("row copies (k/v cache, links)", Elementwise),
        "bias_gelu_forward" => ("gelu fwd (+bias)", Elementwise),
        "gelu_backward" => ("gelu bwd", Elementwise),
        "rope" => ("rope", Elementwise),
        "norm_forward" => ("layernorm fwd", Norm),
        "norm_backward_input" | "norm_backward_params_partial" => ("layernorm bwd", Norm),
        "softmax_cross_entropy" => ("cross-entropy", Loss),
        "adamw" => ("adamw", Optimizer),
        "sum_squares_partial" | "sum_squares_finish" => ("grad norm (sums of squares)", Optimizer),
        "to_bf16" => ("cast to bf16", Cast),
        _ => return None,
    })
}

/// What a category override (a [`Scope`]) turns a kernel into: the scopes a stage opens.
fn scope_category(scope: &'static str) -> Group {
    match scope {
        GRAD_ACCUMULATION => Group::GradAccumulation,
        LAYERNORM_BWD => Group::Norm,
        _ => Group::Cast,
    }
}

/// The scope of the gradient tree's sums ([`crate::Gpu::profile_scope`]).
pub(crate) const GRAD_ACCUMULATION: &str = "gradient accumulation";
/// The scope of the norm backward's column sums.
pub(crate) const LAYERNORM_BWD: &str = "layernorm bwd";
/// The scope of the BF16 weight copies' refresh after an update.
pub(crate) const WEIGHT_REFRESH: &str = "cast to bf16 (weight copies)";

/// The category and group of one timed operation. `scope` overrides a kernel's category (the
/// caller knows better: a residual add that is a gradient sum); `label` names a product: its
/// layer and pass.
pub(crate) fn categorize(
    kind: OpKind<'_>,
    scope: Option<&'static str>,
    label: Option<(&'static str, Pass)>,
) -> (Category, Group) {
    match kind {
        OpKind::Gemm => (
            Category::Gemm(label.unwrap_or(("(unlabelled)", Pass::Fwd))),
            Group::Gemm,
        ),
        OpKind::Kernel(name) => match (scope, kernel_category(name)) {
            (Some(s), Some(_)) => (Category::Static(s), scope_category(s)),
            (_, Some((c, g))) => (Category::Static(c), g),
            (_, None) => (Category::Static("unknown kernel"), Group::Unknown),
        },
        OpKind::Alloc => (Category::Static("alloc (zeroed)"), Group::Memory),
        OpKind::Memset => (Category::Static("memset"), Group::Memory),
        OpKind::Upload => (Category::Static("copy host->device"), Group::Memory),
        OpKind::Download => (
            Category::Static("copy device->host (blocking)"),
            Group::Memory,
        ),
        OpKind::Sync => (Category::Static("host sync"), Group::Sync),
    }
}

/// A category's name: static, or a product's label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Category {
    Static(&'static str),
    Gemm((&'static str, Pass)),
}

impl std::fmt::Display for Category {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Category::Static(s) => f.write_str(s),
            Category::Gemm((layer, pass)) => write!(f, "gemm {layer} {}", pass.name()),
        }
    }
}

/// One timed operation: its category, GPU time and host time, in seconds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timed {
    pub category: Category,
    pub group: Group,
    /// Whether it launched work on the GPU (a kernel or a product).
    pub launch: bool,
    pub gpu_s: f64,
    pub host_s: f64,
}

/// The labels and scope a stage sets around its operations; held by the [`crate::Gpu`].
#[derive(Default)]
pub(crate) struct Labels {
    /// The label of the products issued next: their layer (`attn.c_attn`) and pass.
    pub product: Cell<Option<(&'static str, Pass)>>,
    /// A category override of the kernels issued inside a [`Scope`].
    pub scope: Cell<Option<&'static str>>,
}

/// A [`crate::Gpu`]'s profiling state: off (one flag checked per operation) or recording.
#[derive(Default)]
pub(crate) struct State {
    /// Whether operations are being timed.
    pub on: Cell<bool>,
    pub labels: Labels,
    /// The operations timed since [`State::begin`], with the instant it began.
    pub recording: RefCell<(Option<Instant>, Vec<Timed>)>,
}

impl State {
    /// Names the products issued from now on (layer and pass); a no-op unless profiling.
    pub(crate) fn label_products(&self, layer: &str, pass: Pass) {
        if self.on.get() {
            self.labels.product.set(Some((product_layer(layer), pass)));
        }
    }

    /// Changes the pass of the products' label (the layer stays).
    pub(crate) fn label_pass(&self, pass: Pass) {
        if let Some((layer, _)) = self.labels.product.get() {
            self.labels.product.set(Some((layer, pass)));
        }
    }

    /// Starts recording (forgetting what an earlier recording held).
    pub fn begin(&self) {
        let mut r = self.recording.borrow_mut();
        r.1.clear();
        r.0 = Some(Instant::now());
        self.labels.product.set(None);
        self.labels.scope.set(None);
        self.on.set(true);
    }

    /// The category of an operation of `kind` issued now (with the current scope and label).
    pub fn categorize(&self, kind: OpKind<'_>) -> (Category, Group) {
        categorize(kind, self.labels.scope.get(), self.labels.product.get())
    }

    /// Records an operation (its GPU time may be filled in later, by its index).
    pub fn push(
        &self,
        (category, group): (Category, Group),
        launch: bool,
        host: Duration,
        gpu_s: f64,
    ) {
        self.recording.borrow_mut().1.push(Timed {
            category,
            group,
            launch,
            gpu_s,
            host_s: host.as_secs_f64(),
        });
    }

    /// Stops recording: the operations, and the wall time since [`State::begin`] (`None` when
    /// no recording was begun).
    pub fn end(&self) -> Option<(Vec<Timed>, Duration)> {
        self.on.set(false);
        let mut r = self.recording.borrow_mut();
        let started = r.0.take()?;
        Some((std::mem::take(&mut r.1), started.elapsed()))
    }

    /// Opens a category override of the kernels issued until the guard drops.
    pub fn scope(&self, category: &'static str) -> Scope<'_> {
        Scope {
            before: self.labels.scope.replace(Some(category)),
            cell: &self.labels.scope,
        }
    }
}

/// A category override, undone when dropped ([`crate::Gpu::profile_scope`]).
pub struct Scope<'a> {
    pub(crate) cell: &'a Cell<Option<&'static str>>,
    pub(crate) before: Option<&'static str>,
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        self.cell.set(self.before);
    }
}

/// Which of a linear layer's products: the forward, `dx = dy W` or `dW += dy^T x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Pass {
    Fwd,
    Dx,
    Dw,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Fwd => "fwd",
            Pass::Dx => "dx",
            Pass::Dw => "dw",
        }
    }
}

/// A linear layer's name in the profile, its layer index dropped (`h.3.mlp.c_fc` → `mlp.c_fc`);
/// static, so that labelling costs no allocation.
pub(crate) fn product_layer(layer: &str) -> &'static str {
    use model::params::{BlockLayer, names};
    const LINEAR: [BlockLayer; 4] = [
        BlockLayer::CAttn,
        BlockLayer::AttnProj,
        BlockLayer::CFc,
        BlockLayer::MlpProj,
    ];
    LINEAR
        .iter()
        .map(|l| l.name())
        .chain([names::LM_HEAD.trim_end_matches(".weight")])
        .find(|n| layer.ends_with(n))
        .unwrap_or("other")
}

/// One row of the table: a category's share of a step.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The category (`layernorm fwd`, `gemm mlp.c_fc dw`, …).
    pub category: String,
    /// Its group.
    pub group: Group,
    /// Calls per step.
    pub calls: f64,
    /// GPU milliseconds per step.
    pub gpu_ms: f64,
    /// Percent of the step's wall time.
    pub pct_of_step: f64,
    /// Mean GPU microseconds per call.
    pub mean_us: f64,
    /// Host milliseconds per step spent in the calls (API cost, or waiting for copies and syncs).
    pub host_ms: f64,
}

/// A group's share of a step.
#[derive(Clone, Debug, Serialize)]
pub struct GroupRow {
    /// The group.
    pub group: Group,
    /// Calls per step.
    pub calls: f64,
    /// GPU milliseconds per step.
    pub gpu_ms: f64,
    /// Percent of the step's wall time.
    pub pct_of_step: f64,
}

/// Where the time of the profiled steps went (per step: the means over the steps profiled).
#[derive(Clone, Debug, Serialize)]
pub struct Profile {
    /// Steps profiled.
    pub steps: usize,
    /// Host wall time per step, profiled (the profiling's own overhead included).
    pub wall_ms: f64,
    /// GPU time per step summed over every timed operation.
    pub gpu_busy_ms: f64,
    /// From the first operation's start to the last one's end on the GPU, per step (the
    /// emulation: the wall time).
    pub stream_span_ms: f64,
    /// Wall time not covered by timed GPU work: host work between launches, launch latency when
    /// the GPU drained its queue, work on other streams. Large means host- or launch-bound.
    pub host_gap_ms: f64,
    /// Host time per step spent inside the timed calls.
    pub host_in_calls_ms: f64,
    /// Kernel launches and cuBLAS calls per step.
    pub launches: f64,
    /// Timed operations per step (launches, copies, memsets, allocations, syncs).
    pub ops: f64,
    /// Percent of the GPU time in operations no category knows (should be 0).
    pub unknown_pct: f64,
    /// The categories, largest GPU time first.
    pub categories: Vec<Row>,
    /// The groups, largest GPU time first.
    pub groups: Vec<GroupRow>,
    /// How the numbers were taken.
    pub timer: &'static str,
}

/// Sums timed operations of `steps` steps, which took `wall_s` and spanned `span_s` on the GPU,
/// into a [`Profile`].
pub(crate) fn summarize(
    ops: &[Timed],
    steps: usize,
    wall_s: f64,
    span_s: f64,
    timer: &'static str,
) -> Profile {
    let per = 1.0 / steps.max(1) as f64;
    let wall_ms = wall_s * 1e3 * per;
    let pct = |ms: f64| {
        if wall_ms > 0.0 {
            100.0 * ms / wall_ms
        } else {
            0.0
        }
    };
    // (calls, gpu s, host s) by category and by group.
    let mut cats: BTreeMap<(Category, Group), (usize, f64, f64)> = BTreeMap::new();
    let mut groups: BTreeMap<Group, (usize, f64)> = BTreeMap::new();
    let (mut busy, mut host, mut launches, mut unknown) = (0.0, 0.0, 0usize, 0.0);
    for op in ops {
        let e = cats.entry((op.category, op.group)).or_default();
        e.0 += 1;
        e.1 += op.gpu_s;
        e.2 += op.host_s;
        let g = groups.entry(op.group).or_default();
        g.0 += 1;
        g.1 += op.gpu_s;
        busy += op.gpu_s;
        host += op.host_s;
        launches += op.launch as usize;
        if op.group == Group::Unknown {
            unknown += op.gpu_s;
        }
    }
    let mut categories: Vec<Row> = cats
        .into_iter()
        .map(|((category, group), (calls, gpu, host))| Row {
            category: category.to_string(),
            group,
            calls: calls as f64 * per,
            gpu_ms: gpu * 1e3 * per,
            pct_of_step: pct(gpu * 1e3 * per),
            mean_us: gpu * 1e6 / calls as f64,
            host_ms: host * 1e3 * per,
        })
        .collect();
    categories.sort_by(|a, b| b.gpu_ms.total_cmp(&a.gpu_ms));
    let mut groups: Vec<GroupRow> = groups
        .into_iter()
        .map(|(group, (calls, gpu))| GroupRow {
            group,
            calls: calls as f64 * per,
            gpu_ms: gpu * 1e3 * per,
            pct_of_step: pct(gpu * 1e3 * per),
        })
        .collect();
    groups.sort_by(|a, b| b.gpu_ms.total_cmp(&a.gpu_ms));
    let gpu_busy_ms = busy * 1e3 * per;
    Profile {
        steps,
        wall_ms,
        gpu_busy_ms,
        stream_span_ms: span_s * 1e3 * per,
        host_gap_ms: (wall_ms - gpu_busy_ms).max(0.0),
        host_in_calls_ms: host * 1e3 * per,
        launches: launches as f64 * per,
        ops: ops.len() as f64 * per,
        unknown_pct: if busy > 0.0 {
            100.0 * unknown / busy
        } else {
            0.0
        },
        categories,
        groups,
        timer,
    }
}

impl Profile {
    /// The table: the categories, then the groups, then the totals.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<36} {:>8} {:>10} {:>7} {:>10} {:>10}",
            "category", "calls", "gpu ms", "% step", "mean us", "host ms"
        );
        for r in &self.categories {
            let _ = writeln!(
                s,
                "{:<36} {:>8.0} {:>10.3} {:>6.1}% {:>10.1} {:>10.3}",
                r.category, r.calls, r.gpu_ms, r.pct_of_step, r.mean_us, r.host_ms
            );
        }
        let _ = writeln!(
            s,
            "{:<36} {:>8} {:>10} {:>7}",
            "group", "calls", "gpu ms", "% step"
        );
        for g in &self.groups {
            let _ = writeln!(
                s,
                "{:<36} {:>8.0} {:>10.3} {:>6.1}%",
                g.group.name(),
                g.calls,
                g.gpu_ms,
                g.pct_of_step
            );
        }
        let _ = writeln!(
            s,
            "per step ({} profiled, {}): wall {:.3} ms, gpu busy {:.3} ms, stream span {:.3} ms, host gap {:.3} ms ({:.1}%), host in calls {:.3} ms, {:.0} launches, {:.0} ops, unknown {:.2}%",
            self.steps,
            self.timer,
            self.wall_ms,
            self.gpu_busy_ms,
            self.stream_span_ms,
            self.host_gap_ms,
            if self.wall_ms > 0.0 {
                100.0 * self.host_gap_ms / self.wall_ms
            } else {
                0.0
            },
            self.host_in_calls_ms,
            self.launches,
            self.ops,
            self.unknown_pct,
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_the_gpu_loads_has_a_category() {
        let names = crate::compile::KERNELS
            .iter()
            .map(|s| s.to_string())
            .chain(crate::compile::attention_kernels());
        for name in names {
            assert!(
                kernel_category(&name).is_some(),
                "kernel {name} has no profile category: add it to kernel_category"
            );
        }
        assert_eq!(kernel_category("no_such_kernel"), None);
        assert_eq!(kernel_category("attn_sideways_d64"), None);
    }

    #[test]
    fn attention_kernels_of_both_variants_share_their_categories() {
        for (a, b) in [
            ("attn_forward_d64", "attn_tc_forward_d128"),
            ("attn_backward_dq_d16", "attn_tc_backward_dq_d64"),
            ("attn_backward_dkdv_d32", "attn_tc_backward_dkdv_d64"),
            ("attn_tc_forward_d64", "attn_tc2_forward_d64"),
            ("attn_tc_backward_dq_d64", "attn_tc2_backward_dq_d64"),
            ("attn_tc_backward_dkdv_d128", "attn_tc2_backward_dkdv_d128"),
            ("attn_backward_delta", "attn_tc2_backward_delta"),
        ] {
            assert_eq!(kernel_category(a), kernel_category(b));
        }
        // `_delta` is no head width's suffix.
        assert_eq!(
            kernel_category("attn_backward_delta").map(|c| c.0),
            Some("attention bwd delta")
        );
    }

    #[test]
    fn scopes_override_kernels_and_labels_name_products() {
        let (c, g) = categorize(OpKind::Kernel("add_assign"), Some(GRAD_ACCUMULATION), None);
        assert_eq!(
            (c.to_string(), g),
            (GRAD_ACCUMULATION.to_string(), Group::GradAccumulation)
        );
        let fc = Some(("mlp.c_fc", Pass::Dw));
        let (c, g) = categorize(OpKind::Kernel("add_assign"), None, fc);
        assert_eq!(
            (c.to_string(), g),
            ("residual add".to_string(), Group::Elementwise)
        );
        let (c, g) = categorize(OpKind::Gemm, Some(LAYERNORM_BWD), fc);
        assert_eq!(
            (c.to_string(), g),
            ("gemm mlp.c_fc dw".to_string(), Group::Gemm)
        );
        let (c, g) = categorize(OpKind::Kernel("mystery"), Some(GRAD_ACCUMULATION), None);
        assert_eq!(
            (c.to_string(), g),
            ("unknown kernel".to_string(), Group::Unknown)
        );
        assert_eq!(product_layer("h.11.mlp.c_proj"), "mlp.c_proj");
        assert_eq!(product_layer("h.0.attn.c_attn"), "attn.c_attn");
        assert_eq!(product_layer("lm_head"), "lm_head");
        assert_eq!(product_layer("h.2.something"), "other");
    }

    #[test]
    fn a_summary_sums_per_step_and_shares_of_the_wall_time() {
        let op = |category, group, launch, gpu_s, host_s| Timed {
            category,
            group,
            launch,
            gpu_s,
            host_s,
        };
        let ops = [
            op(
                Category::Gemm(("mlp.c_fc", Pass::Fwd)),
                Group::Gemm,
                true,
                0.004,
                0.0001,
            ),
            op(
                Category::Gemm(("mlp.c_fc", Pass::Fwd)),
                Group::Gemm,
                true,
                0.004,
                0.0001,
            ),
            op(
                Category::Static("layernorm fwd"),
                Group::Norm,
                true,
                0.001,
                0.0001,
            ),
            op(
                Category::Static("host sync"),
                Group::Sync,
                false,
                0.0,
                0.002,
            ),
            op(
                Category::Static("unknown kernel"),
                Group::Unknown,
                true,
                0.001,
                0.0,
            ),
        ];
        // Two steps of 10 ms each.
        let p = summarize(&ops, 2, 0.020, 0.012, "test");
        assert_eq!(p.launches, 2.0);
        assert_eq!(p.ops, 2.5);
        assert!((p.wall_ms - 10.0).abs() < 1e-9);
        assert!((p.gpu_busy_ms - 5.0).abs() < 1e-9);
        assert!((p.host_gap_ms - 5.0).abs() < 1e-9);
        assert!((p.stream_span_ms - 6.0).abs() < 1e-9);
        assert!((p.unknown_pct - 10.0).abs() < 1e-9);
        let first = &p.categories[0];
        assert_eq!(first.category, "gemm mlp.c_fc fwd");
        assert_eq!(first.calls, 1.0);
        assert!((first.gpu_ms - 4.0).abs() < 1e-9);
        assert!((first.pct_of_step - 40.0).abs() < 1e-9);
        assert!((first.mean_us - 4000.0).abs() < 1e-6);
        let sum: f64 = p.categories.iter().map(|r| r.gpu_ms).sum();
        assert!((sum - p.gpu_busy_ms).abs() < 1e-9);
        assert!(p.table().contains("gemm mlp.c_fc fwd"));
        // The keys scripts/gpu-check.sh's profile step reads (rehearsed in tests/gpu_check.rs).
        let json = serde_json::to_value(&p).unwrap();
        for key in [
            "wall_ms",
            "gpu_busy_ms",
            "host_gap_ms",
            "launches",
            "unknown_pct",
        ] {
            assert!(json[key].is_number(), "{key} in {json}");
        }
        assert!(json["categories"][0]["category"].is_string(), "{json}");
        assert!(json["categories"][0]["gpu_ms"].is_number(), "{json}");
    }
}
