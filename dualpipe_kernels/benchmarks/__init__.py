"""The ``dualpipe-kernels bench`` suites and their helpers.

Layers (bottom first; a module imports only modules below it, held by
tests/unit/test_import_graph.py): foundations (common, metrics, payload,
sleep_stages, in_situ_costs), helpers of several suites (compute_floor, peers,
moe_block, sleep_runs, moe_ranks) or of one (cuda_ipc_bare), reports and row
fields of one suite (overhead_report, schedules_report, schedules_short,
cuda_ipc_report: they import no suite), and the suites.
"""
