"""The per-chunk CUDA graph option group: ``Pipeline(..., graphs=GraphOptions(enabled=True))``.

Off by default.  What is captured, when, and where a stage falls back to eager is described in
runtime/graphs.py and docs/runtime_options.md.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GraphOptions", "CAPTURE_ERROR_MODES"]

#: torch.cuda.graph's ``capture_error_mode`` values (what other threads may do while a stage is captured)
CAPTURE_ERROR_MODES = ("thread_local", "global", "relaxed")


@dataclass(frozen=True)
class GraphOptions:
    """Per-chunk CUDA graphs of the stage forwards and backwards (GPU only).

    ``enabled``: capture and replay (False: the stage modules run as given, nothing is wrapped).
    ``warmup_iters``: eager forward+backward runs of each (stage, input shape) on a side stream before its
    first capture (lazy initialisation of cuBLAS handles and kernels must not happen under capture); >= 1.
    ``allow_rng``: graph stages whose modules draw random numbers (dropout).  torch registers the default
    CUDA generator with every graph, so each replay draws fresh numbers, but not the numbers an eager run
    would draw: such a run is not bit-exact against eager.  False: those stages run eager.
    ``capture_error_mode``: torch.cuda.graph's mode during a capture; ``"thread_local"`` (default) lets the
    transport's threads keep issuing CUDA calls.
    ``max_graphs_per_stage``: a stage whose capture plan needs more graphs than this runs eager (each
    graph holds its slot's saved activations in a private pool); None: no limit.
    """

    enabled: bool = False
    warmup_iters: int = 3
    allow_rng: bool = False
    capture_error_mode: str = "thread_local"
    max_graphs_per_stage: int | None = None

    def __post_init__(self) -> None:
        for name in ("enabled", "allow_rng"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"GraphOptions.{name} must be a bool, got {value!r}")
        w = self.warmup_iters
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"GraphOptions.warmup_iters must be an int >= 1, got {w!r}")
        if self.capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"GraphOptions.capture_error_mode must be one of {', '.join(CAPTURE_ERROR_MODES)}, "
                f"got {self.capture_error_mode!r}"
            )
        m = self.max_graphs_per_stage
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
            raise ValueError(
                f"GraphOptions.max_graphs_per_stage must be None or an int >= 2 (one forward and one backward "
                f"graph per slot), got {m!r}"
            )
