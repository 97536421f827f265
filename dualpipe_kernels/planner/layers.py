"""Per-layer costs: the planner's input, and the ``--layers FILE`` JSON format.

File format (docs/architecture.md)::

    {"layers": [{"name", "f_s", "b_s", "w_s", "activation_bytes", "param_bytes", "boundary_bytes"}, ...],
     "microbatch_size": 1, "unit": "s"}

Times are of one layer for one micro-batch of ``microbatch_size`` samples (the
profiled size): ``f_s`` forward, ``b_s`` full backward (input + weight
gradients), ``w_s`` its weight-gradient part (``0 <= w_s <= b_s``).
``activation_bytes``: what autograd saves for the backward of one micro-batch;
``boundary_bytes``: the layer's output (what a stage cut after it sends);
``param_bytes``: the layer's parameters.  ``unit`` is ``"s"`` for measured
times, ``"params"`` when the times are the parameter-count fallback (no sample
input): the planner's step times are then in that unit, not seconds.
``microbatch_size`` and ``unit`` are optional (defaults 1 and ``"s"``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["LayerCost", "LayerTable", "load_layers", "save_layers"]

_NUM_FIELDS = ("f_s", "b_s", "w_s", "activation_bytes", "param_bytes", "boundary_bytes")
UNITS = ("s", "params")


@dataclass(frozen=True)
class LayerCost:
    """One layer's costs for one micro-batch of the table's ``microbatch_size`` (see module docstring)."""

    name: str
    f_s: float
    b_s: float
    w_s: float
    activation_bytes: float
    param_bytes: float
    boundary_bytes: float

    def __post_init__(self) -> None:
        for field in _NUM_FIELDS:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v < 0:
                shown = f"an integer of {len(str(abs(v)))} digits" if isinstance(v, int) and not _finite(v) else repr(v)
                raise ValueError(f"layer {self.name!r}: {field} must be a finite number >= 0, got {shown}")
        if self.w_s > self.b_s:
            raise ValueError(f"layer {self.name!r}: w_s ({self.w_s}) must be <= b_s ({self.b_s})")

    @property
    def time_s(self) -> float:
        """Forward + full backward of one micro-batch: what the partitioner balances."""
        return self.f_s + self.b_s


@dataclass(frozen=True)
class LayerTable:
    """The layers of a model in order, with the micro-batch size their costs were measured at."""

    layers: tuple[LayerCost, ...]
    microbatch_size: int = 1
    unit: str = "s"

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("the layer table has no layers")
        mbs = self.microbatch_size
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"microbatch_size must be an integer >= 1, got {mbs!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        if not any(layer.time_s > 0 for layer in self.layers):
            raise ValueError("every layer has zero time (f_s + b_s); nothing to balance")

    def to_dict(self) -> dict[str, object]:
        return {
            "layers": [asdict(layer) for layer in self.layers],
            "microbatch_size": self.microbatch_size,
            "unit": self.unit,
        }


def _finite(v: float) -> bool:
    """``math.isfinite`` that also answers False for an int too large for a float (no OverflowError)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _layer_from(entry: object, index: int) -> LayerCost:
    if not isinstance(entry, dict):
        raise ValueError(f"layers[{index}] must be an object, got {type(entry).__name__}")
    missing = [k for k in ("name", *_NUM_FIELDS) if k not in entry]
    if missing:
        raise ValueError(f"layers[{index}] is missing {', '.join(missing)}")
    return LayerCost(name=str(entry["name"]), **{k: entry[k] for k in _NUM_FIELDS})


def table_from_dict(data: object) -> LayerTable:
    """Parse the ``--layers`` JSON object (ValueError naming the bad entry)."""
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise ValueError('layers file must be a JSON object with a "layers" list')
    layers = tuple(_layer_from(e, i) for i, e in enumerate(data["layers"]))
    return LayerTable(layers, data.get("microbatch_size", 1), data.get("unit", "s"))


def load_layers(path: str | Path) -> LayerTable:
    """Read a ``--layers`` file; a missing file, bad JSON, nan/inf, a bad field or deep nesting is a ValueError."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read layers file {path}: {e.strerror or e}") from None
    try:
        # Python's json accepts NaN/Infinity; a cost table must not.
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"layers file {path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    except RecursionError:
        raise ValueError(f"layers file {path} nests too deeply to be a layer table") from None
    return table_from_dict(data)


def _reject_constant(name: str) -> float:
    raise ValueError(f"layers file holds {name}; costs must be finite numbers")


def save_layers(table: LayerTable | Sequence[LayerCost], path: str | Path) -> Path:
    """Write ``table`` in the ``--layers`` format; returns the path."""
    if not isinstance(table, LayerTable):
        table = LayerTable(tuple(table))
    out = Path(path)
    out.write_text(json.dumps(table.to_dict(), indent=1) + "\n")
    return out
