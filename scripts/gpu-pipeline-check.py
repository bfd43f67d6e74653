#!/usr/bin/env python3
"""Compares seqpipe runs for scripts/gpu-check.sh (plain Python 3: no packages needed).

  losses RUN_A RUN_B [--rel TOL]   per-step training losses of two runs' metrics.jsonl: identical
                                   bit for bit (TOL 0, the default) or within a relative TOL
  grads DIR_A DIR_B [--step N]     `--dump-grads` files of two runs (any stage counts): worst
                                   relative L2 difference per tensor, over every tensor
  state URL_A URL_B                the newest committed checkpoints of two runs (any stage counts):
                                   every tensor (weights and AdamW moments) identical bit for bit

Each prints one line and exits 1 when the comparison fails.
"""
import argparse
import glob
import json
import math
import os
import struct
import sys


def read_safetensors(path):
    """name -> (dtype, shape, raw bytes) of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = (meta["dtype"], tuple(meta["shape"]), data[a:b])
    return out


def losses(run):
    rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "event" not in r}


def cmd_losses(a, b, rel):
    la, lb = losses(a), losses(b)
    if sorted(la) != sorted(lb) or not la:
        print(f"LOSSES DIFFER: steps {sorted(la)} vs {sorted(lb)}")
        return 1
    worst = max(abs(la[s] - lb[s]) / max(abs(la[s]), 1e-30) for s in la)
    ok = worst <= rel if rel > 0 else all(la[s] == lb[s] for s in la)
    first, last = min(la), max(la)
    verdict = "identical" if worst == 0 else f"worst relative difference {worst:.2e}"
    print(
        f"{'' if ok else 'LOSSES DIFFER: '}{len(la)} steps, {verdict}; "
        f"loss {la[first]:.4f} -> {la[last]:.4f} vs {lb[first]:.4f} -> {lb[last]:.4f}"
    )
    return 0 if ok else 1


def floats(raw):
    return struct.unpack(f"<{len(raw) // 4}f", raw)


def gathered(pattern):
    out = {}
    for path in sorted(glob.glob(pattern)):
        out.update(read_safetensors(path))
    return out


def cmd_grads(a, b, step, bound):
    ga = gathered(os.path.join(a, f"step-{step}-stage-*.safetensors"))
    gb = gathered(os.path.join(b, f"step-{step}-stage-*.safetensors"))
    if not ga or sorted(ga) != sorted(gb):
        print(f"GRADIENT SETS DIFFER: {len(ga)} vs {len(gb)} tensors")
        return 1
    worst, worst_name = 0.0, ""
    for name in ga:
        x, y = floats(ga[name][2]), floats(gb[name][2])
        num = math.sqrt(sum((p - q) ** 2 for p, q in zip(x, y)))
        den = math.sqrt(sum(q * q for q in y)) or 1.0
        if num / den > worst:
            worst, worst_name = num / den, name
    ok = worst <= bound
    print(
        f"{'' if ok else 'GRADIENTS DIFFER: '}step {step}, {len(ga)} tensors, worst relative L2 "
        f"{worst:.2e} ({worst_name}), bound {bound:.0e}"
    )
    return 0 if ok else 1


def newest_state(url):
    steps = sorted(glob.glob(os.path.join(url, "step-*")))
    for step_dir in reversed(steps):
        if os.path.exists(os.path.join(step_dir, "manifest.json")):
            return os.path.basename(step_dir), gathered(os.path.join(step_dir, "*.safetensors"))
    return None, {}


def cmd_state(a, b):
    sa, ta = newest_state(a)
    sb, tb = newest_state(b)
    if sa is None or sa != sb or sorted(ta) != sorted(tb):
        print(f"STATES DIFFER: {sa} ({len(ta)} tensors) vs {sb} ({len(tb)} tensors)")
        return 1
    differ = [n for n in ta if ta[n] != tb[n]]
    if differ:
        print(f"STATES DIFFER at {sa}: {len(differ)} of {len(ta)} tensors, e.g. {differ[0]}")
        return 1
    print(f"{sa}: all {len(ta)} tensors (weights and AdamW moments) bit-identical")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("losses")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--rel", type=float, default=0.0)
    s = sub.add_parser("grads")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--step", type=int, default=1)
    s.add_argument("--bound", type=float, default=1e-4)
    s = sub.add_parser("state")
    s.add_argument("a")
    s.add_argument("b")
    args = p.parse_args()
    if args.cmd == "losses":
        return cmd_losses(args.a, args.b, args.rel)
    if args.cmd == "grads":
        return cmd_grads(args.a, args.b, args.step, args.bound)
    return cmd_state(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
