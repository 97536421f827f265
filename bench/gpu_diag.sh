#!/usr/bin/env bash
# Short GPU diagnostics for failures seen in bench/device_check.sh (run 2 on an H200): details that a step
# timeout cut from the report.  Writes diag.txt (and build.log) to $OUT.  Under 3 minutes.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-bench/results/device}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-16}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
{
  echo "== build"
  timeout 80 env DUALPIPE_KERNELS_CUDA=1 "$PY" setup.py build_ext --inplace >"$OUTDIR/build.log" 2>&1
  echo "build rc=$?"
  echo "== fp8 pack on the GPU against the CPU fallback (first failure, long traceback)"
  timeout 40 "$PY" -m pytest -x -q -m gpu tests/test_kernels_pack.py -k "fp32_4097 and fp8" --tb=long \
    -p no:cacheprovider 2>&1 | tail -80
  echo "== fp8 first differing bytes"
  timeout 30 "$PY" bench/gpu_diag_fp8.py
  echo "== demo on CUDA, transport auto (segfaulted in run 2): faulthandler stacks"
  timeout 40 "$PY" -m dualpipe_kernels demo --device cuda --ranks 2 --steps 1 2>&1 | tail -60
  echo "== one CUDA IPC transfer between two processes (hung in run 2): stacks after 12 s"
  timeout 40 "$PY" bench/gpu_diag_ipc.py
} >"$OUTDIR/diag.txt" 2>&1
tail -c 11000 "$OUTDIR/diag.txt"
