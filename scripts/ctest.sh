#!/usr/bin/env bash
# Build the C++ core of both native engines without Python or CUDA (the shm
# engine, csrc/common, and the CUDA IPC engine's host logic over a fake device)
# and run their GoogleTest unit tests with ctest: a plain build, then
# ThreadSanitizer, then AddressSanitizer (+UBSan). One build directory per configuration, so reruns
# are incremental. Needs cmake, a C++ compiler and libgtest-dev.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${MAX_JOBS:-$(nproc)}"
for san in "" thread address; do
  dir="build/cmake${san:+-$san}"
  echo "== ctest ${san:-plain} ($dir)"
  # line tables only (-g1): backtraces keep file:line, the plain build compiles in 2/3 of the time
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DDPK_SANITIZER="$san" >/dev/null
  cmake --build "$dir" -j "$jobs" >/dev/null
  # TSan: report races as failures; second-deadlock detection off (shm futex waits confuse it).
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" ASAN_OPTIONS="detect_leaks=1" \
    ctest --test-dir "$dir" --output-on-failure -j "$jobs" --timeout 120
done
