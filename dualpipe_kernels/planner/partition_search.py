"""The exact searches behind :func:`.partition.partition_layers`, one per placement kind.

Each takes the layers' costs and the stage (and rank) counts and returns the layers per model stage, in
order; :mod:`.partition` describes the kinds, the objective and when each runs.  Exact up to the
bisections' stopping width, relative :data:`REL_TOL`.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["REL_TOL", "linear_sizes", "nested_sizes", "robin_pareto_sizes", "robin_two_sizes"]

#: relative width at which a bisection over the slowest load stops
REL_TOL = 1e-12


# ---- linear: bisection over segment sums, greedy check -----------------------
def _greedy_segments(c: list[float], limit: float) -> list[int] | None:
    """Fewest contiguous segments with sums <= limit (None if a layer exceeds it)."""
    sizes, acc, count = [], 0.0, 0
    for x in c:
        if x > limit:
            return None
        if count and acc + x > limit:
            sizes.append(count)
            acc, count = 0.0, 0
        acc += x
        count += 1
    sizes.append(count)
    return sizes


def _split_to(sizes: list[int], m: int) -> list[int]:
    """Split segments (largest first) until there are ``m``: costs are >= 0, so no sum grows."""
    sizes = list(sizes)
    while len(sizes) < m:
        k = max(range(len(sizes)), key=lambda i: sizes[i])
        sizes[k : k + 1] = [sizes[k] - 1, 1]
    return sizes


def _greedy_probe(c: list[float], limit: float) -> tuple[int, float, float]:
    """Greedy at ``limit``: (segments, largest segment sum, least sum that made a cut: the next limit to try).

    Every limit below the third value gives the same segments (no comparison turns), so when there are too
    many segments the optimum is at least that value.
    """
    acc, count, segments, most, nxt = 0.0, 0, 1, 0.0, math.inf
    for x in c:
        if x > limit:
            return len(c) + 1, math.inf, x
        if count and acc + x > limit:
            nxt = min(nxt, acc + x)
            most = max(most, acc)
            acc, count, segments = 0.0, 0, segments + 1
        acc += x
        count += 1
    return segments, max(most, acc), nxt


def linear_sizes(c: list[float], m: int) -> list[int]:
    """Exact: the least limit at which the greedy needs <= m segments, by bisection with jumps (O(n) per probe).

    The optimum is a segment sum; an infeasible probe lifts the lower end to the next sum the greedy would
    compare, a feasible one lowers the upper end to the largest segment it made.
    """
    lo, hi = max(c), _greedy_probe(c, math.inf)[1]
    for step in range(400):  # bisection halves the gap; a third of the probes try the lower end itself
        if lo >= hi * (1 - REL_TOL):
            break
        mid = lo if step % 3 == 2 else (lo + hi) / 2
        count, most, nxt = _greedy_probe(c, mid)
        if count <= m:
            hi = min(hi, most)
        else:
            lo = max(lo, nxt)
    if lo <= hi and _greedy_probe(c, lo)[0] <= m:
        hi = lo
    seg = _greedy_segments(c, hi)
    assert seg is not None and len(seg) <= m
    return _split_to(seg, m)


# ---- nested pairs: threshold DP over (left cut, right cut) --------------------
def _nested_feasible(prefix: np.ndarray, pairs: int, limit: float) -> list[int] | None:
    """Cut positions ``x_0..x_M`` with every pair load ``<= limit``, or None.

    State after ``k`` outer pairs: ``(i, j) = (x_k, x_{M-k})``.  A step to
    ``(i', j')`` loads ``P[i'] - P[i] + P[j] - P[j']``; feasibility of a target
    is a 2-D running minimum of ``P[j] - P[i]`` over reachable states with
    ``i < i'`` and ``j > j'``.  The last pair is the two middle segments, one
    contiguous block ``[x_{m-1}, x_{m+1})`` of at least two layers.
    """
    n = len(prefix) - 1
    big = np.inf
    idx = np.arange(n + 1)
    span = prefix[None, :] - prefix[:, None]  # span[i, j] = P[j] - P[i]
    reach = np.zeros((n + 1, n + 1), dtype=bool)
    reach[0, n] = True
    levels = [reach]
    tol = limit * REL_TOL * 1e-3  # rounding slack, well below the bisection's stopping width
    for k in range(1, pairs):
        val = np.where(reach, span, big)
        best = np.minimum.accumulate(val, axis=0)
        best = np.minimum.accumulate(best[:, ::-1], axis=1)[:, ::-1]
        # shifted[i', j'] = best[i' - 1, j' + 1]
        shifted = np.full((n + 1, n + 1), big)
        shifted[1:, :-1] = best[:-1, 1:]
        need = 2 * (pairs - k)  # layers the inner pairs still need
        reach = (shifted - span <= limit + tol) & (idx[None, :] - idx[:, None] >= need)
        if not reach.any():
            return None
        levels.append(reach)
    last = reach & (span <= limit + tol) & (idx[None, :] - idx[:, None] >= 2)
    if not last.any():
        return None
    i, j = map(int, np.argwhere(last)[0])
    left, right = [i], [j]
    for k in range(pairs - 1, 0, -1):
        prev = levels[k - 1]
        ok = prev.copy()
        ok[i:, :] = False
        ok[:, : j + 1] = False
        loads = (prefix[i] - prefix[:, None]) + (prefix[None, :] - prefix[j])
        ok &= loads <= limit + tol
        i, j = map(int, np.argwhere(ok)[0])
        left.append(i)
        right.append(j)
    # The middle cut: any split of the last block works (both halves non-empty).
    mid = left[0] + 1
    cuts = list(reversed(left)) + [mid] + right
    return cuts


def nested_sizes(c: list[float], m: int) -> list[int]:
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    pairs = m // 2

    def achieved(cuts: list[int]) -> float:
        seg = [prefix[cuts[t + 1]] - prefix[cuts[t]] for t in range(m)]
        return max(seg[k] + seg[m - 1 - k] for k in range(pairs))

    best = _nested_feasible(prefix, pairs, float(prefix[-1]))
    assert best is not None  # the whole sum is always feasible when len(c) >= m
    # Some pair carries at least the average load: just below it is infeasible (or the optimum is 0).
    hi, lo = achieved(best), float(prefix[-1]) / pairs * (1 - 1e-9)
    for _ in range(200):  # bisection halves the gap; 200 steps exhaust float precision
        if hi - lo <= REL_TOL * hi:
            break
        mid = (lo + hi) / 2
        cuts = _nested_feasible(prefix, pairs, mid)
        if cuts is None:
            lo = mid
        else:
            best, hi = cuts, achieved(cuts)
    return [best[t + 1] - best[t] for t in range(m)]


# ---- round robin, two stages per rank: threshold DP over (first-half cut, second-half cut) ----
def _robin_two_feasible(prefix: np.ndarray, ranks: int, limit: float) -> tuple[list[int] | None, float]:
    """``(cuts x_0..x_2R, inf)`` with every rank's load ``<= limit``, or ``(None, next)``.

    Rank ``k`` holds stages ``k`` and ``R + k``: the first half of the stages
    cuts ``[0, x)`` and the second half ``[x, n)``, walked in lockstep.  State
    after ``k`` ranks: ``(x, i, j) = (x_R, x_k, x_{R+k})``, from ``(x, 0, x)``
    to ``(x, x, n)``; a step to ``(i', j')`` loads ``P[i'] - P[i] + P[j'] -
    P[j]``, so a target is reachable when the running maximum of ``P[i] +
    P[j]`` over reachable states with ``i < i'`` and ``j < j'`` is at least
    ``P[i'] + P[j'] - limit``.  Arrays hold every ``x`` at once, in offsets
    ``(q, u, v) = (x - R, i - k, j - x - k)``: each stage takes at least one
    layer, so ``0 <= u <= q``, ``0 <= v <= W - 1 - q`` (``W = n - 2R + 1``), and
    ``i < i'`` becomes ``u <= u'``.  When infeasible, ``next`` is the least
    limit at which any comparison made here would turn: every limit below it is
    infeasible too (the reachable sets stay the same), so the search can jump.
    """
    n = len(prefix) - 1
    w = n - 2 * ranks + 1
    q = np.arange(w)
    valid = (q[None, :] <= q[:, None])[:, :, None] & (q[None, :] <= w - 1 - q[:, None])[:, None, :]
    second = q[:, None] + q[None, :] + ranks  # x + v without k, clipped where invalid
    tol = limit * REL_TOL * 1e-3

    def pair(k: int) -> np.ndarray:  # P[i] + P[j] at level k, shape (w, w, w)
        return prefix[q + k][None, :, None] + prefix[np.minimum(second + k, n)][:, None, :]

    def running_best(reach: np.ndarray, k: int) -> np.ndarray:
        best = np.where(reach, pair(k), -np.inf)
        return np.maximum.accumulate(np.maximum.accumulate(best, axis=1), axis=2)

    reach = np.zeros((w, w, w), dtype=bool)
    reach[:, 0, 0] = True
    levels, nxt = [reach], np.inf
    for k in range(1, ranks):
        need = np.where(valid, pair(k) - running_best(reach, k - 1), np.inf)
        reach = need <= limit + tol
        missed = need[~reach]
        nxt = min(nxt, float(missed.min())) if missed.size else nxt
        if not reach.any():
            return None, nxt
        levels.append(reach)
    xs = q + ranks
    need_end = prefix[xs] + prefix[n] - running_best(reach, ranks - 1)[q, q, w - 1 - q]
    end = need_end <= limit + tol
    if not end.any():
        return None, min(nxt, float(need_end.min()))
    t = int(np.argmax(end))
    x = t + ranks
    i, j = x, n
    first, last = [x], [n]
    for k in range(ranks - 1, 0, -1):
        ii = (q + k)[:, None]
        jj = (x + q + k)[None, :]
        ok = levels[k][t] & (ii < i) & (jj < j)
        ok &= prefix[i] + prefix[j] - (prefix[ii] + prefix[np.minimum(jj, n)]) <= limit + tol
        u, v = map(int, np.argwhere(ok)[0])
        i, j = u + k, x + v + k
        first.append(i)
        last.append(j)
    return [0, *reversed(first), *reversed(last)], np.inf


def robin_two_sizes(c: list[float], ranks: int) -> list[int]:
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    m = 2 * ranks

    def achieved(cuts: list[int]) -> float:
        seg = [prefix[cuts[t + 1]] - prefix[cuts[t]] for t in range(m)]
        return max(seg[k] + seg[ranks + k] for k in range(ranks))

    # Lower bound: the mean rank load and the heaviest layer; on even costs it is often the optimum.
    lo = max(float(prefix[-1]) / ranks, max(c))
    best, lo = _robin_two_feasible(prefix, ranks, lo)
    if best is not None:
        return [best[t + 1] - best[t] for t in range(m)]
    # A first solution: the best cut of the stages alone (cheap), counted per rank.
    linear = linear_sizes(c, m)
    best = [0, *np.cumsum(linear).tolist()]
    hi = achieved(best)
    # Invariant: every limit below ``lo`` is infeasible, ``hi`` is achieved.  Probing ``lo`` itself ends
    # the search when it is feasible (often, after a jump); bisection keeps the probes logarithmic.
    for step in range(200):
        if lo >= hi * (1 - REL_TOL):
            break
        mid = lo if step % 3 == 2 else (lo + hi) / 2
        cuts, nxt = _robin_two_feasible(prefix, ranks, mid)
        if cuts is None:
            lo = max(lo, nxt)
        else:
            best, hi = cuts, min(hi, achieved(cuts))
    return [best[t + 1] - best[t] for t in range(m)]


# ---- round robin, any number of stages per rank: Pareto-pruned search over cuts -------
def _pareto(entries: list[tuple[tuple[float, ...], object]]) -> list[tuple[tuple[float, ...], object]]:
    """The entries whose load vectors no other entry's is componentwise <= (one of equal vectors kept)."""
    entries = sorted(entries, key=lambda e: (sum(e[0]), e[0]))
    kept: list[tuple[tuple[float, ...], object]] = []
    for vec, parent in entries:
        if not any(all(a <= b for a, b in zip(k, vec, strict=True)) for k, _ in kept):
            kept.append((vec, parent))
    return kept


