"""The overlap metric: how much of a step's communication hid behind its compute.

Three terms, measured in the same run on the same processes (docs/architecture.md):

* ``T_step``: the step with real activation sizes;
* ``T_compute``: the same step, same pipeline, with every boundary transfer
  cut to a few bytes (compute and the runtime's own bookkeeping stay);
* ``T_comm``: the transfers alone: the bytes the step moves, timed over the
  same transport and processes with nothing else running.

``exposed_comm_s = T_step - T_compute`` is what moving the data added to the
step; ``hidden_comm_share = 1 - exposed_comm_s / T_comm``.  The raw share is
always reported; one outside [0, 1] cannot be a share (the step got faster
with more data, or slower by more than the transfers cost): it is flagged as
noise and the share is None, never a clipped number passed off as a measurement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["OverlapMetric", "overlap_metric", "share_text", "ROUNDING", "METRIC_SENTENCE"]

#: The overlap metric in one sentence (the docs and every table that prints it).
METRIC_SENTENCE = (
    "comm hidden = 1 - (T_step - T_compute) / T_comm, where T_step is the step with real activations, "
    "T_compute the same pipeline in the same run with every transfer cut to a few bytes, and T_comm the "
    "step's transfers alone on the measured link; a raw value outside [0, 1] is shown as noise, not as a share."
)

#: A raw share this close outside [0, 1] is floating-point rounding, not noise: it is clipped into range.
ROUNDING = 1e-9


@dataclass(frozen=True)
class OverlapMetric:
    """One step's overlap figures, in seconds; see the module docstring.

    ``hidden_comm_share`` is within [0, 1] or None; ``hidden_comm_share_raw`` is
    the unclipped value (None only when ``t_comm_s`` is not positive);
    ``hidden_comm_noise`` says the raw value left [0, 1].
    """

    t_step_s: float
    t_compute_s: float
    t_comm_s: float
    exposed_comm_s: float
    hidden_comm_share_raw: float | None
    hidden_comm_share: float | None
    hidden_comm_noise: bool

    def as_dict(self) -> dict[str, float | bool | None]:
        return asdict(self)


def overlap_metric(t_step_s: float, t_compute_s: float, t_comm_s: float) -> OverlapMetric:
    """The metric from its three measured terms (seconds; ValueError for a negative or non-finite one)."""
    for name, v in (("T_step", t_step_s), ("T_compute", t_compute_s), ("T_comm", t_comm_s)):
        if not (v >= 0 and v != float("inf")):
            raise ValueError(f"overlap metric: {name} must be a finite time >= 0 s, got {v}")
    exposed = t_step_s - t_compute_s
    raw = 1.0 - exposed / t_comm_s if t_comm_s > 0 else None
    noise = raw is None or not -ROUNDING <= raw <= 1.0 + ROUNDING
    return OverlapMetric(
        t_step_s=float(t_step_s),
        t_compute_s=float(t_compute_s),
        t_comm_s=float(t_comm_s),
        exposed_comm_s=float(exposed),
        hidden_comm_share_raw=raw,
        hidden_comm_share=None if noise or raw is None else min(1.0, max(0.0, raw)),
        hidden_comm_noise=noise,
    )


def share_text(share: float | None, raw: float | None, digits: int = 2) -> str:
    """A table cell: the share, ``noise (raw X)`` when the raw value left [0, 1], ``-`` when nothing moved."""
    if share is not None:
        return f"{share:.{digits}f}"
    return "-" if raw is None else f"noise (raw {raw:.{digits}f})"
