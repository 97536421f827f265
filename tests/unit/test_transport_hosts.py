"""Host ids: which peers count as same-host (native engine) and which as remote (torch.distributed)."""

from __future__ import annotations

import socket

from dualpipe_kernels.transport.hosts import HOST_ID_ENV, host_id


def test_plain_process_is_its_hostname(monkeypatch):
    for var in (HOST_ID_ENV, "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    assert host_id() == socket.gethostname()
    monkeypatch.setenv("GROUP_RANK", "1")  # not set by torchrun: does not count
    assert host_id() == socket.gethostname()


def test_torchrun_nodes_are_different_hosts(monkeypatch):
    monkeypatch.delenv(HOST_ID_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    ids = set()
    for node in ("0", "1"):
        monkeypatch.setenv("GROUP_RANK", node)
        ids.add(host_id())
    assert ids == {f"{socket.gethostname()}/node0", f"{socket.gethostname()}/node1"}


def test_override_wins(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv(HOST_ID_ENV, "rack2-host7")
    assert host_id() == "rack2-host7"
