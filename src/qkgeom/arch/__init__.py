"""Architecture families: where the queries, keys and values of a model live.

One module per family, the single place that knows its weight layout, head grouping and
how to capture q/k; :func:`adapter_for` finds a model's family for the measurement, the
key control, the monitor and export. Adding a family: docs/architecture.md.
"""

from __future__ import annotations

from torch import nn

from qkgeom.arch import bert, gpt, gpt2, llama, neox
from qkgeom.arch.base import QK_SITES, AttentionSite, ModelAdapter, QKCallback
from qkgeom.errors import QKGeomError

__all__ = ["FAMILIES", "QK_SITES", "SUPPORTED", "AttentionSite", "ModelAdapter", "QKCallback",
           "adapter_for"]

# Tried in this order; each ``detect`` returns None for a model that is not of its family.
FAMILIES = (gpt, bert, gpt2, neox, llama)
SUPPORTED = ("qkgeom GPT", "GPT-2 (c_attn)", "GPT-NeoX/Pythia (query_key_value)",
             "Llama/Mistral/Qwen-style (q_proj/k_proj, rotary, GQA)",
             "BERT-style encoders (attention.self.query/key)")


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The :class:`ModelAdapter` of ``model``: an HF model (task heads are looked through to
    the base model) or the project's GPT. Unsupported models get one line naming the
    supported families."""
    base = getattr(model, "base_model", model)
    for family in FAMILIES:
        adapter = family.detect(base)
        if adapter is not None:
            return adapter
    raise QKGeomError(f"unsupported architecture {type(model).__name__}: qkgeom does not know "
                      "where its queries and keys live; supported: " + "; ".join(SUPPORTED))
