#!/usr/bin/env bash
# The GPU checks of seqpipe: a lent GPU machine's first command must bring back a complete report.
#
#   scripts/gpu-check.sh pack   (here, with a Rust toolchain) builds `--features cuda`, strips the
#                               binary into .gpu-bin/ (git-ignored; carry it to the GPU machine)
#                               and compiles the kernels ahead of time into .gpu-bin/cache
#   scripts/gpu-check.sh run    (on the GPU machine: no Rust, no registry) runs one pass, PASS=1
#                               (the default), 2 or 3, each made to end within 9 minutes on an
#                               H100 (one device command runs at most 10):
#
#   PASS=1, the first command on a fresh machine (estimated 7 min on an H100; parts below)
#     preflight   nvidia-smi, PyTorch/CUDA/NCCL versions, `seqpipe gpu info` (the GPU, driver, the
#                 CUDA library files loaded, the kernel image), where compute-sanitizer is
#     kernels     every CUDA kernel against the CPU oracle, bare (its numbers come back whatever
#                 the sanitizers do), then under `compute-sanitizer --tool memcheck`, then the
#                 attention kernels (`gpu check --only attention`) under `--tool racecheck`;
#                 without compute-sanitizer the sanitizer steps say it was not found
#     grads-fp32  whole-model FP32 gradients against the CPU stage's (presets a, b, long, gpt2
#                 batch 1): within 1e-4
#     determinism two runs of the same GPT-2 bf16 job give bit-identical weights
#     pipeline    the pipeline runtime with CUDA stages on a small model (several stages on the one
#                 GPU, host-staged links): first-step gradients against CPU stages (unmasked, and
#                 with document masks on synthetic packed documents), 2 vs 4 stages,
#                 seq1f1b-i with 2 chunks per worker and seq1f1b-zb (split backwards) against
#                 seq1f1b bit-identical, stop + resume onto 3 stages, one worker SIGKILLed
#                 mid-run, bf16
#     bench-gpt2-eager  one round of GPT-2 124M bf16 steps: seqpipe against PyTorch eager
#   PASS=2 (estimated 7 min): gemm (the step's products in FP32, TF32 and three ways of BF16),
#     profile-gpt2 (where a GPT-2 bf16 step's time goes: every kernel, product, copy and sync
#     timed by CUDA events and summed by category, for the whole batch and for the pipeline's
#     shape of 8 micro-batches x 4 segments), attention-v2 (the same two profiles with the
#     tensor-core attention kernels v1 and v2, SEQPIPE_ATTENTION, side by side), grads-bf16 (presets a and gpt2, stated), bench-gpt2 (ROUNDS alternating rounds of seqpipe,
#     seqpipe with --bf16-operands, PyTorch eager and torch.compile), pipeline-gpt2 (GPT-2 124M on
#     2 CUDA stages, checkpoints and peer snapshots timed)
#   PASS=3 (estimated 7 min): bench-presets (presets a, b, long: seqpipe, eager, torch.compile,
#     ROUNDS rounds, default 1 here), link (the NCCL link between two ranks, then the pipeline over
#     NCCL device links against host-staged ones, straight and with a stage SIGKILLed)
#   SECTIONS="pipeline kernels" runs the named parts alone instead of a pass.
#
# Estimated H100 time of each part, in seconds (nothing has run on a GPU yet: these are estimates).
# How: the fresh machine's start (1-2 min) is outside the command's time. Each GPU process pays
# module loading: a cubin loads in well under a second; PTX is JIT-compiled once (~17 s for the
# 4.3 MB, measured with ptxas here) and then found in the driver's compute cache, which this
# script keeps in $WORK for the whole command. Training and benchmark steps are FLOPs at an
# assumed MFU (GPT-2 124M bf16: ~7 TFLOP per 8 x 1024-token step, at 10% of 989 TFLOP/s ~70 ms,
# the small presets a few ms) plus process start and the CPU-side init of the weights (~2 s for
# 124M). Compute-sanitizer: NVIDIA's guide gives no slowdown factor; 10-100x on kernel time is
# the range usually quoted, so the estimates take 100x on the oracle's ~0.2 s of kernels plus
# ~30 s of instrumenting the module at load. CPU-side work (the CPU oracle, the CPU stage's
# reference gradients) is scaled from this 2-core machine by 1/4 for 16 cores. The pipeline is
# the DEVICE=cpu rehearsal's time here (tests/gpu_check.rs) divided by 4, plus a second per worker.
#   pass 1: preflight 15, kernels (bare 15 + memcheck 60 + racecheck on attention 60) 135,
#           grads-fp32 70, determinism 30, pipeline 150, bench-gpt2-eager 35: 435 s (7.3 min)
#           of a 540 s budget
#   pass 2: preflight 15, gemm 20, profile-gpt2 30 (two processes of ~4 s of start and weight
#           init each; 12 steps of ~60 ms at 8 x 1024 tokens, then 12 of ~0.4 s at 32 x 1024 in
#           the pipeline's shape; the profiled steps a few percent slower), attention-v2 60
#           (profile-gpt2's two processes twice), grads-bf16 50, bench-gpt2 with ROUNDS=2
#           (seqpipe 15 + bf16 operands 15 + eager 20 + compile 90 then 30 once Inductor's cache
#           holds it) 190, pipeline-gpt2 (20 steps, 4 checkpoints of 1.5 GB into /tmp) 90: 455 s
#   pass 3: preflight 15, bench-presets with ROUNDS=1 (per preset: seqpipe 10, eager 15, compile
#           60) 255, link (NCCL round trips and the killed peer 60, then 3 pipeline jobs of 12
#           steps 60) 120: 390 s
#
# Nothing aborts a pass: every command runs under `timeout -k` (its part's limit, capped by LIMIT
# seconds if set, by STEP_LIMITS="name=seconds ..." for single steps, and by the pass's time
# left), and its failure, crash, timeout or missing JSON becomes a FAILED / TIMED OUT line naming
# the step in report.txt; then the next step runs. A watchdog keeps the pass within BUDGET
# seconds (default 540): once too little is left, the remaining steps are reported as NOT RUN
# (out of time). report.txt is written line by line as the pass goes.
#
# $OUT (default ./gpu-out) receives only report.txt, runs.jsonl (one JSON line per benchmark run)
# and logs.tar.gz (every step's stdout/stderr, the compute-sanitizer logs and the pipeline runs'
# metrics, each log cut to its head and tail if long; the archive stays under 16 MiB). Run
# directories (checkpoints, gradient dumps) stay in $WORK (default a new /tmp/seqpipe-gpu-check.*).
# The script exits 0 when every step passed, 1 otherwise. DEVICE=cpu rehearses the pipeline part
# with CPU stages on a machine without a GPU (tests/gpu_check.rs does).
cd "$(dirname "$0")/.." || exit 2
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
  # .gpu-bin is in .gitignore: name it in the device call's carry.
  du -sh .gpu-bin
}

