#!/usr/bin/env bash
# The GPU checks of seqpipe, in one device call.
#
#   scripts/gpu-check.sh pack   (here, with a Rust toolchain) builds `--features cuda`, strips the
#                               binary into .gpu-bin/ (git-ignored; carry it to the GPU machine)
#                               and compiles the kernels for sm_80 and sm_90 into .gpu-bin/cache
#                               (NVRTC here: each device call then skips a minute of compiling)
#   scripts/gpu-check.sh run    (on the GPU machine: no Rust, no registry) finds the CUDA
#                               libraries of the machine's Python wheels, then runs
#     1. every CUDA kernel against the CPU oracle (relative error per kernel and precision),
#     2. whole-model gradients on the GPU against the CPU stage's FP32 ones (presets a, b, long,
#        gpt2): FP32 within 1e-4, BF16 stated,
#     3. determinism: two runs of the same bf16 job give bit-identical weights,
#     4. the pipeline runtime with CUDA stages (`seqpipe train --set model.device=cuda`, several
#        stages on the one GPU, host-staged links): first-step gradients against the CPU stages',
#        2 vs 4 stages bit-identical, stop + resume bit-identical, one worker SIGKILLed mid-run and
#        the run still bit-identical, bf16 loss falling, and a GPT-2 124M job on synthetic data,
#     5. the step's matrix products timed in FP32, TF32 and BF16 (FP32 operands rounded by cuBLAS,
#        as now, against BF16 operands with and without the casts: `seqpipe gpu gemm`), then
#        GPT-2 124M (and presets a, b, long) training steps, bf16 (GPT-2 also with
#        --bf16-operands, the casts paid in the step): seqpipe against PyTorch eager
#        and torch.compile (scripts/gpu-torch-bench.py), alternating rounds, every round printed,
#     6. the NCCL link (`seqpipe gpu link`): bit-exact round trips and bandwidth between two ranks,
#        then rank 1 SIGKILLed and the waiting receive aborted by the watchdog, not hung (needs two
#        GPUs, or NCCL >= 2.30, which allows two ranks on one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1);
#        then the pipeline over NCCL device links (`pipeline.transport=nccl`) against host-staged
#        links, straight and with a stage SIGKILLed mid-run, bit-identical.
#   Everything goes to $OUT (default ./gpu-out): report.txt (the summary), one JSON line per run
#   in runs.jsonl, and the logs. ROUNDS (default 2), STEPS (default 10) and LIMIT (seconds per
#   command, default 300) can be set; SECTIONS
#   (default "1 2 3 4 5 6") picks sections, e.g. SECTIONS="4" to rerun the pipeline checks alone, and
#   PRESETS (default "gpt2 a b long") the presets of section 5. A device call runs at most 10
#   minutes: split the run, e.g. SECTIONS="1 2 3", then "4", then SECTIONS=5 PRESETS=gpt2, then
#   SECTIONS=5 PRESETS="a b long", then "6" (torch.compile compiles for a minute or so per process).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu-bin/seqpipe}
# The pipeline section's device; DEVICE=cpu rehearses it on a machine without a GPU.
DEVICE=${DEVICE:-cuda}

pack() {
  command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
  cargo build --release --features cuda
  mkdir -p .gpu-bin
  strip -o "$BIN" target/release/seqpipe
  # NVRTC comes with the test dependencies (./.venv): it compiles the kernels here, with no GPU,
  # into an sm_80 and an sm_90 cubin plus their PTX. The GPU machine loads the cubin of its
  # architecture (no JIT), or JIT-compiles the PTX where none matches; `gpu info` says which.
  eval "$(SEQPIPE_TEST_DEPS_ONLY=1 ./scripts/test.sh)"
  SEQPIPE_CACHE=.gpu-bin/cache "$BIN" gpu ptx --arch sm_80 --arch sm_90
  local arch
  for arch in sm_80 sm_90; do
    ls .gpu-bin/cache/ptx/kernels-$arch-*.cubin .gpu-bin/cache/ptx/kernels-$arch-*.cubin.blake3 >/dev/null ||
      { echo "pack: no $arch cubin (with its hash) in .gpu-bin/cache/ptx" >&2; return 1; }
  done
  mkdir -p .git/info
  grep -qx '/.gpu-bin/' .git/info/exclude 2>/dev/null || echo '/.gpu-bin/' >> .git/info/exclude
  du -sh .gpu-bin
}

