"""transport="auto" on GPUs falls back to the torch transport when any CUDA IPC step fails.

The agreement runs without a GPU: ranks are threads sharing one HashStore
(``negotiate``), or spawned gloo ranks whose CUDA IPC pieces are replaced by
fakes that fail the way the engine does (``make_transport``).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dualpipe_kernels.runtime import spawn
from dualpipe_kernels.transport import Transport, TransportError
from dualpipe_kernels.transport.fallback import failed_step, negotiate

EVENT_ERROR = "cudaIpcGetEventHandle failed: cudaErrorNotSupported (operation not supported)"
OPEN_ERROR = (
    "rank 1: cannot attach to the channel of peer rank 0: cudaIpcOpenMemHandle failed: cudaErrorMapBufferObjectFailed"
)


class _Built(Transport):
    """Stands for a CudaIpcTransport that was built; records close()."""

    name = "built"

    def __init__(self, rank: int) -> None:
        super().__init__(30.0)
        self._rank = rank
        self.closed = False

    @property
    def rank(self) -> int:
        return self._rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Any:
        raise AssertionError("not used")

    irecv = isend

    def close(self) -> None:
        self.closed = True


def _run_ranks(world: int, fail: dict[tuple[str, int], str]) -> tuple[list[Any], list[int], list[_Built]]:
    """Each rank (a thread) negotiates; ``fail[(phase, rank)]`` makes that rank's probe or build raise."""
    store = dist.HashStore()
    out: list[Any] = [None] * world
    builds: list[int] = []
    built: list[_Built] = []
    lock = threading.Lock()

    def rank_main(r: int) -> None:
        def probe() -> None:
            if ("probe", r) in fail:
                raise RuntimeError(fail[("probe", r)])

        def build() -> Transport:
            with lock:
                builds.append(r)
            if ("build", r) in fail:
                raise TransportError(fail[("build", r)])
            t = _Built(r)
            with lock:
                built.append(t)
            return t

        out[r] = negotiate(store, "test", r, world, probe, build, timeout_s=10.0)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, builds, built


def test_every_rank_keeps_cuda_ipc_when_every_step_works() -> None:
    out, builds, built = _run_ranks(3, {})
    assert sorted(builds) == [0, 1, 2]
    for r, (transport, reason) in enumerate(out):
        assert isinstance(transport, _Built) and transport.rank == r and not transport.closed and reason == ""


def test_a_failed_probe_on_one_rank_stops_every_rank_before_the_rendezvous() -> None:
    out, builds, _ = _run_ranks(3, {("probe", 1): EVENT_ERROR})
    assert builds == [], "no rank may start a rendezvous that a peer will never join"
    for transport, reason in out:
        assert transport is None
        assert reason.startswith("get event handle (cudaIpcGetEventHandle) failed on rank 1: RuntimeError")


def test_a_failed_peer_open_closes_what_the_other_ranks_built() -> None:
    out, builds, built = _run_ranks(2, {("build", 1): OPEN_ERROR})
    assert sorted(builds) == [0, 1]
    assert [t.rank for t in built] == [0] and built[0].closed, "rank 0's transport must be closed"
    for transport, reason in out:
        assert transport is None
        assert "peer open (cudaIpcOpenMemHandle) failed on rank 1" in reason and "MapBufferObjectFailed" in reason


@pytest.mark.parametrize(
    ("message", "step"),
    [
        ("cudaIpcGetMemHandle failed: cudaErrorInvalidValue", "get memory handle"),
        (EVENT_ERROR, "get event handle"),
        (OPEN_ERROR, "peer open (cudaIpcOpenMemHandle)"),
        ("cannot attach to the channel of peer rank 2: bad name", "peer open (attaching"),
        ("rank 0: CUDA IPC rendezvous with peer rank 1 timed out after 60 s", "rendezvous"),
        ("something else", "build"),
    ],
)
def test_failed_step_names_the_cuda_call(message: str, step: str) -> None:
    assert failed_step("build", message).startswith(step)


def _auto_worker(rank: int, world: int) -> tuple[str, str, list[str]]:
    """make_transport("auto", cuda) with the engine replaced by one whose peer open fails on rank 1."""
    import dualpipe_kernels.transport as transport_mod
    from dualpipe_kernels.transport import cuda_ipc, fallback, make_transport

    def fake_cuda_ipc(group: Any, device: Any, timeout_s: float) -> Transport:
        if rank == 1:
            raise TransportError(OPEN_ERROR)
        return _Built(rank)

    transport_mod.native_available = lambda device=None: True  # type: ignore[assignment]
    fallback.probe_cuda_ipc = lambda device: None  # type: ignore[assignment]
    cuda_ipc.CudaIpcTransport = fake_cuda_ipc  # type: ignore[assignment,misc]
    os.environ[transport_mod.CUDA_IPC_ENV] = "1"  # "auto" may try the engine (it is off by default on GPUs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = make_transport("auto", None, torch.device("cuda", 0), timeout_s=10.0)
    kind = type(t).__name__
    dev = str(getattr(t, "device", ""))
    t.close()
    return kind, dev, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _auto_default_worker(rank: int, world: int) -> tuple[str, int]:
    """make_transport("auto", cuda) without DUALPIPE_KERNELS_CUDA_IPC: the engine is never built."""
    import dualpipe_kernels.transport as transport_mod
    from dualpipe_kernels.runtime.fingerprint import resolved_transport
    from dualpipe_kernels.transport import cuda_ipc, fallback, make_transport

    calls = []
    transport_mod.native_available = lambda device=None: True  # type: ignore[assignment]
    fallback.probe_cuda_ipc = lambda device: calls.append("probe")  # type: ignore[assignment,func-returns-value]
    cuda_ipc.CudaIpcTransport = lambda *a, **k: calls.append("build")  # type: ignore[assignment,misc]
    os.environ.pop(transport_mod.CUDA_IPC_ENV, None)
    t = make_transport("auto", None, torch.device("cuda", 0), timeout_s=10.0)
    kind = type(t).__name__
    t.close()
    assert resolved_transport("auto", torch.device("cuda", 0)) == "torch"
    return kind, len(calls)


def test_auto_on_a_gpu_uses_torch_unless_the_cuda_ipc_engine_is_asked_for() -> None:
    """The CUDA IPC engine crashed at channel set-up on the first GPU it ran on: "auto" does not pick it."""
    for rank, (kind, calls) in enumerate(spawn(_auto_default_worker, 2, timeout_s=120)):
        assert kind == "TorchDistTransport" and calls == 0, f"rank {rank}: {kind}, engine calls {calls}"


def test_make_transport_auto_falls_back_to_torch_naming_the_step() -> None:
    for rank, (kind, dev, msgs) in enumerate(spawn(_auto_worker, 2, timeout_s=120)):
        assert kind == "TorchDistTransport" and dev == "cuda:0", f"rank {rank} got {kind} on {dev}"
        assert len(msgs) == 1 and f"rank {rank}: CUDA IPC is not usable here (peer open" in msgs[0], msgs
        assert "failed on rank 1" in msgs[0] and "uses the torch transport" in msgs[0]
