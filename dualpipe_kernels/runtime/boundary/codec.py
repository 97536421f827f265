"""Boundary formats: how the tensors of one boundary message become transfers, and back.

``none`` (the default): one transfer per tensor, at full precision.  ``packed``:
the message's tensors packed into one uint8 buffer (:func:`dualpipe_kernels.kernels.pack`),
bit for bit, one transfer.  ``bf16`` / ``fp8`` / ``fp8_pow2``: packed, with the
tensors that carry gradient cast on the way (fp32/fp16 -> bf16; fp32/fp16/bf16 ->
e4m3 with one fp32 scale per 128 elements, scales in the same buffer).

What stays exact under a lossy format: every tensor of an activation message
that does not require grad (ids, masks, float constants such as an additive
attention mask, which may hold -inf), besides what the kernels never cast
(integers, bool, float64, complex).  Gradients are all cast.  An exact float
tensor is packed as the integer dtype of its width (a free ``view``), so the
kernels carry its bits unchanged.  In a forward-only step nothing requires
grad, so nothing is cast.

Activations and gradients have their own format (:class:`BoundaryFormat`);
the end-of-step exchanges (mirror gradients) always use ``none``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualpipe_kernels.kernels import FORMATS as PACK_FORMATS
from dualpipe_kernels.kernels import PackLayout, plan_layout, unpack
from dualpipe_kernels.runtime.boundary.header import Layout, TensorMeta

__all__ = ["BOUNDARY_FORMATS", "BoundaryFormat", "boundary_format", "MessageCodec", "WireSpec"]

#: boundary format names (their index is the code in the metadata)
BOUNDARY_FORMATS = ("none", *PACK_FORMATS)
_GRADIENTS = 1  # TagSpace direction of gradient messages
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

WireSpec = tuple[int, torch.dtype, tuple[int, ...]]
"""One data transfer of a message: (slot index within the message, dtype, shape)."""


@dataclass(frozen=True)
class BoundaryFormat:
    """The boundary format of activation messages and of gradient messages (names in :data:`BOUNDARY_FORMATS`)."""

    activations: str = "none"
    gradients: str = "none"

    def __post_init__(self) -> None:
        for what, name in (("activations", self.activations), ("gradients", self.gradients)):
            if name not in BOUNDARY_FORMATS:
                names = ", ".join(BOUNDARY_FORMATS)
                raise ValueError(f"boundary_format: unknown format {name!r} for {what}; expected one of {names}")

    def for_direction(self, direction: int) -> str:
        """The format of messages of TagSpace ``direction`` (0 activations, 1 gradients, 2 end-of-step: none)."""
        return (self.activations, self.gradients, "none")[direction]

    def __str__(self) -> str:
        if self.activations == self.gradients:
            return self.activations
        return f"{self.activations},{self.gradients}"


def boundary_format(spec: object) -> BoundaryFormat:
    """A :class:`BoundaryFormat` from ``spec``: None, a name (both directions), ``"act,grad"``, a pair, or one."""
    if spec is None:
        return BoundaryFormat()
    if isinstance(spec, BoundaryFormat):
        return spec
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) == 1:
            return BoundaryFormat(parts[0], parts[0])
        if len(parts) == 2:
            return BoundaryFormat(parts[0], parts[1])
    elif isinstance(spec, (tuple, list)) and len(spec) == 2 and all(isinstance(p, str) for p in spec):
        return BoundaryFormat(spec[0], spec[1])
    raise ValueError(
        f"boundary_format: expected a format name ({', '.join(BOUNDARY_FORMATS)}), 'activations,gradients', "
        f"a pair of names or a BoundaryFormat; got {spec!r}"
    )


def _exact_view(dtype: torch.dtype) -> torch.dtype:
    """The dtype an exact tensor is packed as: floats as the integer of their width, the rest as is."""
    return _INT_OF_WIDTH[dtype.itemsize] if dtype.is_floating_point else dtype


class MessageCodec:
    """Turns the tensors of messages of one format and direction into transfers, and received buffers back."""

    def __init__(self, fmt: str, direction: int) -> None:
        if fmt not in BOUNDARY_FORMATS:
            raise ValueError(f"unknown boundary format {fmt!r}; expected one of {', '.join(BOUNDARY_FORMATS)}")
        self.format = fmt
        self.code = BOUNDARY_FORMATS.index(fmt)
        self.packed = fmt != "none"
        self._lossy = fmt not in ("none", "packed")
        self.direction = direction

    def exact(self, dtype: torch.dtype, requires_grad: bool) -> bool:
        """Whether a tensor is carried bit for bit although the format is lossy (see the module docstring)."""
        return self._lossy and self.direction != _GRADIENTS and not requires_grad and dtype.is_floating_point

    # (Loops, not generator expressions: these run for every boundary message.)
    def layout(self, tensors: Sequence[torch.Tensor | None], grad_flags: Sequence[bool]) -> Layout:
        lossy = self._lossy
        out: list[tuple[torch.dtype, tuple[int, ...], bool] | None] = []
        for t, g in zip(tensors, grad_flags, strict=False):
            if t is None:
                out.append(None)
            else:
                out.append((t.dtype, tuple(t.shape), lossy and self.exact(t.dtype, bool(g))))
        return tuple(out)

    def layout_of(self, metas: Sequence[TensorMeta | None]) -> Layout:
        lossy = self._lossy
        out: list[tuple[torch.dtype, tuple[int, ...], bool] | None] = []
        for m in metas:
            out.append(None if m is None else (m.dtype, m.shape, lossy and self.exact(m.dtype, m.requires_grad)))
        return tuple(out)

    def pack_layout(self, layout: Layout) -> PackLayout | None:
        """The packed buffer's layout for a message of ``layout`` (None when unpacked or no tensor)."""
        specs = [(_exact_view(e[0]) if e[2] else e[0], e[1]) for e in layout if e is not None]
        return plan_layout(specs, self.format) if self.packed and specs else None

    def wire_specs(self, layout: Layout) -> list[WireSpec]:
        """The data transfers of a message of ``layout`` (zero-size ones are not sent)."""
        if not self.packed:
            return [(i, e[0], e[1]) for i, e in enumerate(layout) if e is not None and 0 not in e[1]]
        pl = self.pack_layout(layout)
        return [(0, torch.uint8, (pl.nbytes,))] if pl is not None and pl.nbytes > 0 else []

    def pack_inputs(
        self, tensors: Sequence[torch.Tensor | None], layout: Layout, device: torch.device
    ) -> list[torch.Tensor]:
        """The tensors ``pack`` reads (on ``device``), exact ones viewed as integers."""
        out = []
        for t, e in zip(tensors, layout, strict=True):
            if t is not None:
                assert e is not None, "a tensor's layout entry is never None"
                t = t.detach().to(device)
                out.append(t.view(_exact_view(t.dtype)) if e[2] else t)
        return out

    def alloc(
        self, layout: Layout, device: torch.device
    ) -> tuple[list[torch.Tensor | None], list[tuple[int, torch.Tensor]]]:
        """(the message's tensors, new on ``device``; the (slot, buffer) transfers to receive for them).

        Unpacked: the buffers are the tensors themselves; packed: one uint8
        buffer that :meth:`finish` unpacks into the tensors once it has arrived.
        """
        tensors: list[torch.Tensor | None] = [
            None if e is None else torch.empty(e[1], dtype=e[0], device=device) for e in layout
        ]
        if not self.packed:
            return tensors, [(i, t) for i, t in enumerate(tensors) if t is not None and t.numel() > 0]
        return tensors, [
            (slot, torch.empty(shape, dtype=dt, device=device)) for slot, dt, shape in self.wire_specs(layout)
        ]

    def finish(
        self, tensors: list[torch.Tensor | None], buffers: Sequence[tuple[int, torch.Tensor]], layout: Layout
    ) -> list[torch.Tensor | None]:
        """``tensors`` filled from the received ``buffers`` (after the transfers completed)."""
        if self.packed and buffers:
            self.unpack_into(tensors, layout, buffers[0][1])
        return tensors

    def unpack_into(self, tensors: Sequence[torch.Tensor | None], layout: Layout, packed: torch.Tensor) -> None:
        """Unpack the packed buffer of a message of ``layout`` into its (allocated) ``tensors``."""
        pl = self.pack_layout(layout)
        assert pl is not None
        targets: list[torch.Tensor] = []
        for t, e in zip(tensors, layout, strict=True):
            if e is not None:
                assert t is not None, "every layout entry has a tensor"
                targets.append(t.view(_exact_view(t.dtype)) if e[2] else t)
        unpack(packed, pl, out=targets)
