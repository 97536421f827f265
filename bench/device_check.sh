#!/usr/bin/env bash
# One-shot GPU check of dualpipe-kernels on a machine with an NVIDIA GPU.
#
#   bash bench/device_check.sh            # report in $OUT if set, else bench/results/device/
#
# Steps (each with its own timeout, all inside an overall budget of
# DEVICE_CHECK_BUDGET_S seconds, default 450 = 7.5 minutes; a failing step is
# recorded and the script goes on):
#   env     nvidia-smi, python, torch, CUDA visibility
#   build   python setup.py build_ext --inplace  (MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 DUALPIPE_KERNELS_CUDA=1)
#   import  dualpipe_kernels._C imports and has the CUDA engine
#   tests   pytest -m gpu tests/   (JUnit XML kept)
#   bench   bench/bench_cuda_ipc.py --json  (IPC P2P vs same-GPU copy_, compute/transfer overlap)
#   report  report.md + report.json (+ logs/ with every step's output)
#
# What the machine needs: a CUDA driver, a CUDA toolkit (nvcc; CUDA_HOME or
# /usr/local/cuda), and a Python (PYTHON, else ./.venv/bin/python, else
# python3) with torch (a CUDA build), setuptools, ninja, pybind11, numpy,
# pytest and pytest-timeout. Nothing is downloaded: the machine may be offline.
# The build goes in place (the tree is a copy), tests and benchmarks import the
# package through PYTHONPATH.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${OUT:-$ROOT/bench/results/device}"
LOGDIR="$OUTDIR/logs"
mkdir -p "$LOGDIR"
STEPS="$OUTDIR/steps.tsv"
: >"$STEPS"
BUDGET_S="${DEVICE_CHECK_BUDGET_S:-450}"
# DEVICE_CHECK_STEPS: the steps to run (a dry run elsewhere: DEVICE_CHECK_STEPS="env import")
WANTED=" ${DEVICE_CHECK_STEPS:-env build import tests bench} "
T_START=$(date +%s)

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

# run_step NAME LIMIT_S CMD...: runs CMD with a timeout capped by the remaining
# budget, logs to logs/NAME.log and appends "name rc seconds limit" to steps.tsv.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local now left t0 rc
  if [[ "$WANTED" != *" $name "* ]]; then
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >>"$STEPS"
    return 0
  fi
  now=$(date +%s)
  left=$((BUDGET_S - (now - T_START) - 15))  # keep 15 s for the report
  if ((left < 10)); then
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >>"$STEPS"
    echo "[device_check] $name: skipped (budget spent)" >&2
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "[device_check] $name (timeout ${limit}s): $*" >&2
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$LOGDIR/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$limit" >>"$STEPS"
  echo "[device_check] $name: rc=$rc ($(($(date +%s) - t0)) s)" >&2
  return 0
}

run_step env 60 bash -c '
  nvidia-smi || echo "nvidia-smi failed"
  echo "python: '"$PY"'"; "'"$PY"'" --version
  command -v nvcc && nvcc --version | tail -2
  "'"$PY"'" -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), \"devices\", torch.cuda.device_count()); print(torch.cuda.get_device_name(0))"
  nproc; free -g; df -h /dev/shm'

run_step build 300 env DUALPIPE_KERNELS_CUDA=1 "$PY" setup.py build_ext --inplace

run_step import 60 "$PY" -c '
import json
import torch  # loads libc10 & co. before the extension
from dualpipe_kernels import _C
info = _C.build_info()
print(json.dumps(info))
assert _C.has_cuda(), "extension built without CUDA"
print("cuda runtime", _C.cuda.runtime_version(), "devices", _C.cuda.device_count())
assert _C.cuda.device_count() >= 1, "no CUDA device visible to the extension"'

run_step tests 200 "$PY" -m pytest -m gpu tests/ -q -rfEs -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$OUTDIR/pytest-gpu.xml"

run_step bench 180 bash -c '"'"$PY"'" bench/bench_cuda_ipc.py --json --timeout 150 >"'"$OUTDIR"'/bench_cuda_ipc.json"'

