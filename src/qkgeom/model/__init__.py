"""The project's GPT (separate W_Q / W_K per layer)."""

from qkgeom.model.gpt import GPT, flops_per_token, init_qk, soft_cap, z_loss

__all__ = ["GPT", "flops_per_token", "init_qk", "soft_cap", "z_loss"]
