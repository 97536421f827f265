"""A ``torch.distributed`` store that counts the operations made through it (spawned ranks import it).

``count_group_stores()`` makes every store the package reaches through ``group_store`` (the fingerprint
exchange, the torch transport's groups and its sequencing layer) a :class:`CountingStore` around the real one,
so a test can read how many store operations a pipeline step made.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


class CountingStore(dist.Store):
    """Delegates to ``inner``; ``ops`` counts every set / get / add / compare_set / wait / check / delete."""

    def __init__(self, inner: Any, counter: list[int] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self._counter = counter if counter is not None else [0]

    @property
    def ops(self) -> int:
        return self._counter[0]

    @ops.setter
    def ops(self, value: int) -> None:
        self._counter[0] = value

    def clone(self) -> CountingStore:
        """A client of its own (as ``Store.clone``) that counts into the same total."""
        self.ops += 1
        return CountingStore(self.inner.clone(), self._counter)

    def set(self, key: str, value: Any) -> None:
        self.ops += 1
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.ops += 1
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self.ops += 1
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.ops += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.ops += 1
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self.ops += 1
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self.ops += 1
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self.ops += 1
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def count_group_stores() -> CountingStore:
    """Route the package's ``group_store`` through one CountingStore around the default group's store."""
    from dualpipe_kernels.runtime import fingerprint
    from dualpipe_kernels.transport import base, torch_dist

    counting = CountingStore(base.group_store(None))

    def group_store(group: Any) -> CountingStore:
        return counting

    for module in (base, torch_dist, fingerprint):
        module.group_store = group_store  # type: ignore[attr-defined]
    return counting
