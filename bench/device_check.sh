#!/usr/bin/env bash
# One-shot GPU check of dualpipe-kernels, sized for a short device window (the whole run < 8 minutes,
# even when every GPU test fails or hangs).
#
#   bash bench/device_check.sh              # results in $OUT if set, else bench/results/device/
#   DEVICE_CHECK_DRY=1 bash bench/device_check.sh   # on a machine without a GPU: walks every step
#                                            # (the build only checks the extension imports)
#   DPK_FAULT_IPC_WAIT=1 ...                 # fault injection: in the transport tests rank 1 sticks in a
#                                            # wait that never fires; the step must still end in time
#
# Steps, in order, each with its own timeout (capped by what is left of DEVICE_CHECK_BUDGET_S, default
# 475 s); a failing step is recorded and the script goes on.  DEVICE_CHECK_STEPS picks a subset.  Steps
# run in the order of what later work needs most: the kernels and memory figures before the long suites.
#   smoke      GPU, compute mode, PYTORCH_CUDA_ALLOC_CONF; then two processes pass a CUDA tensor and an
#              interprocess event through torch.multiprocessing (does CUDA IPC work in this sandbox?)
#   build      python setup.py build_ext --inplace, unless the extension already imports with CUDA and is
#              newer than every source under csrc/ (a copy of the built extension goes to the output
#              folder, debug sections stripped, so a second run on a fresh machine can carry it instead of
#              compiling again)
#   gpu        pytest -m gpu on the GPU unit tests: the Triton pack kernels against the CPU fallback,
#              the CUDA IPC engine's zero-copy views, small rings and teardown order, and the per-peer
#              transport choice (CUDA IPC same host, torch across faked hosts; NCCL with 2+ GPUs), the
#              kernels' sm_90 builds with this machine's Triton (registers per variant), and the per-chunk
#              CUDA graphs (tests/unit/test_graphs_gpu.py: capture + replay bit-exact against eager, replays =
#              the schedule's F/B count, an unseen shape runs eager) (JUnit XML)
#   bench      dualpipe-kernels bench kernels at 64 and 256 MiB with fp32 and bf16 inputs (--dtypes fp32,bf16
#              where the kernels suite has that option; pack/unpack vs a same-GPU copy and torch cat + cast; with
#              DEVICE_CHECK_VARIANTS=1 five launch shapes of the Triton kernels side by side), cuda_ipc (the engine
#              vs its bare ceiling and the context hop, 256 B .. 256 MiB, host and device us per message, overlap;
#              and --fake-device: the engine's host cost without the GPU), memory_gpu at 4 ranks x 16
#              micro-batches (offload / recompute / fp8 vs keep: step time and device memory), graphs (per-chunk
#              CUDA graphs on tiny stages: time per compute action with graphs on vs off, bit-exact)
#   transport  pytest tests/process/test_cuda_ipc.py: every two-process scenario, the error paths among them (size/dtype
#              mismatch, timeout, a killed peer) (per-test timeouts below the step's; JUnit XML)
#   runtime    the demo on the GPU: two processes on GPU 0, --device cuda, over the CUDA IPC engine, then auto
#   wire       the GPU wire (benchmarks/wire_check.py): 2 ranks on GPU 0 over the CUDA IPC engine and over auto,
#              step 1 bit-exact against one process, and a profiled step's cudaStreamSynchronize /
#              cudaDeviceSynchronize / cudaEventSynchronize / D2H copies, in the step and on the message path
#              (report.json: bench.wire)
#   compat     pytest -m gpu tests/process/test_compat.py (the reference's API on CUDA; JUnit XML)
#   hostcpu    dualpipe-kernels bench schedules --short-chunks-only: the short-chunk row (DualPipeV 4 x 16,
#              1/2/1 ms sleep chunks, CPU tensors) on this host's CPUs, a core per rank (the row's target,
#              measured / simulated <= 1.10, was measured only with 4 ranks on 2 CPUs so far); no GPU, so it goes last
#
# Output: at most 7 files in the output folder: report.md, report.json, logs.tar.gz (every step's log,
# steps.tsv, benchmark and demo JSON), junit-transport.xml, junit-compat.xml, junit-gpu.xml, and the
# extension built in the build step (_C.<tag>.so).  Every step also streams
# its output to stdout as it runs.  Nothing is downloaded.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${OUT:-$ROOT/bench/results/device}"
mkdir -p "$OUTDIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dpk-device-check.XXXXXX")"
LOGDIR="$WORK/logs"
mkdir -p "$LOGDIR"
STEPS="$WORK/steps.tsv"
: >"$STEPS"
BUDGET_S="${DEVICE_CHECK_BUDGET_S:-475}"
ALL_STEPS="smoke build gpu bench transport runtime wire compat hostcpu"
WANTED=" ${DEVICE_CHECK_STEPS:-$ALL_STEPS} "
DRY="${DEVICE_CHECK_DRY:-0}"
T_START=$(date +%s)

