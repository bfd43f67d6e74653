#!/usr/bin/env python3
"""seqpipe's training step against idiomatic PyTorch (eager and torch.compile) on the same CPU threads.

The peer is the model a PyTorch user would write (nanoGPT style): an `nn.Module` with `nn.Embedding`
for tokens and positions, blocks of `nn.LayerNorm` / `nn.Linear` (qkv, proj, fc, proj),
`F.scaled_dot_product_attention(is_causal=True)`, tanh GELU, an untied `nn.Linear` head and
`F.cross_entropy`; `torch.optim.AdamW` with PyTorch's default implementation choice and
`torch.nn.utils.clip_grad_norm_`.

For each preset and each round: runs `seqpipe bench step --preset P --dump DIR --json` (whole model
in one process, one warm-up step then --steps timed steps), then, each in a fresh Python process (so
that peak RSS is its own), trains the identical model in PyTorch eager and in `torch.compile(model)`
(inductor; compiled by one forward+backward before the loop, so compile time is not timed) from the
weights and batch seqpipe dumped, with the same AdamW settings, clipping, threads and number of steps.
Rounds alternate seqpipe, eager, compile, seqpipe, eager, compile, ... Every round's median step
time of each side is printed, then the median over rounds and the ratios seqpipe/eager and
seqpipe/compile (< 1: seqpipe is faster), peak RSS of each side, and how far the first step's
gradients (per tensor) and the final weights differ from seqpipe's.

Usage: scripts/bench-vs-torch.py [--preset a b long] [--steps N] [--threads T] [--rounds R]
                                 [--modes eager compile] [--bin PATH]
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
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

GRAD_TOLERANCE = 1e-5  # first-step gradients: max |ours - seqpipe| / max |seqpipe| per tensor


def vm_kb(field):
    """A `Vm*` field of /proc/self/status, in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# ---------------------------------------------------------------------------------------------
# The idiomatic model (nanoGPT's layout and names).


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Mlp(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.c_fc = nn.Linear(d, hidden)
        self.c_proj = nn.Linear(hidden, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, heads, hidden, eps):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = Mlp(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """GPT-2 style: learned positions, pre-LayerNorm, tanh GELU, untied head."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["vocab_size"], d),
            wpe=nn.Embedding(cfg["max_seq_len"], d),
            h=nn.ModuleList(
                Block(d, cfg["heads"], cfg["ffn_mult"] * d, cfg["norm_eps"]) for _ in range(cfg["layers"])
            ),
            ln_f=nn.LayerNorm(d, eps=cfg["norm_eps"]),
        ))
        self.lm_head = nn.Linear(d, cfg["vocab_size"], bias=False)

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def torch_name(seqpipe_name):
    """seqpipe's tensor name -> the module's parameter name. seqpipe stores linear weights as
    (out, in) and embeddings as (rows, d), nn.Linear's and nn.Embedding's layouts: no transposes."""
    return seqpipe_name if seqpipe_name.startswith("lm_head.") else "transformer." + seqpipe_name


# ---------------------------------------------------------------------------------------------
# The two sides.


def run_seqpipe(binary, preset, steps, threads, out_dir):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), CANDLE_NUM_THREADS=str(threads))
    cmd = [binary, "bench", "step", "--preset", preset, "--steps", str(steps),
           "--threads", str(threads), "--dump", out_dir, "--json"]
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_torch_process(mode, threads, out_dir):
    """`run_torch` in a fresh Python process, so that its peak memory is its own."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(threads),
           "--torch-run", out_dir, "--torch-mode", mode]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"PyTorch {mode} run failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_torch(out_dir, mode):
    with open(os.path.join(out_dir, "run.json")) as f:
        run = json.load(f)
    cfg = run["model"]
    assert cfg["position"] == "learned" and cfg["norm"] == "layernorm", cfg
    init = load_file(os.path.join(out_dir, "init.safetensors"))
    batch = load_file(os.path.join(out_dir, "batch.safetensors"))
    ref_grads = load_file(os.path.join(out_dir, "grads.safetensors"))
    ref_final = load_file(os.path.join(out_dir, "final.safetensors"))

    model = Gpt(cfg)
    model.load_state_dict({torch_name(n): w for n, w in init.items()}, strict=True)
    params = dict(model.named_parameters())
    decayed = {torch_name(n) for n in run["decayed"]}
    beta1, beta2, eps = run["adamw"]
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in params.items() if n in decayed], "weight_decay": run["weight_decay"]},
            {"params": [p for n, p in params.items() if n not in decayed], "weight_decay": 0.0},
        ],
        lr=run["lr"], betas=(beta1, beta2), eps=eps,
    )
    idx, targets = batch["inputs"], batch["targets"]
    step_fn = model
    compile_s = None
    rss_before_kb = vm_kb("VmRSS")
    if mode == "compile":
        step_fn = torch.compile(model)
        started = time.perf_counter()
        step_fn(idx, targets).backward()  # compiles forward and backward; weights untouched
        model.zero_grad(set_to_none=True)
        compile_s = time.perf_counter() - started

    times, losses, grad_err = [], [], None
    for step in range(run["steps"] + 1):  # one untimed warm-up step, as seqpipe
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = step_fn(idx, targets)
        loss.backward()
        if step == 0:  # untimed warm-up step
            grad_err = rel_diffs({n: params[torch_name(n)].grad for n in ref_grads}, ref_grads)
        torch.nn.utils.clip_grad_norm_(model.parameters(), run["grad_clip"])
        opt.step()
        elapsed = time.perf_counter() - started
        losses.append(loss.item())
        if step > 0:
            times.append(elapsed * 1e3)
    weight_err = rel_diffs({n: params[torch_name(n)].detach() for n in ref_final}, ref_final)
    return {
        "mode": mode,
        "step_ms": times,
        "median_ms": statistics.median(times),
        "peak_rss_mb": vm_kb("VmHWM") / 1024,
        "rss_before_mb": rss_before_kb / 1024,
        "compile_s": compile_s,
        "losses": losses,
        "grad_err": grad_err,
        "weight_err": weight_err,
        "adamw_impl": adamw_impl(opt),
    }


