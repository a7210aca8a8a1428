"""Attack 3: disk full / read-only results folder. The run stops with a one-line error
naming the file, exits non-zero, and its last good checkpoint is intact (and resumable).

ENOSPC is injected at the write layer (``QKGEOM_FAULT=enospc:GLOB:N`` in ``qkgeom.io``):
the Nth matching write and every later one fail half-way, as on a full disk. A read-only
folder is a real ``chmod`` when the tests run as a normal user; as root (CI containers)
chmod does not stop writes, so the same refusal is injected (``erofs``) instead.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    assert_clean_error,
    assert_same_results,
    cli,
    figure,
    status,
    train_args,
    train_in_process,
)

from qkgeom.training.checkpoint import list_checkpoints

STEPS = 12


@pytest.fixture(scope="module")
def reference(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("disk") / "ref", STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("fault, words", [
    ("enospc:ckpt_*.pt:2", ("ckpt_00000008.pt", "No space left")),
    ("enospc:p*-L0.parquet:5", ("metrics.parts", "No space left")),  # the step-8 probe
    ("enospc:metrics.parquet:1", ("metrics.parquet", "No space left")),  # the compaction
    ("erofs:*:10", ("Read-only file system",)),
])
def test_disk_full_stops_cleanly_and_the_last_checkpoint_resumes(
        sample_data: Path, reference: Path, tmp_path: Path, fault: str,
        words: tuple[str, ...]) -> None:
    out = tmp_path / "run"
    res = cli(*train_args(sample_data, out, STEPS), fault=fault)
    assert_clean_error(res.returncode, res.stderr, words=(*words, "--resume"))
    error = res.stderr.strip()
    ckpts = list_checkpoints(out)
    assert ckpts, "no checkpoint survived"
    step, path = ckpts[-1]
    assert step < STEPS and status(out)["state"] != "done"  # the fault stopped the run
    assert torch.load(path, weights_only=False)["step"] == step  # intact
    assert not list(out.rglob(".*.tmp"))  # the failed write left no temp file
    res = cli(*train_args(sample_data, out, STEPS), "--resume")  # space freed: resume
    assert res.returncode == 0, res.stderr
    assert status(out)["state"] == "done"
    assert_same_results(reference, out)
    where = Path(error.split(": cannot write")[0].split()[-1]).name
    figure(f"disk {fault}", f"stopped with exit 2 at the write of {where}; last good "
           f"checkpoint step {step} intact; resume bit-exact")


def test_read_only_out_folder(sample_data: Path, tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    out = parent / "run"
    if os.geteuid() == 0:
        # root ignores the permission bits: inject the read-only refusal instead.
        res = cli(*train_args(sample_data, out, STEPS), fault="erofs:*:1")
        how = "root: EROFS injected at the write layer (chmod does not stop root)"
        words: tuple[str, ...] = ("Read-only file system",)
    else:
        parent.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            res = cli(*train_args(sample_data, out, STEPS))
        finally:
            parent.chmod(stat.S_IRWXU)
        how = "chmod 500 on the parent folder"
        words = ("Permission denied",)
    assert_clean_error(res.returncode, res.stderr, words=words)
    assert not list_checkpoints(out)
    figure("read-only folder", f"one-line error, exit 2 ({how})")
