#!/usr/bin/env bash
# Training data from a real S3 server (SeaweedFS on loopback, behind the benchmark's latency proxy)
# next to a local directory, in one run: time to the first unit, step time with a cold and a warm
# cache, bytes fetched per token used. Usage: scripts/bench-data.sh [extra `seqpipe bench data` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-seaweedfs.sh
source scripts/bench-seaweedfs.sh
bench_build
# Uses ports base..base+6 and their gRPC ports (+10000).
bench_start_seaweedfs "${SEQPIPE_BENCH_PORT_BASE:-23100}"
bench_seqpipe bench data --url "s3://bench/data" "$@"
