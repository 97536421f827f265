"""Small reference models split into pipeline stages (used by the demo, the examples and tests)."""

from dualpipe_kernels.models.gpt import GPTConfig, GPTStage, build_gpt_stages, gpt_loss, stage_modules_for

__all__ = ["GPTConfig", "GPTStage", "build_gpt_stages", "gpt_loss", "stage_modules_for"]