def adamw_impl(opt):
    """Which AdamW implementation PyTorch's defaults picked (fused, foreach or the for-loop)."""
    d = opt.defaults
    if d.get("fused"):
        return "fused"
    if d.get("foreach"):
        return "foreach"
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
        params = [p for g in opt.param_groups for p in g["params"]]
        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
        return "fused" if fused else "foreach" if foreach else "for-loop"
    except Exception:  # private helper: best effort only
        return "default"


def rel_diffs(ours, ref):
    """Per tensor: max |a - b| / max |b|."""
    out = {}
    for name, b in ref.items():
        a = ours[name].float()
        scale = b.abs().max().item() or 1.0
        out[name] = (a - b).abs().max().item() / scale
    return out


def worst(errs):
    name = max(errs, key=lambda n: errs[n] if math.isfinite(errs[n]) else math.inf)
    return errs[name], name


# ---------------------------------------------------------------------------------------------


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=["a", "b", "long"], choices=["a", "b", "long"])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternate seqpipe, eager, compile this many times")
    ap.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=["eager", "compile"],
                    help="PyTorch modes to compare against")
    ap.add_argument("--bin", default=os.path.join(root, "target", "release", "seqpipe"))
    ap.add_argument("--torch-run", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--torch-mode", default="eager", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.torch_run:
        print(json.dumps(run_torch(args.torch_run, args.torch_mode)))
        return

    print(f"torch {torch.__version__}, {args.threads} threads, {args.steps} timed steps after 1 "
          f"warm-up, {args.rounds} alternating rounds ({', '.join(['seqpipe'] + args.modes)})",
          flush=True)
    failed = False
    for preset in args.preset:
        sides = ["seqpipe"] + args.modes
        results = {s: [] for s in sides}
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="seqpipe-vs-torch-") as out_dir:
                results["seqpipe"].append(run_seqpipe(args.bin, preset, args.steps, args.threads, out_dir))
                for mode in list(args.modes):
                    try:
                        results[mode].append(run_torch_process(mode, args.threads, out_dir))
                    except RuntimeError as e:
                        print(f"preset {preset} round {r + 1}: {e}", file=sys.stderr, flush=True)
                        print(f"  -> dropping PyTorch {mode} mode", flush=True)
                        args.modes.remove(mode)
                        del results[mode]
                        sides.remove(mode)
            line = [f"preset {preset} round {r + 1}:"]
            for s in sides:
                x = results[s][-1]
                extra = ""
                if s != "seqpipe":
                    extra = f", grad err {worst(x['grad_err'])[0]:.1e}"
                    if x["compile_s"] is not None:
                        extra += f", compile {x['compile_s']:.0f} s"
                steps = "/".join(f"{t:.0f}" for t in x["step_ms"])
                line.append(f"  {s:8s} median {x['median_ms']:8.1f} ms (steps {steps}), "
                            f"peak RSS {x['peak_rss_mb']:.0f} MiB{extra}")
            print("\n".join(line), flush=True)

        med = {s: statistics.median(x["median_ms"] for x in results[s]) for s in sides}
        print(f"preset {preset}, median over {args.rounds} rounds of each round's median step time:")
        for s in sides:
            rss = [x["peak_rss_mb"] for x in results[s]]
            note = ""
            if s != "seqpipe":
                before = statistics.median(x["rss_before_mb"] for x in results[s])
                note = f" ({before:.0f} MiB of it before the model was built: import torch)"
            per_round = " / ".join(f"{x['median_ms']:.1f}" for x in results[s])
            print(f"  {s:8s} {med[s]:8.1f} ms  (rounds: {per_round}), peak RSS "
                  f"{min(rss):.0f}-{max(rss):.0f} MiB{note}")
        for s in sides[1:]:
            print(f"  seqpipe/{s} = {med['seqpipe'] / med[s]:.2f}x  (< 1: seqpipe faster)")
        for s in sides[1:]:
            x = results[s][0]
            print(f"  {s}: AdamW {x['adamw_impl']}; first-step gradient max relative difference per "
                  f"tensor (round 1):")
            errs = x["grad_err"]
            for n in sorted(errs):
                print(f"    {n:28s} {errs[n]:.2e}")
            w = worst(x["weight_err"])
            print(f"    worst {worst(errs)[0]:.2e} ({worst(errs)[1]}); final weights worst "
                  f"{w[0]:.1e} ({w[1]}); loss seqpipe/{s} after {len(x['losses'])} steps "
                  f"{results['seqpipe'][0]['losses'][-1]:.5f}/{x['losses'][-1]:.5f}")
            all_worst = max(worst(y["grad_err"])[0] for y in results[s])
            if not math.isfinite(all_worst) or all_worst > GRAD_TOLERANCE:
                print(f"  gradients of {preset} ({s}) disagree: {all_worst:.2e} > {GRAD_TOLERANCE:.0e}",
                      file=sys.stderr, flush=True)
                failed = True
        print(flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
