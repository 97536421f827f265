"""GPU diagnostic: one CUDA IPC transfer between two processes, with stacks if it hangs (bench/gpu_diag.sh)."""

import faulthandler

import torch

from dualpipe_kernels.runtime.launch import spawn_outcomes


def rank_main(rank, world):
    faulthandler.dump_traceback_later(12, exit=True)
    from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

    torch.cuda.set_device(0)
    for staging in ("ipc", "host"):
        t = CudaIpcTransport(device=0, timeout_s=8.0, staging=staging)
        print(f"rank {rank} {staging}: built", flush=True)
        x = torch.arange(1024, dtype=torch.float32, device="cuda") + rank
        if rank == 0:
            h = t.isend(x, 1, 7, "diag")
        else:
            y = torch.empty_like(x)
            h = t.irecv(y, 0, 7, "diag")
        print(f"rank {rank} {staging}: posted", flush=True)
        h.wait(8.0)
        torch.cuda.synchronize()
        print(f"rank {rank} {staging}: done", flush=True)
        if rank == 1:
            print("received ok", torch.equal(y.cpu(), torch.arange(1024, dtype=torch.float32)), flush=True)
        t.close()
    return "ok"


if __name__ == "__main__":
    for o in spawn_outcomes(rank_main, 2, timeout_s=35):
        print(o.rank, o.ok, o.value if o.ok else o.error)