# Directories of the CUDA libraries shipped in the machine's Python wheels (nvidia-*), with a
# libnccl.so link (cudarc looks for it; the wheel ships only libnccl.so.2).
cuda_libs() {
  local dirs links
  dirs=$(python3 - <<'PY'
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except ImportError:  # no CUDA wheels (a DEVICE=cpu rehearsal)
    roots = []
seen = []
for root in roots:
    for lib in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True):
        d = os.path.dirname(lib)
        if d not in seen:
            seen.append(d)
print(":".join(seen))
PY
)
  links=$(mktemp -d)
  local nccl
  nccl=$(IFS=:; for d in $dirs; do ls "$d"/libnccl.so.2 2>/dev/null; done | head -1)
  [ -n "$nccl" ] && ln -sf "$nccl" "$links/libnccl.so"
  echo "$links:$dirs"
}

run() {
  OUT=${OUT:-$PWD/gpu-out}
  ROUNDS=${ROUNDS:-2}
  STEPS=${STEPS:-10}
  SECTIONS=${SECTIONS:-1 2 3 4 5 6}
  mkdir -p "$OUT"
  local libs
  libs=$(cuda_libs)
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The PTX cache outlives one device call (the machine stays up between calls while it is warm),
  # and starts with the kernels `pack` compiled.
  export SEQPIPE_CACHE="${SEQPIPE_CACHE:-/tmp/seqpipe-cache}" PYTHONUNBUFFERED=1
  mkdir -p "$SEQPIPE_CACHE/ptx"
  cp -n .gpu-bin/cache/ptx/*.ptx "$SEQPIPE_CACHE/ptx/" 2>/dev/null || true
  report="$OUT/report.txt" runs="$OUT/runs.jsonl" started=$SECONDS
  : > "$report"; : > "$runs"
  say "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$report" || true
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" 2>&1 | tee -a "$report" || true
  for section in $SECTIONS; do
    case $section in
      1) kernels ;;
      2) gradients ;;
      3) determinism ;;
      4) pipeline ;;
      5) bench ;;
      6) link ;;
      *) say "no section $section" ;;
    esac
  done
}

say() { echo "$@" | tee -a "$report"; }

# Runs a command for at most LIMIT seconds (default 300; exit 124 past it): a hang on the GPU then
# costs one command, not the rest of a 10-minute device call.
limit() { timeout -k 10 "${LIMIT:-300}" "$@"; }

kernels() {
  say "== 1. kernels vs the CPU oracle"
  limit "$BIN" gpu check 2>&1 | tee -a "$report" || say "KERNEL CHECK FAILED"
  say "(kernel check: $((SECONDS - started)) s)"
}

gradients() {
  say "== 2. whole-model gradients vs the CPU stage's FP32 ones (same weights and batch): FP32 within"
  say "   the bound; BF16 (tensor-core products and attention) stated"
  for run in "fp32 a" "fp32 b" "fp32 long" "fp32 gpt2 --batch 1" "bf16 a" "bf16 gpt2 --batch 1"; do
    local precision=${run%% *} spec=${run#* }
    # shellcheck disable=SC2086
    if limit "$BIN" gpu bench --preset $spec --precision "$precision" --check --warmup 0 --steps 2 > "$OUT/check.json" 2> "$OUT/check.err"; then
      python3 - "$OUT/check.json" "$spec" <<'PY' | tee -a "$report"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
c = r["grad_check"]
bound = "stated (no bound)" if c["bound"] is None else f"bound {c['bound']:.0e}"
print(f"{r['precision']} {sys.argv[2]:>16}: worst grad rel L2 {c['worst_rel_l2']:.2e} ({c['worst_param']}), loss gpu {c['loss_gpu']:.6f} cpu {c['loss_cpu']:.6f}, {bound}, attention on {r['attention']}")
PY
    else
      say "$run: GRADIENT CHECK FAILED: $(tail -3 "$OUT/check.err")"
    fi
  done
}

determinism() {
  say "== 3. determinism (gpt2, bf16, two runs of $STEPS steps)"
  local h1 h2
  h1=$(limit "$BIN" gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps "$STEPS" | tee -a "$runs" | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['final_params_blake3'])")
  h2=$(limit "$BIN" gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps "$STEPS" | tee -a "$runs" | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['final_params_blake3'])")
  if [ "$h1" = "$h2" ]; then say "bit-identical weights after $STEPS steps: $h1"; else say "WEIGHTS DIFFER: $h1 vs $h2"; fi
}

# One `seqpipe train` of the pipeline checks into $T/NAME (further arguments are train's); its last
# lines go to the report.
train_job() {
  local name=$1 t0=$SECONDS
  shift
  if limit "$BIN" train -q --set run.dir="$T/$name" "$@" > "$T/$name.out" 2>&1; then
    say "$name: $(grep '^done:' "$T/$name.out" | tail -1) ($((SECONDS - t0)) s)"
  else
    say "$name: TRAIN FAILED ($((SECONDS - t0)) s): $(tail -5 "$T/$name.out")"
    return 1
  fi
}

# The pid of the running `seqpipe worker` of stage $1 whose command line mentions $2 (read from
# /proc: no procps needed).
worker_pid() {
  python3 - "$1" "$2" <<'PY'
import os, sys
stage, mark = sys.argv[1], sys.argv[2]
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    args = [a.decode(errors="replace") for a in args]
    if "worker" in args and "--stage" in args and args[args.index("--stage") + 1] == stage and any(mark in a for a in args):
        print(pid)
        break
PY
}

# Runs job $1 in the background, SIGKILLs its stage 1 worker once step $2 is recorded, waits for
# the run, and checks each recovery against its tier's bound.
chaos_job() {
  local name=$1 after=$2
  shift 2
  limit "$BIN" train -q --set run.dir="$T/$name" "$@" > "$T/$name.out" 2>&1 &
  local launcher=$! killed=""
  for _ in $(seq 600); do
    if grep -q "\"step\":$after," "$T/$name/metrics.jsonl" 2>/dev/null; then
      killed=$(worker_pid 1 "$T/$name/")
      [ -n "$killed" ] && kill -KILL "$killed"
      break
    fi
    sleep 0.1
  done
  if wait "$launcher"; then say "$name: killed worker pid ${killed:-NONE}; $(grep '^done:' "$T/$name.out" | tail -1)"; else say "CHAOS RUN FAILED: $(tail -5 "$T/$name.out")"; fi
  python3 - "$T/$name/metrics.jsonl" <<'PY' 2>&1 | tee -a "$report" || true
import json, sys
events = [json.loads(l) for l in open(sys.argv[1]) if '"recovered"' in l]
for e in events:
    print(f"recovered at step {e['step']}: tier {e['tier']}, {e['recovery_s']:.2f} s, {e['lost_steps']} steps lost, {e.get('redone_units', 0)} units redone")
    # The bound of one worker's loss: a mid-step recovery redoes no completed step; peer
    # snapshots lag training by at most one step (the kill may land while the newest one is
    # still being copied, the likelier the busier the machine), so at most one is redone.
    bound = {"mid_step": 0, "peer": 1}.get(e["tier"])
    if bound is None or e["lost_steps"] > bound:
        print("RECOVERY WORSE THAN ITS BOUND: a lost worker is recovered mid-step or from the peer snapshots, losing at most 1 completed step")
if not events:
    print("NO RECOVERY EVENT: the kill did not land")
PY
}

compare() { python3 scripts/gpu-pipeline-check.py "$@" 2>&1 | tee -a "$report" || true; }

pipeline() {
  say "== 4. the pipeline runtime with CUDA stages (default job: 4 stages on the one GPU, host-staged links)"
  T="$OUT/train"
  rm -rf "$T"; mkdir -p "$T"
  # Every run of a comparison shares the LR schedule (decay over 24 steps) and checkpoints every 6.
  local job=(--set train.eval_every=0 --set train.decay_steps=24 --set checkpoint.every=6)
  local cuda=("${job[@]}" --set model.device="$DEVICE" --set model.precision=fp32)
  train_job cpu4 "${job[@]}" --set train.steps=12 --dump-grads "$T/cpu4-grads" || true
  train_job cuda4 "${cuda[@]}" --set train.steps=12 --dump-grads "$T/cuda4-grads" || return 0
  say "-- first-step gradients, CUDA stages (fp32) vs CPU stages:"
  compare grads "$T/cpu4-grads" "$T/cuda4-grads" --bound 1e-4
  say "-- per-step losses, CUDA vs CPU (within 1e-3 relative after 12 steps):"
  compare losses "$T/cpu4" "$T/cuda4" --rel 1e-3
  train_job cuda2 "${cuda[@]}" --set train.steps=12 --set pipeline.stages=2 || true
  say "-- 2 stages vs 4 stages on the GPU (bit-identical):"
  compare losses "$T/cuda4" "$T/cuda2"
  compare state "$T/cuda4/checkpoints" "$T/cuda2/checkpoints"
  train_job cuda-split "${cuda[@]}" --set train.steps=6 || true
  if limit "$BIN" resume -q "$T/cuda-split" --set train.steps=12 --set pipeline.stages=3 > "$T/cuda-split-resume.out" 2>&1; then
    say "-- 6 steps, stop, resume for 6 more, onto 3 stages (bit-identical to the straight run):"
  else
    say "RESUME FAILED: $(tail -5 "$T/cuda-split-resume.out")"
  fi
  compare losses "$T/cuda4" "$T/cuda-split"
  compare state "$T/cuda4/checkpoints" "$T/cuda-split/checkpoints"
  say "-- chaos: SIGKILL of stage 1's worker after step 8 of 24 (the run recovers, bit-identical):"
  train_job calm "${cuda[@]}" --set train.steps=24 || true
  chaos_job chaos 8 "${cuda[@]}" --set train.steps=24
  compare losses "$T/calm" "$T/chaos"
  compare state "$T/calm/checkpoints" "$T/chaos/checkpoints"
  say "-- bf16 matrix products, default job, 60 steps (loss must fall):"
  train_job bf16 --set model.device="$DEVICE" --set model.precision=bf16 --set train.eval_every=0 || true
  say "-- GPT-2 124M shape on synthetic data, 2 stages, bf16, 20 steps, peer snapshots after every"
  say "   step and a checkpoint every 5 (state copied to pinned host memory behind the compute):"
  [ "$DEVICE" = cuda ] || return 0
  train_job gpt2 --set model.device=cuda --set model.precision=bf16 --set model.vocab_size=50257 \
    --set model.layers=12 --set model.d_model=768 --set model.heads=12 --set model.max_seq_len=1024 \
    --set train.seq_len=1024 --set train.micro_batch_size=4 --set pipeline.microbatches=8 \
    --set pipeline.stages=2 --set train.steps=20 --set train.warmup_steps=5 --set train.lr=6e-4 \
    --set train.min_lr=6e-5 --set train.eval_every=0 --set checkpoint.every=5 \
    --set checkpoint.keep_last=1 || true
  python3 - "$T/gpt2/metrics.jsonl" <<'PY' 2>&1 | tee -a "$report" || true
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r for r in rows if "loss" in r and "event" not in r]
tps = sorted(r["tokens_per_s"] for r in steps[3:]) or [0]
print(f"gpt2 pipeline: loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f} over {len(steps)} steps, median {tps[len(tps) // 2]:.0f} tokens/s after step 3")
ckpts = [r for r in rows if r.get("event") == "checkpoint"]
for c in ckpts:
    print(f"checkpoint of step {c['step']}: {c['bytes'] / 1e6:.0f} MB, the step stalled {1e3 * c['snapshot_s']:.2f} ms for the snapshot, upload {c['upload_s']:.2f} s")
if not ckpts:
    print("NO CHECKPOINT EVENT")
times = {r["step"]: r["step_time_s"] for r in steps}
after = [times[c["step"] + 1] for c in ckpts if c["step"] + 1 in times]
plain = sorted(t for s, t in times.items() if s > 3 and s - 1 not in {c["step"] for c in ckpts})
if after and plain:
    print(f"step time after a checkpoint {1e3 * sum(after) / len(after):.1f} ms vs median {1e3 * plain[len(plain) // 2]:.1f} ms otherwise")
PY
}

bench() {
  say "== 5. training step, bf16: seqpipe vs PyTorch eager and torch.compile ($ROUNDS alternating rounds)"
  say "-- the step's matrix products (GPT-2 124M, 8 x 1024 rows) in each way BF16 mode could feed cuBLAS:"
  if limit "$BIN" gpu gemm > "$OUT/gemm.json" 2> "$OUT/gemm.err"; then
    python3 - "$OUT/gemm.json" <<'PY' 2>&1 | tee -a "$report" || true
import json, sys
r = json.loads(open(sys.argv[1]).read())
ways = [w for w, _ in r["totals_ms"]]
print(f"{'product':<36} {'m x n x k':>20} " + " ".join(f"{w[:22]:>23}" for w in ways))
rows = {}
for t in r["times"]:
    rows.setdefault((t["what"], tuple(t["mnk"])), {})[t["how"]] = t
for (what, mnk), by in rows.items():
    print(f"{what:<36} {'x'.join(map(str, mnk)):>20} " + " ".join(f"{by[w]['ms']:>9.3f} ms {by[w]['tflops']:>6.0f} TF" for w in ways))
print("sum (one block + one head chunk): " + ", ".join(f"{w} {ms:.2f} ms" for w, ms in r["totals_ms"]))
fast = dict(r["totals_ms"])["bf16 fast (fp32 operands)"]
print(f"bf16 operands vs fp32 operands (fast): {fast / dict(r['totals_ms'])['bf16 operands']:.2f}x faster, {fast / dict(r['totals_ms'])['bf16 operands + casts']:.2f}x with the casts; results differ by {r['bf16_operands_vs_fast_rel_l2']:.1e} (rel L2)")
PY
  else
    say "GEMM BENCHMARK FAILED: $(tail -5 "$OUT/gemm.err")"
  fi
  for preset in ${PRESETS:-gpt2 a b long}; do
    for round in $(seq "$ROUNDS"); do
      limit "$BIN" gpu bench --preset "$preset" --precision bf16 --steps "$STEPS" >> "$runs" 2>> "$OUT/bench.err" || say "seqpipe $preset failed: $(tail -2 "$OUT/bench.err")"
      # The same step with every product's operands rounded into BF16 copies first (gpt2 only).
      if [ "$preset" = gpt2 ]; then
        limit "$BIN" gpu bench --preset "$preset" --precision bf16 --bf16-operands --steps "$STEPS" >> "$runs" 2>> "$OUT/bench.err" || say "seqpipe (bf16 operands) $preset failed: $(tail -2 "$OUT/bench.err")"
      fi
      for mode in eager compile; do
        limit python3 scripts/gpu-torch-bench.py --preset "$preset" --precision bf16 --mode "$mode" --steps "$STEPS" >> "$runs" 2>> "$OUT/torch.err" || say "torch $mode $preset failed: $(tail -2 "$OUT/torch.err")"
      done
      say "(round $round of $preset done at $((SECONDS - started)) s)"
    done
  done
  python3 - "$runs" <<'PY' | tee -a "$report"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'impl':<24} {'preset':<6} {'prec':<5} {'attention':<12} {'batch':>5} {'seq':>5} {'median ms':>10} {'tokens/s':>11} {'MFU':>7} {'mem MiB':>8}  loss first->last  every step (ms)")
for r in rows:
    steps = " ".join(f"{x:.1f}" for x in r["step_ms"])
    print(f"{r['impl']:<24} {r['preset']:<6} {r['precision']:<5} {r.get('attention', 'sdpa'):<12} {r['batch']:>5} {r['seq_len']:>5} {r['median_ms']:>10.2f} {r['tokens_per_s']:>11.0f} {100*r['mfu']:>6.1f}% {r['peak_mem_mib']:>8.0f}  {r['losses'][0]:.3f}->{r['losses'][-1]:.3f}  {steps}")
PY
}

link() {
  say "== 6. NCCL link between two ranks (bit-exact round trips, bandwidth, abort on a killed peer)"
  # Two ranks on the one GPU need NCCL >= 2.30 and this switch; older NCCL reports "skipped".
  if NCCL_MULTI_RANK_GPU_ENABLE=1 timeout 300 "$BIN" gpu link > "$OUT/link.json" 2> "$OUT/link.err"; then
    python3 - "$OUT/link.json" <<'PY' 2>&1 | tee -a "$report" || true
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
if "skipped" in r:
    print("skipped:", r["skipped"])
else:
    rt = sorted(r["round_trip_ms"])
    print(f"NCCL {r['nccl']} on {r['gpu']} devices {r['devices']}: {r['mib']:.1f} MiB per transfer, round trip median {rt[len(rt) // 2]:.3f} ms = {r['nccl_gb_per_s']:.1f} GB/s; host copies (d2h + h2d) {r['host_copies_gb_per_s']:.1f} GB/s; bit-exact {r['bit_exact']}")
    print(f"killed peer: abort tripped after {r['abort_tripped_after_s']:.0f} s, the receive ended after {r['abort_s']:.2f} s with: {r['abort_error']}; GPU usable after: {r['usable_after_abort']}")
PY
  else
    say "NCCL LINK CHECK FAILED: $(tail -5 "$OUT/link.err") $(tail -c 600 "$OUT/link.json")"
    return 0
  fi
  grep -q '"skipped"' "$OUT/link.json" && return 0
  say "-- the pipeline over NCCL device links (pipeline.transport=nccl; boundary tensors stay on the"
  say "   GPU, headers over TCP) against host-staged links, 3 stages, fp32, 12 steps (bit-identical):"
  T="$OUT/nccl"
  rm -rf "$T"; mkdir -p "$T"
  local job=(--set train.eval_every=0 --set train.decay_steps=12 --set checkpoint.every=6
    --set model.device=cuda --set model.precision=fp32 --set pipeline.stages=3)
  train_job tcp3 "${job[@]}" --set train.steps=12 || return 0
  NCCL_MULTI_RANK_GPU_ENABLE=1 train_job nccl3 "${job[@]}" --set train.steps=12 --set pipeline.transport=nccl || return 0
  compare losses "$T/tcp3" "$T/nccl3"
  compare state "$T/tcp3/checkpoints" "$T/nccl3/checkpoints"
  python3 - "$T/tcp3/metrics.jsonl" "$T/nccl3/metrics.jsonl" <<'PY' 2>&1 | tee -a "$report" || true
import json, sys
for path, name in zip(sys.argv[1:], ("tcp", "nccl")):
    times = sorted(json.loads(l)["step_time_s"] for l in open(path) if '"loss"' in l and '"event"' not in l)[2:]
    print(f"{name}: median step {1e3 * times[len(times) // 2]:.1f} ms over steps 3..12")
PY
  say "-- chaos over NCCL device links: SIGKILL of stage 1's worker after step 4 (replaced mid-step, the"
  say "   neighbours join new device links and resend from their kept buffers; bit-identical):"
  NCCL_MULTI_RANK_GPU_ENABLE=1 chaos_job nccl-chaos 4 "${job[@]}" --set train.steps=12 --set pipeline.transport=nccl
  compare losses "$T/tcp3" "$T/nccl-chaos"
  compare state "$T/tcp3/checkpoints" "$T/nccl-chaos/checkpoints"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
