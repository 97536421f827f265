"""Zero-bubble backward split: input gradients now (I), weight gradients later (W).

Two mechanisms, both per pipeline instance:

* **Graph split** (ordinary modules, no custom code).  At I the stage's
  autograd graph is walked once: nodes on a path from the stage outputs to the
  stage inputs form the *input closure*.  For every parameter the nodes of that
  closure that feed its gradient (e.g. the ``AddmmBackward`` of a Linear) are
  the param's *cut nodes*.  The I pass runs ``torch.autograd.backward`` with
  ``inputs=`` the stage inputs only, while pre-hooks on the cut nodes record
  the gradients flowing into them.  W later runs ``torch.autograd.grad`` from
  the cut nodes (with the recorded gradients) to the parameters.  Every
  gradient is computed by the same autograd node from the same incoming
  gradient as in a full backward, and W adds into ``.grad`` exactly as
  ``AccumulateGrad`` would, so the result is bit-identical to the full
  backward (for a parameter used by at most two nodes of a stage; more uses
  may sum in another order).  A stage whose inputs need no gradient (the first
  stage) defers its whole backward to W.

* **WeightGradStore** (user autograd functions that already split their own
  weight-gradient work, as in the DualPipe reference): while a store is
  *enabled* such a function calls ``store.put(fn)`` instead of computing; the
  runtime ``flush``es after the I and ``pop``s at the W.  Parameters whose
  gradient path crosses a custom autograd function are computed in the I pass
  (their function may defer through the store), never recomputed at W.

``current_store()`` returns the store of the pipeline step running in this
thread/context (a ``contextvars.ContextVar``, not a global queue: two
pipelines never share a store); the compat module's class-level facade reads it.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = [
    "WeightGradStore",
    "current_store",
    "run_backward",
    "backward_full",
    "host_backward_full",
    "full_backward_for",
    "backward_input",
    "DeferredWeightGrad",
    "ParamEdges",
]

# The store bound to the pipeline step running in this context (None outside a step).
_BOUND_STORE: contextvars.ContextVar[WeightGradStore | None] = contextvars.ContextVar(
    "dualpipe_kernels_weight_grad_store", default=None
)


def current_store() -> WeightGradStore | None:
    """The WeightGradStore of the pipeline step running now (None when no step is running)."""
    return _BOUND_STORE.get()


class WeightGradStore:
    """Deferred weight-gradient closures of one pipeline.

    ``put(fn)`` queues ``fn`` in the current cache (callers check ``enabled``
    first); ``flush(key)`` closes the cache as one unit of work under ``key``
    (default: FIFO order); ``pop(key)`` runs a unit (the oldest when ``key`` is
    None); ``clear()`` drops everything (start of each step).
    """

    def __init__(self) -> None:
        self.enabled = False
        self._cache: list[Callable[[], Any]] = []
        self._queue: collections.OrderedDict[Hashable, list[Callable[[], Any]]] = collections.OrderedDict()
        self._auto = 0

    def put(self, fn: Callable[[], Any]) -> None:
        self._cache.append(fn)

    def flush(self, key: Hashable | None = None) -> None:
        if key is None:
            key, self._auto = ("fifo", self._auto), self._auto + 1
        if key in self._queue:
            raise ValueError(f"WeightGradStore: unit {key!r} flushed twice")
        self._queue[key] = self._cache
        self._cache = []

    def pop(self, key: Hashable | None = None) -> None:
        if key is None:
            if not self._queue:
                raise ValueError("WeightGradStore.pop: nothing flushed")
            _, fns = self._queue.popitem(last=False)
        else:
            fns = self._queue.pop(key, [])
        # Deferred closures (``weight.grad += g.T @ x``) must not record autograd
        # history: under grad mode ``.grad`` would get a grad_fn that keeps the
        # step's activations alive until ``zero_grad``.
        if fns:  # (entering no_grad costs a few microseconds: not for the usual empty unit)
            with torch.no_grad():
                for fn in fns:
                    fn()

    def has(self, key: Hashable) -> bool:
        return key in self._queue

    def __len__(self) -> int:
        return len(self._queue)

    def clear(self) -> None:
        self.enabled = False
        self._cache = []
        self._queue.clear()
        self._auto = 0

    @contextlib.contextmanager
    def bind(self) -> Iterator[WeightGradStore]:
        """Make this store ``current_store()`` for the duration of the block."""
        token = _BOUND_STORE.set(self)
        try:
            yield self
        finally:
            _BOUND_STORE.reset(token)

    def enabled_for(self, on: bool) -> _Enabled:
        """A context in which ``enabled`` is ``on`` (a plain class: entered on every backward)."""
        return _Enabled(self, on)


class _Enabled:
    __slots__ = ("store", "on", "prev")

    def __init__(self, store: WeightGradStore, on: bool) -> None:
        self.store, self.on, self.prev = store, on, store.enabled

    def __enter__(self) -> None:
        self.prev, self.store.enabled = self.store.enabled, self.on

    def __exit__(self, *exc: object) -> None:
        self.store.enabled = self.prev


def run_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Backward from ``tensors`` with ``grads``, accumulating into leaves' ``.grad``.

    Uses the graph edges, not the tensors' data, so it works after the runtime
    freed a sent activation's storage (the reference's ``run_backward``).
    """
    pairs = [(t, g) for t, g in zip(tensors, grads, strict=False) if g is not None]
    if not pairs:
        return
    edges = [get_gradient_edge(t) for t, _ in pairs]
    torch.autograd.backward(edges, [g for _, g in pairs])


