"""A MoE stage chunk for the ``moe`` benchmark: sleep-timed compute, real all_to_all over an expert group.

One chunk, on expert rank ``e`` of an expert-parallel (EP) group of ``ep``
processes, maps tokens ``x [rows, cols]`` (float32) through four phases, as a
DeepSeek-V3 MoE layer does::

    h    = attn(x)            compute: sleep, then x * wa  (+ a zero weight-sleep term)
    recv = dispatch(h)        all_to_all: row block r of h goes to expert rank r
    z    = expert(recv)       compute: sleep, then recv * we
    out  = combine(z)         all_to_all: the blocks go back to the ranks they came from

The compute is a sleep (ranks sharing a small CPU do not fight for it) plus an
elementwise product whose gradients are real; the dispatch and combine are
real ``all_to_all_single`` collectives whose send buffer is padded to a
configurable size (:class:`ExpertGroup.pad_elems`), in forward and, as the
transpose exchange of the gradients, in backward.  Backward phases sleep
``I = B - W`` and defer ``W`` through the running pipeline's WeightGradStore,
like :mod:`.sleep_stages`.

Forward and backward are written once, as *phase generators* that yield each
posted all_to_all's work handle (:func:`run_phases` drives them).  A plain
forward drives one generator and waits each exchange at once.
``OverlappedMoEChunk.overlapped_forward_backward`` drives the backward of one
chunk and the forward of the other round-robin, so each all_to_all is in
flight while the other chunk computes (DeepSeek-V3, Figure 4)::

    B1: combine-grad a2a ──┐           B1: expert bwd ──┐ dispatch-grad a2a ─┐   B1: attn bwd
    F0:            attn fwd │ dispatch a2a ──────────── │ F0: expert fwd     │ combine a2a ───

Values are small integers (see :func:`init_chunk` and the data the suite
makes), so every product and sum is exact in float32 and gradients are
bit-identical whatever order a schedule accumulates them in.

Two implementations of the all_to_all (:class:`ExpertGroup`), both real
collectives over the expert group, with the same bytes and results:

* ``native`` (given a :class:`~dualpipe_kernels.transport.native.NativeTransport`
  over the expert group): each peer block, padding included, is one send and
  one receive on the shared-memory engine, whose per-peer worker threads move
  it (a single ``process_vm_readv`` copy for large blocks) while the posting
  thread goes on; the own block's tokens are a local copy on the group's copy
  thread (off the compute thread, as a GPU all_to_all copies it on its
  communication stream), its padding is not copied (it would not cross a link
  on a GPU; see :func:`_native_all_to_all`).  Forward and backward exchanges share the
  transport, so a rank's exchanges run in posting order, like collectives on
  one communication stream: the one posted first finishes first instead of two
  sharing the copy bandwidth and both finishing late.
* ``gloo``: ``all_to_all_single`` on ``group_f`` (forward) or ``group_b``
  (backward), two process groups over the same ranks; inside a pair one of
  each is in flight at once, each group sees its collectives in the same order
  on every expert rank because every expert rank runs the same schedule.  Over
  TCP loopback every byte is copied by the kernel on both sides, several times
  the CPU work of the native path per byte.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge

from dualpipe_kernels.benchmarks.sleep_stages import WeightSleep, sleep_seconds

__all__ = [
    "ExpertGroup",
    "MoEChunk",
    "OverlappedMoEChunk",
    "init_chunk",
    "moe_criterion",
    "run_phases",
    "token_bytes",
]

Phases = Generator[Any, None, Any]  # yields posted work handles, returns the phase program's result


@dataclass
class ExpertGroup:
    """The expert-parallel group a chunk exchanges tokens over.

    ``pad_elems``: float32 zeros appended to each peer's block of every
    all_to_all (mutable: the suite sweeps it between steps, identically on
    every rank).  A send buffer is ``size * (rows // size * cols + pad_elems)``
    float32 elements.

    Owns one send and one receive buffer per direction (forward, backward),
    reused by every exchange: at most one exchange per direction is in flight
    (each phase program waits for its exchange before posting the next), and
    the padding is zeroed once, not written per exchange, so posting costs a
    copy of the tokens only.
    """

    group_f: Any
    group_b: Any
    size: int
    pad_elems: int = 0
    native: Any = None  # a NativeTransport over the expert group (its ranks = expert ranks), else gloo
    _buffers: dict[bool, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _tags: Any = field(default_factory=itertools.count, repr=False)
    _copier: ThreadPoolExecutor | None = field(default=None, repr=False)

    def close(self) -> None:
        """Stop the copy thread and close the native transport (idempotent); the groups stay the caller's."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        if self.native is not None:
            self.native.close()

    @property
    def backend(self) -> str:
        """``native`` or ``gloo``: what moves the all_to_all's bytes."""
        return "gloo" if self.native is None else "native"

    def a2a_bytes(self, rows: int, cols: int) -> int:
        """Bytes of one rank's send buffer in one all_to_all of a ``[rows, cols]`` token block."""
        return 4 * self.size * (rows // self.size * cols + self.pad_elems)

    def _pair(self, backward: bool, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, receive) ``[size, block + pad_elems]`` buffers of a direction, made anew when the size changes."""
        shape = (self.size, block + self.pad_elems)
        bufs = self._buffers.get(backward)
        if bufs is None or tuple(bufs[0].shape) != shape:
            bufs = (torch.zeros(shape), torch.zeros(shape))
            self._buffers[backward] = bufs
        return bufs

    def post(self, x: torch.Tensor, backward: bool) -> Phases:
        """Post the all_to_all of ``x [rows, cols]`` (yields its work), then return the received ``[rows, cols]``."""
        rows, cols = x.shape
        if rows % self.size:
            raise ValueError(f"all_to_all over {self.size} expert ranks needs rows divisible by it, got {rows}")
        block = rows // self.size * cols
        send, recv = self._pair(backward, block)
        send[:, :block].copy_(x.detach().reshape(self.size, block))
        if self.native is not None:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix="moe-a2a-copy")
            yield _native_all_to_all(self.native, self._copier, recv, send, next(self._tags), block)
        else:
            group = self.group_b if backward else self.group_f
            yield dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)
        return recv[:, :block].reshape(rows, cols).clone()

    def exchange(self, x: torch.Tensor, backward: bool) -> torch.Tensor:
        """The same all_to_all, waited at once."""
        return run_phases(self.post(x, backward))[0]


class _NativeAllToAll:
    """The work of one all_to_all posted on the native transport: its per-peer transfers and its local copy."""

    def __init__(self, handles: list[Any], local: Future[Any]) -> None:
        self._handles = handles
        self._local = local

    def wait(self) -> None:
        """Every transfer done (each wait bounded by the transport's timeout, whose error names the peer)."""
        for h in self._handles:
            h.wait()
        self._local.result()


def _native_all_to_all(
    transport: Any, copier: ThreadPoolExecutor, recv: torch.Tensor, send: torch.Tensor, tag: int, local: int
) -> _NativeAllToAll:
    """Post block ``p`` of ``send [size, n]`` to expert rank ``p`` and receive its block for us into ``recv[p]``.

    The receives go first, so a peer's large send finds its receive posted; the own block's first ``local``
    elements (its tokens) are copied on ``copier`` (torch's copy releases the GIL), so posting returns at
    once.  The own block's padding is not copied: the padding stands for the bytes that cross the expert
    group's links, and on a GPU the own block never crosses one (it is a device-local copy at memory
    bandwidth, a few percent of the link's time), whereas here a copy of it would cost the cores as much
    as a peer block does.  ``tag``: the same sequence number on every expert rank.
    """
    me = transport.rank
    handles = []
    for p in range(send.shape[0]):
        if p != me:
            handles.append(transport.irecv(recv[p], p, tag, f"all_to_all {tag}: block from expert rank {p}"))
    for p in range(send.shape[0]):
        if p != me:
            handles.append(transport.isend(send[p], p, tag, f"all_to_all {tag}: block to expert rank {p}"))
    return _NativeAllToAll(handles, copier.submit(recv[me, :local].copy_, send[me, :local]))


def run_phases(*programs: Phases) -> list[Any]:
    """Drive phase generators round-robin; return their results in order.

    Each turn waits for the exchange a program posted on its previous turn,
    then runs it up to its next posted exchange, so one program's exchange is
    in flight while the next program computes.
    """
    live: list[tuple[int, Phases, Any]] = [(i, p, None) for i, p in enumerate(programs)]
    results: list[Any] = [None] * len(programs)
    while live:
        still = []
        for i, prog, work in live:
            if work is not None:
                work.wait()
            try:
                still.append((i, prog, next(prog)))
            except StopIteration as done:
                results[i] = done.value
        live = still
    return results


class _Compute(torch.autograd.Function):
    """Identity in value; forward sleeps ``f_s``, backward sleeps ``i_s`` (the phase's input-gradient work)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f_s: float, i_s: float) -> torch.Tensor:
        sleep_seconds(f_s)
        ctx.i_s = i_s
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        sleep_seconds(ctx.i_s)
        return g, None, None


class _AllToAll(torch.autograd.Function):
    """Wires an exchange already done (``received[0]``) into autograd; backward exchanges the gradient back.

    ``received`` is a one-element list, not a tensor argument, so autograd
    does not treat it as an input.  ``tape`` (the combine of a chunk) is kept
    on the node, where the overlap hook finds it from the chunk's output or loss.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ExpertGroup, received: list[torch.Tensor], tape: Any) -> torch.Tensor:
        ctx.group = group
        if tape is not None:
            ctx.moe_tape = tape
        return received[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.group.exchange(g.contiguous(), backward=True), None, None, None


@dataclass
class _Tape:
    """What the backward phases of one chunk call need: its intermediate tensors (``h``, ``recv``, ``z``)."""

    h: torch.Tensor
    recv: torch.Tensor
    z: torch.Tensor


class MoEChunk(nn.Module):
    """One stage chunk (module docstring); costs in seconds per micro-batch.

    ``f_s``, ``b_s``, ``w_s``: the chunk's forward, full backward and
    weight-gradient compute, split evenly over its two compute phases.
    Input and output: one float32 ``[rows, cols]`` tensor, ``rows`` divisible
    by the expert group's size.
    """

    def __init__(self, cols: int, group: ExpertGroup, f_s: float, b_s: float, w_s: float) -> None:
        super().__init__()
        if not (f_s >= 0 and b_s >= 0 and 0 <= w_s <= b_s):
            raise ValueError(f"chunk costs need F, B, W >= 0 and W <= B (seconds), got F={f_s} B={b_s} W={w_s}")
        self.group = group
        self.f_phase, self.i_phase, self.w_phase = f_s / 2, (b_s - w_s) / 2, w_s / 2
        self.wa = nn.Parameter(torch.ones(cols))
        self.we = nn.Parameter(torch.ones(cols))
        self.wa_sleep = nn.Parameter(torch.zeros(1))
        self.we_sleep = nn.Parameter(torch.zeros(1))
        self.overlapped_pairs = 0

    def _compute(self, x: torch.Tensor, w: torch.Tensor, w_sleep: torch.Tensor) -> torch.Tensor:
        u = _Compute.apply(x, self.f_phase, self.i_phase)
        return u * w + WeightSleep.apply(w_sleep, u, self.w_phase, True)

    def forward_phases(self, x: torch.Tensor) -> Phases:
        """The chunk's forward; yields at its dispatch and combine, returns ``out``."""
        h = self._compute(x, self.wa, self.wa_sleep)
        got = yield from self.group.post(h, backward=False)
        recv = _AllToAll.apply(h, self.group, [got], None)
        z = self._compute(recv, self.we, self.we_sleep)
        got = yield from self.group.post(z, backward=False)
        return _AllToAll.apply(z, self.group, [got], _Tape(h, recv, z))

    def backward_phases(self, tape: _Tape, grad_out: torch.Tensor) -> Phases:
        """The chunk's full backward from ``grad_out``; yields at the two gradient exchanges.

        Autograd runs each compute phase up to the next exchange only (the
        exchange nodes of the forward graph are not run: their exchanges are
        posted here, asynchronously), and parameter gradients add into ``.grad``.
        """
        g_z = yield from self.group.post(grad_out.contiguous(), backward=True)
        g_recv, *g_params = torch.autograd.grad(tape.z, [tape.recv, self.we, self.we_sleep], g_z)
        for p, g in zip((self.we, self.we_sleep), g_params, strict=True):
            p.grad = g if p.grad is None else p.grad + g
        g_h = yield from self.group.post(g_recv, backward=True)
        torch.autograd.backward([tape.h], [g_h])
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_phases(self.forward_phases(x))[0]


def _tape_node(t: torch.Tensor, what: str) -> Any:
    """The combine node of the chunk whose output ``t`` is or feeds (a breadth-first walk of its graph)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop(0)
        if node is None or node in seen:
            continue
        if hasattr(node, "moe_tape"):
            return node
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    raise RuntimeError(f"overlap hook: {what} does not come from a MoEChunk forward (no combine node in its graph)")


class OverlappedMoEChunk(MoEChunk):
    """MoEChunk plus the F&B overlap hook the runtime calls for a pair ``(F of module0; B of module1)``."""

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: nn.Module,
        inputs0: Sequence[torch.Tensor],
        criterion0: Any,
        labels0: Sequence[torch.Tensor],
        module1: nn.Module,
        loss1: torch.Tensor | None,
        outputs1: Sequence[torch.Tensor],
        output_grads1: Sequence[torch.Tensor],
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Chunk 1's backward phases and chunk 0's forward phases, interleaved; returns ``([out0], loss0)``."""
        if not isinstance(module0, MoEChunk) or not isinstance(module1, MoEChunk):
            raise TypeError("overlapped_forward_backward needs two MoEChunk modules")
        if loss1 is not None:
            node = _tape_node(loss1, "loss1")
            (grad_out,) = torch.autograd.grad(loss1, [GradientEdge(node, 0)])
        else:
            if len(outputs1) != 1 or len(output_grads1) != 1:
                raise ValueError(
                    f"overlap hook: expected one output and one gradient, got {len(outputs1)}, {len(output_grads1)}"
                )
            node, grad_out = _tape_node(outputs1[0], "outputs1[0]"), output_grads1[0]
        _, out0 = run_phases(module1.backward_phases(node.moe_tape, grad_out), module0.forward_phases(inputs0[0]))
        loss0 = criterion0(out0, *labels0) if criterion0 is not None else None
        module0.overlapped_pairs += 1
        return [out0], loss0


def init_chunk(chunk: MoEChunk, seed: int) -> MoEChunk:
    """Small-integer weights (1 or 2) from ``seed``, so every gradient of the benchmark is exact in float32."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        chunk.wa.copy_(torch.randint(1, 3, chunk.wa.shape, generator=gen).float())
        chunk.we.copy_(torch.randint(1, 3, chunk.we.shape, generator=gen).float())
    return chunk


def moe_criterion(out: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
    """Sum of the outputs (labels ignored): a gradient of ones, exact in any summation order."""
    return out.sum()


def token_bytes(rows: int, cols: int) -> int:
    """Bytes of one micro-batch of tokens (the pipeline's boundary activation)."""
    return 4 * rows * cols
