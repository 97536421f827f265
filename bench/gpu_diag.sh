#!/usr/bin/env bash
# Short GPU recheck of the CUDA IPC engine (docs/history.md, "GPU runs"): after the H200's runs 4-6 fixed the
# std::random_device crash, the destroyed-stream abort and the demo's wire device, run 6 crashed in the
# engine's first formatted message (an ostringstream; csrc/common/msg.h replaced them, unverified on a GPU).
# Each step with its own timeout, writing into $OUT as it goes (a cut run keeps what it has):
#   build; the engine's GPU tests; the demo over the engine; the whole transport suite with stacks of a
#   stuck scenario (Python and native).  About 4 minutes; bench/device_check.sh is the full check.  With DUALPIPE_KERNELS_NATIVE_TRACEBACK=1 a crash prints its native stack.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-bench/results/device}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-16}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DUALPIPE_KERNELS_NATIVE_TRACEBACK=1
PY="${PYTHON:-python3}"
LOG="$OUTDIR/diag.txt"
: >"$LOG"
step() { echo "== $* ($(date +%T))" >>"$LOG"; }
step build
timeout 70 env DUALPIPE_KERNELS_CUDA=1 "$PY" setup.py build_ext --inplace >"$OUTDIR/build.log" 2>&1
echo "build rc=$?" >>"$LOG"
step "the engine's GPU tests"
timeout 45 "$PY" -m pytest -q -m gpu tests/process/test_cuda_ipc_engine.py tests/process/test_transport_per_peer_gpu.py \
  -p no:cacheprovider --timeout 30 -x 2>&1 | tail -40 >>"$LOG"
step "demo over the CUDA IPC engine"
timeout 30 "$PY" -m dualpipe_kernels demo --device cuda --ranks 2 --steps 2 --transport native --json \
  >"$OUTDIR/demo_native.json" 2>>"$LOG"
echo "rc=$?" >>"$LOG"
step "transport suite, every set-up, stacks of a stuck scenario after 8 s"
DPK_STUCK_STACKS_S=8 timeout 150 "$PY" -m pytest -q tests/process/test_cuda_ipc.py -p no:cacheprovider \
  --timeout 60 -rA 2>&1 | grep -v "^frame #" | tail -300 >>"$LOG"
step done
tail -c 11000 "$LOG"
