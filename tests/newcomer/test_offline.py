"""``qkgeom analyze`` of a hub model without a network: one line naming HF_HUB_OFFLINE=1
and local folders, no retries, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="hub checkpoints need qkgeom[hf]")

PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")


def test_unreachable_hub_is_one_line_and_no_retries(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in PROXIES and k != "HF_HUB_OFFLINE"}
    # a hub address where nothing listens: the connection is refused at once
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf-home"))
    out = tmp_path / "ckpt"
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "analyze", "gpt2", "--tokens",
                          "64", "--out", str(out)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "cannot load gpt2" in lines[0] and "cannot be reached" in lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0] and "local folder" in lines[0]
    assert "Retry" not in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


def test_offline_setting_uses_the_cache_only(tmp_path: Path, monkeypatch, capsys) -> None:
    import huggingface_hub.constants

    from qkgeom.cli import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(SystemExit) as stop:
        main(["analyze", "qkgeom-tests/not-cached", "--revisions", "step0,step512",
              "--out", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "HF_HUB_OFFLINE is set and it is not in the local HF cache" in err
    assert not (tmp_path / "ckpt").exists()
