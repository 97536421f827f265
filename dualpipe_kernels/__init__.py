"""dualpipe-kernels: DualPipe / DualPipeV pipeline parallelism with communication hidden behind compute."""

__version__ = "0.1.0"
