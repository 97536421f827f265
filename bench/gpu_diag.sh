#!/usr/bin/env bash
# Short GPU recheck of the CUDA IPC engine after the fixes of the first H200's runs 4-6 (README, "GPU check"):
# ShmSegment names without std::random_device (the SIGSEGV in create_incoming), torch's pooled streams for the
# engine's copies (buffers recorded on a destroyed stream aborted the processes at exit), and the runtime's
# wire device through the demo's PayloadSwitch.  In order of what matters most, each with its own timeout,
# writing into $OUT as it goes (a cut run keeps what it has):
#   build; bench memory_gpu over the engine (memory_gpu.json); the engine's GPU tests; the demo over the
#   engine; the transport suite of one set-up with stacks of a stuck scenario (Python and native).
# About 3.5 minutes.  With DUALPIPE_KERNELS_NATIVE_TRACEBACK=1 a crash prints its native stack.
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
step "bench memory_gpu over the CUDA IPC engine"
timeout 50 "$PY" -m dualpipe_kernels bench memory_gpu --json --no-plots --out "$OUTDIR" --microbatches 8 \
  --rows 1024 --cols 4096 --steps 3 --timeout 40 --transport native >"$OUTDIR/memory_gpu.stdout.json" 2>>"$LOG"
echo "rc=$?" >>"$LOG"
step "the engine's GPU tests"
timeout 45 "$PY" -m pytest -q -m gpu tests/test_cuda_ipc_engine.py tests/test_transport_per_peer_gpu.py \
  -p no:cacheprovider --timeout 30 -x 2>&1 | tail -40 >>"$LOG"
step "demo over the CUDA IPC engine"
timeout 30 "$PY" -m dualpipe_kernels demo --device cuda --ranks 2 --steps 2 --transport native --json \
  >"$OUTDIR/demo_native.json" 2>>"$LOG"
echo "rc=$?" >>"$LOG"
step "transport suite, set-up ipc-staged, stacks of a stuck scenario after 8 s"
DPK_STUCK_STACKS_S=8 timeout 50 "$PY" -m pytest -q tests/test_cuda_ipc.py -k "ipc-staged" -p no:cacheprovider \
  --timeout 45 -rA 2>&1 | grep -v "^frame #" | tail -250 >>"$LOG"
step done
tail -c 11000 "$LOG"
