"""Where the queries and keys of a model live: one small adapter per architecture.

An adapter finds, per layer, the attention module, the W_Q / W_K weights (read raw, in
``nn.Linear`` layout ``(n_heads·hd, d_model)``, no LayerNorm folding) and the modules whose
outputs are the pre-rotary q and k. Nothing in the model is edited: q/k are captured by
hooks that :func:`capture_qk` always removes.

Supported (the names :func:`find_attention_sites` reports):

* ``qkgeom``: the project's own GPT (``blocks[i].attn.{q,k}_proj``; q/k via ``tap_qk``);
* ``gpt2``: HF GPT-2, fused ``c_attn`` (a ``Conv1D``, ``y = x @ W``; W_Q = ``W[:, :d].T``);
* ``gpt_neox``: HF GPT-NeoX / Pythia, fused ``query_key_value`` interleaved per head
  (rows ``[q_h; k_h; v_h]`` per head), partial rotary on the first ``rotary_ndims`` dims;
* ``llama``: Llama / Mistral / Qwen2 / Qwen3-style separate ``q_proj`` / ``k_proj`` with
  rotary and grouped-query attention (``q_norm`` / ``k_norm`` outputs are used when present);
* ``bert``: BERT-style encoders (``encoder.layer[i].attention.self.{query,key}``),
  bidirectional attention.

Capture sites. ``post-rotary`` (default): q and k exactly as the model's attention
function receives them (after bias, q/k norms and rotary; for GQA the distinct key heads,
before ``repeat_kv``). They are taken by wrapping the registered Hugging Face attention
functions (``sdpa``, ``eager``, flash, ...) for the duration of the capture, so the model
keeps its fast attention. ``pre-rotary``: the outputs of the q/k projections (after the
q/k norm, if any), before rotary. Models without rotary have one site only.

GQA pairing rule: query head ``h`` is paired with key head ``h // (H / H_kv)``, the key
head the model attends with (HF's ``repeat_kv`` order). Per head, ``pr_k_*`` and the
contrast of query head ``h`` use that key head; a key head shared by ``R`` query heads
appears in ``R`` rows. At the layer level the keys are the ``H_kv`` distinct heads
concatenated; repeating them as the attention does leaves every PR unchanged (the
repeated covariance / Gram matrix has the same non-zero spectrum, scaled by ``R``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

from qkgeom.control.keyspectrum import layer_list
from qkgeom.errors import QKGeomError

__all__ = [
    "QK_SITES",
    "SUPPORTED_ARCHITECTURES",
    "AttentionSite",
    "ModelAdapter",
    "capture_qk",
    "find_attention_sites",
]

QK_SITES = ("post-rotary", "pre-rotary")
SUPPORTED_ARCHITECTURES = (
    "qkgeom GPT", "GPT-2 (c_attn)", "GPT-NeoX/Pythia (query_key_value)",
    "Llama/Mistral/Qwen-style (q_proj/k_proj, rotary, GQA)",
    "BERT-style encoders (attention.self.query/key)",
)

# on_qk(layer, q_site, k_site, q_attn, k_attn, scale): q (B, H, T, hd), k (B, H_kv, T, hd).
QKCallback = Callable[[int, Tensor, Tensor, Tensor, Tensor, float], None]


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One layer: its attention module, where W_Q/W_K are stored and how q/k come out."""

    layer: int
    attention: nn.Module  # the module the attention function receives (HF) / tapped (qkgeom)
    q_module: nn.Module  # holds W_Q (``layout``)
    k_module: nn.Module  # holds W_K (the same module for fused layouts)
    layout: str  # "linear" | "conv1d_qkv" | "neox_qkv"
    n_head: int  # query heads H
    n_kv_head: int  # key heads H_kv (= H without GQA)
    head_dim: int
    d_model: int
    q_out: nn.Module | None = None  # output = pre-rotary q, if not q_module (e.g. q_norm)
    k_out: nn.Module | None = None

    @property
    def group(self) -> int:
        """Query heads per key head, R = H / H_kv."""
        return self.n_head // self.n_kv_head

    def qk_weights(self) -> tuple[Tensor, Tensor]:
        """(w_q, w_k): (H·hd, d_model) and (H_kv·hd, d_model), nn.Linear layout, detached."""
        H, Hk, hd, d = self.n_head, self.n_kv_head, self.head_dim, self.d_model
        if self.layout == "linear":
            return self.q_module.weight.detach(), self.k_module.weight.detach()
        w = self.q_module.weight.detach()
        if self.layout == "conv1d_qkv":  # (d, 3·H·hd), y = x @ w
            return w[:, : H * hd].T, w[:, H * hd : 2 * H * hd].T
        heads = w.view(H, 3, hd, d)  # neox: per head [q_h; k_h; v_h]
        return heads[:, 0].reshape(H * hd, d), heads[:, 1].reshape(Hk * hd, d)

    def qk_biases(self) -> tuple[Tensor | None, Tensor | None]:
        """(b_q, b_k) in the same row order as :meth:`qk_weights`, or None."""
        H, hd = self.n_head, self.head_dim
        if self.layout == "linear":
            return (getattr(self.q_module, "bias", None), getattr(self.k_module, "bias", None))
        b = self.q_module.bias
        if b is None:
            return None, None
        b = b.detach()
        if self.layout == "conv1d_qkv":
            return b[: H * hd], b[H * hd : 2 * H * hd]
        heads = b.view(H, 3, hd)
        return heads[:, 0].reshape(-1), heads[:, 1].reshape(-1)

    def split(self, out: Tensor, which: str) -> Tensor:
        """Projection output (B, T, ·) -> pre-rotary per-head (B, heads, T, hd)."""
        B, T = out.shape[0], out.shape[1]
        H, hd = self.n_head, self.head_dim
        if self.layout == "linear":
            return out.reshape(B, T, -1, hd).transpose(1, 2)  # (B, h, T, hd)
        if self.layout == "conv1d_qkv":
            part = out[..., : H * hd] if which == "q" else out[..., H * hd : 2 * H * hd]
            return part.reshape(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        qkv = out.reshape(B, T, H, 3 * hd).transpose(1, 2)  # (B, H, T, 3hd)
        return qkv[..., :hd] if which == "q" else qkv[..., hd : 2 * hd]  # (B, H, T, hd)


@dataclass(frozen=True, eq=False)
class ModelAdapter:
    """The architecture name, its per-layer sites and how its attention works."""

    arch: str
    sites: list[AttentionSite]
    causal: bool  # decoder (causal) or encoder (bidirectional) attention
    rotary: bool  # rotary embeddings act between the projections and the attention
    max_positions: int | None  # context length the model was built for (None: unknown)

    @property
    def n_layer(self) -> int:
        return len(self.sites)


def _cfg(model: nn.Module, *names: str) -> int | None:
    cfg = getattr(model, "config", None)
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _unknown(model: nn.Module) -> QKGeomError:
    return QKGeomError(
        f"unsupported architecture {type(model).__name__}: qkgeom does not know where its "
        "queries and keys live; supported: " + "; ".join(SUPPORTED_ARCHITECTURES))


def find_attention_sites(model: nn.Module) -> ModelAdapter:
    """The adapter of ``model`` (an HF model, its base model, or the project's GPT).

    Key weights of GPT, GPT-2, GPT-NeoX and Llama-style models are located by
    :func:`qkgeom.control.find_key_sites` (the one place that knows where W_K lives); the
    queries sit beside them. Raises :class:`QKGeomError` naming what is supported.
    """
    from qkgeom.control import find_key_sites
    from qkgeom.model import GPT

    model = getattr(model, "base_model", model) if not isinstance(model, GPT) else model
    bert = layer_list(model, ("encoder.layer", "bert.encoder.layer"))
    if bert is not None and hasattr(getattr(bert[0], "attention", None), "self"):
        sites = []
        for i, layer in enumerate(bert):
            att = layer.attention.self
            hd = att.attention_head_size
            sites.append(AttentionSite(i, att, att.query, att.key, "linear",
                                       att.num_attention_heads, att.num_attention_heads, hd,
                                       att.query.in_features))
        causal = bool(getattr(bert[0].attention.self, "is_causal", False))
        return ModelAdapter("bert", sites, causal, False, _cfg(model, "max_position_embeddings"))
    try:
        arch, keys = find_key_sites(model)
    except QKGeomError:
        raise _unknown(model) from None
    parents = {id(child): mod for mod in model.modules() for child in mod.children()}
    sites = []
    for ks in keys:
        if arch == "qkgeom":
            blk = model.blocks[ks.layer].attn
            sites.append(AttentionSite(ks.layer, blk, blk.q_proj, blk.k_proj, "linear",
                                       ks.n_head, ks.n_head, ks.head_dim, ks.d_model))
            continue
        parent = parents[id(ks.module)]  # the attention module owning the projection
        if arch in ("gpt2", "gpt_neox"):
            sites.append(AttentionSite(ks.layer, parent, ks.module, ks.module, ks.layout,
                                       ks.n_head, ks.n_head, ks.head_dim, ks.d_model))
            continue
        # llama-style: separate projections, GQA, optional per-head q/k norms
        q_proj = parent.q_proj
        n_q = q_proj.out_features // ks.head_dim
        if n_q % ks.n_head:
            raise QKGeomError(f"layer {ks.layer}: {n_q} query heads are not a multiple of "
                              f"{ks.n_head} key heads")
        sites.append(AttentionSite(ks.layer, parent, q_proj, ks.module, "linear", n_q,
                                   ks.n_head, ks.head_dim, ks.d_model,
                                   getattr(parent, "q_norm", None),
                                   getattr(parent, "k_norm", None)))
    if arch == "qkgeom":
        return ModelAdapter(arch, sites, True, False, model.config.block_size)
    return ModelAdapter(arch, sites, True, arch in ("gpt_neox", "llama"),
                        _cfg(model, "max_position_embeddings", "n_positions"))


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
    """Wrap every registered HF attention function (and ``eager``) with ``fn`` for the block.

    The attention modules of transformers 5 all call
    ``ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)(self, q, k, v,
    mask, scaling=..., ...)`` with q/k after bias, norms and rotary; wrapping the registry
    (and restoring it afterwards, whatever happens) hands those tensors over without
    touching the model, and the model keeps its own attention kernel.
    """
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
def capture_qk(model: nn.Module, adapter: ModelAdapter, on_qk: QKCallback,
               qk_site: str = "post-rotary") -> Iterator[None]:
    """Call ``on_qk(layer, q_site, k_site, q_attn, k_attn, scale)`` per layer and forward.

    ``q_attn``/``k_attn`` are what the attention computes with (post-rotary; keys are the
    H_kv distinct heads); ``q_site``/``k_site`` are the same tensors, or the pre-rotary
    projections when ``qk_site="pre-rotary"`` and the model has rotary. ``scale`` is the
    logit scale the model uses (1/√hd unless the model says otherwise). Hooks and wrappers
    are always removed on exit.
    """
    if qk_site not in QK_SITES:
        raise QKGeomError(f"unknown --qk-site {qk_site!r}; choose one of {', '.join(QK_SITES)}")
    if adapter.arch == "qkgeom":
        from qkgeom.model import tap_qk

        scale = 1.0 / math.sqrt(adapter.sites[0].head_dim)
        with tap_qk(model, lambda i, q, k: on_qk(i, q, k, q, k, scale)):
            yield
        return
    by_module = {id(site.attention): site for site in adapter.sites}
    pre = qk_site == "pre-rotary" and adapter.rotary
    stash: dict[tuple[int, str], Tensor] = {}
    hooks = []

    def keep(layer: int, which: str, site: AttentionSite):
        def hook(_mod: nn.Module, _inp: object, out: Tensor) -> None:
            stash[(layer, which)] = site.split(out, which)  # (B, h, T, hd)
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
                q_out, k_out = site.q_out or site.q_module, site.k_out or site.k_module
                hooks.append(q_out.register_forward_hook(keep(site.layer, "q", site)))
                hooks.append(k_out.register_forward_hook(keep(site.layer, "k", site)))
        with _attention_function_tap(on_attention):
            yield
    finally:
        for h in hooks:
            h.remove()