# Directories of the CUDA libraries shipped in the machine's Python wheels (nvidia-*), with a
# libnccl.so link (cudarc looks for it; the wheel ships only libnccl.so.2).
cuda_libs() {
  local dirs links nccl
  dirs=$(timeout 60 python3 - <<'PY'
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
  links=$(mktemp -d "$WORK/libs.XXXX")
  nccl=$(IFS=:; for d in $dirs; do ls "$d"/libnccl.so.2 2>/dev/null; done | head -1)
  if [ -n "$nccl" ]; then ln -sf "$nccl" "$links/libnccl.so"; fi
  echo "$links${dirs:+:$dirs}"
}

# Where compute-sanitizer is: on PATH, in a CUDA toolkit, or in a Python wheel (empty if nowhere).
find_sanitizer() {
  local c
  if c=$(command -v compute-sanitizer); then echo "$c"; return; fi
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
    /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
    if [ -x "$c" ]; then echo "$c"; return; fi
  done
  timeout 60 python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except ImportError:
    roots = []
for root in roots:
    for c in glob.glob(os.path.join(root, "**", "compute-sanitizer"), recursive=True):
        if os.path.isfile(c) and os.access(c, os.X_OK):
            print(c)
            raise SystemExit
PY
}

say() { echo "$@" | tee -a "$report"; }

# One report line per step: its status, then its name.
status_line() { printf '%-9s %s\n' "$1" "$2" | tee -a "$report"; }

# The last lines of a step's stderr (its stdout where stderr is empty), on one line.
tail_of() {
  local f=$1.err
  [ -s "$f" ] || f=$1.out
  [ -s "$f" ] || { echo "(no output)"; return; }
  tail -n 3 "$f" | tr -s '\n\t' '  ' | cut -c1-400
}

# The first errors of a compute-sanitizer log, on one line.
sanitizer_errors() {
  grep '^=========' "$1" 2>/dev/null | sed 's/^========= *//' \
    | grep -v -e '^$' -e '^COMPUTE-SANITIZER' -e 'ERROR SUMMARY' -e 'SUMMARY:' | head -n 6 \
    | tr '\n' '|' | sed 's/|$//; s/|/ | /g' | cut -c1-600
}

# The limit of step $1 (default $2 seconds): STEP_LIMITS' entry for it, capped by LIMIT.
step_limit() {
  local name=$1 lim=$2 entry
  for entry in ${STEP_LIMITS:-}; do
    [ "${entry%%=*}" = "$name" ] && lim=${entry#*=}
  done
  if [ -n "${LIMIT:-}" ] && [ "$LIMIT" -lt "$lim" ]; then lim=$LIMIT; fi
  echo "$lim"
}

not_run() {
  status_line "NOT RUN" "$1 (out of time: $((deadline - SECONDS)) s left of the pass's budget)"
  not_run_count=$((not_run_count + 1))
}

# step NAME SECONDS [--json] [--runs] CMD...: one step of the pass. CMD runs for at most SECONDS
# (see step_limit; never past the pass's deadline), stdout to $LOGS/NAME.out, stderr to
# $LOGS/NAME.err. --json: its last line of stdout must be a JSON object; --runs: that line is also
# appended to runs.jsonl. Every step leaves one status line (ok, FAILED, TIMED OUT or NOT RUN)
# naming it in the report; returns 0 only when CMD succeeded.
step() {
  local name=$1 lim t0=$SECONDS rc json="" keep="" why="${WHY:-}" left
  lim=$(step_limit "$name" "$2")
  shift 2
  while :; do
    case ${1:-} in
      --json) json=1; shift ;;
      --runs) json=1 keep=1; shift ;;
      *) break ;;
    esac
  done
  WHY=""
  left=$((deadline - SECONDS))
  if [ "$left" -lt "${MIN_STEP:-5}" ]; then not_run "$name"; return 3; fi
  [ "$lim" -gt "$left" ] && lim=$left
  timeout -k 10 "$lim" "$@" > "$LOGS/$name.out" 2> "$LOGS/$name.err" < /dev/null
  rc=$?
  local took=$((SECONDS - t0)) log="$LOGS/$name"
  if [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$took" -ge "$lim" ]; }; then
    status_line "TIMED OUT" "$name (no end within its limit of $lim s)${why:+: $why}: $(tail_of "$log")"
    timed_out_count=$((timed_out_count + 1))
    return 124
  fi
  if [ "$rc" -eq 86 ] && [ -s "$log.sanitizer.log" ]; then
    status_line FAILED "$name (compute-sanitizer found errors, after $took s): $(sanitizer_errors "$log.sanitizer.log")"
    failed_count=$((failed_count + 1))
    return "$rc"
  fi
  if [ "$rc" -ne 0 ]; then
    local how="exit $rc"
    [ "$rc" -gt 128 ] && how="killed by signal $((rc - 128))"
    [ "$rc" -eq 127 ] && how="not found (exit 127)"
    status_line FAILED "$name ($how after $took s)${why:+: $why}: $(tail_of "$log")"
    failed_count=$((failed_count + 1))
    return "$rc"
  fi
  if [ -n "$json" ]; then
    local line
    line=$(grep -v '^[[:space:]]*$' "$log.out" | tail -n 1)
    if ! printf '%s' "$line" | python3 -c 'import json, sys; assert isinstance(json.loads(sys.stdin.read()), dict)' 2> /dev/null; then
      status_line FAILED "$name (exit 0 after $took s, but no JSON object as its last line of output: '$(printf '%s' "$line" | cut -c1-200)')"
      failed_count=$((failed_count + 1))
      return 65
    fi
    [ -n "$keep" ] && printf '%s\n' "$line" >> "$runs"
  fi
  status_line ok "$name ($took s)"
  ok_count=$((ok_count + 1))
  return 0
}

