"""What every architecture family tells the rest of qkgeom about a model.

Per layer an :class:`AttentionSite`: where each head's W_Q, W_K and W_V are stored (read
raw, in ``nn.Linear`` layout ``(heads·hd, d_model)``), the head grouping under GQA (query
head ``h`` attends with key head ``h // (H / H_kv)``, HF's ``repeat_kv`` order) and the
modules whose outputs are the pre-rotary q/k; per model a :class:`ModelAdapter`. Fused
layouts override the few ``*_heads`` / ``split`` methods in their family's module.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = ["QK_SITES", "AttentionSite", "ModelAdapter", "QKCallback", "blocks_with", "config_int",
           "layer_list"]

QK_SITES = ("post-rotary", "pre-rotary")
# on_qk(layer, q_site, k_site, q_attn, k_attn, scale): q (B, H, T, hd), k (B, H_kv, T, hd).
QKCallback = Callable[[int, Tensor, Tensor, Tensor, Tensor, float], None]


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention layer. This base class is the layout of separate ``nn.Linear``
    projections (head ``h`` owns rows ``h·hd:(h+1)·hd``); fused layouts subclass it."""

    layer: int
    attention: nn.Module  # the module the attention function receives (HF) or is tapped (ours)
    q_module: nn.Module  # holds W_Q in its ``weight``
    k_module: nn.Module  # holds W_K (the same module as q_module for fused layouts)
    v_module: nn.Module  # holds W_V
    n_head: int  # query heads H
    n_kv_head: int  # key/value heads H_kv (= H without GQA)
    head_dim: int
    d_model: int
    q_out: nn.Module | None = None  # output = pre-rotary q, when not q_module (a q norm)
    k_out: nn.Module | None = None

    @property
    def group(self) -> int:
        """Query heads per key head, R = H / H_kv."""
        return self.n_head // self.n_kv_head

    # -- layout (fused weights override ``heads``, ``bias_heads`` and ``split``) ----------

    def heads(self, w: Tensor, which: str) -> Tensor:
        """(heads, hd, d_model) view of W_Q / W_K / W_V (``which`` = q, k, v) inside a
        tensor laid out like that projection's stored weight; writable in place."""
        n = self.n_head if which == "q" else self.n_kv_head
        return w.view(n, self.head_dim, self.d_model)

    def k_heads(self, w: Tensor) -> Tensor:
        """(H_kv, hd, d_model) view of W_K inside a tensor laid out like ``k_module.weight``."""
        return self.heads(w, "k")

    def bias_heads(self, b: Tensor, which: str) -> Tensor:
        """(heads, hd) view of the q / k / v bias inside the module's bias."""
        return b.view(-1, self.head_dim)

    def split(self, out: Tensor, which: str) -> Tensor:
        """Output (B, T, ·) of the q or k projection -> pre-rotary (B, heads, T, hd)."""
        B, T = out.shape[0], out.shape[1]
        return out.reshape(B, T, -1, self.head_dim).transpose(1, 2)

    # -- reading ------------------------------------------------------------------------

    def _module(self, which: str) -> nn.Module:
        return {"q": self.q_module, "k": self.k_module, "v": self.v_module}[which]

    def weight(self, which: str) -> Tensor:
        """W_Q / W_K / W_V (``which`` = q, k, v) as the model uses it (a parametrisation
        runs), in nn.Linear layout (heads·hd, d_model), detached; a copy for fused layouts."""
        return self.heads(self._module(which).weight.detach(), which).reshape(-1, self.d_model)

    def bias(self, which: str) -> Tensor | None:
        """The q / k / v bias in the row order of :meth:`weight`, or None."""
        b = getattr(self._module(which), "bias", None)
        return None if b is None else self.bias_heads(b.detach(), which).reshape(-1)

    def qk_weights(self) -> tuple[Tensor, Tensor]:
        """(w_q, w_k): (H·hd, d_model) and (H_kv·hd, d_model)."""
        return self.weight("q"), self.weight("k")

    def key_stored(self) -> Tensor:
        """The stored parameter holding W_K (the unconstrained original under a
        parametrisation), for in-place writes through :meth:`k_heads`."""
        if parametrize.is_parametrized(self.k_module, "weight"):
            return self.k_module.parametrizations["weight"].original
        return self.k_module._parameters["weight"]

    def key_effective(self) -> Tensor:
        """The weight holding W_K as the model uses it (runs the parametrisation)."""
        return self.k_module.weight


Capture = Callable[["ModelAdapter", QKCallback, str], AbstractContextManager[None]]


@dataclass(frozen=True, eq=False)
class ModelAdapter:
    """A model as qkgeom sees it: its family, per-layer sites and how attention works."""

    arch: str  # family name: qkgeom | gpt2 | gpt_neox | llama | bert
    net: nn.Module  # the module a forward pass runs (HF: the base model, no task head)
    sites: list[AttentionSite]
    causal: bool  # decoder (causal) or encoder (bidirectional) attention
    rotary: bool  # rotary embeddings act between the projections and the attention
    max_positions: int | None  # the context the model was built for (None: unknown)
    capture_fn: Capture  # the family's way to hand over q/k (see :meth:`capture`)
    logit_softcap: float | None = None  # c of c·tanh(s/c) on the scaled logits; None: no cap

    @property
    def n_layer(self) -> int:
        return len(self.sites)

    def capture(self, on_qk: QKCallback, qk_site: str = "post-rotary"
                ) -> AbstractContextManager[None]:
        """Call ``on_qk(layer, q_site, k_site, q_attn, k_attn, scale)`` per layer during the
        block's forward passes, the model untouched afterwards: ``*_attn`` what attention
        computes with (keys: the H_kv distinct heads), ``*_site`` the same or, with
        ``qk_site="pre-rotary"`` on a rotary model, the pre-rotary projections."""
        from qkgeom.errors import QKGeomError

        if qk_site not in QK_SITES:
            raise QKGeomError(f"unknown qk site {qk_site!r}; choose one of {', '.join(QK_SITES)}")
        return self.capture_fn(self, on_qk, qk_site)

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Any:
        """One forward pass of ``net`` on token ids (B, T) without a KV cache; an
        ``attention_mask`` (1 on real tokens) goes to an HF model (our causal GPT needs none
        for right padding)."""
        if self.arch == "qkgeom":
            if attention_mask is not None:
                raise ValueError("the project's GPT takes no attention_mask")
            return self.net(ids)
        kwargs: dict[str, Any] = {"input_ids": ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(device=ids.device, dtype=torch.long)
        if self.causal:
            kwargs["use_cache"] = False
        return self.net(**kwargs)


def layer_list(model: nn.Module, paths: tuple[str, ...]) -> nn.ModuleList | None:
    """The first non-empty ``nn.ModuleList`` at one of the dotted ``paths`` (whatever
    wrapper sits around an HF model's blocks), else None."""
    for path in paths:
        try:
            mods = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(mods, nn.ModuleList) and len(mods) > 0:
            return mods
    return None


def blocks_with(model: nn.Module, paths: tuple[str, ...], member: str) -> nn.ModuleList | None:
    """The per-layer blocks (:func:`layer_list`) whose first block has the dotted submodule
    ``member`` (e.g. ``attn.c_attn``), else None: how a family recognises its models."""
    layers = layer_list(model, paths)
    try:
        return layers if layers is not None and layers[0].get_submodule(member) else None
    except AttributeError:
        return None


def config_int(model: nn.Module, *names: str) -> int | None:
    """The first positive int among the model config's attributes ``names``."""
    cfg = getattr(model, "config", None)
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
