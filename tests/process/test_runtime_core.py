"""Core checks of the pipeline runtime (the big matrix lives in test_runtime_exact.py and friends).

One 2-rank spawn runs several pipelines (1F1B, DualPipeV, DualPipe, ZB1P, an
overlap-hook model whose weight gradients go through the WeightGradStore) and
compares each against the single-process reference: losses and gradients
bit-exact (``torch.equal``), DualPipe's mirrored copies within the reference's
cosine bound.  A second spawn checks that a rank that never shows up makes the
other raise within the timeout, naming the peer, the action and the
micro-batch.  The zero-bubble split is also checked in one process.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from spawn_checks import Check, results, run_checks
from torch.autograd.graph import get_gradient_edge
from toy_models import DeferredLinearFunc, accumulate_weight_grad, forward_then_backward

from dualpipe_kernels.runtime import Pipeline, WireOptions, run_backward, run_reference, spawn, spawn_outcomes
from dualpipe_kernels.runtime.zero_bubble import WeightGradStore, backward_full, backward_input, current_store
from dualpipe_kernels.schedules.generators import build_schedule
from dualpipe_kernels.schedules.trace import to_events

HIDDEN = 8


def _criterion(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.Tanh(), nn.Linear(2 * HIDDEN, HIDDEN))


def _deep() -> nn.Module:
    return nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(40)])


def _defer_to_store(weight: torch.Tensor, fn: Any) -> bool:
    """The running pipeline's WeightGradStore takes the weight-gradient work ``fn`` when it is enabled."""
    store = current_store()
    if store is None or not store.enabled:
        return False
    store.put(fn)
    return True


