"""The ``cuda_ipc`` suite's report: its result (:func:`.cuda_ipc.run`) as Markdown, every figure beside its ceiling."""

from __future__ import annotations

from typing import Any

from dualpipe_kernels.benchmarks.common import fmt, markdown_table

__all__ = ["to_markdown"]


def to_markdown(result: dict[str, Any]) -> str:
    """The GPU run's table (or the fake device's) and its verdicts against the targets."""
    if result.get("mode") == "fake-device":
        table = markdown_table(
            result["rows"],
            ["size_bytes", "messages", "host_us_per_msg", "post_us_per_msg", "complete_us_per_msg", "zero_copy"],
            ["size (B)", "msgs/burst", "host us/msg", "post us/msg", "completion us/msg", "zero-copy"],
        )
        verdict = "PASS" if result["host_pass"] else "FAIL"
        return "\n".join([
            f"CUDA IPC engine's host path over the fake device ({result['host_cpus']} host CPUs; both ends in one "
            f"process; copies move no bytes while timed, one burst per size checked byte-exact).",
            "",
            table,
            "",
            f"Host cost per message (post + completion) <= {result['target_host_us_per_msg']} us: {verdict}.",
        ])  # fmt: skip
    head = (
        f"CUDA IPC point-to-point on {result['device']} ({result['staging']} staging, asked "
        f"{result['staging_requested']}; signals: {result['signal_mechanism']}; ring {result['num_slots']} x "
        f"{result['slot_bytes'] >> 10} KiB, {result['max_inflight']} in flight, zero-copy from "
        f"{result['direct_min_bytes']} B) vs the bare ceiling (interprocess-event ping-pong with a copy from the "
        f"peer's IPC-mapped buffer) and `dst.copy_(src)`; every receive buffer checked."
    )
    table = markdown_table(
        result["rows"],
        ["size_bytes", "messages", "engine_gbps", "bare_gbps", "copy_gbps", "engine_over_bare", "host_us_per_msg",
         "device_us_per_msg"],
        ["size (B)", "msgs", "engine GB/s", "bare GB/s", "copy GB/s", "engine / bare", "host us/msg",
         "device us/msg"],
    )  # fmt: skip
    lines = [
        head,
        "",
        table,
        "",
        f"Context hop (bare interprocess-event ping-pong): {fmt(result['hop_us'], 4)} us.",
        f"Min engine / bare at >= {result['bandwidth_min_size'] >> 20} MiB: {fmt(result['engine_over_bare_min'], 3)} "
        f"(target >= {result['bandwidth_target_ratio']}): {'PASS' if result['bandwidth_pass'] else 'FAIL'}.",
        f"{result['small_msg_bytes']} B messages: device time per message / hop = {fmt(result['small_over_hop'], 3)} "
        f"(target <= {result['small_target']}): {'PASS' if result['small_pass'] else 'FAIL'}.",
    ]
    o = result["overlap"]
    if o:
        lines.append(
            f"Compute + transfer: compute {fmt(o['compute_ms'], 4)} ms ({o['matmuls']} bf16 matmuls of "
            f"{o['matmul_n']}^3), transfer {fmt(o['transfer_ms'], 4)} ms ({o['transfer_bytes'] >> 20} MiB), both "
            f"{fmt(o['both_ms'], 4)} ms = {fmt(o['ratio'], 3)} x the longer (target <= {o['target']}): "
            f"{'PASS' if o['pass'] else 'FAIL'}."
        )
    return "\n".join(lines)