def robin_pareto_sizes(c: list[float], ranks: int, m: int) -> list[int]:
    """Exact: the best cut among those whose every rank load is ``<= limit``, for growing limits from the
    lower bound up to a known solution's load (the first limit that admits a cut gives the optimum)."""
    bound = max(_robin_loads(c, linear_sizes(c, m), ranks))
    limit = max(sum(c) / ranks, max(c))
    while True:
        limit = min(limit, bound) * (1 + REL_TOL)
        cuts = _robin_pareto_within(c, ranks, m, limit)
        if cuts is not None:
            return cuts
        limit *= 1.05  # tight limits prune most partial cuts, so start low and grow


def _robin_loads(c: list[float], sizes: list[int], ranks: int) -> list[float]:
    """Each rank's load when model stage ``s`` (``sizes[s]`` layers) sits on rank ``s mod ranks``."""
    loads, start = [0.0] * ranks, 0
    for s, size in enumerate(sizes):
        loads[s % ranks] += float(sum(c[start : start + size]))
        start += size
    return loads


def _robin_pareto_within(c: list[float], ranks: int, m: int, limit: float) -> list[int] | None:
    """The best cut with every rank load ``<= limit`` (None if there is none).

    A partial cut is dropped when its slowest rank exceeds ``limit``, or when
    another one ending at the same layer and stage has per-rank loads at most
    its own everywhere (any completion of it is then no better): exact.
    """
    n = len(c)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)
    # front[i]: (loads per rank, (previous cut, previous loads)) for partial cuts ending at layer i.
    front: dict[int, list[tuple[tuple[float, ...], object]]] = {0: [((0.0,) * ranks, None)]}
    history = [front]
    for s in range(m):
        r = s % ranks
        nxt: dict[int, list[tuple[tuple[float, ...], object]]] = {}
        for i, entries in front.items():
            for e in range(i + 1, n - (m - s - 1) + 1):
                seg = prefix[e] - prefix[i]
                for vec, _ in entries:
                    load = vec[r] + seg
                    if load <= limit:
                        nxt.setdefault(e, []).append((vec[:r] + (load,) + vec[r + 1 :], (i, vec)))
        front = {e: _pareto(v) for e, v in nxt.items()}
        history.append(front)
    if n not in front:
        return None
    vec, parent = min(front[n], key=lambda e: max(e[0]))
    cuts = [n]
    for s in range(m, 0, -1):
        assert isinstance(parent, tuple)
        i, prev = parent
        cuts.append(i)
        parent = next(p for v, p in history[s - 1][i] if v == prev)
    cuts.reverse()
    return [cuts[t + 1] - cuts[t] for t in range(m)]
