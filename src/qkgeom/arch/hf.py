"""Capturing q/k from Hugging Face models (transformers >= 5), shared by the HF families.

Post-rotary: every attention module of transformers 5 calls the registered attention
function with q and k after bias, q/k norms and rotary (for GQA the distinct key heads);
wrapping the registered functions for the block, the registry restored whatever happens,
hands those over without touching the model, which keeps its own fast kernel.
Pre-rotary: forward hooks on the q/k projections (or norms), split by the site's layout.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, QKCallback
from qkgeom.errors import QKGeomError

__all__ = ["capture_hf"]


def _eager_default(module: nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the module's own modeling file (HF's default)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise QKGeomError(f"{type(module).__name__}: no eager attention function to wrap; "
                          "load the model with attn_implementation='sdpa'")
    return fn


@contextmanager
def _attention_function_tap(fn: Callable[[nn.Module, Tensor, Tensor, float | None], None]
                            ) -> Iterator[None]:
    """Wrap every registered HF attention function (and ``eager``) with ``fn`` for the block."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    saved = dict(mapping)

    def wrap(orig: Callable | None) -> Callable:
        def tapped(module, query, key, value, attention_mask, *args, **kwargs):
            fn(module, query, key, kwargs.get("scaling"))
            target = orig if orig is not None else _eager_default(module)
            return target(module, query, key, value, attention_mask, *args, **kwargs)
        return tapped

    try:
        for name, orig in saved.items():
            mapping[name] = wrap(orig)
        mapping["eager"] = wrap(None)
        yield
    finally:
        mapping.clear()
        mapping.update(saved)


@contextmanager
def capture_hf(adapter: ModelAdapter, on_qk: QKCallback, qk_site: str) -> Iterator[None]:
    """:meth:`ModelAdapter.capture` for Hugging Face models (see the module docstring)."""
    by_module = {id(site.attention): site for site in adapter.sites}
    pre = qk_site == "pre-rotary" and adapter.rotary
    stash: dict[tuple[int, str], Tensor] = {}
    hooks = []

    def keep(site: AttentionSite, which: str):
        def hook(_mod: nn.Module, _inp: object, out: Tensor) -> None:
            stash[(site.layer, which)] = site.split(out, which)  # (B, h, T, hd)
        return hook

    def on_attention(module: nn.Module, q: Tensor, k: Tensor, scaling: float | None) -> None:
        site = by_module.get(id(module))
        if site is None:
            return
        scale = float(scaling) if scaling is not None else float(
            getattr(module, "scaling", 1.0 / math.sqrt(site.head_dim)))
        if pre:
            q_site, k_site = stash.pop((site.layer, "q")), stash.pop((site.layer, "k"))
        else:
            q_site, k_site = q, k
        on_qk(site.layer, q_site, k_site, q, k, scale)

    try:
        if pre:
            for site in adapter.sites:
                hooks.append((site.q_out or site.q_module).register_forward_hook(keep(site, "q")))
                hooks.append((site.k_out or site.k_module).register_forward_hook(keep(site, "k")))
        with _attention_function_tap(on_attention):
            yield
    finally:
        for h in hooks:
            h.remove()
