#!/usr/bin/env bash
# Short GPU diagnostics for the failures bench/device_check.sh found on the first H200 (runs 2 and 3):
# the CUDA IPC engine dies with SIGSEGV in create_incoming, and the Triton fp8 unpack differed from the
# CPU fallback.  Builds with line tables (DUALPIPE_KERNELS_DEBUG_INFO=1) and turns on the native
# traceback (DUALPIPE_KERNELS_NATIVE_TRACEBACK=1), so a crash names its C++ function and line.
# Writes diag.txt (and build.log) to $OUT.  About 2.5 minutes.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-bench/results/device}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-16}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DUALPIPE_KERNELS_NATIVE_TRACEBACK=1
PY="${PYTHON:-python3}"
LOGS="$(mktemp -d)"
{
  echo "== machine"
  command -v gdb addr2line gcc g++ c++ nvcc
  c++ --version | head -1; gcc --version | head -1; nvcc --version | tail -2
  "$PY" -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch._C._GLIBCXX_USE_CXX11_ABI)"
  df -h /dev/shm | tail -1; ulimit -s; ldd --version | head -1
  echo "== build (-g1)"
  timeout 110 env DUALPIPE_KERNELS_CUDA=1 DUALPIPE_KERNELS_DEBUG_INFO=1 "$PY" setup.py build_ext --inplace \
    >"$OUTDIR/build.log" 2>&1
  echo "build rc=$?"
  grep -i "warning\|error" "$OUTDIR/build.log" | head -20
  echo "== engine steps in one process"
  timeout 40 "$PY" bench/gpu_diag_native.py >"$LOGS/native.txt" 2>&1
  echo "rc=$?"
  cat "$LOGS/native.txt" | head -120
  echo "-- frames in the extension"
  "$PY" bench/gpu_diag_native.py resolve "$LOGS/native.txt"
  if command -v gdb >/dev/null; then
    echo "== the same under gdb"
    timeout 60 gdb -q -batch -ex "set pagination off" -ex run -ex "bt 30" -ex "info threads" -ex "thread apply all bt 8" \
      --args "$PY" bench/gpu_diag_native.py 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited\|libthread_db" | tail -150
  fi
  echo "== one CUDA IPC transfer between two processes"
  timeout 40 "$PY" bench/gpu_diag_ipc.py >"$LOGS/ipc.txt" 2>&1
  echo "rc=$?"
  head -150 "$LOGS/ipc.txt"
  echo "-- frames in the extension"
  "$PY" bench/gpu_diag_native.py resolve "$LOGS/ipc.txt"
  echo "== Triton pack kernels on the GPU against the CPU fallback (fp8 unpack fix)"
  timeout 60 "$PY" -m pytest -q -m gpu tests/test_kernels_pack.py -p no:cacheprovider 2>&1 | tail -25
} >"$OUTDIR/diag.txt" 2>&1
tail -c 11000 "$OUTDIR/diag.txt"
