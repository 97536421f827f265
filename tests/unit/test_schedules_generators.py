"""Generators: exact per-rank orders against the reference, layouts, counts and bad input.

The expected DualPipe / DualPipeV orders below were written out by hand from
the reference implementation's eight phase loops (deepseek-ai/DualPipe,
``DualPipe.step``), not produced by our generator.  A second, independent
source for DualPipeV, ZB-V, interleaved 1F1B and ZB1P is torch's own
``torch.distributed.pipelining`` schedule classes.
"""

from __future__ import annotations

import pytest

from dualpipe_kernels.schedules import SCHEDULE_NAMES, ActionType, build_schedule, schedule_layout, validate

# ---- hand-derived reference orders ------------------------------------------------

# DualPipe, 4 ranks, 8 micro-batches.  Rank r holds stage r (down: mbs 0..3) and
# stage 7-r (up: mbs 4..7).  Ranks 1 and 2 are the middle ranks: their first
# main-step pair runs unpaired (F then B).
DUALPIPE_4_8 = [
    "0F0 0F1 0F2 7F4 7I4 7W4 7F5 (0F3;7B5)OVERLAP_F_B (7F6;0B0)OVERLAP_F_B 7B6 (7F7;0B1)OVERLAP_F_B 7B7 "
    "0I2 0W2 0I3 0W3",
    "1F0 6F4 1F1 6F5 1F2 6B4 (6F6;1B0)OVERLAP_F_B (1F3;6B5)OVERLAP_F_B (6F7;1B1)OVERLAP_F_B 6B6 1B2 6I7 1I3 6W7 1W3",
    "5F4 2F0 5F5 2F1 5F6 2B0 (2F2;5B4)OVERLAP_F_B (5F7;2B1)OVERLAP_F_B (2F3;5B5)OVERLAP_F_B 2B2 5B6 2I3 5I7 2W3 5W7",
    "4F4 4F5 4F6 3F0 3I0 3W0 3F1 (4F7;3B1)OVERLAP_F_B (3F2;4B4)OVERLAP_F_B 3B2 (3F3;4B5)OVERLAP_F_B 3B3 "
    "4I6 4W6 4I7 4W7",
]

# DualPipe, 2 ranks, 4 micro-batches: both ranks are middle ranks.
DUALPIPE_2_4 = [
    "0F0 3F2 0F1 3B2 (3F3;0B0)OVERLAP_F_B 3B3 0I1 0W1",
    "2F2 1F0 2F3 1B0 (1F1;2B2)OVERLAP_F_B 1B1 2I3 2W3",
]

# DualPipeV, 2 ranks, 4 micro-batches (stages 0..3; rank 0 holds 0 and 3).
DUALPIPEV_2_4 = [
    "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 (3F3;0B1)OVERLAP_F_B 3B3 "
    "0I2 0W2 0I3 0W3",
    "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B (2F3;1B1)OVERLAP_F_B 2B2 1B2 2I3 1I3 2W3 1W3",
]

# DualPipeV on one rank: both stages of the V on rank 0, no communication.
DUALPIPEV_1_2 = ["0F0 1F0 0F1 1B0 (1F1;0B0)OVERLAP_F_B 1B1 0I1 0W1"]


@pytest.mark.parametrize(
    "name, ranks, n, expected",
    [
        ("dualpipe", 4, 8, DUALPIPE_4_8),
        ("dualpipe", 2, 4, DUALPIPE_2_4),
        ("dualpipev", 2, 4, DUALPIPEV_2_4),
        ("dualpipev", 1, 2, DUALPIPEV_1_2),
    ],
)
def test_reference_order(name: str, ranks: int, n: int, expected: list[str]) -> None:
    s = build_schedule(name, ranks, n)
    got = [" ".join(row) for row in s.to_strings()]
    assert got == expected
    validate(s)


def test_dualpipe_middle_ranks_have_the_unpaired_first_main_step() -> None:
    # 8 ranks: middle ranks 3 and 4 run F then B unpaired right after phase 3.
    s = build_schedule("dualpipe", 8, 16)
    for r in range(8):
        acts = s.actions[r]
        first_pair = next(i for i, a in enumerate(acts) if a.type is ActionType.OVERLAP_F_B)
        if r in (3, 4):
            assert acts[first_pair - 2].type is ActionType.F
            assert acts[first_pair - 1].type is ActionType.B
        else:
            assert acts[first_pair - 1].type in (ActionType.F, ActionType.W)


def test_dualpipev_unpaired_step_only_on_last_rank() -> None:
    s = build_schedule("dualpipev", 4, 8)
    for r in range(4):
        strings = s.to_strings()[r]
        # The only full B outside F&B pairs before the first pair is on the last rank.
        first_pair = next(i for i, t in enumerate(strings) if t.endswith("OVERLAP_F_B"))
        has_unpaired_b = any("B" in t and not t.endswith("OVERLAP_F_B") for t in strings[:first_pair])
        assert has_unpaired_b == (r == 3)


# ---- a second source: torch.distributed.pipelining ----------------------------------


