"""Which host a rank is on, for choosing a transport per peer (same host: native engine; else torch.distributed).

The host id is the hostname, refined by torchrun's node rank (``GROUP_RANK``)
when torchrun started the process: ranks of different torchrun nodes are then
treated as being on different hosts even when they share one machine (the
one-host rehearsal of a multi-node run: ``torchrun --nnodes 2`` twice on
127.0.0.1), so their traffic takes the inter-node path it would take on a real
cluster.  ``DUALPIPE_KERNELS_HOST_ID`` overrides both.
"""

from __future__ import annotations

import os
import socket

__all__ = ["HOST_ID_ENV", "host_id"]

#: environment variable: this process's host id, overriding the hostname and torchrun's node rank
HOST_ID_ENV = "DUALPIPE_KERNELS_HOST_ID"


def host_id() -> str:
    """This process's host id: ``$DUALPIPE_KERNELS_HOST_ID``, else ``hostname[/node<GROUP_RANK>]``."""
    given = os.environ.get(HOST_ID_ENV, "").strip()
    if given:
        return given
    name = socket.gethostname()
    node = os.environ.get("GROUP_RANK", "").strip()
    # torchrun sets GROUP_RANK (its node rank) together with TORCHELASTIC_RUN_ID; plain env vars do not count.
    if node and "TORCHELASTIC_RUN_ID" in os.environ:
        return f"{name}/node{node}"
    return name