# step limits (seconds): each step's cap; DEVICE_CHECK_BUDGET_S bounds the whole run, so a step never gets
# more than what is left of it.  The caps add up to more than the budget: only a run where every early step
# hits its cap (a hang in each) starves the last ones, and the steps are ordered so that those are the ones
# whose figures matter least (the transport and compat suites; the gpu step already runs the IPC engine).
LIMIT_SMOKE=20
# build: 18 translation units in parallel; the largest (the CUDA bindings) takes ~45 s on one core here
LIMIT_BUILD=120
# gpu: 48 s in run 5; each launch kind now compiles its own kernel variant (about 1 s each, ~20 in these tests),
# and the device_build test compiles nine (its own timeout, 90 s, stays below this cap); the graph tests
# (four one-process trainings of three steps, one capture each) about 10 s more
LIMIT_GPU=160
# bench: kernels 60 (2 sizes x 2 dtypes) + cuda_ipc 60 + its fake-device row 15 + memory_gpu 70 (twice if the
# engine fails) + graphs 40 (one process, 2 x 33 steps of tiny chunks); variants 120 s more when on
LIMIT_BENCH=260
LIMIT_WIRE=115
LIMIT_TRANSPORT=185
LIMIT_RUNTIME=60
LIMIT_COMPAT=55
# hostcpu: about 48 s on the 2-core machine (three launches, each: calibration, 4 spawned ranks, 22 steps of
# 0.13 s, the compute floor: 6 steps of each rank alone, 6 of all at once; the bare pipeline: 6 steps)
LIMIT_HOSTCPU=75

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
  PY="$ROOT/.venv/bin/python"
else
  PY="$(command -v python3 || command -v python || echo python3)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export MAX_JOBS="${MAX_JOBS:-16}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export PYTHONUNBUFFERED=1

# run_step NAME LIMIT CMD...: CMD under `timeout` (its whole process group), output streamed to stdout and
# to logs/NAME.log; appends "name rc seconds limit" to steps.tsv.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local left t0 rc
  if [[ "$WANTED" != *" $name "* ]]; then
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >>"$STEPS"
    return 0
  fi
  left=$((BUDGET_S - ($(date +%s) - T_START) - 10)) # 10 s for the report and the archive
  if ((left < 5)); then
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >>"$STEPS"
    echo "[device_check] $name: skipped (budget spent)"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "[device_check] ==== $name (timeout ${limit}s): $(printf '%s' "$*" | tr '\n' ' ' | cut -c1-160)"
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$limit" >>"$STEPS"
  echo "[device_check] ==== $name: rc=$rc ($(($(date +%s) - t0)) s of ${limit})"
  return 0
}

# the Python parts of the smoke and build steps, as files (bash -c cannot carry here-documents in functions)
cat >"$WORK/smoke_ipc.py" <<'PYEOF'
import sys
import time

import torch
import torch.multiprocessing as mp


def child(q, r):
    t, ev = q.get(timeout=10)
    torch.cuda.current_stream().wait_event(ev)
    r.put(float(t.sum().item()))


if __name__ == "__main__":
    print(f"torch {torch.__version__} (cuda {torch.version.cuda}); devices {torch.cuda.device_count()}", flush=True)
    if not torch.cuda.is_available():
        sys.exit("smoke: no CUDA device visible")
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    ev = torch.cuda.Event(interprocess=True)
    ev.record()
    p = ctx.Process(target=child, args=(q, r), daemon=True)
    p.start()
    q.put((t, ev))
    got = r.get(timeout=15)
    p.join(5)
    want = float(t.sum().item())
    print(f"smoke: CUDA tensor + interprocess event through torch.multiprocessing: got {got}, want {want} "
          f"({time.monotonic() - t0:.1f} s)")
    sys.exit(0 if got == want else 1)
PYEOF
cat >"$WORK/build_check.py" <<'PYEOF'
import sys
from pathlib import Path

import torch  # noqa: F401 - loads libc10 before the extension

try:
    from dualpipe_kernels import _C
