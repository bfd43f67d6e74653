#!/usr/bin/env python3
"""seqpipe's training step against PyTorch eager on the same CPU threads, in one run.

For each preset: runs `seqpipe bench step --preset P --dump DIR --json` (whole model in one process),
then trains the identical GPT in PyTorch eager from the weights and batch it dumped (same threads,
same optimizer settings and number of steps) and prints both median step times, their ratio, both
peak resident memories, and how far the first step's gradients and the final weights differ.
With --rounds R the two alternate R times and the best median of each is kept (the machine is
shared: the best round is the one least disturbed by other work).

Usage: scripts/bench-vs-torch.py [--preset a b long] [--steps N] [--threads T] [--rounds R] [--bin PATH]
(scripts/bench-vs-torch.sh makes the virtual environment and builds the binary first.)
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def vm_kb(field):
    """A `Vm*` field of /proc/self/status, in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class Gpt(torch.nn.Module):
    """seqpipe's GPT-2 style model (learned positions, pre-LayerNorm, tanh GELU, untied head),
    with parameters named exactly as seqpipe names them."""

    def __init__(self, cfg, tensors):
        super().__init__()
        self.cfg = cfg
        self.names = sorted(tensors)
        self.params = torch.nn.ParameterList(
            [torch.nn.Parameter(tensors[n].clone()) for n in self.names]
        )
        self.by_name = dict(zip(self.names, self.params))

    def p(self, name):
        return self.by_name[name]

    def linear(self, x, prefix, bias=True):
        return F.linear(x, self.p(prefix + ".weight"), self.p(prefix + ".bias") if bias else None)

    def norm(self, x, prefix):
        c = self.cfg["d_model"]
        return F.layer_norm(
            x, (c,), self.p(prefix + ".weight"), self.p(prefix + ".bias"), self.cfg["norm_eps"]
        )

    def forward(self, idx, targets):
        cfg = self.cfg
        b, t = idx.shape
        c, h = cfg["d_model"], cfg["heads"]
        x = self.p("wte.weight")[idx] + self.p("wpe.weight")[:t]  # (B, T, C)
        for i in range(cfg["layers"]):
            pre = f"h.{i}"
            qkv = self.linear(self.norm(x, pre + ".ln_1"), pre + ".attn.c_attn")  # (B, T, 3C)
            q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in qkv.split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
            y = y.transpose(1, 2).contiguous().view(b, t, c)
            x = x + self.linear(y, pre + ".attn.c_proj")
            f = F.gelu(self.linear(self.norm(x, pre + ".ln_2"), pre + ".mlp.c_fc"), approximate="tanh")
            x = x + self.linear(f, pre + ".mlp.c_proj")
        logits = self.linear(self.norm(x, "ln_f"), "lm_head", bias=False)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def run_ours(binary, preset, steps, threads, out_dir):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), CANDLE_NUM_THREADS=str(threads))
    cmd = [binary, "bench", "step", "--preset", preset, "--steps", str(steps),
           "--threads", str(threads), "--dump", out_dir, "--json"]
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_torch_process(threads, out_dir):
    """`run_torch` in a fresh Python process, so that its peak memory is its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(threads), "--torch-run", out_dir]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_torch(out_dir):
    with open(os.path.join(out_dir, "run.json")) as f:
        run = json.load(f)
    cfg = run["model"]
    init = load_file(os.path.join(out_dir, "init.safetensors"))
    batch = load_file(os.path.join(out_dir, "batch.safetensors"))
    ref_grads = load_file(os.path.join(out_dir, "grads.safetensors"))
    ref_final = load_file(os.path.join(out_dir, "final.safetensors"))
    model = Gpt(cfg, init)
    decayed = set(run["decayed"])
    beta1, beta2, eps = run["adamw"]
    groups = [
        {"params": [model.p(n) for n in model.names if n in decayed], "weight_decay": run["weight_decay"]},
        {"params": [model.p(n) for n in model.names if n not in decayed], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=run["lr"], betas=(beta1, beta2), eps=eps)
    idx, targets = batch["inputs"], batch["targets"]
    rss_before_kb = vm_kb("VmRSS")
    times, losses, grad_err = [], [], None
    for step in range(run["steps"] + 1):
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx, targets)
        loss.backward()
        if step == 0:
            grad_err = max_rel_diff({n: model.p(n).grad for n in model.names}, ref_grads)
        torch.nn.utils.clip_grad_norm_(model.parameters(), run["grad_clip"])
        opt.step()
        elapsed = time.perf_counter() - started
        losses.append(loss.item())
        if step > 0:
            times.append(elapsed * 1e3)
    weight_err = max_rel_diff({n: model.p(n).detach() for n in model.names}, ref_final)
    return {
        "median_ms": statistics.median(times),
        "peak_rss_mb": vm_kb("VmHWM") / 1024,
        "rss_before_mb": rss_before_kb / 1024,
        "losses": losses,
        "grad_err": grad_err,
        "weight_err": weight_err,
    }


def max_rel_diff(ours, ref):
    """Largest |a - b| over all tensors, relative to the largest |b| of the same tensor; and its name."""
    worst = (0.0, None)
    for name, b in ref.items():
        a = ours[name].float()
        scale = b.abs().max().item() or 1.0
        err = (a - b).abs().max().item() / scale
        if err > worst[0] or worst[1] is None:
            worst = (err, name)
    return worst


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=["a", "b", "long"], choices=["a", "b", "long"])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="alternate ours/torch this many times")
    ap.add_argument("--bin", default=os.path.join(root, "target", "release", "seqpipe"))
    ap.add_argument("--torch-run", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.torch_run:
        print(json.dumps(run_torch(args.torch_run)))
        return
    print(f"torch {torch.__version__}, {args.threads} threads, {args.steps} timed steps, "
          f"best of {args.rounds} rounds")
    header = ("preset", "ours ms", "torch ms", "ours/torch", "ours MiB", "torch MiB (after import)",
              "grad rel err", "final weight rel err", "loss ours/torch")
    print(" | ".join(header))
    for preset in args.preset:
        ours, theirs = None, None
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="seqpipe-vs-torch-") as out_dir:
                o = run_ours(args.bin, preset, args.steps, args.threads, out_dir)
                t = run_torch_process(args.threads, out_dir)
            ours = o if ours is None or o["median_ms"] < ours["median_ms"] else ours
            theirs = t if theirs is None or t["median_ms"] < theirs["median_ms"] else theirs
        ratio = ours["median_ms"] / theirs["median_ms"]
        print(" | ".join([
            preset,
            f"{ours['median_ms']:.1f}",
            f"{theirs['median_ms']:.1f}",
            f"{ratio:.2f}x",
            f"{ours['peak_rss_mb']:.0f}",
            f"{theirs['peak_rss_mb']:.0f} ({theirs['rss_before_mb']:.0f})",
            f"{theirs['grad_err'][0]:.1e} ({theirs['grad_err'][1]})",
            f"{theirs['weight_err'][0]:.1e} ({theirs['weight_err'][1]})",
            f"{ours['losses'][-1]:.4f}/{theirs['losses'][-1]:.4f}",
        ]), flush=True)
        if not math.isfinite(theirs["grad_err"][0]) or theirs["grad_err"][0] > 1e-3:
            print(f"  gradients of {preset} disagree", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
