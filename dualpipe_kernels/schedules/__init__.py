"""Schedules as data: IR, generators, validator, lowering to comms, exporters.

Pure Python: no torch.distributed, no processes.  The PNG exporter
(``schedules.plot``) is not imported here so that importing the package does
not import matplotlib.
"""

from .ascii import to_ascii
from .costs import CommModel, CostModel
from .csv_io import load_csv, to_csv
from .deps import (
    RULES,
    TRANSFER,
    Dep,
    DepKind,
    Program,
    ProgramError,
    Rule,
    Topology,
    dependencies,
    dependency_keys,
    produced_keys,
)
from .generators import SCHEDULE_NAMES, build_schedule, schedule_fits, schedule_layout
from .ir import COMM_TYPES, COMPUTE_TYPES, Action, ActionType, Schedule, format_actions, parse_action, parse_actions
from .lowering import lower_comms, lower_program
from .simulator import SimEvent, SimResult, reference_bubble, simulate
from .trace import chrome_trace, chrome_trace_compare, to_events, write_chrome_trace
from .validate import CommPair, ScheduleError, comm_pairs, validate

__all__ = [
    "Action",
    "ActionType",
    "COMM_TYPES",
    "COMPUTE_TYPES",
    "CommModel",
    "CommPair",
    "CostModel",
    "SimEvent",
    "SimResult",
    "chrome_trace",
    "chrome_trace_compare",
    "reference_bubble",
    "simulate",
    "to_events",
    "write_chrome_trace",
    "Dep",
    "DepKind",
    "SCHEDULE_NAMES",
    "Schedule",
    "ScheduleError",
    "Topology",
    "Program",
    "ProgramError",
    "Rule",
    "RULES",
    "TRANSFER",
    "lower_program",
    "build_schedule",
    "comm_pairs",
    "dependencies",
    "dependency_keys",
    "format_actions",
    "load_csv",
    "lower_comms",
    "parse_action",
    "parse_actions",
    "produced_keys",
    "schedule_fits",
    "schedule_layout",
    "to_ascii",
    "to_csv",
    "validate",
]
