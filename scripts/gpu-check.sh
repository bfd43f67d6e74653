#!/usr/bin/env bash
# The GPU checks of seqpipe, in one device call.
#
#   scripts/gpu-check.sh pack   (here, with a Rust toolchain) builds `--features cuda`, strips the
#                               binary into .gpu-bin/ (git-ignored; carry it to the GPU machine)
#   scripts/gpu-check.sh run    (on the GPU machine: no Rust, no registry) finds the CUDA
#                               libraries of the machine's Python wheels, then runs
#     1. every CUDA kernel against the CPU oracle (relative error per kernel and precision),
#     2. whole-model FP32 gradients on the GPU against the CPU stage's (presets a, b, long, gpt2),
#     3. determinism: two runs of the same bf16 job give bit-identical weights,
#     4. GPT-2 124M (and presets a, b, long) training steps, bf16: seqpipe against PyTorch eager
#        and torch.compile (scripts/gpu-torch-bench.py), alternating rounds, every round printed.
#   Everything goes to $OUT (default ./gpu-out): report.txt (the summary), one JSON line per run
#   in runs.jsonl, and the logs. ROUNDS (default 2) and STEPS (default 10) can be set.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin/seqpipe

pack() {
  command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
  cargo build --release --features cuda
  mkdir -p .gpu-bin
  strip -o "$BIN" target/release/seqpipe
  mkdir -p .git/info
  grep -qx '/.gpu-bin/' .git/info/exclude 2>/dev/null || echo '/.gpu-bin/' >> .git/info/exclude
  ls -la "$BIN"
}

# Directories of the CUDA libraries shipped in the machine's Python wheels (nvidia-*), with a
# libnccl.so link (cudarc looks for it; the wheel ships only libnccl.so.2).
cuda_libs() {
  local dirs links
  dirs=$(python3 - <<'PY'
import glob, os
import nvidia
seen = []
for root in nvidia.__path__:
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
  mkdir -p "$OUT"
  export LD_LIBRARY_PATH="$(cuda_libs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export SEQPIPE_CACHE="$OUT/cache" PYTHONUNBUFFERED=1
  local report="$OUT/report.txt" runs="$OUT/runs.jsonl"
  : > "$report"; : > "$runs"
  say() { echo "$@" | tee -a "$report"; }
  say "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$report"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" 2>&1 | tee -a "$report"
  say "== 1. kernels vs the CPU oracle"
  local started=$SECONDS
  "$BIN" gpu check 2>&1 | tee -a "$report" || say "KERNEL CHECK FAILED"
  say "(kernel check: $((SECONDS - started)) s)"
  say "== 2. whole-model FP32 gradients vs the CPU stage (same weights and batch)"
  for spec in "a" "b" "long" "gpt2 --batch 1"; do
    # shellcheck disable=SC2086
    if "$BIN" gpu bench --preset $spec --precision fp32 --check --warmup 0 --steps 2 > "$OUT/check.json" 2> "$OUT/check.err"; then
      python3 - "$OUT/check.json" "$spec" <<'PY' | tee -a "$report"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
c = r["grad_check"]
print(f"{sys.argv[2]:>16}: worst grad rel L2 {c['worst_rel_l2']:.2e} ({c['worst_param']}), loss gpu {c['loss_gpu']:.6f} cpu {c['loss_cpu']:.6f}, bound {c['bound']:.0e}")
PY
    else
      say "$spec: GRADIENT CHECK FAILED: $(tail -3 "$OUT/check.err")"
    fi
  done
  say "== 3. determinism (gpt2, bf16, two runs of $STEPS steps)"
  local h1 h2
  h1=$("$BIN" gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps "$STEPS" | tee -a "$runs" | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['final_params_blake3'])")
  h2=$("$BIN" gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps "$STEPS" | tee -a "$runs" | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['final_params_blake3'])")
  if [ "$h1" = "$h2" ]; then say "bit-identical weights after $STEPS steps: $h1"; else say "WEIGHTS DIFFER: $h1 vs $h2"; fi
  say "== 4. training step, bf16: seqpipe vs PyTorch eager and torch.compile ($ROUNDS alternating rounds)"
  for preset in gpt2 a b long; do
    for round in $(seq "$ROUNDS"); do
      "$BIN" gpu bench --preset "$preset" --precision bf16 --steps "$STEPS" >> "$runs" 2>> "$OUT/bench.err" || say "seqpipe $preset failed: $(tail -2 "$OUT/bench.err")"
      for mode in eager compile; do
        python3 scripts/gpu-torch-bench.py --preset "$preset" --precision bf16 --mode "$mode" --steps "$STEPS" >> "$runs" 2>> "$OUT/torch.err" || say "torch $mode $preset failed: $(tail -2 "$OUT/torch.err")"
      done
      say "(round $round of $preset done at $((SECONDS - started)) s)"
    done
  done
  python3 - "$runs" <<'PY' | tee -a "$report"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'impl':<14} {'preset':<6} {'prec':<5} {'batch':>5} {'seq':>5} {'median ms':>10} {'tokens/s':>11} {'MFU':>7} {'mem MiB':>8}  loss first->last  every step (ms)")
for r in rows:
    steps = " ".join(f"{x:.1f}" for x in r["step_ms"])
    print(f"{r['impl']:<14} {r['preset']:<6} {r['precision']:<5} {r['batch']:>5} {r['seq_len']:>5} {r['median_ms']:>10.2f} {r['tokens_per_s']:>11.0f} {100*r['mfu']:>6.1f}% {r['peak_mem_mib']:>8.0f}  {r['losses'][0]:.3f}->{r['losses'][-1]:.3f}  {steps}")
PY
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
