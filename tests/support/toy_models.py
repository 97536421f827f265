"""Toy stage models, criteria, data and the run configurations of the multi-process runtime tests.

Shared by the code that runs in spawned ranks (``rank_configs``,
``rank_lifecycle``) and the checks the parent runs (``runtime_checks``).
Everything is module level so spawned worker processes can import it by name
(``tests/`` is on ``sys.path``: conftest.py puts it there, and the spawn start
method hands the parent's ``sys.path`` to its children).

All models are fp32 and tiny (8 features) so a configuration costs
milliseconds; what is under test is the runtime's bookkeeping, not the maths.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 8
VOCAB = 16

Tensors = tuple[torch.Tensor, ...]
MicroBatch = tuple[Tensors, Tensors]  # (stage-0 inputs, criterion labels) of one micro-batch


# --------------------------------------------------------------------------------------------
# Stage models
# --------------------------------------------------------------------------------------------
class ToyStage(nn.Module):
    """x [b, DIM] -> tanh(linear(x)) [b, DIM]."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def seeded_layer(seed: int, dim: int = DIM) -> nn.Module:
    """``Sequential(Linear, Tanh)`` drawn after ``torch.manual_seed(seed)``: every rank builds the same layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, dim), nn.Tanh())


class RichStage(nn.Module):
    """Several tensors per boundary, an integer side input and an unused output.

    ``(x [b, DIM] float, ids [b] int64, unused [b, DIM] float) -> (y, ids, aux)``.
    ``ids`` passes through unchanged (no grad); ``unused`` is ignored, so the
    previous stage's ``aux`` output gets no gradient (its ``aux`` weights keep
    ``grad is None``); only the last stage's ``aux`` reaches the loss.
    """

    def __init__(self, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.emb = nn.Embedding(vocab, dim)
        self.aux = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, unused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.tanh(self.linear(x) + self.emb(ids))
        return y, ids, self.aux(x)


class ViewStage(nn.Module):
    """Returns a view of its input (forbidden, as in the reference: the runtime frees sent outputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape)


class ExitStage(nn.Module):
    """A ToyStage whose ``exit_on``-th forward call kills the process (``os._exit(exit_code)``)."""

    def __init__(self, exit_on: int, exit_code: int = 3, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.exit_on = exit_on
        self.exit_code = exit_code
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.exit_on:
            os._exit(self.exit_code)
        return torch.tanh(self.linear(x))


# ---- the reference's example model (examples/example_dualpipe.py), written for the compat API ----
Defer = Callable[[torch.Tensor, Callable[[], None]], bool]
"""``defer(weight, fn)``: take ``weight``'s gradient work ``fn`` to run later (True), or leave it to run now."""


def accumulate_weight_grad(weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, defer: Defer) -> None:
    """``weight.grad += grad^T x`` of ``y = x @ weight^T``: now, or later when ``defer`` takes the work."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)

    def weight_grad() -> None:
        weight.grad += grad.flatten(0, -2).T @ x.flatten(0, -2)

    if not defer(weight, weight_grad):
        weight_grad()


class DeferredLinearFunc(torch.autograd.Function):
    """y = x @ W^T whose weight gradient ``defer`` may postpone (see :func:`accumulate_weight_grad`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, defer: Defer) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.defer = defer
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, weight = ctx.saved_tensors
        accumulate_weight_grad(weight, grad, x, ctx.defer)
        return grad @ weight, None, None


def _defer_to_compat_store(weight: torch.Tensor, fn: Callable[[], None]) -> bool:
    """The reference example's choice: ``WeightGradStore`` takes the work when it is enabled."""
    from dualpipe_kernels.compat import WeightGradStore

    if not WeightGradStore.enabled:
        return False
    weight.deferred_w = getattr(weight, "deferred_w", 0) + 1  # counted so tests see the store was used
    WeightGradStore.put(fn)
    return True


class _ExampleLinear(nn.Linear):
    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return DeferredLinearFunc.apply(inp, self.weight, _defer_to_compat_store)


class ExampleStage(nn.Module):
    """The reference example's stage: linear (DIM -> 4 DIM), gelu, linear (4 DIM -> DIM), no bias.

    Defines ``overlapped_forward_backward`` (the reference's contract); each call
    is counted in ``fb_calls`` so tests can check the hook ran.
    """

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear1 = _ExampleLinear(dim, dim * 4, bias=False)
        self.linear2 = _ExampleLinear(dim * 4, dim, bias=False)
        self.fb_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(x)))

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: ExampleStage,
        inputs0: Sequence[torch.Tensor],
        criterion0: Callable[..., torch.Tensor] | None,
        labels0: Sequence[torch.Tensor],
        module1: ExampleStage,
        loss1: torch.Tensor | None,
        outputs1: Sequence[torch.Tensor],
        output_grads1: Sequence[torch.Tensor],
    ) -> tuple[Sequence[torch.Tensor], torch.Tensor | None]:
        from dualpipe_kernels.compat import run_backward

        module0.fb_calls += 1
        return forward_then_backward(
            module0, inputs0, criterion0, labels0, loss1, outputs1, output_grads1, run_backward
        )