# torch.autograd.backward's call into the engine, without its per-call argument handling (tensor-or-list
# normalisation, __torch_function__ dispatch, _make_grads' shape checks): ~20 us per backward on this
# runtime's hot path.  None on a torch that lacks it: the public function is used then.
_ENGINE_RUN = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _backward(
    roots: Sequence[tuple[GradientEdge, torch.Tensor | None]],
    retain_graph: bool = False,
    inputs: Sequence[GradientEdge] = (),
) -> None:
    """``torch.autograd.backward(edges, grads, retain_graph, inputs=inputs)`` for ``(edge, grad)`` roots.

    The runtime builds every root gradient itself (the received gradient of an
    output, or the loss seed), so the public function's checks are skipped
    when every gradient is a tensor; the engine call is the same.
    """
    edges, grads = zip(*roots, strict=True)  # no generator expressions: this runs for every backward
    if _ENGINE_RUN is None or _has_none(grads):
        torch.autograd.backward(list(edges), list(grads), retain_graph=retain_graph, inputs=list(inputs) or None)
        return
    _ENGINE_RUN(edges, grads, retain_graph, False, tuple(inputs), allow_unreachable=True, accumulate_grad=True)


def _has_none(items: Sequence[object]) -> bool:
    for x in items:
        if x is None:
            return True
    return False


# The engine itself, under _ENGINE_RUN (which checks torch's autograd debug logging and stashes the caller's
# context variables for the engine's device threads): for a backward of host tensors, which the engine runs
# on the calling thread, neither is needed.  ~4 us per backward.  None on a torch without it.
_RUN_BACKWARD = getattr(getattr(torch.autograd.Variable, "_execution_engine", None), "run_backward", None)


def _full_backward(engine: Callable[..., Any] | None, doc: str) -> Callable[[Sequence[Any]], None]:
    """A full backward from ``(edge, grad)`` roots through ``engine`` (_ENGINE_RUN's signature) when no grad
    is None, else through :func:`_backward` (the public function)."""

    def full(roots: Sequence[tuple[GradientEdge, torch.Tensor | None]]) -> None:
        if not roots:
            return
        if engine is not None:  # :func:`_backward` inline (once per backward): the engine call when no grad is None
            edges, grads = zip(*roots, strict=True)
            for g in grads:
                if g is None:
                    break
            else:
                engine(edges, grads, False, False, (), True, True)  # allow_unreachable, accumulate_grad
                return
        _backward(roots)

    full.__doc__ = doc
    return full


backward_full = _full_backward(
    _ENGINE_RUN, "Full backward from ``(edge, grad)`` roots (grad None: a scalar loss, gradient 1)."
)
host_backward_full = _full_backward(
    _RUN_BACKWARD,
    ":func:`backward_full` for stages on the host (see :func:`full_backward_for`): the engine called directly.",
)


