"""A CPU transport that behaves, for the runtime, like a device wire, and catches every host read of it.

``StrictWire`` wraps a gloo ``TorchDistTransport``: it declares itself a device wire (``host_wire`` False, as
NCCL or CUDA IPC are), so the runtime must treat everything it posts or receives as device memory; every
tensor posted to it (and so every view of that storage) is remembered as a *wire tensor*.  ``HostReadGuard``
is a ``__torch_function__`` mode that, while on, records and refuses every host read of a wire tensor:
``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``, ``bool()``, ``int()``, ``float()``,
and patches ``torch.cuda.synchronize``, ``Stream.synchronize`` and ``Event.synchronize`` to count calls.

Headers travel on the wrapped transport itself (``host_channel``: host memory, not wire tensors).  With an
``ordered=True`` inner transport the wire is an in-order one (as NCCL), whose channels are marked too.

Module level so spawned ranks can import it (tests/ is on sys.path).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from dualpipe_kernels.transport.base import Handle, Transport

_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class _Registry:
    """Storages of the tensors posted to a strict wire (by address; an entry lives as long as its tensor)."""

    def __init__(self) -> None:
        self._by_ptr: dict[int, weakref.ReferenceType[torch.Tensor]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if tensor.numel() > 0:
            self._by_ptr[tensor.untyped_storage().data_ptr()] = weakref.ref(tensor)

    def holds(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        ref = self._by_ptr.get(tensor.untyped_storage().data_ptr())
        return ref is not None and ref() is not None


class StrictWire(Transport):
    """A device wire on CPU (see the module docstring); ``registry`` holds its wire tensors."""

    name = "strict_wire"

    def __init__(self, inner: Transport, registry: _Registry | None = None, channel: int | None = None) -> None:
        super().__init__(inner.timeout_s)
        self.inner = inner
        self.registry = registry if registry is not None else _Registry()
        self.device = torch.device("cpu")
        self.device_native = True
        self._channel = channel

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def host_wire(self) -> bool:
        return False

    @property
    def matches_tags(self) -> bool:
        return self.inner.matches_tags

    @property
    def recv_lookahead(self) -> int:
        return self.inner.recv_lookahead

    def in_order(self, channel: int) -> Transport:
        return StrictWire(self.inner.in_order(channel), self.registry, channel)

    def host_channel(self) -> Transport:
        return self.inner.host_channel() if not self.inner.matches_tags else self.inner

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.registry.add(tensor)
        return self.inner.isend(tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.registry.add(tensor)
        return self.inner.irecv(tensor, peer, tag, what)

    def close(self) -> None:
        if self._channel is None:
            self.inner.close()


class HostReadGuard(TorchFunctionMode):
    """While on: every host read of a wire tensor of ``registry`` is recorded in ``reads`` and raises; every
    CUDA synchronize is counted in ``syncs``."""

    def __init__(self, registry: _Registry) -> None:
        super().__init__()
        self.registry = registry
        self.reads: list[str] = []
        self.syncs: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = name in _READS or (name == "to" and _to_host(args[1:], kwargs))
        if read and args and isinstance(args[0], torch.Tensor) and self.registry.holds(args[0]):
            self.reads.append(f"{name} of a wire tensor {tuple(args[0].shape)} {args[0].dtype}")
            raise AssertionError(f"host read of a wire tensor: {self.reads[-1]}")
        return func(*args, **kwargs)

    def __enter__(self) -> HostReadGuard:
        for owner, attr in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda.Event, "synchronize")):  # fmt: skip
            original = getattr(owner, attr)
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._counting(f"{getattr(owner, '__name__', owner)}.{attr}", original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()
        super().__exit__(*exc)

    def _counting(self, label: str, original: Any) -> Any:
        def synchronize(*args: Any, **kwargs: Any) -> Any:
            self.syncs.append(label)
            return original(*args, **kwargs)

        return synchronize


def _to_host(args: Any, kwargs: Any) -> bool:
    """Whether a ``Tensor.to`` call names the CPU as its target device."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False
