"""Every C++ source names the standard headers of what it uses (include what you use, for the std library).

A source that compiles only because another standard header happens to pull in the one it needs breaks on
a newer libstdc++: the first GPU machine's g++ stopped on ``std::runtime_error`` in csrc/cuda/ipc_exports.cpp,
which reached <stdexcept> only through <string> on this machine's g++ 12.  This check reads the sources (no
compiler): for each ``std::`` name in the table below, the file itself or one of the project headers it
includes (followed recursively) must include the standard header that declares it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"

#: std name -> the header that declares it (the names this project uses, and their usual neighbours)
HEADER_OF = {
    **dict.fromkeys(
        (
            "runtime_error",
            "logic_error",
            "invalid_argument",
            "out_of_range",
            "length_error",
            "overflow_error",
            "range_error",
            "domain_error",
            "underflow_error",
        ),
        "stdexcept",
    ),
    **dict.fromkeys(("string", "to_string", "stoi", "stol", "stoul", "stoull", "stod", "getline"), "string"),
    "string_view": "string_view",
    **dict.fromkeys(
        (
            "is_integral_v",
            "is_enum_v",
            "is_same_v",
            "enable_if_t",
            "underlying_type_t",
            "decay_t",
            "is_trivially_copyable_v",
        ),
        "type_traits",
    ),
    "vector": "vector",
    "deque": "deque",
    "array": "array",
    "map": "map",
    "set": "set",
    "unordered_map": "unordered_map",
    "unordered_set": "unordered_set",
    "optional": "optional",
    "nullopt": "optional",
    "variant": "variant",
    "tuple": "tuple",
    "make_tuple": "tuple",
    **dict.fromkeys(("unique_ptr", "shared_ptr", "weak_ptr", "make_unique", "make_shared"), "memory"),
    **dict.fromkeys(
        ("mutex", "lock_guard", "unique_lock", "scoped_lock", "recursive_mutex", "call_once", "once_flag"), "mutex"
    ),
    "condition_variable": "condition_variable",
    **dict.fromkeys(
        (
            "atomic",
            "atomic_thread_fence",
            "memory_order_relaxed",
            "memory_order_acquire",
            "memory_order_release",
            "memory_order_acq_rel",
            "memory_order_seq_cst",
        ),
        "atomic",
    ),
    "thread": "thread",
    "this_thread": "thread",
    "chrono": "chrono",
    "function": "functional",
    **dict.fromkeys(("ostringstream", "istringstream", "stringstream"), "sstream"),
    **dict.fromkeys(
        (
            "sort",
            "find",
            "find_if",
            "min_element",
            "max_element",
            "fill",
            "copy",
            "any_of",
            "all_of",
            "none_of",
            "remove_if",
            "count_if",
            "clamp",
            "reverse",
            "lower_bound",
            "upper_bound",
        ),
        "algorithm",
    ),
    **dict.fromkeys(("move", "forward", "pair", "make_pair", "swap", "exchange"), "utility"),
    **dict.fromkeys(("memcpy", "memset", "memcmp", "strlen", "strerror", "strncpy", "strcmp"), "cstring"),
    **dict.fromkeys(("exception", "exception_ptr", "current_exception", "rethrow_exception", "terminate"), "exception"),
    **dict.fromkeys(("numeric_limits",), "limits"),
    **dict.fromkeys(("accumulate", "iota"), "numeric"),
    "system_error": "system_error",
    **dict.fromkeys(("ifstream", "ofstream", "fstream"), "fstream"),
    **dict.fromkeys(("atoi", "atol", "strtol", "strtoull", "getenv", "calloc", "malloc", "free", "abort"), "cstdlib"),
    **dict.fromkeys(("fprintf", "snprintf", "printf", "fflush"), "cstdio"),
    **dict.fromkeys(("random_device", "mt19937", "mt19937_64", "uniform_int_distribution"), "random"),
    "enable_shared_from_this": "memory",
    **dict.fromkeys(("ref", "cref"), "functional"),
    "strncmp": "cstring",
    "error_code": "system_error",
    "generic_category": "system_error",
    "system_category": "system_error",
}
#: headers that declare a name as well as the one in the table (either satisfies the check)
ALSO = {
    "utility": {"algorithm"},  # std::swap / std::move(first, last, out)
    "algorithm": {"utility"},  # std::min / std::max live in <algorithm>; never listed above
    "system_error": {"stdexcept"},
    "exception": {"stdexcept", "system_error"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
STD_NAME = re.compile(r"\bstd::([a-z_]+)\b")


def _strip_comments_and_strings(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def _includes(path: Path, seen: set[Path] | None = None) -> set[str]:
    """Standard headers included by ``path`` and, recursively, by the project headers it includes."""
    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    found: set[str] = set()
    for kind, name in INCLUDE.findall(path.read_text()):
        if kind == "<":
            found.add(name)
            continue
        for base in (path.parent, CSRC):
            cand = (base / name).resolve()
            if cand.is_file():
                found |= _includes(cand, seen)
                break
    return found


SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cc", ".cu", ".h", ".cuh"))


def test_the_table_covers_the_names_the_sources_use() -> None:
    """Every std:: name a source uses is in the table or known to need no check (so the check keeps up)."""
    exempt = {
        "size_t",
        "uint8_t",
        "uint16_t",
        "uint32_t",
        "uint64_t",
        "int32_t",
        "int64_t",
        "ptrdiff_t",
        "uintptr_t",
        "intptr_t",
        "micro",
        "milli",
        "nano",
        "remove",
        "min",
        "max",
        "abs",
        "errc",
        "defer_lock",
        "adopt_lock",
        "try_to_lock",
        "cv_status",
        "nothrow",
        "launder",
        "get",
        "begin",
        "end",
        "size",
        "data",
        "isfinite",
        "chrono_literals",
        "literals",
        "ios",
        "hex",
        "dec",
        "setw",
        "setfill",
        "byte",
        "is_same_v",
        "enable_if_t",
        "decay_t",
        "is_trivially_copyable_v",
    }
    unknown = {}
    for path in SOURCES:
        names = set(STD_NAME.findall(_strip_comments_and_strings(path.read_text())))
        names -= set(HEADER_OF) | exempt
        if names:
            unknown[str(path.relative_to(ROOT))] = sorted(names)
    assert not unknown, f"std names with no header in this test's table (add them): {unknown}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(CSRC)))
def test_each_source_includes_the_standard_headers_of_what_it_uses(path: Path) -> None:
    text = _strip_comments_and_strings(path.read_text())
    have = _includes(path)
    missing = {}
    for name in sorted(set(STD_NAME.findall(text))):
        header = HEADER_OF.get(name)
        if header is None or header in have or ALSO.get(header, set()) & have:
            continue
        missing[f"std::{name}"] = f"<{header}>"
    assert not missing, (
        f"{path.relative_to(ROOT)} uses {missing} without including it (directly or via its own headers)"
    )


#: standard headers whose code keeps process-wide state in libstdc++ (locale facets, the random device): on a
#: toolchain that links part of libstdc++ into the extension (the first H200's /opt/gcc with
#: -Wl,-Bsymbolic-functions) the copy in the .so and the process's disagree, and the first number formatted
#: by an ostringstream, or the first std::random_device, crashed the process.  csrc/common/msg.h formats
#: messages instead; the C++ unit tests (csrc/tests, never in the extension) may use anything.
STATEFUL_STD_HEADERS = {"sstream", "iostream", "istream", "ostream", "fstream", "iomanip", "locale", "random", "regex"}
_EXTENSION_SOURCES = [p for p in SOURCES if "tests" not in p.relative_to(CSRC).parts]


@pytest.mark.parametrize("path", _EXTENSION_SOURCES, ids=lambda p: str(p.relative_to(CSRC)))
def test_extension_sources_avoid_iostreams_and_random(path: Path) -> None:
    used = {name for kind, name in INCLUDE.findall(path.read_text()) if kind == "<"} & STATEFUL_STD_HEADERS
    names = set(STD_NAME.findall(_strip_comments_and_strings(path.read_text())))
    streams = names & {"ostringstream", "istringstream", "stringstream", "ifstream", "ofstream", "cout", "cerr"}
    assert not used and not streams, (
        f"{path.relative_to(ROOT)} uses {sorted(used) + sorted(streams)}: format with common/msg.h (Msg, "
        "std::to_string, snprintf) and read files with open/read, see STATEFUL_STD_HEADERS"
    )


#: sources that include torch or pybind11 headers: they compile in whatever standard torch asks for
_TORCH_INCLUDE = re.compile(r'#\s*include\s*[<"](torch/|pybind11/|c10/|ATen/)')


def test_sources_without_torch_compile_as_cxx17() -> None:
    """torch 2.11 (the first GPU machine's) builds extensions with -std=c++17, torch 2.14 (CI's) with c++20:
    the engine's own sources must be C++17, so a C++20-only construct cannot pass CI and fail on a GPU box."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx is not None, "no C++ compiler on PATH (the extension build needs one too)"
    plain = [p for p in SOURCES if p.suffix == ".cpp" and "tests" not in p.parts]
    plain = [p for p in plain if not _TORCH_INCLUDE.search(p.read_text())]
    assert len(plain) >= 8, plain
    cuda_home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    flags = [f"-I{CSRC}"]
    has_cuda = (cuda_home / "include" / "cuda_runtime_api.h").exists()
    if has_cuda:  # the CUDA engine's sources need its headers
        flags += [f"-I{cuda_home / 'include'}", "-DDUALPIPE_KERNELS_WITH_CUDA"]
    else:
        plain = [p for p in plain if "cuda" not in p.parts]
    cu = [p for p in SOURCES if p.suffix == ".cu" and has_cuda]  # host-only CUDA C++: g++ reads it
    cmd = [cxx, "-std=c++17", "-Wpedantic", "-Werror=pedantic", "-fsyntax-only", *flags, *map(str, plain)]
    cmd += ["-x", "c++", *map(str, cu)] if cu else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
