"""The project's GPT (separate W_Q / W_K per layer) and its q/k taps."""

from qkgeom.model.gpt import GPT, flops_per_token, init_qk
from qkgeom.model.taps import tap_qk

__all__ = ["GPT", "flops_per_token", "init_qk", "tap_qk"]
