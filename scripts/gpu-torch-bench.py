#!/usr/bin/env python3
"""Idiomatic PyTorch peer for seqpipe's CUDA training step.

Trains the same GPT-2 style model seqpipe uses (learned positions, pre-LayerNorm blocks, tanh GELU,
untied lm_head, fused AdamW with gradient clipping) on one fixed random batch, the way a PyTorch
user would write it, times every step with CUDA events and prints one JSON line on stdout (median
step time, tokens/s, MFU, peak memory, every loss); everything else goes to stderr.
scripts/gpu-check.sh calls it, alternating it with `seqpipe gpu bench` in one run.

Usage: scripts/gpu-torch-bench.py --preset a|b|long|gpt2 --precision fp32|tf32|bf16
       --mode eager|compile [--steps 10] [--warmup 3] [--seed 1] [--batch N]
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:  # gpu-check.sh reports this line as the step's failure
    sys.exit(f"gpu-torch-bench: PyTorch not importable ({e}): run it where torch with CUDA is installed")

# name: (vocab V, d_model C, layers L, heads H, seq T, batch B)
PRESETS = {
    "a": (4096, 256, 4, 4, 256, 8),
    "b": (8192, 512, 6, 8, 512, 4),
    "long": (4096, 128, 2, 2, 4096, 1),
    "gpt2": (50257, 768, 12, 12, 1024, 8),
}
# Dense peak FLOP/s of an H100/H200 SXM.
PEAK_FLOPS = {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.attn = Attention(c, heads)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, c, layers, heads, t_max):
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(t_max, c)
        self.h = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c, eps=1e-5)
        self.lm_head = nn.Linear(c, vocab, bias=False)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj") else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, default="a")
    p.add_argument("--precision", choices=PEAK_FLOPS, default="bf16")
    p.add_argument("--mode", choices=("eager", "compile"), default="eager")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch", type=int, default=None)
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0:
        sys.exit("gpu-torch-bench: --steps must be >= 1 and --warmup >= 0")
    if not torch.cuda.is_available():
        print("gpu-torch-bench: CUDA is not available", file=sys.stderr)
        sys.exit(1)

    # Keep stdout for the one JSON line: anything else (Inductor, Triton, C++ warnings) goes to stderr.
    json_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)

    vocab, c, layers, heads, seq, batch = PRESETS[args.preset]
    batch = args.batch or batch
    tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if args.precision == "bf16" \
        else contextlib.nullcontext
    gpu = torch.cuda.get_device_name()
    print(f"gpu-torch-bench: {gpu}, torch {torch.__version__}, preset {args.preset}, "
          f"{args.precision}, {args.mode}, batch {batch}", file=sys.stderr)

    torch.manual_seed(args.seed)
    model = GPT(vocab, c, layers, heads, seq).to("cuda")
    params = sum(q.numel() for q in model.parameters())
    decay, no_decay = [], []
    for name, q in model.named_parameters():
        (decay if q.dim() >= 2 and not name.startswith(("wte.", "wpe.")) else no_decay).append(q)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    all_params = decay + no_decay
    if args.mode == "compile":
        model = torch.compile(model)

    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, vocab, (batch, seq), generator=gen).to("cuda")
    y = torch.randint(0, vocab, (batch, seq), generator=gen).to("cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(all_params, 1.0)
        opt.step()
        return loss.detach()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses, step_ms = [], []
    for i in range(args.warmup + args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        losses.append(loss.item())
        if i >= args.warmup:
            step_ms.append(ms)
        print(f"step {i}{' (warm-up)' if i < args.warmup else ''}: {ms:.3f} ms, "
              f"loss {losses[-1]:.4f}", file=sys.stderr)
    peak_mem_mib = torch.cuda.max_memory_allocated() / 2**20

    median_ms = statistics.median(step_ms)
    flops_per_token = 6 * params + 12 * layers * c * seq
    tokens_per_s = batch * seq / (median_ms / 1e3)
    mfu = flops_per_token * tokens_per_s / PEAK_FLOPS[args.precision]
    print(f"median {median_ms:.3f} ms, {tokens_per_s:.0f} tokens/s, MFU {100 * mfu:.1f}%, "
          f"peak {peak_mem_mib:.0f} MiB", file=sys.stderr)
    result = {
        "impl": f"torch-{args.mode}", "torch": torch.__version__, "gpu": gpu,
        "preset": args.preset, "precision": args.precision, "batch": batch, "seq_len": seq,
        "params": params, "flops_per_token": flops_per_token,
        "warmup": args.warmup, "steps": args.steps, "step_ms": step_ms, "median_ms": median_ms,
        "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_mib": peak_mem_mib, "losses": losses,
    }
    json_out.write(json.dumps(result) + "\n")
    json_out.flush()


if __name__ == "__main__":
    main()
