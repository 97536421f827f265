"""What a stage module receives and returns: the calling convention of stages and of the layers inside them.

A layer's (or a stage's) output becomes the next one's arguments:

* a tensor (or any single object that is not a tuple, list or dict): one positional argument;
* a tuple or list: its members are the positional arguments, in order;
* a dict: its items are the keyword arguments.

Inside a :class:`~dualpipe_kernels.runtime.stages.StageLayers` this is how one
layer's output is fed to the next (:func:`run_layers`).  Across a stage boundary
the members travel as one message (tensors and ``None``; tensors that do not
require grad, such as bool masks and int64 position ids, travel exactly under
every boundary format and get no gradient).  A dict crosses a boundary as its
values followed by one small uint8 tensor naming its keys (:func:`flatten_outputs`;
the receiving side turns it back into keyword arguments with :func:`call_args`),
so nothing in the boundary protocol changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["call_args", "flatten_outputs", "run_layers", "next_args", "is_keys_member"]

# A dict's keys travel as UTF-8 after this prefix; a uint8 tensor of a user's that starts with these 12 bytes
# and ends a message would be read as keys (the prefix holds two 0xff bytes, invalid in UTF-8 text).
_KEYS_PREFIX = b"\xffDPK:kwargs\xff"
_PREFIX = torch.frombuffer(bytearray(_KEYS_PREFIX), dtype=torch.uint8)


def next_args(out: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the layer after one that returned ``out`` (see the module docstring)."""
    if isinstance(out, (tuple, list)):
        return tuple(out), {}
    if isinstance(out, Mapping):
        bad = [k for k in out if not isinstance(k, str)]
        if bad:
            raise ValueError(f"a layer returned a dict with non-string keys {bad[:3]}; keys must be argument names")
        return (), dict(out)
    return (out,), {}


def run_layers(layers: Iterable[nn.Module], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Call ``layers`` in order, each with the previous one's output as its arguments; the last output."""
    out: Any = None
    first = True
    for layer in layers:
        if not first:
            args, kwargs = next_args(out)
        out = layer(*args, **kwargs)
        first = False
    if first:  # no layer: the arguments pass through
        return args[0] if len(args) == 1 and not kwargs else (dict(kwargs) if kwargs and not args else args)
    return out


def _keys_member(keys: Iterable[str]) -> torch.Tensor:
    text = "\0".join(keys).encode()
    return torch.cat([_PREFIX, torch.frombuffer(bytearray(text), dtype=torch.uint8)]) if text else _PREFIX.clone()


def is_keys_member(t: Any) -> bool:
    """Whether ``t`` is the keys member that ends a dict's message (see :func:`flatten_outputs`)."""
    n = _PREFIX.numel()
    return (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.uint8
        and t.dim() == 1
        and t.numel() >= n
        and bool(torch.equal(t[:n].cpu(), _PREFIX))
    )


def flatten_outputs(out: Any, stage: int) -> tuple[Any, ...]:
    """A stage's output as the members of its boundary message: a tensor -> ``(t,)``, a tuple as is,
    a dict -> its values and a keys member.  Members must be tensors or None."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, Mapping):
        _, kwargs = next_args(out)
        members: tuple[Any, ...] = (*kwargs.values(), _keys_member(kwargs))
    elif isinstance(out, (tuple, list)):
        members = tuple(out)
    else:
        raise ValueError(
            f"stage {stage} returned {type(out).__name__}; a stage must return a tensor, a tuple of tensors "
            "or a dict of tensors (None members allowed)"
        )
    return members


def call_args(ins: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` of a stage whose inputs (as received or given) are ``ins``."""
    if ins and is_keys_member(ins[-1]):
        raw = bytes(ins[-1][_PREFIX.numel() :].cpu().tolist())
        keys = raw.decode().split("\0") if raw else []
        values = ins[:-1]
        if len(keys) != len(values):
            raise ValueError(f"a dict message names {len(keys)} keys for {len(values)} values")
        return [], dict(zip(keys, values, strict=True))
    return ins, {}
