"""``qkgeom export``: the exported model's tokenizer knows the context (model_max_length =
block size, truncation keeps the end of a prompt), generate() within it works through
transformers, and the command prints its one result line (no progress bar)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="export needs qkgeom[hf]")

CONTEXT = 32  # the smoke preset's block_size


@pytest.fixture(scope="module")
def exported(smoke_run, tmp_path_factory) -> tuple[Path, str, str]:
    """(folder, stdout, stderr) of ``qkgeom export`` of the smoke run."""
    from qkgeom.cli import main

    out = tmp_path_factory.mktemp("export") / "hf"
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr), pytest.raises(SystemExit) as stop:
        main(["export", str(smoke_run.path), "--out", str(out)])
    assert stop.value.code == 0, stderr.getvalue()
    return out, stdout.getvalue(), stderr.getvalue()


def test_export_prints_one_line(exported) -> None:
    out, stdout, stderr = exported
    assert stdout.strip() == f"exported: {out}"
    assert stderr == ""  # no "Writing model shards: 100%|███|" leaking


def test_the_tokenizer_truncates_to_the_context(exported) -> None:
    out, _, _ = exported
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.model_max_length == CONTEXT
    text = "Anarchism is a political philosophy. " * 4
    ids = tok(text, truncation=True)["input_ids"]
    assert len(ids) == CONTEXT
    assert tok.decode(ids) == text[-CONTEXT:]  # the end of the prompt is what continues


def test_generate_within_the_context(exported, smoke_run) -> None:
    from qkgeom.checkpoints.resolve import load_run_model

    out, _, _ = exported
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tok("The history of", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        full = model.generate(prompt, do_sample=False)  # 20 new tokens, capped at the context
        assert full.shape[1] == CONTEXT and torch.equal(full[:, :prompt.shape[1]], prompt)
        more = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(more, full[:, :prompt.shape[1] + 6])
    # the exported model is the run's model: the same logits over the whole context
    ours, _, _ = load_run_model(smoke_run.path)
    with torch.no_grad():
        want, _ = ours.eval()(full)
        got = model(full).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