def full_backward_for(modules: Iterable[torch.nn.Module]) -> Callable[[Sequence[Any]], None]:
    """The full backward for stages ``modules``: :func:`host_backward_full` when every parameter and buffer
    of them is on the host, CUDA was never initialised in this process and torch's autograd debug logging is
    off (its hooks come from the wrapper skipped there), else :func:`backward_full`."""
    import logging

    on_host = all(t.device.type == "cpu" for m in modules for t in (*m.parameters(), *m.buffers()))
    quiet = logging.getLogger("torch.autograd.graph").getEffectiveLevel() > logging.DEBUG  # torch's own logger
    if on_host and quiet and _RUN_BACKWARD is not None and not torch.cuda.is_initialized():
        return host_backward_full
    return backward_full


def _is_custom(node: Node) -> bool:
    return isinstance(node, torch.autograd.function.BackwardCFunction)


@dataclass
class _Group:
    """Parameters whose W pass starts from the same cut nodes."""

    params: list[torch.Tensor] = field(default_factory=list)
    param_edges: list[GradientEdge] = field(default_factory=list)  # each parameter's AccumulateGrad edge
    cut_nodes: list[Node] = field(default_factory=list)
    root_edges: list[tuple[GradientEdge, torch.Tensor | None]] = field(default_factory=list)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class DeferredWeightGrad:
    """The W half of one (stage, micro-batch) backward; ``run()`` once, in micro-batch order."""

    groups: list[_Group]

    def run(self) -> None:
        groups, self.groups = self.groups, []
        # No history for the accumulation into ``.grad`` (autograd.grad itself
        # runs fine under no_grad: it only stops *recording* new graph).
        with torch.no_grad():
            for g in groups:
                _run_group(g)

    def __bool__(self) -> bool:
        return bool(self.groups)