class _HookStage(nn.Module):
    """A stage with the reference's ``overlapped_forward_backward`` contract; counts hook calls."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(2 * HIDDEN, HIDDEN) / HIDDEN)
        self.w2 = nn.Parameter(torch.randn(HIDDEN, 2 * HIDDEN) / HIDDEN)
        self.hook_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(DeferredLinearFunc.apply(x, self.w1, _defer_to_store))
        return DeferredLinearFunc.apply(h, self.w2, _defer_to_store)

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ) -> tuple[Any, Any]:
        module0.hook_calls += 1
        return forward_then_backward(
            module0, inputs0, criterion0, labels0, loss1, outputs1, output_grads1, run_backward
        )


def _cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum()))


def _grads_match(mine: dict[int, nn.Module], ref: dict[int, nn.Module], exact: bool) -> bool:
    for s, m in mine.items():
        for p, q in zip(m.parameters(), ref[s].parameters(), strict=False):
            if p.grad is None or q.grad is None:
                if p.grad is not q.grad:
                    return False
            elif exact and not torch.equal(p.grad, q.grad):
                return False
            elif not exact and _cos_diff(p.grad, q.grad) >= 1e-13:
                return False
    return True


def _check(rank: int, name: str, make: Any, batch: int, n: int, **kw: Any) -> dict[str, bool]:
    """Run one training and one inference step of ``name``; compare with the reference."""
    sched = build_schedule(name, 2, n)
    n_model = max(sched.model_stage) + 1
    torch.manual_seed(0)
    model = [make() for _ in range(n_model)]
    torch.manual_seed(1)
    x, t = torch.randn(batch, HIDDEN), torch.randn(batch, HIDDEN)
    mine = {s: copy.deepcopy(model[sched.model_stage[s]]) for s in sched.stages_of_rank(rank)}
    single = [copy.deepcopy(m) for m in model]  # one copy per model stage: DualPipe's copies summed
    ref = {s: single[sched.model_stage[s]] for s in range(sched.num_stages)}
    # An uneven batch on purpose (10 or 11 rows over 4): allowed, with the plain sum of the micro-batch losses
    # on both sides (the reference splits it the same way; a scaled uneven step weights losses by rows).
    uneven = batch % n != 0
    if uneven:
        kw = {**kw, "allow_uneven": True, "scale_grads": False}
    pipe = Pipeline(sched, mine, timeout_s=30.0, record_timeline=True, **kw)
    res = pipe.step(x, labels=(t,), criterion=_criterion)
    ref_losses = run_reference(ref, sched, (x,), (t,), _criterion, scale_grads=not uneven)
    ref_outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    with torch.no_grad():
        run_reference(ref, sched, (x,), (t,), None, forward_only=True, outputs=ref_outputs)
        inf = pipe.step(x, labels=(t,), criterion=_criterion, return_outputs=True)
    pipe.close()
    loss_stages = [m for m in range(n) if sched.path(m)[-1] in sched.stages_of_rank(rank)]
    # A hook-less F&B pair posts its forward half's send between the halves (inside the pair's span); a
    # hooked one after the hook returns (after the pair).
    hooked = isinstance(next(iter(mine.values())), _HookStage)
    spans = {label: (t0, t1) for _, label, t0, t1 in res.timeline}
    labels = pipe._loop.labels
    early = True
    for i, j in pipe._loop.early_send.items():
        (p0, p1), (s0, s1) = spans[labels[i]], spans[labels[j]]
        early = early and (s0 >= p1 if hooked else p0 <= s0 <= s1 <= p1)
    return {
        "losses": sorted(res.losses) == loss_stages
        and all(torch.equal(res.losses[m], ref_losses[m]) for m in loss_stages),
        "grads": _grads_match(mine, ref, exact=n_model == sched.num_stages),
        "inference": all(torch.equal(inf.losses[m], ref_losses[m]) for m in loss_stages)
        and inf.outputs is not None
        and all(torch.equal(inf.outputs[m][0], ref_outputs[m][0]) for m in loss_stages),
        "timeline": len(res.timeline) == len(pipe.schedule.actions[rank])
        and all(e[0] == rank and 0.0 <= e[2] <= e[3] <= res.step_time_s for e in res.timeline)
        and len(to_events(res.timeline)) == len(res.timeline),
        "early_send": early,
        "hook": not isinstance(next(iter(mine.values())), _HookStage)
        or name == "1f1b"
        or sum(m.hook_calls for m in mine.values()) > 0,
    }


def _from_sequential(rank: int) -> dict[str, bool]:
    """DualPipe built from one nn.Sequential (uneven partition); mirror copies summed by the runtime."""
    sched = build_schedule("dualpipe", 2, 4)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(5)])
    ref_model = copy.deepcopy(model)
    pipe = Pipeline.from_sequential(sched, model, partition=[3, 2], wire=WireOptions(timeout_s=30.0))
    torch.manual_seed(1)
    x, t = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    res = pipe.step(x, labels=(t,), criterion=_criterion)
    pieces = [ref_model[:3], ref_model[3:]]
    ref = {s: pieces[sched.model_stage[s]] for s in range(sched.num_stages)}
    ref_losses = run_reference(ref, sched, (x,), (t,), _criterion)
    pipe.close()
    mine = {s: m for s, m in pipe.stage_modules.items()}
    return {
        "layers": [len(mine[s]) for s in sorted(mine)] == ([3, 2] if rank == 0 else [2, 3]),
        "losses": len(res.losses) == 2 and all(torch.equal(v, ref_losses[m]) for m, v in res.losses.items()),
        "grads": _grads_match(mine, ref, exact=False),
    }


def _core_worker(rank: int, world_size: int) -> dict[str, dict[str, bool]]:
    torch.use_deterministic_algorithms(True)
    out = {
        "from_sequential": _from_sequential(rank),
        "1f1b": _check(rank, "1f1b", _mlp, batch=10, n=4),
        "dualpipev": _check(rank, "dualpipev", _mlp, batch=11, n=4),  # uneven: last micro-batch smaller
        "dualpipe": _check(rank, "dualpipe", _mlp, batch=8, n=4),
        # 80 parameters per stage: more than one boundary message carries, so the
        # mirror-gradient exchange must pack them.
        "dualpipe_many_params": _check(rank, "dualpipe", _deep, batch=8, n=4),
        "zb1p": _check(rank, "zb1p", _mlp, batch=8, n=4),
        "dualpipev_hook_store": _check(rank, "dualpipev", _HookStage, batch=8, n=4),
        "dualpipev_hook_refmode": _check(rank, "dualpipev", _HookStage, batch=8, n=4, zero_bubble="store"),
    }
    return out


@pytest.fixture(scope="module")
def core_results() -> list[dict[str, dict[str, bool]]]:
    return spawn(_core_worker, 2, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case",
    [
        "1f1b",
        "dualpipev",
        "dualpipe",
        "dualpipe_many_params",
        "zb1p",
        "dualpipev_hook_store",
        "dualpipev_hook_refmode",
        "from_sequential",
    ],
)
def test_two_ranks_match_reference(core_results: list[dict[str, dict[str, bool]]], case: str) -> None:
    for rank, res in enumerate(core_results):
        assert res[case] == {k: True for k in res[case]}, f"rank {rank}: {res[case]}"


def _timeout_worker(rank: int, world_size: int, transport: str) -> str:
    sched = build_schedule("1f1b", 2, 2)
    torch.manual_seed(0)
    if rank == 1:
        # Bad input on rank 1 (two modules for one stage) fails at once; the rank
        # stays alive without taking part, so rank 0 must time out naming it.
        try:
            Pipeline(sched, [_mlp(), _mlp()])
        except ValueError as exc:
            time.sleep(6.0)
            return f"ValueError: {exc}"
        return "no error"
    start = time.monotonic()
    try:
        # Construction is collective (the fingerprint exchange): it already waits for rank 1 here.
        pipe = Pipeline(sched, {0: _mlp()}, timeout_s=2.0, transport=transport)
        pipe.step(torch.randn(4, HIDDEN))
    except TimeoutError as exc:
        return f"{time.monotonic() - start:.1f}|{exc}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["torch", "native"])
def test_missing_peer_times_out_naming_it(transport: str) -> None:
    outcomes = spawn_outcomes(_timeout_worker, 2, transport, timeout_s=90)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert outcomes[1].value.startswith("ValueError") and "holds 1 stage(s)" in outcomes[1].value
    elapsed, msg = outcomes[0].value.split("|", 1)
    assert float(elapsed) < 5.0
    # the fingerprint exchange at construction (runtime/fingerprint.py) names the missing peer, any transport
    assert "pipeline rank 0" in msg and "peer pipeline rank 1" in msg and "build its Pipeline" in msg, msg


@pytest.mark.parametrize("first_stage", [False, True])
def test_zero_bubble_split_is_bit_exact(first_stage: bool) -> None:
    """I now + W later (in micro-batch order) == the full backward, bit for bit."""
    torch.manual_seed(0)
    full, split = _mlp(), None
    full.append(nn.LayerNorm(HIDDEN))
    split = copy.deepcopy(full)
    xs = [torch.randn(5, HIDDEN) for _ in range(3)]
    gs = [torch.randn(5, HIDDEN) for _ in range(3)]
    deferred = []
    for x, g in zip(xs, gs, strict=False):
        a = x.clone().requires_grad_(not first_stage)
        y = full(a)
        backward_full([(get_gradient_edge(y), g)])
        b = x.clone().requires_grad_(not first_stage)
        z = split(b)
        w = backward_input([(get_gradient_edge(z), g)], [b] if not first_stage else [], list(split.parameters()))
        if not first_stage:
            assert torch.equal(a.grad, b.grad)
        assert all(p.grad is None for p in split.parameters())  # nothing before W
        deferred.append(w)
    for w in deferred:
        w.run()
    for p, q in zip(full.parameters(), split.parameters(), strict=False):
        assert torch.equal(p.grad, q.grad)


def test_weight_grad_store_is_per_instance() -> None:
    a, b = WeightGradStore(), WeightGradStore()
    log: list[str] = []
    with a.bind():
        assert current_store() is a
        with b.bind():
            assert current_store() is b
        a.put(lambda: log.append("a0"))
        a.flush(("s", 0))
    b.put(lambda: log.append("b0"))
    b.flush()
    assert current_store() is None
    b.pop()
    a.pop(("s", 0))
    assert log == ["b0", "a0"] and len(a) == 0 and len(b) == 0


class _StoreLinearFunc(torch.autograd.Function):
    """Like ``toy_models.DeferredLinearFunc`` but holds the weight on ``ctx`` (saved-tensor hooks may hand back a new
    Python object for a saved leaf, and ``.grad`` must land on the parameter itself)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,), weight = ctx.saved_tensors, ctx.weight
        accumulate_weight_grad(weight, grad, x, _defer_to_store)
        return grad @ weight, None