except ImportError as exc:
    sys.exit(f"build: the extension does not import ({exc})")
so = Path(_C.__file__).stat().st_mtime
newer = [p for p in Path("csrc").rglob("*") if p.is_file() and p.stat().st_mtime > so]
print(f"build: {_C.__file__}: {_C.build_info()}")
if not _C.has_cuda() or newer:
    sys.exit(f"build: needed (with CUDA: {_C.has_cuda()}; sources newer than the extension: {len(newer)})")
print("build: up to date, with CUDA")
PYEOF

smoke() {
  nvidia-smi --query-gpu=name,compute_mode,driver_version,memory.total,memory.used --format=csv 2>&1 ||
    echo "nvidia-smi: unavailable"
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-<unset>}  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>}"
  echo "python: $PY ($("$PY" --version 2>&1)); nproc $(nproc); /dev/shm: $(df -h /dev/shm 2>/dev/null | tail -1)"
  "$PY" "$WORK/smoke_ipc.py"
}

build() {
  "$PY" "$WORK/build_check.py" && return 0
  if [[ "$DRY" == 1 ]]; then
    echo "build: dry run: would run: DUALPIPE_KERNELS_CUDA=1 $PY setup.py build_ext --inplace"
    return 0
  fi
  DUALPIPE_KERNELS_CUDA=1 "$PY" setup.py build_ext --inplace || return 1
  local so
  so="_C.$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("SOABI"))').so"
  # without its debug sections (26 MB -> 1 MB): what comes back from a device machine is capped at 16 MB a file
  cp "dualpipe_kernels/$so" "$OUTDIR/" && strip --strip-debug "$OUTDIR/$so" ||
    echo "build: built, but the extension could not be copied to $OUTDIR"
}

bench() {
  local rc=0
  # the two sizes that matter (64 and 256 MiB), fp32 and bf16 inputs; --dtypes only where the kernels
  # suite has it (an older tree runs its default dtype)
  local dtypes=()
  if "$PY" -m dualpipe_kernels bench kernels --help 2>/dev/null | grep -q -- "--dtypes"; then
    dtypes=(--dtypes fp32,bf16)
  else
    echo "bench kernels: no --dtypes option in this tree: its default input dtype only"
  fi
  # (dry run: one small size, one sample: the same kernels under the Triton interpreter, in seconds, not 60+)
  local sizes=(--samples 5 --sizes 67108864,268435456)
  [[ "${DRY:-0}" == 1 ]] && sizes=(--samples 1 --sizes 65536)
  timeout 60 "$PY" -m dualpipe_kernels bench kernels --json --no-plots --out "$WORK/bench" "${sizes[@]}" \
    "${dtypes[@]}" >"$WORK/bench/kernels.stdout.json" || rc=1
  # the engine against its bare ceiling (context hop; ping-pong with a copy from the peer's IPC-mapped
  # buffer), 256 B .. 256 MiB, and the compute + transfer overlap; then its host cost over the fake device
  timeout 60 "$PY" -m dualpipe_kernels bench cuda_ipc --json --no-plots --out "$WORK/bench" --iters 3 \
    --overlap-bytes 1G --overlap-reps 2 --timeout 55 >"$WORK/bench/cuda_ipc.stdout.json" || rc=1
  timeout 15 "$PY" -m dualpipe_kernels bench cuda_ipc --fake-device --json --no-plots --out "$WORK/bench/fake" \
    >"$WORK/bench/cuda_ipc_fake.stdout.json" || rc=1
  # over the CUDA IPC engine (the transport this measures); over the torch transport only if that fails
  local t
  for t in native torch; do
    echo "bench memory_gpu --transport $t"
    # the issue's 4 ranks x 16 micro-batches (4 processes on one GPU); 8 MiB blocks; offload and offload:fp8
    # by both GPU paths (staging / @mapped: keep the faster); keep and recompute always run
    timeout 75 "$PY" -m dualpipe_kernels bench memory_gpu --json --no-plots --out "$WORK/bench" --ranks 4 \
      --microbatches 16 --rows 512 --cols 4096 --steps 3 --timeout 70 --transport "$t" \
      --policies offload,offload@mapped,offload:fp8,offload:fp8@mapped \
      >"$WORK/bench/memory_gpu.stdout.json" && break
    rc=1
  done
  # per-chunk CUDA graphs: time per compute action with graphs on vs off on tiny chunks (one process)
  timeout 40 "$PY" -m dualpipe_kernels bench graphs --json --no-plots --out "$WORK/bench" \
    >"$WORK/bench/graphs.stdout.json" || rc=1
  # launch shapes (DEVICE_CHECK_VARIANTS=1; each shape compiles its kernels, generic ones too: up to two
  # minutes): last and on
  # their own, so a cut loses only them.  Off by default since run 5: the transport suite needs the time.
  if [ "${DEVICE_CHECK_VARIANTS:-0}" = 1 ]; then
    timeout 120 "$PY" -m dualpipe_kernels bench kernels --json --no-plots --out "$WORK/bench/variants" --samples 3 \
      --sizes 67108864,268435456 --num-tensors 1,64 --formats packed,fp8 --variants 16x32,16x32g,16x8,16x8g,32x32 \
      >"$WORK/bench/kernels_variants.stdout.json" || rc=1
  fi
  return $rc
}

