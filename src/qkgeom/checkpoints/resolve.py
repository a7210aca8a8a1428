"""Checkpoint lists: which checkpoints, their steps, loading one, and its Q/K hash.

A checkpoint is a hub revision, a local HF folder (or a folder of them), or a checkpoint
of a qkgeom run folder, read with ``torch.load(weights_only=True)`` only. Steps come from
names, else ``trainer_state.json``, else the list's order. Before anything is written the
analysis's memory estimate is checked, and without the network (or with
``HF_HUB_OFFLINE=1``) hub checkpoints load from the local cache only: one not cached is a
one-line error instead of retries and a traceback (docs/checkpoints.md#install-and-offline-use).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkgeom.arch import ModelAdapter
from qkgeom.errors import QKGeomError, first_line
from qkgeom.runs import CHECKPOINTS, is_run_folder, read_record

__all__ = ["CheckpointSpec", "analysis_memory", "auto_device_map", "check_analysis_fits",
           "free_model", "hub_reachable", "load_checkpoint", "load_run_model", "qk_hash",
           "require_hub", "resolve_checkpoints"]

_STEP = re.compile(r"(?:^|[^a-z])(?:global_step|step|checkpoint|ckpt)[-_]?(\d+)$", re.IGNORECASE)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_PROBE_S = 3.0  # seconds the hub reachability probe waits for a connection
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")


@dataclass(frozen=True)
class CheckpointSpec:
    """One checkpoint to analyse."""

    name: str  # revision, folder name or ``ckpt_00000250``
    kind: str  # "hub" | "folder" | "run"
    source: str  # hub id, folder path, or run folder
    revision: str | None = None  # hub revision
    run_step: int | None = None  # own-run checkpoint step
    step: int = 0
    step_source: str = "order"  # "name" | "trainer_state" | "run" | "order"


def _parse_step(name: str) -> int | None:
    m = _STEP.search(name)
    return int(m.group(1)) if m else None


def _is_hf_folder(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _is_run_folder(path: Path) -> bool:
    return is_run_folder(path) and (path / CHECKPOINTS).is_dir() and not _is_hf_folder(path)


def _folder_step(path: Path) -> tuple[int | None, str]:
    step = _parse_step(path.name)
    if step is not None:
        return step, "name"
    state = path / "trainer_state.json"
    try:
        return int(json.loads(state.read_text(encoding="utf-8"))["global_step"]), "trainer_state"
    except (OSError, ValueError, KeyError, TypeError):
        return None, "order"


def _ordered(specs: list[CheckpointSpec], steps: list[int | None],
             sources: list[str]) -> list[CheckpointSpec]:
    if any(s is None for s in steps):
        return [replace(sp, step=i, step_source="order") for i, sp in enumerate(specs)]
    out = [replace(sp, step=int(s), step_source=src)
           for sp, s, src in zip(specs, steps, sources, strict=True)]
    return sorted(out, key=lambda sp: sp.step)


def _run_checkpoints(run: Path, revisions: list[str] | None) -> list[CheckpointSpec]:
    from qkgeom.training.checkpoint import run_checkpoints

    found = run_checkpoints(run)
    steps = sorted(found)
    if revisions:
        wanted = []
        for rev in revisions:
            step = int(rev) if rev.isdigit() else _parse_step(rev)
            if step not in found:
                raise QKGeomError(f"{run}: no checkpoint at step {rev}; it has steps "
                                  + ", ".join(map(str, steps)))
            wanted.append(step)
        steps = sorted(set(wanted))
    return [CheckpointSpec(f"ckpt_{s:08d}", "run", str(run), run_step=s, step=s,
                           step_source="run") for s in steps]


def resolve_checkpoints(models: list[str], revisions: list[str] | None = None
                        ) -> list[CheckpointSpec]:
    """The checkpoints named by ``models`` (hub id, folders, a run folder) and
    ``revisions``, ordered by step. Raises QKGeomError for anything it cannot use."""
    if not models:
        raise QKGeomError("name a model: a hub id, HF folders, or a qkgeom run folder")
    paths = [Path(m) for m in models]
    if len(models) == 1 and _is_run_folder(paths[0]):
        return _run_checkpoints(paths[0], revisions)
    if all(p.exists() for p in paths):
        return _folder_checkpoints(paths, revisions)
    missing = [m for m, p in zip(models, paths, strict=True) if not p.exists()]
    if len(models) > 1:
        raise QKGeomError(f"{missing[0]}: no such folder (several models must be local folders)")
    if models[0].startswith((".", "/", "~")) or models[0].count("/") > 1:
        raise QKGeomError(f"{models[0]}: no such folder, and not a hub id (owner/name)")
    revs = revisions or ["main"]
    return _ordered([CheckpointSpec(r, "hub", models[0], revision=r) for r in revs],
                    [_parse_step(r) for r in revs], ["name"] * len(revs))


def _folder_checkpoints(paths: list[Path], revisions: list[str] | None
                        ) -> list[CheckpointSpec]:
    """HF folders: those named, ``revisions`` sub-folders of one, or every HF sub-folder of
    a folder of them (a Trainer's ``checkpoint-*``)."""
    folders: list[Path] = []
    for p in paths:
        if not p.is_dir():
            raise QKGeomError(f"{p}: not a folder; pass HF checkpoint folders")
        if revisions and len(paths) == 1:
            folders += [p / r for r in revisions]
        elif _is_hf_folder(p):
            folders.append(p)
        else:
            subs = sorted(s for s in p.iterdir() if s.is_dir() and _is_hf_folder(s))
            if not subs:
                raise QKGeomError(f"{p}: neither an HF model folder (config.json with a "
                                  "model_type) nor a folder of them, nor a qkgeom run")
            folders += subs
    for f in folders:
        if not _is_hf_folder(f):
            raise QKGeomError(f"{f}: not an HF model folder (no config.json with a model_type)")
    names = [f.name for f in folders]
    unique = len(set(names)) == len(names)  # else the same leaf name in different parents
    found = [_folder_step(f) for f in folders]
    return _ordered([CheckpointSpec(f.name if unique else str(f), "folder", str(f))
                     for f in folders], [s for s, _ in found], [src for _, src in found])


# ------------------------------------------------------------------------------- loading


def load_run_model(run: str | Path, step: int | None = None) -> tuple[nn.Module, Any, int]:
    """(GPT, CharVocab, step) of a run folder's checkpoint at ``step`` (default: newest)."""
    from qkgeom.data import load_vocab
    from qkgeom.training.checkpoint import load_model

    model, step = load_model(run, step)
    data_dir = read_record(run).get("data_dir")
    if not data_dir:
        raise QKGeomError(f"{Path(run) / 'config.json'}: no data_dir; is {run} a qkgeom run "
                          "folder?")
    return model, load_vocab(data_dir), step


def _dims(spec: CheckpointSpec) -> dict[str, int] | None:
    """Layers, heads, width, vocabulary and context of a checkpoint, read from its config
    without loading weights (None when they cannot be read: the estimate is skipped)."""
    if spec.kind == "run":
        from qkgeom.runs import load_config

        m = load_config(spec.source).model
        return {"n_layer": m.n_layer, "n_head": m.n_head, "d": m.n_embd,
                "vocab": m.vocab_size, "context": m.block_size}
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(spec.source, revision=spec.revision,
                                         local_files_only=True)
        cfg = getattr(cfg, "text_config", None) or cfg
        return {"n_layer": int(cfg.num_hidden_layers), "n_head": int(cfg.num_attention_heads),
                "d": int(cfg.hidden_size), "vocab": int(cfg.vocab_size),
                "context": int(getattr(cfg, "max_position_embeddings", 0) or 512)}
    except Exception:  # not installed, offline, an unusual config: nothing to check against
        return None


def analysis_memory(dims: dict[str, int], seq_len: int, batch_size: int,
                    dtype_bytes: int, measure_bytes: int = 8) -> dict[str, float]:
    """The big memory terms (bytes) of measuring one checkpoint: weights, one batch's
    hidden states and one layer's attention scores in the model's dtype, the q/k captures
    in the measurement precision, the float64 accumulators."""
    L, H, d, V = dims["n_layer"], dims["n_head"], dims["d"], dims["vocab"]
    tokens = batch_size * seq_len
    return {"weights": float((12 * L * d * d + (V + dims["context"]) * d) * dtype_bytes),
            "activations": float(8 * tokens * d * dtype_bytes),
            "attention scores": float(batch_size * H * seq_len ** 2 * dtype_bytes),
            "q/k captures": float(4 * tokens * d * measure_bytes),
            "accumulators": float(8 * L * 2 * d * d)}


def check_analysis_fits(specs: list[CheckpointSpec], *, text: str | None, max_tokens: int,
                        seq_len: int | None, batch_size: int | None, dtype: str,
                        device: str) -> None:
    """Refuse, before any model loads, an analysis whose memory estimate (the first
    checkpoint's sizes, the batch it would run) exceeds what ``device`` has."""
    from qkgeom.checkpoints.analyze import _TOKENS_PER_BATCH, DEFAULT_SEQ_LEN
    from qkgeom.training.resources import require_memory

    if not specs:
        return
    require_hub(specs)
    if auto_device_map(device) and torch.cuda.device_count() > 1:
        return  # split over several GPUs by accelerate: no one device's budget applies
    dims = _dims(specs[0])
    if dims is None:
        return
    if specs[0].kind == "run" and text is None:  # the run's own probe set, in float64
        from qkgeom.runs import load_config

        cfg = load_config(specs[0].source)
        terms = analysis_memory(dims, dims["context"], cfg.probe_batch, 4)
    else:
        T = seq_len or min(dims["context"], DEFAULT_SEQ_LEN)
        batch = batch_size or max(1, _TOKENS_PER_BATCH // T)
        batch = min(batch, -(-max_tokens // T))  # never more windows than the text gives
        terms = analysis_memory(dims, T, batch, _DTYPES.get(dtype, torch.float32).itemsize, 4)
    require_memory(terms, torch.device(device),
                   "lower --batch-size or --seq-len, or use a larger device")


def require_transformers() -> None:
    """QKGeomError (not a traceback) when Hugging Face ``transformers`` is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise QKGeomError("Hugging Face checkpoints need transformers: pip install "
                          "'qkgeom[hf]'") from None


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """Whether a TCP connection to the hub's host opens within :data:`HUB_PROBE_S` (True
    behind a proxy, which the probe cannot see through: transformers then decides)."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(name) for name in _PROXIES):
        return True
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port),
                                      timeout=HUB_PROBE_S):
            return True
    except OSError:
        return False


def _hub_only_cached() -> bool:
    """Load hub checkpoints from the local cache only: offline by setting or by fact."""
    return _hub_offline() or not hub_reachable()


def _hub_error(source: str, revision: str | None, what: str = "") -> QKGeomError:
    from huggingface_hub import constants

    why = ("HF_HUB_OFFLINE is set" if _hub_offline() else
           f"the hub ({constants.ENDPOINT}) cannot be reached")
    rev = f" (revision {revision})" if revision and revision != "main" else ""
    return QKGeomError(f"cannot load {what}{source}{rev}: {why} and it is not in the local "
                       "HF cache; download it once on a machine with network (it is then "
                       "cached), or pass a local folder (qkgeom analyze ./my-model); "
                       "HF_HUB_OFFLINE=1 uses cached files without trying the network")


def require_hub(specs: list[CheckpointSpec]) -> None:
    """Before anything is written: every hub checkpoint's config must be loadable (the hub
    reachable, or the checkpoint cached); a one-line QKGeomError otherwise."""
    hub = [s for s in specs if s.kind == "hub"]
    if not hub:
        return
    require_transformers()  # before the hub client it brings is asked anything
    if not _hub_only_cached():
        return
    from transformers import AutoConfig

    for spec in hub:
        try:
            AutoConfig.from_pretrained(spec.source, revision=spec.revision,
                                       local_files_only=True)
        except Exception:  # not cached (or a broken cache entry): the hint says what to do
            raise _hub_error(spec.source, spec.revision) from None


def load_checkpoint(spec: CheckpointSpec, *, dtype: str = "float32", device: str = "cpu",
                    attn_implementation: str = "sdpa",
                    trust_remote_code: bool = False) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of one checkpoint, on ``device`` in eval mode."""
    if dtype not in _DTYPES:
        raise QKGeomError(f"unknown --dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    if spec.kind == "run":
        model, vocab, _ = load_run_model(spec.source, spec.run_step)
        return model.to(device=device, dtype=_DTYPES[dtype]), vocab
    require_transformers()
    from transformers import AutoModel

    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype], "attn_implementation": attn_implementation,
                              "trust_remote_code": trust_remote_code}
    if spec.revision is not None:
        kwargs["revision"] = spec.revision
    cached_only = spec.kind == "hub" and _hub_only_cached()
    mapped = auto_device_map(device)
    if mapped:
        kwargs["device_map"] = "auto"
    try:
        model = AutoModel.from_pretrained(spec.source, local_files_only=cached_only, **kwargs)
    except Exception as err:  # missing files, offline hub, unknown revision: user-fixable
        if cached_only:
            raise _hub_error(spec.source, spec.revision) from None
        raise QKGeomError(f"cannot load {spec.source}"
                          + (f" (revision {spec.revision})" if spec.revision else "")
                          + f": {first_line(err, 300)}") from None
    return (model if mapped else model.to(device)).eval(), None


def auto_device_map(device: str) -> bool:
    """Whether HF checkpoints load with ``device_map="auto"``: on ``--device cuda`` (every
    visible GPU) with ``accelerate`` installed, a model too large for one GPU is split over
    them layer by layer; ``cuda:N`` and other devices load it whole."""
    if device != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def load_tokenizer(spec: CheckpointSpec, name: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The HF tokenizer of ``name`` (``--tokenizer``) or of the checkpoint itself."""
    require_transformers()
    from transformers import AutoTokenizer

    src = name or spec.source
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if name is None and spec.revision is not None:
        kwargs["revision"] = spec.revision
    cached_only = not Path(src).exists() and _hub_only_cached()
    try:
        return AutoTokenizer.from_pretrained(src, local_files_only=cached_only, **kwargs)
    except Exception as err:
        if cached_only:
            raise _hub_error(src, kwargs.get("revision"), "the tokenizer of ") from None
        raise QKGeomError(f"cannot load a tokenizer from {src}: {first_line(err, 300)}; pass "
                          "--tokenizer") from None


def free_model(model: nn.Module | None) -> None:
    """Drop the last reference the caller passes in and return its memory."""
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def qk_hash(adapter: ModelAdapter) -> str:
    """SHA-256 of every layer's raw W_Q, W_K and their biases, in layer order: equal
    hashes, identical query/key weights."""
    digest = hashlib.sha256()
    for site in adapter.sites:
        for t in (*site.qk_weights(), site.bias("q"), site.bias("k")):
            if t is None:
                digest.update(b"-")
                continue
            t = t.detach().to("cpu").contiguous()
            digest.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