def _torch_orders(cls_name: str, ranks: int, n: int, local_stages: int) -> list[list[str]]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, cls_name)
    # The per-rank order is a pure function of these fields; no process group needed.
    obj = cls.__new__(cls)
    obj.pp_group_size = ranks
    obj._n_microbatches = n
    obj.n_local_stages = local_stages
    obj.num_stages = obj._num_stages = ranks * local_stages
    obj.number_of_rounds = max(1, n // ranks)
    obj.microbatches_per_round = n // obj.number_of_rounds
    return [[str(a) for a in obj._calculate_single_rank_operations(r) if a is not None] for r in range(ranks)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_dualpipev_matches_torch(ranks: int) -> None:
    for n in (2 * ranks, 2 * ranks + 1, 3 * ranks + 2):
        assert build_schedule("dualpipev", ranks, n).to_strings() == _torch_orders("ScheduleDualPipeV", ranks, n, 2)


@pytest.mark.parametrize("ranks", [1, 2, 4, 5])
def test_zbv_matches_torch(ranks: int) -> None:
    for n in (1, ranks, 2 * ranks - 1, 3 * ranks + 1):
        assert build_schedule("zbv", ranks, n).to_strings() == _torch_orders("ScheduleZBVZeroBubble", ranks, n, 2)


@pytest.mark.parametrize("ranks, v", [(2, 2), (3, 2), (4, 3), (2, 4)])
def test_interleaved_matches_torch(ranks: int, v: int) -> None:
    for n in (ranks, 2 * ranks, 3 * ranks):
        ours = build_schedule("interleaved1f1b", ranks, n, v).to_strings()
        assert ours == _torch_orders("ScheduleInterleaved1F1B", ranks, n, v)


@pytest.mark.parametrize("ranks", [1, 2, 4, 6])
def test_zb1p_matches_torch(ranks: int) -> None:
    # torch's ZB1P with one stage per rank needs n to be a multiple of n // ranks.
    for n in (ranks, 2 * ranks, 3 * ranks + 1):
        if n % max(1, n // ranks):
            continue
        ours = build_schedule("zb1p", ranks, n).to_strings()
        assert ours == _torch_orders("ScheduleInterleavedZeroBubble", ranks, n, 1)


# ---- simple baselines, written out ---------------------------------------------------


def test_1f1b_and_gpipe_orders() -> None:
    assert [" ".join(r) for r in build_schedule("1f1b", 3, 4).to_strings()] == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    assert [" ".join(r) for r in build_schedule("gpipe", 2, 3).to_strings()] == [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ]
    # ZB-H1: rank r holds back its first r W's until the cool-down.
    assert [" ".join(r) for r in build_schedule("zb1p", 3, 4).to_strings()] == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


# ---- layouts and counts ------------------------------------------------------------


def test_dualpipe_layout() -> None:
    s = build_schedule("dualpipe", 4, 8)
    assert s.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.paths == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert s.microbatch_path == (0, 0, 0, 0, 1, 1, 1, 1)
    assert s.model_stage == (0, 1, 2, 3, 0, 1, 2, 3)
    # Each rank holds two copies... of two different model stages that sum to R-1.
    for r in range(4):
        assert sorted(s.model_stage[st] for st in s.stages_of_rank(r)) == sorted({r, 3 - r})


def test_v_layouts() -> None:
    for name in ("dualpipev", "zbv"):
        s = build_schedule(name, 3, 6)
        assert s.stage_to_rank == (0, 1, 2, 2, 1, 0)
        assert s.paths == ((0, 1, 2, 3, 4, 5),)
    s = build_schedule("interleaved1f1b", 3, 6, 3)
    assert s.stage_to_rank == (0, 1, 2) * 3


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_counts_and_layout_agree(name: str) -> None:
    ranks, n = 4, 8
    s = build_schedule(name, ranks, n)
    layout = schedule_layout(name, ranks, n)
    assert (s.stage_to_rank, s.paths, s.microbatch_path) == (layout.stage_to_rank, layout.paths, layout.microbatch_path)
    assert not s.lowered
    computes = [c for acts in s.actions for a in acts for c in a.computes()]
    f = sum(1 for c in computes if c.type is ActionType.F)
    expected = sum(len(s.path(m)) for m in range(n))
    assert f == expected
    assert sum(1 for c in computes if c.type in (ActionType.B, ActionType.I)) == expected
    assert sum(1 for c in computes if c.type is ActionType.W) == sum(1 for c in computes if c.type is ActionType.I)
    assert all(a.is_compute for acts in s.actions for a in acts)


def test_interleaved_default_and_explicit_chunks() -> None:
    assert build_schedule("interleaved1f1b", 2, 4).num_stages == 4
    assert build_schedule("interleaved1f1b", 2, 4, 3).num_stages == 6
    assert build_schedule("interleaved1f1b", 2, 4, 1).num_stages == 2


# ---- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        (("dualpipe", 3, 12), "even number of ranks"),
        (("dualpipe", 4, 7), "even number of micro-batches"),
        (("dualpipe", 4, 6), r"micro-batches >= 2 \* ranks = 8"),
        (("dualpipe", 0, 4), "even number of ranks >= 2"),
        (("dualpipev", 3, 5), r"micro-batches >= 2 \* ranks = 6"),
        (("dualpipev", 0, 4), "ranks >= 1"),
        (("1f1b", 0, 4), "ranks >= 1"),
        (("gpipe", 2, 0), "micro-batches >= 1"),
        (("zb1p", -1, 4), "ranks >= 1"),
        (("zbv", 2, 0), "micro-batches >= 1"),
        (("interleaved1f1b", 3, 4), "multiple of ranks"),
        (("pipedream", 2, 4), "unknown schedule 'pipedream'"),
        (("1f1b", 2.0, 4), "ranks must be an integer"),
        (("1f1b", True, 4), "ranks must be an integer"),
    ],
)
def test_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)


@pytest.mark.parametrize(
    "name, v, match",
    [
        ("dualpipev", 3, "dualpipev has 2 stage"),
        ("1f1b", 2, "1f1b has 1 stage"),
        ("interleaved1f1b", 0, "stages_per_rank >= 1"),
    ],
)
def test_bad_stages_per_rank(name: str, v: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_schedule(name, 2, 4, v)


def test_fixed_stages_per_rank_accepted_when_equal() -> None:
    assert build_schedule("dualpipev", 2, 4, 2).to_strings() == build_schedule("dualpipev", 2, 4).to_strings()
