#!/usr/bin/env bash
# One-off diagnosis of the GPT-2 pipeline job's step time on the GPU (not committed).
BIN=.gpu-bin/seqpipe
WORK=$(mktemp -d /tmp/diag.XXXX)
libs=$(python3 - <<'PY'
import glob, os
import nvidia
seen=[]
for root in nvidia.__path__:
    for lib in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True):
        d=os.path.dirname(lib)
        if d not in seen: seen.append(d)
print(":".join(seen))
PY
)
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SEQPIPE_CACHE=$WORK/cache CUDA_CACHE_PATH=$WORK/jit
mkdir -p $SEQPIPE_CACHE; cp -rn .gpu-bin/cache/. $SEQPIPE_CACHE/
which nsys ncu 2>&1; ls /usr/local/cuda/bin | tr '\n' ' '; echo; nproc
G="--set model.device=cuda --set model.precision=bf16 --set model.vocab_size=50257 --set model.layers=12 --set model.d_model=768 --set model.heads=12 --set model.max_seq_len=1024 --set train.seq_len=1024 --set train.micro_batch_size=4 --set pipeline.microbatches=8 --set train.steps=8 --set train.warmup_steps=5 --set train.eval_every=0 --set checkpoint.every=0"
job() { local name=$1; shift; local t0=$SECONDS
  timeout 90 $BIN train -q --set run.dir=$WORK/$name $G "$@" --trace $OUT/$name.trace.json > $OUT/$name.out 2>&1
  echo "== $name rc=$? $((SECONDS-t0)) s: $(grep '^done:' $OUT/$name.out)"
  python3 - $WORK/$name/metrics.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if 'loss' in r and 'event' not in r:
        print(f"step {r['step']}: step {r['step_time_s']:.3f} s compute {r['compute_s']:.3f} cpu {r['compute_cpu_s']:.3f} sys {r['cpu_system_s']:.2f} faults {r['page_faults']} loss {r['loss']:.3f} gn {r['grad_norm']:.3f}")
PY
  cp $WORK/$name/logs/stage-0.log $OUT/$name.stage0.log 2>/dev/null; }
job p2-snap --set pipeline.stages=2
job p2-nosnap --set pipeline.stages=2 --set elastic.peer_snapshots=false
job p1-nosnap --set pipeline.stages=1 --set elastic.peer_snapshots=false
job p2-nosnap-k1 --set pipeline.stages=2 --set elastic.peer_snapshots=false --set pipeline.splits=1
for b in 4 8; do timeout 60 $BIN gpu bench --preset gpt2 --precision bf16 --batch $b --steps 5 2>/dev/null | tail -1 | cut -c1-400; done
