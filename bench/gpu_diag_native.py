"""GPU diagnostic: the CUDA IPC engine's rendezvous steps in one process, with native stacks on a crash.

Run by bench/gpu_diag.sh with DUALPIPE_KERNELS_NATIVE_TRACEBACK=1; ``resolve`` turns the handler's frames
into function and line (addr2line, on a -g1 build).  One process cannot map its own IPC handles, so this
exercises what each side does up to the mapping: engine construction and ``create_incoming``.
"""

import re
import subprocess
import sys

import torch


def steps() -> None:
    from dualpipe_kernels.transport.cuda_ipc import native_cuda_module

    mod = native_cuda_module()
    print("build_info", mod.__name__, flush=True)
    for init_first in (True, False):
        if init_first:
            torch.cuda.init()
            torch.empty(1, device="cuda")
        for staging in ("host", "ipc"):
            print(f"-- torch CUDA initialised first: {init_first}, staging {staging}", flush=True)
            e = mod.IpcEngine(0, 0, 4, 1 << 20, staging, 1 << 20, 32)
            print("   engine built", flush=True)
            name = e.create_incoming(1)
            print("   create_incoming ->", name, flush=True)
            e2 = mod.IpcEngine(1, 0, 4, 1 << 20, staging, 1 << 20, 32)
            try:
                e2.attach_outgoing(0, name)
                print("   attach_outgoing ok", flush=True)
            except Exception as exc:  # noqa: BLE001 - reported, one process cannot open its own IPC handles
                print("   attach_outgoing raised", type(exc).__name__, str(exc)[:300], flush=True)
            e2.close(1.0)
            e.close(1.0)
            print("   closed", flush=True)
        if init_first:
            break  # CUDA stays initialised in this process; the other order needs a fresh one


def resolve(log: str) -> str:
    """addr2line for every frame of the native traceback that lies in the extension."""
    m = re.search(r"dualpipe_kernels: (\S+) is loaded at (0x[0-9a-f]+)", log)
    if not m:
        return "(no native traceback in the log)"
    path, base = m.group(1), int(m.group(2), 16)
    out = []
    for line in log.splitlines():
        if path.rsplit("/", 1)[-1] not in line:
            continue
        a = re.search(r"\[(0x[0-9a-f]+)\]", line)
        if a:
            off = hex(int(a.group(1), 16) - base)
            r = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", path, off], capture_output=True, text=True)
            out.append(f"{off}: " + " | ".join(r.stdout.split("\n")).strip(" |"))
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "resolve":
        print(resolve(open(sys.argv[2]).read()))
    else:
        steps()
