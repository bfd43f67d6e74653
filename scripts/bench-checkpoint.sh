#!/usr/bin/env bash
# Checkpoint benchmark against the local disk and a real S3 server (SeaweedFS on loopback), in one run:
# save and load throughput next to the raw write throughput of the same store, and the training stall.
# Usage: scripts/bench-checkpoint.sh [extra `seqpipe bench checkpoint` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-seaweedfs.sh
source scripts/bench-seaweedfs.sh
bench_build
# Uses ports base..base+6 and their gRPC ports (+10000).
bench_start_seaweedfs "${SEQPIPE_BENCH_PORT_BASE:-23000}"
bench_seqpipe bench checkpoint --url "$work/local" --url "s3://bench/ckpt" "$@"