def forward_then_backward(
    module0: nn.Module,
    inputs0: Sequence[torch.Tensor],
    criterion0: Callable[..., torch.Tensor] | None,
    labels0: Sequence[torch.Tensor],
    loss1: torch.Tensor | None,
    outputs1: Sequence[torch.Tensor],
    output_grads1: Sequence[torch.Tensor],
    run_backward: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None],
) -> tuple[Sequence[torch.Tensor], torch.Tensor | None]:
    """An ``overlapped_forward_backward`` hook's work done one after the other, as the reference example's hook:
    chunk 0's forward (and loss), then chunk 1's backward through ``run_backward`` (the API under test's)."""
    outputs0 = module0(*inputs0)
    outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
    loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
    if loss1 is not None:
        loss1.backward()
        loss1.detach_()
    else:
        run_backward(outputs1, output_grads1)
    return outputs0, loss0


# --------------------------------------------------------------------------------------------
# Criteria (module level: picklable)
# --------------------------------------------------------------------------------------------
def mse_criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, label)


def example_criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    # .clone() as in the reference example: the runtime may detach_() the loss in place.
    return F.mse_loss(out, label).clone()


def rich_criterion(y: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(y, label) + 0.125 * aux.pow(2).mean() + 0.0 * ids.sum()


MODEL_KINDS = ("toy", "rich", "example")


def make_stage(kind: str, model_stage: int, seed: int = 0) -> nn.Module:
    """A fresh stage module of ``kind`` whose weights depend only on (kind, model_stage, seed)."""
    torch.manual_seed(1000 * seed + 17 * model_stage + 1)
    if kind == "toy":
        return ToyStage()
    if kind == "rich":
        return RichStage()
    if kind == "example":
        return ExampleStage()
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")


def criterion_of(kind: str) -> Callable[..., torch.Tensor]:
    return {"toy": mse_criterion, "rich": rich_criterion, "example": example_criterion}[kind]


# --------------------------------------------------------------------------------------------
# Configurations and data
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    """One pipeline run: schedule, size, API, transport, model; ``key`` names it in test ids."""

    schedule: str
    ranks: int
    microbatches: int
    stages_per_rank: int | None = None
    api: str = "native"  # "native" (Pipeline) | "compat" (dualpipe_kernels.compat)
    transport: str = "torch"
    model: str = "toy"
    batch: int | None = None  # rows of the full batch; default 2 * microbatches
    train_outputs: bool = False  # also ask for outputs in the training step
    seed: int = 0
    reversed_mapping: bool = False  # rank_mapping[group rank] = ranks - 1 - group rank
    subgroup: tuple[int, ...] | None = None  # world ranks of the pipeline's process group (None: the default group)

    @property
    def key(self) -> str:
        spr = f"x{self.stages_per_rank}" if self.stages_per_rank else ""
        rows = f"-b{self.batch}" if self.batch is not None else ""
        extra = "-revmap" if self.reversed_mapping else ""
        extra += "-group" + "".join(map(str, self.subgroup)) if self.subgroup else ""
        name = f"{self.schedule}{spr}-r{self.ranks}-n{self.microbatches}"
        return f"{name}-{self.api}-{self.transport}-{self.model}{rows}{extra}"

    @property
    def mapping(self) -> list[int]:
        """rank_mapping: group rank -> pipeline rank."""
        return [self.ranks - 1 - g for g in range(self.ranks)] if self.reversed_mapping else list(range(self.ranks))

    @property
    def world(self) -> int:
        """Processes the spawned run needs."""
        return max(self.subgroup) + 1 if self.subgroup else self.ranks

    @property
    def rows(self) -> int:
        return self.batch if self.batch is not None else 2 * self.microbatches


def make_tensors(kind: str, rows: int, seed: int) -> tuple[Tensors, Tensors]:
    """Deterministic (inputs, labels) for ``rows`` samples."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=g)
    label = torch.randn(rows, DIM, generator=g)
    if kind == "rich":
        ids = torch.randint(0, VOCAB, (rows,), generator=g)
        unused = torch.randn(rows, DIM, generator=g)
        return (x, ids, unused), (label,)
    return (x,), (label,)


def split(tensors: Tensors, chunks: int, dim: int = 0) -> list[Tensors]:
    """``tensor_split`` every tensor into ``chunks`` and regroup per micro-batch."""
    parts = [t.tensor_split(chunks, dim=dim) for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(chunks)]


def compat_dualpipe_batches(cfg: RunConfig) -> tuple[tuple[Tensors, Tensors], tuple[Tensors, Tensors]]:
    """The reference DualPipe's two half batches: ((x_first_rank, l_first_rank), (x_last_rank, l_last_rank)).

    The first rank feeds micro-batches 0..N/2-1 and holds the labels of
    N/2..N-1 (its loss is theirs); the last rank the other way round.
    """
    x0, l0 = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
    x1, l1 = make_tensors(cfg.model, cfg.rows, cfg.seed + 2)
    return (x0, l1), (x1, l0)


def microbatches_of(cfg: RunConfig) -> list[MicroBatch]:
    """The micro-batches the pipeline sees, in micro-batch order (ground truth for the reference)."""
    n = cfg.microbatches
    if cfg.api == "compat" and cfg.schedule == "dualpipe":
        (x0, l1), (x1, l0) = compat_dualpipe_batches(cfg)
        xs = split(x0, n // 2) + split(x1, n // 2)
        ls = split(l0, n // 2) + split(l1, n // 2)
        return list(zip(xs, ls, strict=True))
    x, label = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
    return list(zip(split(x, n), split(label, n), strict=True))


def build_schedule_for(cfg: RunConfig) -> Any:
    from dualpipe_kernels.schedules.generators import build_schedule

    return build_schedule(cfg.schedule, cfg.ranks, cfg.microbatches, stages_per_rank=cfg.stages_per_rank)


def make_all_stages(cfg: RunConfig, schedule: Any, shared: bool = False) -> dict[int, nn.Module]:
    """One module per IR stage (copies of a model stage get equal weights), or with ``shared`` one per model stage."""
    by_model: dict[int, nn.Module] = {}
    out: dict[int, nn.Module] = {}
    for s in range(schedule.num_stages):
        ms = schedule.model_stage[s]
        if shared:
            if ms not in by_model:
                by_model[ms] = make_stage(cfg.model, ms, cfg.seed)
            out[s] = by_model[ms]
        else:
            out[s] = make_stage(cfg.model, ms, cfg.seed)
    return out


# --------------------------------------------------------------------------------------------
# The configurations each world size runs (one spawn per world size serves every test file)
# --------------------------------------------------------------------------------------------
def configs_for_world(world: int) -> list[RunConfig]:
    """Every configuration of the shared spawned run with ``world`` processes, in run order.

    toy: bit-exactness of every schedule (native API and compat); rich: uneven
    batch, several tensors per boundary, integer ids, an unused output;
    example: the reference's example model (overlap hook, WeightGradStore)
    through compat; port: the reference's example program.  A reversed
    rank_mapping and a pipeline on a subgroup of the world check that no code
    assumes pipeline rank == world rank.  The "native" transport goes last so
    a failure there cannot disturb the rest.
    """
    r = world
    n_v = 2 * r + 1 if r % 2 else 2 * r + 2  # DualPipeV: odd N allowed; N >= 2R
    n_d, n_1 = 2 * r + 2, 2 * r + 1
    out: list[RunConfig] = [
        RunConfig("dualpipev", r, n_v),
        RunConfig("dualpipev", r, n_v, api="compat"),
        RunConfig("dualpipev", r, n_v, api="compat", model="example"),
    ]
    if r in (2, 4):
        out += [
            RunConfig("dualpipe", r, n_d),
            RunConfig("dualpipe", r, n_d, api="compat"),
            RunConfig("dualpipe", r, n_d, api="compat", model="example"),
            RunConfig("1f1b", r, n_1),
            RunConfig("gpipe", r, n_1),
            RunConfig("zb1p", r, n_1),
            RunConfig("interleaved1f1b", r, 2 * r, stages_per_rank=2),
            # uneven batch (2N + 3 rows), three tensors per boundary, int ids, an unused output
            RunConfig("dualpipev", r, n_v, model="rich", batch=2 * n_v + 3, train_outputs=True),
            RunConfig("dualpipe", r, n_d, model="rich", batch=2 * n_d + 3, train_outputs=True),
            RunConfig("dualpipe", r, n_d, api="compat", model="rich", batch=n_d + 1, train_outputs=True),
            RunConfig("dualpipev", r, n_v, api="compat", model="rich", batch=2 * n_v + 3, train_outputs=True),
        ]
    if r == 2:
        out += [
            RunConfig("1f1b", r, n_1, model="rich", batch=2 * n_1 + 3, train_outputs=True),
            RunConfig("zb1p", r, n_1, model="rich", batch=2 * n_1 + 3, train_outputs=True),
            RunConfig("interleaved1f1b", r, 2 * r, stages_per_rank=2, model="rich", batch=4 * r + 3),
        ]
    if r == 4:
        out += [
            RunConfig("dualpipev", r, n_v, reversed_mapping=True),
            RunConfig("dualpipe", r, n_d, reversed_mapping=True),
            RunConfig("dualpipe", r, n_d, api="compat", reversed_mapping=True),
            RunConfig("dualpipev", 2, 6, subgroup=(1, 3)),
            RunConfig("dualpipev", 2, 6, api="compat", model="example", subgroup=(0, 3), reversed_mapping=True),
            RunConfig("dualpipe", r, 10, api="port", model="example"),
            RunConfig("dualpipev", r, 10, api="port", model="example"),
        ]
    # the native transport last
    if r in (2, 4):
        out += [RunConfig("dualpipev", r, n_v, transport="native")]
    if r == 2:
        out += [
            RunConfig("1f1b", r, n_1, transport="native"),
            RunConfig("dualpipe", r, n_d, transport="native"),
            RunConfig("dualpipev", r, n_v, api="compat", transport="native"),
            RunConfig("dualpipev", r, n_v, transport="native", model="rich", batch=2 * n_v + 3),
        ]
    if r == 4:
        out += [RunConfig("dualpipev", r, n_v, api="compat", transport="native", model="example")]
    return out


# --------------------------------------------------------------------------------------------
# Comparing tensors (ranks and the parent both use it)
# --------------------------------------------------------------------------------------------
COS_TOL = 1e-13


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2 sum(xy) / (sum(xx) + sum(yy)) in float64 (0 for identical tensors, 0 when both are zero)."""
    x, y = x.detach().double(), y.detach().double()
    den = float((x * x).sum() + (y * y).sum())
    return 0.0 if den == 0.0 else 1.0 - 2.0 * float((x * y).sum()) / den