class _StoreStage(nn.Module):
    """An ordinary Linear plus a custom function that defers its weight gradient through the store."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StoreLinearFunc.apply(torch.tanh(self.lin(x)), self.w)


class _SavedCounter:
    """Counts tensors autograd saved for backward that are still alive (pack minus release).

    The pack hook stores a *detached* alias: a saved output that kept its
    grad_fn would form a reference cycle through the (C++) graph that no
    collector sees, so the counter itself would keep retained graphs alive.
    Leaves are not counted (parameters are not activations).
    """

    def __init__(self) -> None:
        self.live = 0

    def hooks(self) -> Any:
        counter = self

        class _Box:
            __slots__ = ("t",)

            def __init__(self, t: torch.Tensor) -> None:
                self.t = t
                counter.live += 1

            def __del__(self) -> None:
                counter.live -= 1

        def pack(t: torch.Tensor) -> Any:
            # Leaves (parameters) are saved as themselves: backward code may use their identity.
            return t if t.is_leaf else _Box(t.detach())

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda b: b.t if isinstance(b, _Box) else b)


def _no_leak_worker(rank: int, world: int) -> dict[str, Any]:
    import gc

    out: dict[str, Any] = {}
    for mode in ("split", "store"):
        torch.manual_seed(0)
        sched = build_schedule("dualpipev", 1, 4)
        stages = {s: _StoreStage() for s in sched.stages_of_rank(0)}
        pipe = Pipeline(sched, stages, zero_bubble=mode)
        counter = _SavedCounter()
        live = []
        for step in range(4):
            x, t = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(step)), torch.zeros(8, HIDDEN)
            with counter.hooks():
                pipe.step(x, labels=(t,), criterion=_criterion)
            gc.collect()
            live.append(counter.live)
        pipe.close()
        grads = [p.grad for m in stages.values() for p in m.parameters()]
        out[mode] = {
            "live": live,
            "all_grads": all(g is not None for g in grads),
            "no_history": all(g.grad_fn is None and not g.requires_grad for g in grads if g is not None),
        }
    return out


def test_deferred_weight_grads_keep_no_history_and_free_the_graph() -> None:
    """After each step: every ``.grad`` is plain data (no grad_fn) and no saved activation survives.

    Covers the store path (a deferred ``weight.grad += ...`` must run under
    no_grad) and the I/W split (the graph retained between I and W must be
    released once W has run): both would show up as saved tensors that
    outlive the step and grow step after step.
    """
    (res,) = spawn(_no_leak_worker, 1, timeout_s=120)
    for mode, r in res.items():
        assert r["all_grads"], mode
        assert r["no_history"], f"{mode}: a parameter's .grad carries autograd history"
        assert r["live"] == [0, 0, 0, 0], f"{mode}: saved tensors alive after each step: {r['live']}"


def _changing_shapes_worker(rank: int, world: int) -> list[bool]:
    """Steps whose micro-batch shapes change from step to step (and an inference step in between)."""
    return _changing_shapes(rank, "torch") + _changing_shapes(rank, "native") + [_presplit_matches(rank)]


def _presplit_matches(rank: int) -> bool:
    """``step(microbatches=...)`` with the tensor_split pieces == ``step(full batch)``, bit for bit."""
    sched = build_schedule("dualpipev", 2, 4)
    torch.manual_seed(0)
    mods = {s: _mlp() for s in sched.stages_of_rank(rank)}
    copies = copy.deepcopy(mods)
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(11, HIDDEN, generator=g), torch.randn(11, HIDDEN, generator=g)
    a = Pipeline(sched, mods, timeout_s=30.0, allow_uneven=True)  # 11 rows: an uneven split on purpose
    b = Pipeline(sched, copies, timeout_s=30.0, allow_uneven=True)
    ra = a.step(x, labels=(t,), criterion=_criterion)
    rb = b.step(
        microbatches=[(p,) for p in x.tensor_split(4)],
        microbatch_labels=[(p,) for p in t.tensor_split(4)],
        criterion=_criterion,
    )
    try:
        b.step(microbatches=[(x,)], microbatch_labels=[(t,)], criterion=_criterion)
        bad_count = False
    except ValueError as e:
        bad_count = "one entry per micro-batch" in str(e)
    a.close()
    b.close()
    same_losses = ra.losses.keys() == rb.losses.keys() and all(
        torch.equal(ra.losses[m], rb.losses[m]) for m in ra.losses
    )
    return same_losses and _grads_match(mods, copies, exact=True) and bad_count


def _changing_shapes(rank: int, transport: str) -> list[bool]:
    torch.use_deterministic_algorithms(True)
    sched = build_schedule("dualpipev", 2, 4)
    torch.manual_seed(0)
    model = [_mlp() for _ in range(sched.num_stages)]
    mine = {s: copy.deepcopy(model[s]) for s in sched.stages_of_rank(rank)}
    ref = {s: model[s] for s in range(sched.num_stages)}
    # batch sizes vary, some uneven over 4 micro-batches: allowed, plain sums on both sides
    pipe = Pipeline(sched, mine, timeout_s=30.0, transport=transport, allow_uneven=True, scale_grads=False)
    ok = []
    for step, batch in enumerate([8, 8, 6, 6, 9, 8]):
        g = torch.Generator().manual_seed(step)
        x, t = torch.randn(batch, HIDDEN, generator=g), torch.randn(batch, HIDDEN, generator=g)
        for m in list(mine.values()) + list(ref.values()):
            m.zero_grad(set_to_none=True)
        if step == 3:
            with torch.no_grad():
                res = pipe.step(x, labels=(t,), criterion=_criterion)
                want = run_reference(ref, sched, (x,), (t,), _criterion, forward_only=True)
            ok.append(all(torch.equal(v, want[m]) for m, v in res.losses.items()))
            continue
        res = pipe.step(x, labels=(t,), criterion=_criterion)
        want = run_reference(ref, sched, (x,), (t,), _criterion, scale_grads=False)
        ok.append(all(torch.equal(v, want[m]) for m, v in res.losses.items()) and _grads_match(mine, ref, exact=True))
    pipe.close()
    return ok


@pytest.mark.timeout(180)
def test_shapes_that_change_between_steps_stay_exact(pair_checks: list[dict[str, Any]]) -> None:
    """Receives are posted speculatively with the previous step's layout: a changed layout must still be exact.

    Also: pre-split micro-batches (``step(microbatches=...)``) give the same result as the full batch.
    """
    for rank, ok in enumerate(results(pair_checks, "changing shapes")):
        assert all(ok), (rank, ok)


def _lookaheads(rank: int, world: int) -> dict[str, int]:
    sched = build_schedule("dualpipev", 2, 4)
    mods = {s: _mlp() for s in sched.stages_of_rank(rank)}
    got = {}
    for name, kw in (("torch", {}), ("native", {}), ("torch_3", {"recv_lookahead": 3})):
        pipe = Pipeline(sched, mods, timeout_s=30.0, transport=name.split("_")[0], **kw)
        x, t = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
        pipe.step(x, labels=(t,), criterion=_criterion)  # the window covers the step's receives either way
        got[name] = pipe.recv_lookahead
        pipe.close()
    return got


@pytest.mark.timeout(120)
def test_receive_window_defaults_to_the_transports_and_an_explicit_one_wins(
    pair_checks: list[dict[str, Any]],
) -> None:
    """gloo posts receives 9 compute actions ahead (late receives cost its loop thread CPU), native 2."""
    for got in results(pair_checks, "lookaheads"):
        assert got == {"torch": 9, "native": 2, "torch_3": 3}, got
    with pytest.raises(ValueError, match="recv_lookahead must be >= 1"):
        Pipeline(build_schedule("1f1b", 1, 2), {0: _mlp(), 1: _mlp()}, recv_lookahead=0)


def _counting_gloo() -> Any:
    """A TorchDistTransport class whose receive posts are counted (class attribute ``posted``)."""
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    class Counting(TorchDistTransport):
        posted = 0

        def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Any:
            Counting.posted += 1
            return super().irecv(tensor, peer, tag, what)

    return Counting


class _NoteFirst(nn.Module):
    """A stage module that notes ``counter.posted`` at its first forward of a step (``armed``)."""

    def __init__(self, counter: Any, notes: list[int]) -> None:
        super().__init__()
        self.lin, self.counter, self.notes, self.armed = nn.Linear(HIDDEN, HIDDEN), counter, notes, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.notes.append(self.counter.posted)
            self.armed = False
        return self.lin(x)


def _early_posts(rank: int, world: int) -> dict[str, Any]:
    sched = build_schedule("1f1b", 2, 8)
    out: dict[str, Any] = {}
    x, t = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    for early in (True, False):
        counting = _counting_gloo()
        notes: list[int] = []
        torch.manual_seed(rank)  # the same weights for both runs
        mods = {s: _NoteFirst(counting, notes) for s in sched.stages_of_rank(rank)}
        transport = counting(timeout_s=30.0)
        pipe = Pipeline(sched, mods, transport=transport, early_small_receives=early)
        steps = []
        for _ in range(3):
            counting.posted = 0
            for m in mods.values():
                m.armed = True
            pipe.step(x, labels=(t,), criterion=_criterion)
            steps.append((notes[-1], counting.posted))
        out[str(early)] = {"steps": steps, "grads": [p.grad.clone() for p in pipe.parameters()]}
        out["default"] = transport.early_small_receives
        pipe.close()
        transport.close()
    return out


#: checks of two ranks that share one spawned pair (``spawn_checks``); the changing shapes last: it turns on
#: torch's deterministic algorithms for the rest of the process
_PAIR_CHECKS: tuple[Check, ...] = (
    ("lookaheads", _lookaheads, ()),
    ("early posts", _early_posts, ()),
    ("changing shapes", _changing_shapes_worker, ()),
)


@pytest.fixture(scope="module")
def pair_checks() -> list[dict[str, Any]]:
    return spawn(run_checks, 2, _PAIR_CHECKS, timeout_s=300)


@pytest.mark.timeout(120)
def test_gloo_posts_every_small_repeated_receive_when_a_step_starts(pair_checks: list[dict[str, Any]]) -> None:
    """Over gloo, once the layouts repeat (the first step learns them, the second sends them inline) every
    receive of the step is posted before the first forward runs; with ``early_small_receives=False`` the
    window posts them as the step goes.  The gradients are the same bits either way (mid-stream posts
    stall gloo: the measurement is in TorchDistTransport.early_small_receives)."""
    for rank, got in enumerate(results(pair_checks, "early posts")):
        early, windowed = got["True"]["steps"], got["False"]["steps"]
        assert got["default"] is True  # the torch transport over gloo asks for it
        for before_first, total in early[2:]:
            assert before_first == total > 0, (rank, early)
        for before_first, total in windowed[2:]:
            assert before_first < total, (rank, windowed)
        assert all(torch.equal(a, b) for a, b in zip(got["True"]["grads"], got["False"]["grads"], strict=True))


def test_gloo_window_posts_1f1b_receives_before_computes_that_wait_for_none() -> None:
    """With gloo's default window, 1F1B's steady state posts new receives before a compute whose input is
    already here (rank 0: a forward, rank 1: a backward), never right before one that waits for a receive:
    posted there, gloo stalled transfers by milliseconds (the measurement is in TorchDistTransport's
    ``recv_lookahead``).  8 puts every one of them in the other place."""
    from dualpipe_kernels.runtime.loop import ActionLoop
    from dualpipe_kernels.schedules.lowering import lower_comms
    from dualpipe_kernels.transport.torch_dist import GLOO_RECV_LOOKAHEAD

    sched = lower_comms(build_schedule("1f1b", 2, 16))
    for la, want_clear in ((GLOO_RECV_LOOKAHEAD, True), (8, False)):
        for r in range(2):
            loop = ActionLoop(sched.actions[r], la)
            acts = loop.actions
            # steady state: until the window reaches the list's end (then the rest is posted at once)
            last_recv = max(j for p in loop.posts for j in p)
            tail = min(i for i, p in enumerate(loop.posts) if last_recv in p)
            # a compute "waits" when its own receive sits right before it in the lowered list
            at = [i for i, p in enumerate(loop.posts[:tail]) if any(j > i for j in p) and acts[i].is_compute]
            waits = [i for i in at if i > 0 and acts[i - 1].type.name.startswith("RECV")]
            assert at, (la, r)
            assert (not waits) == want_clear, (la, r, [str(acts[i]) for i in waits])


def test_early_sends_map_each_pair_to_its_forward_halfs_send() -> None:
    from dualpipe_kernels.runtime.loop import early_sends
    from dualpipe_kernels.schedules.lowering import lower_comms

    sched = lower_comms(build_schedule("dualpipev", 2, 16))
    for r in range(2):
        acts = sched.actions[r]
        got = early_sends(acts)
        pairs = [i for i, a in enumerate(acts) if a.type.name == "OVERLAP_F_B"]
        assert pairs and set(got) <= set(pairs)
        for i in pairs:
            f = acts[i].sub_actions[0]
            nxt = next((k for k in range(i + 1, len(acts)) if acts[k].is_compute), len(acts))
            sends = [
                k
                for k in range(i + 1, nxt)
                if acts[k].type.name == "SEND_F" and (acts[k].stage, acts[k].microbatch) == (f.stage, f.microbatch)
            ]
            # (none: the loss stage's forward, or a forward whose consumer is on this rank)
            assert got.get(i) == (sends[0] if sends else None)
        assert len(got) >= len(pairs) // 2
    # A SEND_F that comes after another compute action is left where it is.
    acts = list(sched.actions[0])
    i = next(iter(early_sends(acts)))
    other = next(a for a in acts if a.is_compute)
    assert i not in early_sends([*acts[: i + 1], other, *acts[i + 1 :]])


def test_gradient_edge_matches_torch() -> None:
    """The runtime's shortcut for a stage output's gradient edge names the same node and output as torch's."""
    from torch.autograd.graph import get_gradient_edge

    from dualpipe_kernels.runtime.compute import gradient_edge

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def, override]
            return x * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            return g * 2

    leaf = torch.randn(2, 3, requires_grad=True)
    a, b = torch.nn.Linear(3, 3)(leaf).split(1)
    for t in (leaf, a, b, Twice.apply(leaf)):
        ours, theirs = gradient_edge(t), get_gradient_edge(t)
        assert ours.node is theirs.node or (ours.node.name() == theirs.node.name() and t.is_leaf)
        assert ours.output_nr == theirs.output_nr
    assert gradient_edge(b).output_nr == 1