# finding NAME ARGS... <<'PY' ... PY: a Python snippet reading step outputs; its lines go to the
# report, indented. A snippet that fails (a field missing, a file absent) is a FAILED line naming
# NAME, never the end of the pass.
finding() {
  local name=$1 out rc
  shift
  out=$(timeout 120 python3 - "$@" 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ]; then
    [ -n "$out" ] && printf '%s\n' "$out" | sed 's/^/   /' | tee -a "$report"
  else
    status_line FAILED "$name: its output was not understood: $(printf '%s' "$out" | tail -n 2 | tr '\n' ' ' | cut -c1-400)"
    failed_count=$((failed_count + 1))
  fi
  return 0
}

# One `seqpipe gpu check` within LIMIT seconds, under the given compute-sanitizer tool (bare with
# none): kernel_check NAME TOOL LIMIT [FLAGS...].
kernel_check() {
  local name=$1 tool=$2 lim=$3
  shift 3
  if [ -n "$tool" ]; then
    step "$name" "$lim" "$SANITIZER" --tool "$tool" --error-exitcode 86 \
      --log-file "$LOGS/$name.sanitizer.log" "$BIN" gpu check --json "$@"
  else
    step "$name" "$lim" "$BIN" gpu check --json "$@"
  fi
  [ -s "$LOGS/$name.out" ] || return 0
  finding "$name" "$LOGS/$name.out" "$LOGS/$name.sanitizer.log" <<'PY'
import json, os, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
r = json.loads(lines[-1])
ks = r["kernels"]
bad = [k for k in ks if not (k["rel_l2"] is not None and k["rel_l2"] <= k["bound"])]
# A bound of 0 is a bit-identity row (the same kernel run twice): at its bound when equal.
def ratio(k):
    if k["rel_l2"] is None:
        return float("inf")
    if k["bound"] == 0:
        return 0.0 if k["rel_l2"] == 0 else float("inf")
    return k["rel_l2"] / k["bound"]
worst = max(ks, key=ratio)
identity = [k for k in ks if k["bound"] == 0]
print(f"{r['gpu']} ({r['arch']}): {len(ks)} kernel outputs, {len(bad)} over their bound; closest to its bound: "
      f"{worst['what']} ({worst['precision']}) rel L2 {worst['rel_l2']:.2e} of {worst['bound']:.0e}"
      + (f"; {sum(k['rel_l2'] == 0 for k in identity)} of {len(identity)} run-twice outputs bit-identical" if identity else ""))
for k in bad:
    print(f"OVER ITS BOUND: {k['what']} ({k['precision']}) rel L2 {k['rel_l2']} rel max {k['rel_max']}, bound {k['bound']:.0e}")
log = sys.argv[2]
if os.path.exists(log):
    summary = [l.strip("= \n") for l in open(log, errors="replace") if "SUMMARY" in l]
    print("compute-sanitizer: " + ("; ".join(summary) if summary else "NO SUMMARY in its log"))
PY
}

preflight() {
  say "== preflight"
  step nvidia-smi 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,compute_cap --format=csv \
    && sed 's/^/   /' "$LOGS/nvidia-smi.out" | tee -a "$report"
  WHY="PyTorch not importable"
  if step torch 60 python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else 'n/a', 'gpu', torch.cuda.is_available())"; then
    TORCH=1
    sed 's/^/   /' "$LOGS/torch.out" | tee -a "$report"
  else
    TORCH=""
  fi
  step gpu-info 60 --json "$BIN" gpu info && sed 's/^/   /' "$LOGS/gpu-info.out" | cut -c1-2000 | tee -a "$report"
  if [ -n "$SANITIZER" ]; then
    say "   compute-sanitizer: $SANITIZER"
  else
    say "   compute-sanitizer: not found (PATH, /usr/local/cuda, the nvidia wheels): the kernel check runs without it"
  fi
}

kernels() {
  say "== kernels vs the CPU oracle: bare, then under compute-sanitizer (memcheck; racecheck on the attention kernels)"
  # Bare first: its errors come back even if the sanitizers run out of time.
  kernel_check kernels "" 60
  if [ -n "$SANITIZER" ]; then
    kernel_check kernels-memcheck memcheck 150
    kernel_check kernels-racecheck racecheck 150 --only attention
  else
    local name
    for name in kernels-memcheck kernels-racecheck; do
      status_line "NOT RUN" "$name (compute-sanitizer not found: the kernel check ran without it)"
      not_run_count=$((not_run_count + 1))
    done
  fi
}