# ---------------------------------------------------------------------------
# report (python if it runs, else a minimal one from bash)
# ---------------------------------------------------------------------------
TOTAL_S=$(($(date +%s) - T_START))
if ! "$PY" - "$OUTDIR" "$TOTAL_S" <<'PYEOF'; then
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, total_s = Path(sys.argv[1]), int(sys.argv[2])
steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, limit = line.split("\t")
    status = "skipped" if rc == "skipped" else ("ok" if rc == "0" else ("timeout" if rc in ("124", "137") else "failed"))
    steps.append({"step": name, "status": status, "rc": rc, "seconds": int(secs), "limit_s": int(limit)})

tests = None
xml = out / "pytest-gpu.xml"
if xml.exists():
    try:
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        a = suite.attrib
        failed = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
        tests = {k: int(a.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        tests["passed"] = tests["tests"] - tests["failures"] - tests["errors"] - tests["skipped"]
        tests["failed_cases"] = failed
    except Exception as e:  # noqa: BLE001
        tests = {"error": f"unreadable JUnit XML: {e}"}

bench = None
bj = out / "bench_cuda_ipc.json"
if bj.exists() and bj.stat().st_size:
    try:
        bench = json.loads(bj.read_text())
    except json.JSONDecodeError as e:
        bench = {"error": f"unreadable benchmark JSON: {e}"}

env_log = out / "logs" / "env.log"
report = {
    "total_s": total_s,
    "steps": steps,
    "all_steps_ok": all(s["status"] == "ok" for s in steps),
    "tests": tests,
    "bench_cuda_ipc": bench,
    "env": env_log.read_text()[-4000:] if env_log.exists() else "",
}
(out / "report.json").write_text(json.dumps(report, indent=2))

md = [f"# dualpipe-kernels device check ({total_s} s)", "", "| step | status | rc | seconds | limit |", "|---|---|---|---|---|"]
md += [f"| {s['step']} | {s['status']} | {s['rc']} | {s['seconds']} | {s['limit_s']} |" for s in steps]
md.append("")
if tests and "error" not in tests:
    md.append(f"GPU tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
              f"{tests['skipped']} skipped of {tests['tests']}")
    md += [f"- FAILED {c}" for c in tests["failed_cases"]]
elif tests:
    md.append(f"GPU tests: {tests['error']}")
else:
    md.append("GPU tests: no JUnit XML (see logs/tests.log)")
md.append("")
if bench and "rows" in bench:
    md.append(f"## CUDA IPC P2P vs same-GPU copy_ on {bench['device']} ({bench['staging']} staging)")
    md += ["", "| size (B) | msgs | IPC GB/s | copy_ GB/s | IPC / copy_ | us/msg |", "|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        md.append(f"| {r['size_bytes']} | {r['messages']} | {r['ipc_gbps']:.1f} | {r['d2d_gbps']:.1f} | "
                  f"{r['ratio']:.2f} | {r['us_per_msg']:.1f} |")
    md.append("")
    md.append(f"Min IPC/copy_ ratio at >= 1 MiB: {bench['bandwidth_ratio_min_ge_1MiB']:.2f} "
              f"(target >= {bench['bandwidth_target_ratio']}): {'PASS' if bench['bandwidth_pass'] else 'FAIL'}")
    o = bench["overlap"]
    md.append(f"Overlap: compute {o['compute_ms']:.1f} ms, transfer {o['transfer_ms']:.1f} ms, both "
              f"{o['both_ms']:.1f} ms = {o['ratio']:.2f} x the longer (target <= {o['target']}): "
              f"{'PASS' if o['pass'] else 'FAIL'}")
else:
    md.append(f"Benchmark: {bench['error'] if bench else 'no output (see logs/bench.log)'}")
for s in steps:
    log = out / "logs" / f"{s['step']}.log"
    if s["status"] in ("failed", "timeout") and log.exists():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        md += ["", f"### {s['step']} ({s['status']}, rc {s['rc']}): last lines of logs/{s['step']}.log", "", "```"]
        md += tail + ["```"]
md += ["", "Logs: logs/<step>.log"]
(out / "report.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PYEOF
  {
    echo "# dualpipe-kernels device check (${TOTAL_S} s; python report failed)"
    echo
    echo '```'
    cat "$STEPS"
    echo '```'
  } >"$OUTDIR/report.md"
  printf '{"total_s": %s, "report_error": "python report step failed", "steps_tsv": "%s"}\n' "$TOTAL_S" "$STEPS" \
    >"$OUTDIR/report.json"
  cat "$OUTDIR/report.md"
fi
echo "[device_check] report: $OUTDIR/report.md" >&2