def test_loss_seed_is_shared_until_written_in_place() -> None:
    """A loss's gradient seed is made once per kind of loss and shared; one that a hook wrote into in place
    is replaced by a fresh one with the right value."""
    from types import SimpleNamespace

    from dualpipe_kernels.runtime.compute import StageCompute

    owner = SimpleNamespace(_seeds={})
    loss = torch.tensor(2.0, requires_grad=True) * 1.5
    s1 = StageCompute._seed(owner, loss, 0.25)  # type: ignore[arg-type]
    assert s1.shape == loss.shape and s1.dtype == loss.dtype and s1.item() == 0.25
    assert StageCompute._seed(owner, loss, 0.25) is s1  # type: ignore[arg-type]
    other = StageCompute._seed(owner, loss.double(), 0.25)  # type: ignore[arg-type]
    assert other is not s1 and other.dtype == torch.float64
    s1.mul_(3)  # what a gradient hook doing g.mul_() would leave behind
    s2 = StageCompute._seed(owner, loss, 0.25)  # type: ignore[arg-type]
    assert s2 is not s1 and s2.item() == 0.25 and StageCompute._seed(owner, loss, 1.0).item() == 1.0  # type: ignore[arg-type]


def test_kept_parameter_edges_stay_the_ones_later_graphs_reach() -> None:
    """A kept AccumulateGrad edge is the node every later forward through the parameter ends in, step after
    step, so the W half may use it; a parameter replaced under the same id gets its own."""
    import gc

    from dualpipe_kernels.runtime.zero_bubble import ParamEdges

    lin = nn.Linear(3, 2)
    edges = ParamEdges()
    kept = edges([lin.weight, lin.bias])
    for _ in range(3):
        out = lin(torch.randn(4, 3))
        reached, todo = set(), [out.grad_fn]
        while todo:  # every node of the graph
            for fn, _ in todo.pop().next_functions:
                if fn is not None and fn not in reached:
                    reached.add(fn)
                    todo.append(fn)
        assert kept[0].node in reached and kept[1].node in reached
        assert edges([lin.weight])[0] is kept[0]  # no second edge for the same parameter
        del out, reached, todo
        gc.collect()
    lin.weight = nn.Parameter(torch.zeros(2, 3))
    fresh = edges([lin.weight])[0]
    assert fresh.node is not kept[0].node and fresh.node.variable is lin.weight


def test_split_backward_with_kept_edges_matches_full_backward() -> None:
    """I then W with kept parameter edges, over several micro-batches, gives torch.equal gradients to a
    full backward per micro-batch (the same graph split as the runtime's, with its edge cache)."""
    from dualpipe_kernels.runtime.zero_bubble import ParamEdges

    torch.manual_seed(0)
    ref, split = _mlp(), _mlp()
    split.load_state_dict(ref.state_dict())
    edges = ParamEdges()
    for _ in range(3):
        x = torch.randn(2, HIDDEN)
        g = torch.randn(2, HIDDEN)
        a = x.clone().requires_grad_(True)
        ref(a).backward(g)
        b = x.clone().requires_grad_(True)
        z = split(b)
        params = list(split.parameters())
        w = backward_input([(get_gradient_edge(z), g)], [b], params, edges(params))
        assert torch.equal(b.grad, a.grad)
        w.run()
    for p, q in zip(ref.parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
