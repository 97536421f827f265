"""One step's records of saved activations, and what the saved-tensor hooks keep in a tensor's place.

A :class:`Record` is one (stage, micro-batch)'s saved activations on a rank; :class:`StepMemory` holds a step's
records and its resident-byte count (``peak``).  Under a memory policy the pack hook of
:class:`.memory.ActivationMemory` returns, instead of a tensor, a placeholder: :class:`Dropped` (recompute),
:class:`OffloadedView` (offload), :class:`Compressed` or :class:`SavedInput` (compress);
:func:`unpack_saved`, the unpack hook, turns any of them back into the tensor autograd asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dualpipe_kernels.runtime.memory_plan import Key, MemoryPolicy
from dualpipe_kernels.runtime.memory_store import OffloadGroup

__all__ = ["Compressed", "Dropped", "OffloadedView", "Record", "SavedInput", "StepMemory", "sole_holder",
           "tensor_bytes", "unpack_saved"]  # fmt: skip


@dataclass
class Dropped:
    """Placeholder saved by a recompute forward: index of the tensor in the replay's save order."""

    rec: Record
    index: int


@dataclass
class OffloadedView:
    """Placeholder saved by offload: a view of storage ``index`` of an offload group."""

    rec: Record
    group: OffloadGroup
    index: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Record:
    """The saved activations of one (stage, micro-batch) on this rank."""

    key: Key
    policy: MemoryPolicy
    pinned: set[int]  # storages that never move: parameters, stage inputs, labels
    offload: bool
    open: bool = True
    counted: set[Any] = field(default_factory=set)  # storages (or compressed tensors) already counted
    nbytes: int = 0  # device-resident bytes of this key now
    seen: dict[Any, Any] = field(default_factory=dict)  # dedupe during the forward (holds sources alive)
    groups: list[OffloadGroup] = field(default_factory=list)  # one per forward (the last one open)
    saves: int = 0  # pack calls of the forward (recompute checks the replay against it)
    dropped: list[int] = field(default_factory=list)
    replay: Callable[[], None] | None = None
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
    recomputed: list[torch.Tensor] | None = None
    recounted: dict[int, int] = field(default_factory=dict)  # storages the recompute counted -> their bytes
    inputs: list[SavedInput] = field(default_factory=list)  # compressed stage inputs of the open forward


@dataclass
class StepMemory:
    """One step's saved-activation records on this rank (``peak``: the step's peak resident bytes)."""

    training: bool = False
    params: set[int] = field(default_factory=set)
    records: dict[Key, Record] = field(default_factory=dict)
    resident: int = 0
    peak: int = 0
    host_bytes: int = 0  # bytes the offload packs wrote to the host arena

    def add(self, rec: Record, n: int) -> None:
        rec.nbytes += n
        self.resident += n
        self.peak = max(self.peak, self.resident)


@dataclass
class Compressed:
    buffer: torch.Tensor
    layout: Any
    requires_grad: bool


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def sole_holder(t: torch.Tensor) -> bool:
    """True when no tensor but ``t`` uses its storage (False where torch cannot tell)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # The probe counts the same way (its own tensor plus the temporary storage object of the call).
    probe = torch.empty(0)
    return bool(use_count(t.untyped_storage()._cdata) <= use_count(probe.untyped_storage()._cdata))


class SavedInput:
    """A stage input saved under compress that only this runtime holds (a received tensor).

    After the forward the runtime needs the input's tensor object (for its
    ``.grad``), not its bytes: :meth:`settle` packs it and frees its storage,
    so the backward reads the packed copy and the input costs what any
    compressed activation costs.  If something took a reference to the storage
    during the forward (a view saved as is), it stays whole.
    """

    def __init__(self, full: torch.Tensor, dtype: torch.dtype | None) -> None:
        self.full: torch.Tensor | None = full  # a leaf or detached (sole holder), so no grad_fn cycle
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None
        self.layout: Any = None

    def settle(self) -> int:
        """End of the forward: pack and free the whole copy if still alone; the change of resident bytes."""
        from dualpipe_kernels.kernels import pack

        full = self.full
        assert full is not None
        if not sole_holder(full):
            return 0
        self.buffer, self.layout = pack([full.detach()], dtype=self.dtype)
        self.full = None
        full.untyped_storage().resize_(0)
        return self.buffer.numel() - tensor_bytes(full)

    def get(self) -> torch.Tensor:
        if self.full is not None:
            return self.full
        from dualpipe_kernels.kernels import unpack

        return unpack(self.buffer, self.layout)[0]  # type: ignore[arg-type]


def unpack_saved(x: Any) -> torch.Tensor:
    """The saved tensor behind what a pack hook returned (recomputing or reloading if needed)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Dropped):
        rec = x.rec
        if rec.recomputed is None:
            raise RuntimeError(
                f"stage {rec.key[0]} micro-batch {rec.key[1]}: a recomputed activation was read before its "
                "recompute (or after its release)"
            )
        return rec.recomputed[x.index]
    if isinstance(x, OffloadedView):
        storage = x.group.storage(x.index)
        return torch.empty(0, dtype=x.dtype, device=storage.device).set_(storage, x.offset, x.size, x.stride)
    if isinstance(x, SavedInput):
        return x.get()
    if isinstance(x, Compressed):
        from dualpipe_kernels.kernels import unpack

        return unpack(x.buffer, x.layout)[0]
    raise TypeError(f"saved-tensor hook got an unknown placeholder {type(x).__name__}")
