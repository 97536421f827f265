"""dualpipe-kernels: DualPipe / DualPipeV pipeline parallelism with communication hidden behind compute."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # ``from dualpipe_kernels import _C`` lands here the first time: the extension links against
    # torch's shared libraries (libc10, libtorch), which only ``import torch`` loads, so import it
    # first.  The package itself stays torch-free to import (the CLI's simulate does not need it).
    if name == "_C":
        import importlib
        import os

        import torch  # noqa: F401

        mod = importlib.import_module("dualpipe_kernels._C")
        if os.environ.get("DUALPIPE_KERNELS_NATIVE_TRACEBACK", "0") not in ("", "0"):
            mod.install_native_traceback()
        return mod
    raise AttributeError(f"module 'dualpipe_kernels' has no attribute {name!r}")