# Whole-model gradients against the CPU stage's, for each "precision preset [flags]" given.
gradients() {
  say "== whole-model gradients vs the CPU stage's FP32 ones (same weights and batch): FP32 within"
  say "   the bound; BF16 (tensor-core products and attention) stated"
  local run precision spec name
  for run in "$@"; do
    precision=${run%% *} spec=${run#* }
    name="grads-$precision-${spec%% *}"
    # shellcheck disable=SC2086
    step "$name" 120 --json "$BIN" gpu bench --preset $spec --precision "$precision" --check --warmup 0 --steps 2 || continue
    finding "$name" "$LOGS/$name.out" "$spec" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
c = r["grad_check"]
bound = "stated (no bound)" if c["bound"] is None else f"bound {c['bound']:.0e}"
print(f"{r['precision']} {sys.argv[2]:>16}: worst grad rel L2 {c['worst_rel_l2']:.2e} ({c['worst_param']}), loss gpu {c['loss_gpu']:.6f} cpu {c['loss_cpu']:.6f}, {bound}, attention on {r['attention']}")
PY
  done
}

determinism() {
  say "== determinism (gpt2, bf16, two runs of $STEPS steps)"
  local first second
  step determinism-1 90 --runs "$BIN" gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps "$STEPS"
  first=$?
  step determinism-2 90 --runs "$BIN" gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps "$STEPS"
  second=$?
  if [ "$first" -ne 0 ] || [ "$second" -ne 0 ]; then
    say "   determinism not judged: a run did not finish with its JSON line"
    return 0
  fi
  finding determinism "$LOGS/determinism-1.out" "$LOGS/determinism-2.out" <<'PY'
import json, sys
h = [json.loads(open(p).read().strip().splitlines()[-1])["final_params_blake3"] for p in sys.argv[1:]]
print(f"bit-identical weights: {h[0]}" if h[0] == h[1] else f"WEIGHTS DIFFER: {h[0]} vs {h[1]}")
PY
}

# One `seqpipe train` of the pipeline checks into $T/NAME within LIMIT seconds (further arguments
# are train's); its last line goes to the report.
train_job() {
  local name=$1 lim=$2
  shift 2
  step "train-$name" "$lim" "$BIN" train -q --set run.dir="$T/$name" "$@" \
    && say "   $name: $(grep -h '^done:' "$LOGS/train-$name.out" "$LOGS/train-$name.err" | tail -1)"
}

# The pid of the running `seqpipe worker` of stage $1 whose command line mentions $2 (read from
# /proc: no procps needed).
worker_pid() {
  timeout 20 python3 - "$1" "$2" <<'PY'
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

# Runs job $1 within $3 seconds, SIGKILLs its stage 1 worker once step $2 is recorded (a watcher in
# the background), and checks each recovery against its tier's bound.
chaos_job() {
  local name=$1 after=$2 lim=$3
  shift 3
  rm -f "$T/$name.killed"
  (
    end=$((SECONDS + lim))
    while [ "$SECONDS" -lt "$end" ]; do
      if grep -q "\"step\":$after," "$T/$name/metrics.jsonl" 2>/dev/null; then
        pid=$(worker_pid 1 "$T/$name/")
        if [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null; then echo "$pid" > "$T/$name.killed"; fi
        break
      fi
      sleep 0.1
    done
  ) &
  local watcher=$!
  step "train-$name" "$lim" "$BIN" train -q --set run.dir="$T/$name" "$@"
  local rc=$?
  kill "$watcher" 2>/dev/null
  wait "$watcher" 2>/dev/null
  [ "$rc" -eq 3 ] && return 0 # not run: out of time
  local killed
  killed=$(cat "$T/$name.killed" 2>/dev/null)
  if [ -z "$killed" ]; then
    status_line FAILED "chaos-$name: no worker was killed (step $after was not reached, or stage 1's worker was not found)"
    failed_count=$((failed_count + 1))
  fi
  [ "$rc" -eq 0 ] && say "   $name: killed worker pid ${killed:-NONE}; $(grep -h '^done:' "$LOGS/train-$name.out" "$LOGS/train-$name.err" | tail -1)"
  finding "recovery-$name" "$T/$name/metrics.jsonl" <<'PY'
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

# compare NAME ARGS...: a comparison of scripts/gpu-pipeline-check.py; its verdict line goes to the
# report whether it holds or not.
compare() {
  local name=$1
  shift
  step "compare-$name" 120 python3 scripts/gpu-pipeline-check.py "$@"
  [ -s "$LOGS/compare-$name.out" ] && sed 's/^/   /' "$LOGS/compare-$name.out" | tee -a "$report"
  return 0
}

pipeline() {
  say "== pipeline: the runtime with CUDA stages (default job: 4 stages on the one GPU, host-staged links; device $DEVICE)"
  T="$WORK/train"
  rm -rf "$T"; mkdir -p "$T"
  # Every run of a comparison shares the LR schedule (decay over 24 steps) and checkpoints every 6.
  local job=(--set train.eval_every=0 --set train.decay_steps=24 --set checkpoint.every=6)
  local cuda=("${job[@]}" --set model.device="$DEVICE" --set model.precision=fp32)
  train_job cpu4 150 "${job[@]}" --set train.steps=12 --dump-grads "$T/cpu4-grads"
  train_job cuda4 150 "${cuda[@]}" --set train.steps=12 --dump-grads "$T/cuda4-grads"
  say "-- first-step gradients, CUDA stages (fp32) vs CPU stages:"
  compare grads-cuda4-cpu4 grads "$T/cpu4-grads" "$T/cuda4-grads" --bound 1e-4
  say "-- per-step losses, CUDA vs CPU (within 1e-3 relative after 12 steps):"
  compare losses-cuda4-cpu4 losses "$T/cpu4" "$T/cuda4" --rel 1e-3
  # Document masks (issue 32): the attention kernels read each position's document start.
  local docs=(--set data.synthetic_document_median=40 --set data.document_mask=true)
  train_job cpu4-docs 150 "${job[@]}" "${docs[@]}" --set train.steps=12 --dump-grads "$T/cpu4-docs-grads"
  train_job cuda4-docs 150 "${cuda[@]}" "${docs[@]}" --set train.steps=12 --dump-grads "$T/cuda4-docs-grads"
  say "-- document masks: first-step gradients and per-step losses, CUDA stages (fp32) vs CPU stages:"
  compare grads-docs grads "$T/cpu4-docs-grads" "$T/cuda4-docs-grads" --bound 1e-4
  compare losses-docs losses "$T/cpu4-docs" "$T/cuda4-docs" --rel 1e-3
  # The document partition (each micro-batch its own segment lengths) and positions restarting
  # at each document (embed_backward_positions_reset), issue 32.
  local part=("${docs[@]}" --set pipeline.partition=documents --set data.reset_positions=true)
  train_job cpu4-part 150 "${job[@]}" "${part[@]}" --set train.steps=12 --dump-grads "$T/cpu4-part-grads"
  train_job cuda4-part 150 "${cuda[@]}" "${part[@]}" --set train.steps=12 --dump-grads "$T/cuda4-part-grads"
  say "-- document partition + positions reset per document: first-step gradients and losses, CUDA vs CPU:"
  compare grads-part grads "$T/cpu4-part-grads" "$T/cuda4-part-grads" --bound 1e-4
  compare losses-part losses "$T/cpu4-part" "$T/cuda4-part" --rel 1e-3
  train_job cuda2 150 "${cuda[@]}" --set train.steps=12 --set pipeline.stages=2
  say "-- 2 stages vs 4 stages on the GPU (bit-identical):"
  compare losses-cuda2 losses "$T/cuda4" "$T/cuda2"
  compare state-cuda2 state "$T/cuda4/checkpoints" "$T/cuda2/checkpoints"
  # Virtual stages (issue 33): 2 workers holding 2 layer chunks each, every chunk a CUDA stage
  # (seq1f1b-i needs k to divide p: 2 segments, against seq1f1b with 2 segments).
  local k2=(--set pipeline.splits=2 --set pipeline.stages=2)
  local chunks=("${k2[@]}" --set pipeline.virtual_stages=2 --set pipeline.schedule=seq1f1b-i)
  train_job cuda2-k2 150 "${cuda[@]}" "${k2[@]}" --set train.steps=12
  train_job cuda-chunks 150 "${cuda[@]}" "${chunks[@]}" --set train.steps=12
  say "-- seq1f1b-i, 2 workers x 2 chunks vs seq1f1b on 2 stages, k = 2 (bit-identical):"
  compare losses-chunks losses "$T/cuda2-k2" "$T/cuda-chunks"
  compare state-chunks state "$T/cuda2-k2/checkpoints" "$T/cuda-chunks/checkpoints"
  # The zero-bubble Seq1F1B (issue 33): every backward split into its input and weight halves,
  # the weight halves deferred; bit-identical to seq1f1b.
  train_job cuda-zb 150 "${cuda[@]}" --set pipeline.schedule=seq1f1b-zb --set train.steps=12
  say "-- seq1f1b-zb vs seq1f1b on 4 stages (bit-identical):"
  compare losses-zb losses "$T/cuda4" "$T/cuda-zb"
  compare state-zb state "$T/cuda4/checkpoints" "$T/cuda-zb/checkpoints"
  train_job cuda-split 150 "${cuda[@]}" --set train.steps=6
  say "-- 6 steps, stop, resume for 6 more, onto 3 stages (bit-identical to the straight run):"
  step resume-cuda-split 150 "$BIN" resume -q "$T/cuda-split" --set train.steps=12 --set pipeline.stages=3
  compare losses-resume losses "$T/cuda4" "$T/cuda-split"
  compare state-resume state "$T/cuda4/checkpoints" "$T/cuda-split/checkpoints"
  say "-- chaos: SIGKILL of stage 1's worker after step 8 of 24 (the run recovers, bit-identical):"
  train_job calm 200 "${cuda[@]}" --set train.steps=24
  chaos_job chaos 8 200 "${cuda[@]}" --set train.steps=24
  compare losses-chaos losses "$T/calm" "$T/chaos"
  compare state-chaos state "$T/calm/checkpoints" "$T/chaos/checkpoints"
  say "-- chaos with chunks: SIGKILL of worker 1 (chunks 1 and 3) after step 4 of 12, seq1f1b-i (bit-identical):"
  chaos_job chaos-chunks 4 200 "${cuda[@]}" "${chunks[@]}" --set train.steps=12
  compare losses-chaos-chunks losses "$T/cuda2-k2" "$T/chaos-chunks"
  compare state-chaos-chunks state "$T/cuda2-k2/checkpoints" "$T/chaos-chunks/checkpoints"
  say "-- chaos with split backwards: SIGKILL of stage 1's worker after step 8 of 24, seq1f1b-zb (bit-identical to seq1f1b):"
  chaos_job chaos-zb 8 200 "${cuda[@]}" --set pipeline.schedule=seq1f1b-zb --set train.steps=24
  compare losses-chaos-zb losses "$T/calm" "$T/chaos-zb"
  compare state-chaos-zb state "$T/calm/checkpoints" "$T/chaos-zb/checkpoints"
  say "-- bf16 matrix products, default job, 60 steps (loss must fall):"
  train_job bf16 200 --set model.device="$DEVICE" --set model.precision=bf16 --set train.eval_every=0
}

# GPT-2 124M on 2 CUDA stages: checkpoints and peer snapshots timed (pass 2).
pipeline_gpt2() {
  say "== pipeline-gpt2: GPT-2 124M shape on synthetic data, 2 CUDA stages, bf16, 20 steps, peer"
  say "   snapshots after every step and a checkpoint every 5 (state copied to pinned host memory behind the compute)"
  T="$WORK/train-gpt2"
  rm -rf "$T"; mkdir -p "$T"
  train_job gpt2 240 --set model.device=cuda --set model.precision=bf16 --set model.vocab_size=50257 \
    --set model.layers=12 --set model.d_model=768 --set model.heads=12 --set model.max_seq_len=1024 \
    --set train.seq_len=1024 --set train.micro_batch_size=4 --set pipeline.microbatches=8 \
    --set pipeline.stages=2 --set train.steps=20 --set train.warmup_steps=5 --set train.lr=6e-4 \
    --set train.min_lr=6e-5 --set train.eval_every=0 --set checkpoint.every=5 \
    --set checkpoint.keep_last=1 || return 0
  finding pipeline-gpt2 "$T/gpt2/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r for r in rows if "loss" in r and "event" not in r]
tps = sorted(r["tokens_per_s"] for r in steps[3:]) or [0]
print(f"gpt2 pipeline: loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f} over {len(steps)} steps, median {tps[len(tps) // 2]:.0f} tokens/s after step 3")
def median(key):
    v = sorted(r[key] for r in steps[3:] if key in r) or [0]
    return v[len(v) // 2]
# Step time against the slowest stage's compute: what the runtime around the units (links, peer
# snapshots, checkpoints) adds; the worker's system CPU time and page faults show copies and fresh
# buffers (peer snapshots of the whole state made a step 4x slower on the first GPU run).
print(f"after step 3, medians: step {median('step_time_s'):.3f} s, compute {median('compute_s'):.3f} s, worker system CPU {median('cpu_system_s'):.2f} s, page faults {median('page_faults')}")
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

gemm() {
  say "== gemm: the step's matrix products (GPT-2 124M, 8 x 1024 rows) in each way BF16 mode could feed cuBLAS"
  step gemm 120 --json "$BIN" gpu gemm || return 0
  finding gemm "$LOGS/gemm.out" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
ways = [w for w, _ in r["totals_ms"]]
print(f"{'product':<36} {'m x n x k':>20} " + " ".join(f"{w[:22]:>23}" for w in ways))
rows = {}
for t in r["times"]:
    rows.setdefault(t["what"], {})[t["how"]] = t
for what, by in rows.items():
    # A way may multiply padded shapes (the cached BF16 head's vocabulary is padded to a multiple
    # of 64): the row shows the first way's m x n x k and marks a cell whose shape differs with *.
    mnk = next(iter(by.values()))["mnk"]
    cells = []
    for w in ways:
        t = by.get(w)
        if t is None:
            cells.append(f"{'-':>23}")
        else:
            mark = "*" if t["mnk"] != mnk else " "
            cells.append(f"{t['ms']:>8.3f}{mark}ms {t['tflops']:>6.0f} TF")
    print(f"{what:<36} {'x'.join(map(str, mnk)):>20} " + " ".join(cells))
print("* a padded shape: " + "; ".join(sorted({f"{w} {chr(120).join(map(str, t['mnk']))}" for by in rows.values() for w, t in by.items() if t["mnk"] != next(iter(by.values()))["mnk"]})))
print("sum (one block + one head chunk): " + ", ".join(f"{w} {ms:.2f} ms" for w, ms in r["totals_ms"]))
fast = dict(r["totals_ms"])["bf16 fast (fp32 operands)"]
print(f"bf16 operands vs fp32 operands (fast): {fast / dict(r['totals_ms'])['bf16 operands']:.2f}x faster, {fast / dict(r['totals_ms'])['bf16 operands + casts']:.2f}x with the casts; results differ by {r['bf16_operands_vs_fast_rel_l2']:.1e} (rel L2)")
PY
}

# Where a GPT-2 bf16 step's time goes (`gpu bench --profile`): the whole batch as one unit, then
# the pipeline's shape on one stage (32 x 1024 tokens as 8 micro-batches of 4 sequences, 4
# segments of 256: the pipeline-gpt2 step of 2026-11-26 took 0.37 s for these tokens, against
# 0.26 s in 4 plain steps). Each table goes to the report, with the host's share.
profile_gpt2() {
  say "== profile-gpt2: where a GPT-2 124M bf16 step's time goes (CUDA events around every operation)"
  local name args
  for name in profile-gpt2 profile-gpt2-pipeline; do
    args=()
    [ "$name" = profile-gpt2-pipeline ] && args=(--batch 32 --micro-batches 8 --segments 4)
    step "$name" 90 --json "$BIN" gpu bench --preset gpt2 --precision bf16 --warmup 3 --steps 5 \
      --profile --profile-steps 3 "${args[@]}" || continue
    finding "$name" "$LOGS/$name.out" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
r = json.loads(lines[-1])
p = r["profile"]
for l in lines[:-1]:
    print(l)
top = ", ".join(f"{c['category']} {c['gpu_ms']:.2f} ms" for c in p["categories"][:5])
print(f"summary: unprofiled median {r['median_ms']:.2f} ms/step; profiled wall {p['wall_ms']:.2f} ms = gpu busy {p['gpu_busy_ms']:.2f} + host gap {p['host_gap_ms']:.2f} ({100 * p['host_gap_ms'] / max(p['wall_ms'], 1e-9):.0f}%); {p['launches']:.0f} launches/step; unknown {p['unknown_pct']:.1f}%; top: {top}")
PY
  done
}

# The two versions of the tensor-core attention kernels (SEQPIPE_ATTENTION=v1, and v2, the
# default) in the profile of a GPT-2 bf16 step, for the whole batch and the pipeline's shape (as
# profile-gpt2): the attention categories side by side, GPU ms per step, and the step medians.
attention_v2() {
  say "== attention-v2: attention kernels v1 against v2 in the profile of a GPT-2 124M bf16 step"
  local shape version args ran
  for shape in gpt2 pipeline; do
    args=()
    [ "$shape" = pipeline ] && args=(--batch 32 --micro-batches 8 --segments 4)
    ran=0
    for version in v1 v2; do
      step "attention-$version-$shape" 90 --json env SEQPIPE_ATTENTION=$version "$BIN" gpu bench \
        --preset gpt2 --precision bf16 --warmup 3 --steps 5 --profile --profile-steps 3 "${args[@]}" &&
        ran=$((ran + 1))
    done
    [ "$ran" -eq 2 ] || continue
    finding "attention-v2-$shape" "$LOGS/attention-v1-$shape.out" "$LOGS/attention-v2-$shape.out" "$shape" <<'PY'
import json, sys
def last_json(path):
    return json.loads([l for l in open(path).read().splitlines() if l.strip()][-1])
runs = [last_json(p) for p in sys.argv[1:3]]
cats = [{c["category"]: c["gpu_ms"] for c in r["profile"]["categories"]} for r in runs]
names = sorted({n for c in cats for n in c if n.startswith("attention")})
print(f"{sys.argv[3]} shape: {'category (GPU ms/step)':<26} {'v1':>8} {'v2':>8} {'v1/v2':>7}")
rows = [(n, cats[0].get(n, 0.0), cats[1].get(n, 0.0)) for n in names]
rows.append(("attention, all", sum(r[1] for r in rows), sum(r[2] for r in rows)))
for n, a, b in rows:
    print(f"{'':<{len(sys.argv[3]) + 7}} {n:<26} {a:>8.2f} {b:>8.2f} {a / b if b else float('nan'):>6.2f}x")
print(f"step median (unprofiled): v1 {runs[0]['median_ms']:.2f} ms, v2 {runs[1]['median_ms']:.2f} ms; profiled gpu busy: v1 {runs[0]['profile']['gpu_busy_ms']:.2f} ms, v2 {runs[1]['profile']['gpu_busy_ms']:.2f} ms")
PY
  done
}

# One round of training-step benchmarks of a preset, bf16: seqpipe (and, for gpt2 with
# operands=1, seqpipe with --bf16-operands), then PyTorch in each mode given.
bench_round() {
  local preset=$1 round=$2 operands=$3 mode
  shift 3
  step "bench-seqpipe-$preset-r$round" 150 --runs "$BIN" gpu bench --preset "$preset" --precision bf16 --steps "$STEPS"
  if [ "$operands" = 1 ]; then
    # The same step with every product's operands rounded into BF16 copies first.
    step "bench-seqpipe-bf16-operands-$preset-r$round" 150 --runs "$BIN" gpu bench --preset "$preset" \
      --precision bf16 --bf16-operands --steps "$STEPS"
  fi
  for mode in "$@"; do
    if [ -z "$TORCH" ]; then
      if [ $((deadline - SECONDS)) -lt "${MIN_STEP:-5}" ]; then
        not_run "torch-$mode-$preset-r$round"
        continue
      fi
      status_line FAILED "torch-$mode-$preset-r$round: PyTorch not importable (see the preflight)"
      failed_count=$((failed_count + 1))
      continue
    fi
    # torch.compile compiles for a minute or so in a fresh process.
    step "torch-$mode-$preset-r$round" 240 --runs python3 scripts/gpu-torch-bench.py --preset "$preset" \
      --precision bf16 --mode "$mode" --steps "$STEPS"
  done
}

# The benchmark rows of runs.jsonl, one line each.
bench_table() {
  finding bench-table "$runs" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'impl':<24} {'preset':<6} {'prec':<5} {'attention':<12} {'batch':>5} {'seq':>5} {'median ms':>10} {'tokens/s':>11} {'MFU':>7} {'mem MiB':>8}  loss first->last  every step (ms)")
for r in rows:
    steps = " ".join(f"{x:.1f}" for x in r["step_ms"])
    print(f"{r['impl']:<24} {r['preset']:<6} {r['precision']:<5} {r.get('attention', 'sdpa'):<12} {r['batch']:>5} {r['seq_len']:>5} {r['median_ms']:>10.2f} {r['tokens_per_s']:>11.0f} {100*r['mfu']:>6.1f}% {r['peak_mem_mib']:>8.0f}  {r['losses'][0]:.3f}->{r['losses'][-1]:.3f}  {steps}")
if not rows:
    print("NO BENCHMARK RUNS")
PY
}

bench_gpt2_eager() {
  say "== bench-gpt2-eager: GPT-2 124M training steps, bf16, seqpipe vs PyTorch eager (one round)"
  bench_round gpt2 1 0 eager
  bench_table
}

bench_gpt2() {
  say "== bench-gpt2: GPT-2 124M training steps, bf16: seqpipe (also with BF16 operands) vs PyTorch eager and torch.compile ($ROUNDS alternating rounds)"
  local round
  for round in $(seq "$ROUNDS"); do bench_round gpt2 "$round" 1 eager compile; done
  bench_table
}

bench_presets() {
  say "== bench-presets: presets ${PRESETS:-a b long}, bf16: seqpipe vs PyTorch eager and torch.compile ($ROUNDS rounds)"
  local preset round
  for preset in ${PRESETS:-a b long}; do
    for round in $(seq "$ROUNDS"); do bench_round "$preset" "$round" 0 eager compile; done
  done
  bench_table
}

link() {
  say "== link: NCCL between two ranks (bit-exact round trips, bandwidth, abort on a killed peer)"
  # Two ranks on the one GPU need NCCL >= 2.30 and this switch; older NCCL reports "skipped".
  step nccl-link 180 --json env NCCL_MULTI_RANK_GPU_ENABLE=1 "$BIN" gpu link || return 0
  finding nccl-link "$LOGS/nccl-link.out" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
if "skipped" in r:
    print("skipped:", r["skipped"])
else:
    rt = sorted(r["round_trip_ms"])
    print(f"NCCL {r['nccl']} on {r['gpu']} devices {r['devices']}: {r['mib']:.1f} MiB per transfer, round trip median {rt[len(rt) // 2]:.3f} ms = {r['nccl_gb_per_s']:.1f} GB/s; host copies (d2h + h2d) {r['host_copies_gb_per_s']:.1f} GB/s; bit-exact {r['bit_exact']}")
    print(f"killed peer: abort tripped after {r['abort_tripped_after_s']:.0f} s, the receive ended after {r['abort_s']:.2f} s with: {r['abort_error']}; GPU usable after: {r['usable_after_abort']}")
PY
  if grep -q '"skipped"' "$LOGS/nccl-link.out"; then
    status_line "NOT RUN" "pipeline over NCCL device links (two ranks on one GPU need NCCL >= 2.30; the link check said skipped)"
    not_run_count=$((not_run_count + 1))
    return 0
  fi
  say "-- the pipeline over NCCL device links (pipeline.transport=nccl; boundary tensors stay on the"
  say "   GPU, headers over TCP) against host-staged links, 3 stages, fp32, 12 steps (bit-identical):"
  T="$WORK/nccl"
  rm -rf "$T"; mkdir -p "$T"
  local job=(--set train.eval_every=0 --set train.decay_steps=12 --set checkpoint.every=6
    --set model.device=cuda --set model.precision=fp32 --set pipeline.stages=3)
  export NCCL_MULTI_RANK_GPU_ENABLE=1
  train_job tcp3 150 "${job[@]}" --set train.steps=12
  train_job nccl3 150 "${job[@]}" --set train.steps=12 --set pipeline.transport=nccl
  compare losses-nccl3 losses "$T/tcp3" "$T/nccl3"
  compare state-nccl3 state "$T/tcp3/checkpoints" "$T/nccl3/checkpoints"
  finding nccl-times "$T/tcp3/metrics.jsonl" "$T/nccl3/metrics.jsonl" <<'PY'
import json, sys
for path, name in zip(sys.argv[1:], ("tcp", "nccl")):
    times = sorted(json.loads(l)["step_time_s"] for l in open(path) if '"loss"' in l and '"event"' not in l)[2:]
    print(f"{name}: median step {1e3 * times[len(times) // 2]:.1f} ms over steps 3..12")
PY
  say "-- chaos over NCCL device links: SIGKILL of stage 1's worker after step 4 (replaced mid-step, the"
  say "   neighbours join new device links and resend from their kept buffers; bit-identical):"
  chaos_job nccl-chaos 4 150 "${job[@]}" --set train.steps=12 --set pipeline.transport=nccl
  compare losses-nccl-chaos losses "$T/tcp3" "$T/nccl-chaos"
  compare state-nccl-chaos state "$T/tcp3/checkpoints" "$T/nccl-chaos/checkpoints"
  unset NCCL_MULTI_RANK_GPU_ENABLE
}

# $OUT/logs.tar.gz: every step's output and the pipeline runs' logs and metrics (not their
# checkpoints or gradient dumps), each file cut to its head and tail past a cap, the archive kept
# under 16 MiB (the device hands back at most 16 MiB a file).
archive_logs() {
  local stage="$WORK/archive" cap
  for cap in 2097152 262144 32768; do
    rm -rf "$stage"; mkdir -p "$stage/logs"
    (
      cd "$WORK" || exit 1
      find logs train train-gpt2 nccl -type f \( -path 'logs/*' -o -name '*.log' -o -name '*.jsonl' \
        -o -name '*.out' -o -name '*.err' -o -name '*.toml' \) 2>/dev/null
    ) | while read -r f; do
      local dest="$stage/logs/${f#logs/}"
      mkdir -p "$(dirname "$dest")"
      local size
      size=$(stat -c %s "$WORK/$f" 2>/dev/null || echo 0)
      if [ "$size" -gt "$cap" ]; then
        { head -c $((cap / 4)) "$WORK/$f"
          printf '\n[... %s bytes cut by gpu-check.sh ...]\n' "$((size - cap))"
          tail -c $((cap * 3 / 4)) "$WORK/$f"; } > "$dest"
      else
        cp "$WORK/$f" "$dest"
      fi
    done
    tar -czf "$OUT/logs.tar.gz" -C "$stage" logs 2>/dev/null
    [ "$(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 0)" -le 16000000 ] && break
  done
  if [ "$(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 99999999)" -gt 16000000 ]; then
    rm -f "$OUT/logs.tar.gz"
    say "logs.tar.gz: FAILED to fit the logs in 16 MiB even cut to 32 KiB each; they stay in $WORK/logs"
  fi
}

# The parts of each pass, in order (their estimated times are in the header).
PASS1="preflight kernels grads-fp32 determinism pipeline bench-gpt2-eager"
PASS2="preflight gemm profile-gpt2 attention-v2 grads-bf16 bench-gpt2 pipeline-gpt2"
PASS3="preflight bench-presets link"

run() {
  PASS=${PASS:-1}
  local parts
  case $PASS in
    1) parts=$PASS1; ROUNDS=${ROUNDS:-2} ;;
    2) parts=$PASS2; ROUNDS=${ROUNDS:-2} ;;
    3) parts=$PASS3; ROUNDS=${ROUNDS:-1} ;;
    *) echo "PASS must be 1, 2 or 3" >&2; exit 2 ;;
  esac
  parts=${SECTIONS:-$parts}
  OUT=${OUT:-$PWD/gpu-out}
  STEPS=${STEPS:-10}
  BUDGET=${BUDGET:-540}
  # The last seconds of the budget are kept for `timeout -k`'s grace and the log archive.
  deadline=$((SECONDS + BUDGET - 25))
  ok_count=0 failed_count=0 timed_out_count=0 not_run_count=0
  mkdir -p "$OUT" || exit 2
  WORK=${WORK:-$(mktemp -d /tmp/seqpipe-gpu-check.XXXXXX)}
  LOGS="$WORK/logs"
  mkdir -p "$LOGS" || exit 2
  report="$OUT/report.txt" runs="$OUT/runs.jsonl"
  : > "$report"; : > "$runs"; rm -f "$OUT/logs.tar.gz"
  trap 'say "INTERRUPTED by a signal after $SECONDS s: the steps after this line did not run"; archive_logs; exit 143' TERM INT
  say "seqpipe gpu-check, pass $PASS: $parts (budget $BUDGET s; started $(date -u +%FT%TZ); work dir $WORK)"
  local libs
  libs=$(cuda_libs)
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The kernel cache starts with what `pack` compiled (cubins and PTX); the driver's JIT cache
  # lives as long as the command, so PTX is compiled once per command, not once per process.
  export SEQPIPE_CACHE="${SEQPIPE_CACHE:-$WORK/seqpipe-cache}" PYTHONUNBUFFERED=1
  export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$WORK/cuda-jit-cache}" CUDA_CACHE_MAXSIZE=4294967296
  mkdir -p "$SEQPIPE_CACHE"
  [ -d .gpu-bin/cache ] && cp -rn .gpu-bin/cache/. "$SEQPIPE_CACHE/" 2>/dev/null
  SANITIZER=$(find_sanitizer)
  TORCH=""
  local part
  for part in $parts; do
    case $part in
      preflight) preflight ;;
      kernels) kernels ;;
      grads-fp32) gradients "fp32 a" "fp32 b" "fp32 long" "fp32 gpt2 --batch 1" ;;
      grads-bf16) gradients "bf16 a" "bf16 gpt2 --batch 1" ;;
      determinism) determinism ;;
      pipeline) pipeline ;;
      pipeline-gpt2) pipeline_gpt2 ;;
      gemm) gemm ;;
      profile-gpt2) profile_gpt2 ;;
      attention-v2) attention_v2 ;;
      bench-gpt2-eager) bench_gpt2_eager ;;
      bench-gpt2) bench_gpt2 ;;
      bench-presets) bench_presets ;;
      link) link ;;
      *) status_line FAILED "$part: no such part (parts: $PASS1 $PASS2 $PASS3)"; failed_count=$((failed_count + 1)) ;;
    esac
  done
  archive_logs
  say "== pass $PASS done in $SECONDS s: $ok_count ok, $failed_count FAILED, $timed_out_count TIMED OUT, $not_run_count NOT RUN; in \$OUT: report.txt, runs.jsonl ($(wc -l < "$runs") runs), logs.tar.gz ($(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 0) bytes)"
  [ "$failed_count" -eq 0 ] && [ "$timed_out_count" -eq 0 ] && [ "$not_run_count" -eq 0 ]
}

case "${1:-}" in
  pack) set -euo pipefail; pack ;;
  run) run ;;
  *) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