hostcpu() {
  # (dry run: one launch of the row instead of three: the same 4 x 16 row, a third of the time)
  local launches=()
  [[ "${DRY:-0}" == 1 ]] && launches=(--short-launches 1)
  timeout 55 "$PY" -m dualpipe_kernels bench schedules --short-chunks-only --json --no-plots --out "$WORK/bench" \
    "${launches[@]}" >"$WORK/bench/schedules_short.stdout.json"
}

mkdir -p "$WORK/bench/variants" "$WORK/bench/fake"
run_step smoke "$LIMIT_SMOKE" bash -c "$(declare -f smoke); PY='$PY' WORK='$WORK' smoke"
run_step build "$LIMIT_BUILD" bash -c "$(declare -f build); PY='$PY' WORK='$WORK' DRY='$DRY' OUTDIR='$OUTDIR' build"
# pytest: -v -rA so that every test reports as it ends; --timeout below the step's (a marker's too: the
# device_build test's 90 s)
run_step gpu "$LIMIT_GPU" "$PY" -m pytest -m "gpu or device_build" tests/unit/test_kernels_pack.py tests/process/test_cuda_ipc_engine.py \
  tests/process/test_transport_per_peer_gpu.py tests/unit/test_graphs_gpu.py -v -rA --continue-on-collection-errors \
  -p no:cacheprovider --timeout 30 --junitxml="$OUTDIR/junit-gpu.xml"
run_step bench "$LIMIT_BENCH" bash -c "$(declare -f bench); PY='$PY' WORK='$WORK' DRY='$DRY' bench"
run_step transport "$LIMIT_TRANSPORT" "$PY" -m pytest tests/process/test_cuda_ipc.py -v -rA -p no:cacheprovider \
  --timeout 60 --junitxml="$OUTDIR/junit-transport.xml"
# the demo over the CUDA IPC engine (--transport native), then over auto (the torch transport on GPUs)
run_step runtime "$LIMIT_RUNTIME" bash -c "set -o pipefail; rc=0; for t in native auto; do \
  '$PY' -m dualpipe_kernels demo --device cuda --ranks 2 --steps 2 --json --transport \$t | tee '$WORK/demo-'\$t.json || rc=1; \
  done; cp '$WORK/demo-native.json' '$WORK/demo.json' 2>/dev/null; exit \$rc"
# the GPU wire: synchronizing calls on the message path after step 1 (dry run: the arguments only)
wire() {
  local dry=""
  [[ "$DRY" == 1 ]] && dry="--dry"
  timeout 110 "$PY" -m dualpipe_kernels.benchmarks.wire_check --transports native,auto $dry \
    >"$WORK/bench/wire.stdout.json"
}
run_step wire "$LIMIT_WIRE" bash -c "$(declare -f wire); PY='$PY' WORK='$WORK' DRY='$DRY' wire"
run_step compat "$LIMIT_COMPAT" "$PY" -m pytest -m gpu tests/process/test_compat.py -v -rA -p no:cacheprovider \
  --timeout 40 --junitxml="$OUTDIR/junit-compat.xml"
run_step hostcpu "$LIMIT_HOSTCPU" bash -c "$(declare -f hostcpu); PY='$PY' WORK='$WORK' DRY='$DRY' hostcpu"

# ---------------------------------------------------------------------------
# report (python if it runs, else a minimal one from bash), then the log archive
# ---------------------------------------------------------------------------
TOTAL_S=$(($(date +%s) - T_START))
if ! "$PY" - "$OUTDIR" "$WORK" "$TOTAL_S" <<'PYEOF'; then
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, work, total_s = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