def _run_group(g: _Group) -> None:
    edges: list[GradientEdge] = []
    grads: list[torch.Tensor | None] = []
    for node in g.cut_nodes:
        for i, gr in enumerate(g.captured.get(node, ())):
            if gr is not None:
                edges.append(GradientEdge(node, i))
                grads.append(gr)
    for e, gr in g.root_edges:
        edges.append(e)
        grads.append(gr)
    if not edges:
        return
    handles = []
    if len(g.cut_nodes) > 1:
        # A cut node may lie below another one: clamp each to its recorded
        # gradient so contributions from above are not counted twice.
        for node in g.cut_nodes:
            saved = g.captured.get(node)
            if saved is not None:
                handles.append(node.register_prehook(lambda _grads, s=saved: s))
    try:
        if _ENGINE_RUN is not None:
            # torch.autograd.grad's engine call without its per-call argument handling: every gradient here
            # is a tensor autograd itself produced (or the caller's root gradient) for exactly its edge.
            dws = _ENGINE_RUN(
                tuple(edges), tuple(grads), True, False, tuple(g.param_edges), allow_unreachable=True,
                accumulate_grad=False,
            )  # fmt: skip
        else:
            dws = torch.autograd.grad(edges, g.param_edges, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for p, dw in zip(g.params, dws, strict=False):
            if dw is None:
                continue
            if p.grad is None:
                p.grad = dw
            else:
                p.grad += dw


class ParamEdges:
    """Each parameter's gradient edge (its AccumulateGrad node), made once and kept.

    ``get_gradient_edge`` of a leaf builds a view to reach the accumulator, two
    tensor ops per parameter per I and per W.  torch keeps a leaf's accumulator
    only while something references it, and reuses it while it lives; the edge
    kept here is such a reference, so every later graph through the parameter
    ends in the same node and the kept edge stays right.  An entry is checked
    against the parameter's identity (a replaced parameter gets a new edge).
    """

    def __init__(self) -> None:
        self._edges: dict[int, tuple[torch.Tensor, GradientEdge]] = {}

    def __call__(self, params: Sequence[torch.Tensor]) -> list[GradientEdge]:
        out = []
        for p in params:
            hit = self._edges.get(id(p))
            if hit is None or hit[0] is not p:
                hit = self._edges[id(p)] = (p, get_gradient_edge(p))
            out.append(hit[1])
        return out


def _graph(root_nodes: Sequence[Node]) -> dict[Node, list[Node]]:
    """parents[n]: the nodes that pass gradient into ``n`` (reverse of next_functions), over the root closure."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen: set[Node] = set()
    q: collections.deque[Node] = collections.deque()
    for n in root_nodes:
        if n not in seen:
            seen.add(n)
            q.append(n)
    while q:
        n = q.popleft()
        for child, _ in n.next_functions:
            if child is None:
                continue
            parents[child].append(n)
            if child not in seen:
                seen.add(child)
                q.append(child)
    return parents


def _upward(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    out: set[Node] = set()
    q: collections.deque[Node] = collections.deque(n for n in starts if n in parents)
    out.update(q)
    while q:
        n = q.popleft()
        for p in parents.get(n, ()):
            if p not in out:
                out.add(p)
                q.append(p)
    return out


def backward_input(
    roots: Sequence[tuple[GradientEdge, torch.Tensor | None]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    param_edges: Sequence[GradientEdge] | None = None,
) -> DeferredWeightGrad:
    """The I half: gradients into ``inputs``' ``.grad`` now; return the W half for ``params``.

    ``roots``: ``(gradient edge of a stage output, its gradient)``; a None
    gradient means a scalar loss (gradient 1).  ``inputs``: the stage's leaf
    inputs that require grad.  Parameters reached through a custom autograd
    function get their gradient now (that function may defer via the store).
    ``param_edges``: ``get_gradient_edge(p)`` of each of ``params``, when the
    caller keeps them (a kept edge keeps the parameter's AccumulateGrad node,
    so every later graph reaches the same node: see :class:`ParamEdges`).
    """
    if not roots:
        return DeferredWeightGrad([])
    root_nodes = [e.node for e, _ in roots]
    parents = _graph(root_nodes)
    # Each leaf's edge once (get_gradient_edge builds a view per call to reach its AccumulateGrad).
    input_edges = [get_gradient_edge(x) for x in inputs]
    input_nodes = [e.node for e in input_edges]
    closure = _upward(input_nodes, parents)  # nodes that lead to a stage input
    root_set = set(root_nodes)

    eager: list[GradientEdge] = []
    groups: dict[int, _Group] = {}
    group_of_node: dict[Node, int] = {}
    if param_edges is None:
        param_edges = [get_gradient_edge(p) for p in params]
    for p, edge in zip(params, param_edges, strict=True):
        acc = edge.node
        if acc not in parents:
            continue  # unused in this stage for this micro-batch
        cuts: set[Node] = set()
        seen = {acc}
        q = collections.deque([acc])
        custom = False
        hit_roots: set[Node] = set()
        while q:
            n = q.popleft()
            custom |= _is_custom(n)
            for par in parents.get(n, ()):
                if par in closure:
                    cuts.add(par)
                    custom |= _is_custom(par)
                elif par not in seen:
                    seen.add(par)
                    q.append(par)
            if n in root_set and n not in closure:
                hit_roots.add(n)
        if custom:
            eager.append(edge)
            continue
        keys = cuts | hit_roots
        # Merge with every existing group that shares a cut node or root.
        gids = sorted({group_of_node[k] for k in keys if k in group_of_node})
        if gids:
            gid = gids[0]
        else:
            gid = max(groups, default=-1) + 1
            groups[gid] = _Group()
        grp = groups[gid]
        for other in gids[1:]:
            og = groups.pop(other)
            grp.params += og.params
            grp.param_edges += og.param_edges
            for k, v in group_of_node.items():
                if v == other:
                    group_of_node[k] = gid
        grp.params.append(p)
        grp.param_edges.append(edge)
        for k in keys:
            group_of_node[k] = gid

    for gid, grp in groups.items():
        nodes = {k for k, v in group_of_node.items() if v == gid}
        grp.cut_nodes = [n for n in nodes if n in closure]
        grp.root_edges = [(e, g) for e, g in roots if e.node in nodes and e.node not in closure]

    handles = []
    for grp in groups.values():
        for node in grp.cut_nodes:

            def record(grads_in: tuple[torch.Tensor | None, ...], node: Node = node, grp: _Group = grp) -> None:
                grp.captured[node] = tuple(grads_in)

            handles.append(node.register_prehook(record))
    try:
        targets = input_edges + eager
        if targets:
            _backward(roots, retain_graph=bool(groups), inputs=targets)
    finally:
        for h in handles:
            h.remove()
    return DeferredWeightGrad([g for g in groups.values() if g.params])
