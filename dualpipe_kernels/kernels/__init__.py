"""Kernels: pack/unpack many tensors into one buffer with an optional bf16/fp8 cast (Triton + torch fallback).

Public API: :func:`pack`, :func:`unpack`, :class:`PackLayout`, :class:`LayoutCache`,
:func:`plan_layout` and :data:`FORMATS`.  Triton is imported only when a Triton
kernel is used.
"""

from dualpipe_kernels.kernels.layout import FORMATS, LayoutCache, PackLayout, format_for, plan_layout
from dualpipe_kernels.kernels.pack import pack, pack_as, resolve_backend, unpack

__all__ = [
    "FORMATS",
    "LayoutCache",
    "PackLayout",
    "format_for",
    "pack",
    "pack_as",
    "plan_layout",
    "resolve_backend",
    "unpack",
]
