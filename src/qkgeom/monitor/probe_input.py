"""The monitor's fixed probe set: token ids ``(n_seq, T)`` from whatever the user has.

The probe set is a fixed slice of held-out tokens, the same at every probe step, so
the monitor turns its input into one LongTensor once, at construction:

- a tensor / array of token ids ``(n_seq, T)`` (or ``(T,)``, one sequence);
- a batch mapping with ``input_ids`` (an ``attention_mask``, if any, must be all ones:
  the measurement engine takes unpadded windows);
- text (a string or a list of strings) plus ``tokenizer=`` (an HF tokenizer, a
  :class:`~qkgeom.data.CharVocab` or anything with ``encode``), cut into ``n_seq``
  windows of ``seq_len`` tokens by :func:`qkgeom.data.text.token_windows`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkgeom.errors import QKGeomError

__all__ = ["DEFAULT_PROBE_SEQUENCES", "probe_ids"]

DEFAULT_PROBE_SEQUENCES = 16  # 16 sequences × block_size, as the trainer's probe set
_DEFAULT_SEQ_LEN = 128  # text input, when neither seq_len nor the model's context is known


def probe_ids(probe: Any, *, tokenizer: Any = None, seq_len: int | None = None,
              n_seq: int = DEFAULT_PROBE_SEQUENCES, max_positions: int | None = None) -> Tensor:
    """Token ids ``(n_seq, T)`` (int64, CPU) of the probe set; see the module docstring.

    ``seq_len`` (text only) defaults to min(model context, 128). Raises
    :class:`QKGeomError` for input it cannot use.
    """
    if isinstance(probe, Mapping):
        if "input_ids" not in probe:
            raise QKGeomError("a probe batch mapping needs 'input_ids'")
        mask = probe.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise QKGeomError("the probe batch is padded (attention_mask has zeros); give "
                              "unpadded windows of equal length")
        probe = probe["input_ids"]
    if isinstance(probe, (str, list, tuple)) and _is_text(probe):
        return _from_text(probe, tokenizer, seq_len, n_seq, max_positions)
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
    return ids.detach().to("cpu", torch.int64).contiguous()


def _is_text(probe: Any) -> bool:
    if isinstance(probe, str):
        return True
    return len(probe) > 0 and all(isinstance(p, str) for p in probe)


def _from_text(texts: str | Iterable[str], tokenizer: Any, seq_len: int | None, n_seq: int,
               max_positions: int | None) -> Tensor:
    from qkgeom.data.text import token_windows

    if tokenizer is None:
        raise QKGeomError("a text probe set needs tokenizer= (an HF tokenizer or a CharVocab)")
    limit = max_positions or _DEFAULT_SEQ_LEN
    seq_len = seq_len or min(limit, _DEFAULT_SEQ_LEN)
    if seq_len > limit:
        raise QKGeomError(f"seq_len {seq_len} exceeds the model's context of {limit}")
    pieces = [texts] if isinstance(texts, str) else list(texts)
    windows = [w for w in token_windows(tokenizer, pieces, n_seq * seq_len, seq_len)
               if len(w) == seq_len]
    if not windows:
        raise QKGeomError(f"the probe text gave fewer than {seq_len} tokens; give more text "
                          "or a smaller seq_len")
    return torch.from_numpy(np.stack(windows))  # (n_seq, T)
