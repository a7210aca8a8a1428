"""The monitor's fixed probe set, from whatever the user has: token ids ``(n_seq, T)`` and,
for a padded batch, its ``attention_mask``.

Made once, at construction, so every probe measures the same tokens: ids or a batch
mapping as given, or text (with ``tokenizer=``) cut into windows by
:func:`qkgeom.data.text.token_windows` (docs/monitor.md, "Probe set").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkgeom.errors import QKGeomError
from qkgeom.geometry.padding import check_mask

__all__ = ["DEFAULT_PROBE_SEQUENCES", "probe_batch"]

DEFAULT_PROBE_SEQUENCES = 16  # 16 sequences × block_size, as the trainer's probe set
_DEFAULT_SEQ_LEN = 128  # text input: window length when neither seq_len nor the context is known


def probe_batch(probe: Any, *, tokenizer: Any = None, seq_len: int | None = None,
                n_seq: int = DEFAULT_PROBE_SEQUENCES, max_positions: int | None = None,
                special_tokens: bool = False) -> tuple[Tensor, Tensor | None]:
    """Token ids ``(n_seq, T)`` (int64, CPU) of the probe set and its bool mask (None when
    nothing is padded); a QKGeomError for input it cannot use. Text only: ``seq_len`` text
    tokens per window (default min(context, 128) less the special tokens), framed with the
    tokenizer's [CLS]/[SEP] when ``special_tokens``."""
    mask = None
    if isinstance(probe, Mapping):
        if "input_ids" not in probe:
            raise QKGeomError("a probe batch mapping needs 'input_ids'")
        mask = probe.get("attention_mask")
        probe = probe["input_ids"]
    if isinstance(probe, (str, list, tuple)) and _is_text(probe):
        return _from_text(probe, tokenizer, seq_len, n_seq, max_positions, special_tokens), None
    try:
        ids = torch.as_tensor(np.asarray(probe) if not isinstance(probe, Tensor) else probe)
    except (TypeError, ValueError):
        raise QKGeomError(f"cannot use a {type(probe).__name__} as a probe set; give token ids "
                          "(n_seq, T), a batch with input_ids, or text with tokenizer=") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.is_complex():
        raise QKGeomError(f"probe token ids must be a non-empty integer (n_seq, T) array, got "
                          f"{ids.dtype} {tuple(ids.shape)}")
    if max_positions is not None and ids.shape[1] > max_positions:
        raise QKGeomError(f"probe sequences of {ids.shape[1]} tokens exceed the model's "
                          f"context of {max_positions}")
    if mask is not None and not isinstance(mask, Tensor):
        mask = np.asarray(mask)
    return ids.detach().to("cpu", torch.int64).contiguous(), check_mask(ids, mask)


def _is_text(probe: Any) -> bool:
    if isinstance(probe, str):
        return True
    return len(probe) > 0 and all(isinstance(p, str) for p in probe)


def _from_text(texts: str | Iterable[str], tokenizer: Any, seq_len: int | None, n_seq: int,
               max_positions: int | None, special_tokens: bool) -> Tensor:
    from qkgeom.data.text import framing_ids, token_windows

    if tokenizer is None:
        raise QKGeomError("a text probe set needs tokenizer= (an HF tokenizer or a CharVocab)")
    before, after = framing_ids(tokenizer) if special_tokens else ([], [])
    extra = len(before) + len(after)
    limit = max_positions or _DEFAULT_SEQ_LEN
    seq_len = seq_len or min(limit, _DEFAULT_SEQ_LEN) - extra
    if seq_len < 1 or seq_len + extra > limit:
        raise QKGeomError(f"seq_len {seq_len} (+{extra} special tokens) does not fit the "
                          f"model's context of {limit}")
    pieces = [texts] if isinstance(texts, str) else list(texts)
    windows = [np.concatenate([before, w, after]).astype(np.int64)
               for w in token_windows(tokenizer, pieces, n_seq * seq_len, seq_len)
               if len(w) == seq_len]
    if not windows:
        raise QKGeomError(f"the probe text gave fewer than {seq_len} tokens; give more text "
                          "or a smaller seq_len")
    return torch.from_numpy(np.stack(windows))  # (n_seq, T)
