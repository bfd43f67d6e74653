#!/usr/bin/env bash
# seqpipe's training step vs idiomatic PyTorch, eager and torch.compile, on the same threads
# (see scripts/bench-vs-torch.py).
# Makes .venv with torch (the CPU wheel index first, plain PyPI if that is unreachable), builds the
# release binary and runs the comparison.
# Usage: scripts/bench-vs-torch.sh [--preset a b long] [--steps N] [--threads T] [--rounds R]
#                                  [--modes eager compile]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c 'import torch, safetensors' 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check torch safetensors numpy \
      --index-url https://download.pytorch.org/whl/cpu \
    || .venv/bin/pip install --quiet --disable-pip-version-check torch safetensors numpy
fi
cargo build --release --quiet -p seqpipe
exec .venv/bin/python scripts/bench-vs-torch.py "$@"