def status(rc: str) -> str:
    return {"skipped": "skipped", "0": "ok", "124": "timeout", "137": "timeout"}.get(rc, "failed")


steps = []
for line in (work / "steps.tsv").read_text().splitlines():
    name, rc, secs, limit = line.split("\t")
    steps.append({"step": name, "status": status(rc), "rc": rc, "seconds": int(secs), "limit_s": int(limit)})


def junit(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable JUnit XML: {e}"}
    cases = list(root.iter("testcase"))
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {
        "tests": len(cases), "failed": len(bad), "skipped": len(skipped),
        "passed": len(cases) - len(bad) - len(skipped),
        "failed_cases": [f"{c.get('classname')}::{c.get('name')}" for c in bad],
    }


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.exists() and path.stat().st_size else None
    except json.JSONDecodeError as e:
        return {"error": f"unreadable JSON {path.name}: {e}"}


bench = {p.stem: load(p) for p in sorted((work / "bench").glob("*.stdout.json"))}
report = {
    "total_s": total_s,
    "steps": steps,
    "all_steps_ok": all(s["status"] == "ok" for s in steps),
    "tests": {k: junit(out / f"junit-{k}.xml") for k in ("transport", "compat", "gpu")},
    "demo": load(work / "demo.json"),
    "demo_auto": load(work / "demo-auto.json"),
    "bench": {k.removesuffix(".stdout"): v for k, v in bench.items()},
}
(out / "report.json").write_text(json.dumps(report, indent=2, default=str))

md = [f"# dualpipe-kernels device check ({total_s} s)", "", "| step | status | rc | seconds | limit |",
      "|---|---|---|---|---|"]
md += [f"| {s['step']} | {s['status']} | {s['rc']} | {s['seconds']} | {s['limit_s']} |" for s in steps]
for k, t in report["tests"].items():
    if t is None or "error" in t:
        md.append(f"\n{k} tests: {t['error'] if t else 'no JUnit XML'}")
        continue
    md.append(f"\n{k} tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped of {t['tests']}")
    md += [f"- FAILED {c}" for c in t["failed_cases"]]
for key, how in (("demo", "CUDA IPC engine"), ("demo_auto", "transport auto")):
    demo = report[key]
    if demo and "losses" in demo:
        md.append(f"\ndemo on CUDA ({how}): {demo.get('ranks')} ranks, bit-exact first step "
                  f"{demo.get('bit_exact_first_step')}, hidden comm share {demo.get('hidden_comm_share')}")
ipc = report["bench"].get("cuda_ipc")
if ipc and "rows" in ipc and ipc.get("mode") == "gpu":
    o = ipc.get("overlap") or {}
    md.append(f"\nCUDA IPC engine ({ipc['staging']} staging, signals: {ipc.get('signal_mechanism')}) vs its bare "
              f"ceiling: context hop {ipc['hop_us']:.1f} us; min engine / bare at >= 64 MiB "
              f"{ipc['engine_over_bare_min']} (target >= {ipc['bandwidth_target_ratio']}); 256 B device us / hop "
              f"{ipc['small_over_hop']} (target <= {ipc['small_target']}); overlap {o.get('ratio')} (target <= 1.1)")
    md += ["", "| size (B) | msgs | engine GB/s | bare GB/s | copy GB/s | engine / bare | host us/msg | device us/msg |",
           "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['size_bytes']} | {r['messages']} | {r['engine_gbps']:.1f} | {r['bare_gbps']:.1f} | "
           f"{r['copy_gbps']:.1f} | {r['engine_over_bare']:.2f} | {r['host_us_per_msg']:.2f} | "
           f"{r['device_us_per_msg']:.2f} |" for r in ipc["rows"]]
fake = report["bench"].get("cuda_ipc_fake")
if fake and "rows" in fake:
    md.append(f"\nCUDA IPC engine's host cost over the fake device ({fake.get('host_cpus')} host CPUs): " + ", ".join(
        f"{r['size_bytes']} B {r['host_us_per_msg']:.2f} us/msg" for r in fake["rows"]
    ) + f" (target <= {fake['target_host_us_per_msg']} us)")
kern = report["bench"].get("kernels")
if kern and "rows" in kern:
    big = [r for r in kern["rows"] if r.get("bytes", 0) >= 64 << 20]
    md += ["", "kernels at >= 64 MiB (ours / same-GPU copy, ours / torch cat + cast):", "",
           "| kernel | format | tensors | MiB | ours GB/s | copy GB/s | torch GB/s | / copy | / torch | us/call | "
           "host us/call |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in big:
        o, c, t = r.get("ours_gbps") or 0.0, r.get("copy_gbps") or 0.0, r.get("torch_gbps") or 0.0
        md.append(f"| {r.get('kernel')} | {r.get('format')} | {r.get('num_tensors')} | {r['bytes'] >> 20} | "
                  f"{o:.0f} | {c:.0f} | {t:.0f} | {o / c if c else 0:.2f} | {o / t if t else 0:.2f} | "
                  f"{r.get('ours_us') or 0:.0f} | {r.get('ours_host_us') or 0:.0f} |")
kern_v = report["bench"].get("kernels_variants") or kern
if kern_v and kern_v.get("variants"):
    md += ["", "pack launch shapes (rows x programs per SM), ours / copy:", "",
           "| shape | kernel | format | tensors | MiB | GB/s | / copy |", "|---|---|---|---|---|---|---|"]
    md += [f"| {v['variant']} | {v['kernel']} | {v['format']} | {v['num_tensors']} | {v['bytes'] >> 20} | "
           f"{v['ours_gbps']:.0f} | {v['ours_vs_copy']:.2f} |" for v in kern_v["variants"]]
mg = report["bench"].get("memory_gpu")
if mg and "rows" in mg:
    md += ["", f"memory policies on the GPU ({mg['config']['ranks']} ranks x {mg['config']['microbatches']} "
           f"micro-batches, transport {mg['config']['transport']}):", "",
           "| policy | saved / keep | meas / pred | alloc / keep | step / keep | step s | exact |",
           "|---|---|---|---|---|---|---|"]
    for r in mg["rows"]:
        md.append(f"| {r['policy']} | {r['share_of_keep']} | {r.get('measured_over_predicted_peak')} | "
                  f"{r['alloc_share_of_keep']} | {r['step_over_keep']:.3f} | {r['step_s']:.4f} | {r['bit_exact']} |")
def num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


gr = report["bench"].get("graphs")
if gr and "rows" in gr:
    off, on = gr["rows"][0], gr["rows"][1]
    md.append(f"\nper-chunk CUDA graphs (interleaved 1F1B, 1 rank x 2 chunks of {gr['config']['layers']} x "
              f"Linear({gr['config']['width']}) + GELU): per action {num(off['per_action_us'], '.1f')} us off, "
              f"{num(on['per_action_us'], '.1f')} us on, on / off {num(on.get('on_over_off'), '.3f')}, "
              f"{on.get('graphs_captured')} graphs, bit-exact {on.get('bit_exact')}, fallback {on.get('fallback')}")


sc = report["bench"].get("schedules_short")
if sc and sc.get("short_chunks"):
    for r in sc["short_chunks"]:
        md.append(f"\nshort chunks on the host CPUs: {r['schedule']} {r['ranks']} x {r['microbatches']}, "
                  f"1/2/1 ms: measured / simulated {num(r.get('ratio'), '.3f')} (target 1.10), step "
                  f"{num(r.get('measured_s'), '.4f')} s against {num(r.get('simulated_s'), '.4f')} s simulated, "
                  f"busiest rank's CPU {num(r.get('rank_cpu_s'), '.4f')} s per step, {r.get('host_cpus')} host CPUs, "
                  f"error {r.get('error')}")
for s in steps:
    log = work / "logs" / f"{s['step']}.log"
    if s["status"] in ("failed", "timeout") and log.exists():
        tail = log.read_text(errors="replace").splitlines()[-12:]
        md += ["", f"### {s['step']} ({s['status']}, rc {s['rc']}): last lines of logs/{s['step']}.log", "", "```"]
        md += tail + ["```"]
md += ["", "Logs: logs.tar.gz (logs/<step>.log, steps.tsv, bench/, demo.json)"]
(out / "report.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PYEOF
  {
    echo "# dualpipe-kernels device check (${TOTAL_S} s; python report failed)"
    echo '```'
    cat "$STEPS"
    echo '```'
  } >"$OUTDIR/report.md"
  printf '{"total_s": %s, "report_error": "python report step failed"}\n' "$TOTAL_S" >"$OUTDIR/report.json"
  cat "$OUTDIR/report.md"
fi
tar -czf "$OUTDIR/logs.tar.gz" -C "$WORK" . && rm -rf "$WORK"
echo "[device_check] done in $(($(date +%s) - T_START)) s: $(ls "$OUTDIR" | tr '\n' ' ')"
