"""Split a batch into micro-batches and merge micro-batch results back.

Tensors are split along ``batch_dim`` with :func:`torch.tensor_split` semantics
(uneven batches allowed: the first ``B % N`` micro-batches get one row more).
Anything else (``None``, Python numbers, strings, 0-d tensors) is a *side
input*: every micro-batch receives the same object.  Split tensors are views
of the caller's tensors; the runtime never writes into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["split_microbatches", "merge_microbatches", "batch_size_of", "SplitCache"]


def batch_size_of(values: Sequence[Any], batch_dim: int = 0) -> int | None:
    """Size of ``batch_dim`` of the first splittable tensor in ``values`` (None when there is none)."""
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[batch_dim])
    return None


def split_microbatches(
    values: Sequence[Any], num_microbatches: int, batch_dim: int = 0, uneven: bool = True
) -> list[tuple[Any, ...]]:
    """Split ``values`` into ``num_microbatches`` tuples (one per micro-batch, same length as ``values``).

    Every tensor with at least one dimension must have the same size along
    ``batch_dim`` and at least ``num_microbatches`` rows (an empty micro-batch is
    almost always a mistake).  ``uneven=False``: a size ``num_microbatches`` does
    not divide is an error naming both (``Pipeline`` passes its ``allow_uneven``).
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    size = batch_size_of(values, batch_dim)
    pieces: list[list[Any]] = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if batch_dim >= v.dim() or batch_dim < -v.dim():
                raise ValueError(f"batch_dim {batch_dim} out of range for argument {i} of shape {tuple(v.shape)}")
            if v.shape[batch_dim] != size:
                raise ValueError(
                    f"argument {i} has {v.shape[batch_dim]} rows along batch_dim {batch_dim}, "
                    f"the first tensor has {size}"
                )
            if size < num_microbatches:
                raise ValueError(
                    f"batch of {size} rows along batch_dim {batch_dim} is smaller than the schedule's "
                    f"{num_microbatches} micro-batches"
                )
            if not uneven and size % num_microbatches:
                raise ValueError(
                    f"batch of {size} rows along batch_dim {batch_dim} does not divide into {num_microbatches} "
                    "micro-batches (pass allow_uneven=True to weight each micro-batch's loss by its rows)"
                )
            pieces.append(list(torch.tensor_split(v, num_microbatches, dim=batch_dim)))
        else:
            pieces.append([v] * num_microbatches)
    if not pieces:
        return [() for _ in range(num_microbatches)]
    return list(zip(*pieces, strict=True))  # micro-batch m: (piece m of each value), no per-item Python call


#: per value: its shape, dtype and device when it is split (a tensor of >= 1 dimension), else None
_Signature = tuple[tuple[torch.Size, torch.dtype, torch.device] | None, ...]


def _signature(values: Sequence[Any]) -> _Signature:
    out: list[tuple[torch.Size, torch.dtype, torch.device] | None] = []
    for v in values:  # a loop, not a generator: once per step
        out.append((v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else None)
    return tuple(out)


class SplitCache:
    """:func:`split_microbatches` for a step that repeats the last step's batch shape (a training loop).

    Per argument kind (``"inputs"``, ``"labels"``) it remembers the signature of the last batch that passed
    the checks (each value's shape, dtype and device, or that it is a side input) with its micro-batch
    count, ``batch_dim`` and ``uneven``: a batch with the same signature is split at once, without the
    checks, which only read that signature.  The split itself always runs (``torch.tensor_split``: one
    call per tensor), so the micro-batches are views of the tensors passed now, whatever their data
    (the cache holds no tensor).  ``hits``: splits that skipped the checks.
    """

    def __init__(self) -> None:
        self._checked: dict[str, tuple[_Signature, int, int, bool]] = {}
        self.hits = 0

    def split(
        self, kind: str, values: Sequence[Any], num_microbatches: int, batch_dim: int = 0, uneven: bool = True
    ) -> list[tuple[Any, ...]]:
        """``split_microbatches(values, num_microbatches, batch_dim, uneven)`` (``kind``: which arguments)."""
        key = (_signature(values), num_microbatches, batch_dim, uneven)
        if self._checked.get(kind) != key:
            out = split_microbatches(values, num_microbatches, batch_dim, uneven)  # the checks, then the split
            self._checked[kind] = key
            return out
        self.hits += 1
        if not values:
            return [() for _ in range(num_microbatches)]
        pieces: list[Any] = []
        for v, e in zip(values, key[0], strict=True):
            pieces.append(
                torch.tensor_split(v, num_microbatches, dim=batch_dim) if e is not None else [v] * num_microbatches
            )
        return list(zip(*pieces, strict=True))


def merge_microbatches(chunks: Sequence[Sequence[torch.Tensor]], batch_dim: int = 0) -> tuple[torch.Tensor, ...]:
    """Concatenate per-micro-batch tuples of tensors along ``batch_dim`` (inverse of the split)."""
    if not chunks:
        return ()
    n = len(chunks[0])
    if any(len(c) != n for c in chunks):
        raise ValueError("micro-batches have different numbers of outputs")
    return tuple(torch.cat([c[i] for c in chunks], dim=batch_dim) for i in range(n))
