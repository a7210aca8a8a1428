"""A lean install: the core pulls no statistics, plotting or NLP stack, the extras are named
for what they enable, the embedded sample ships inside qkgeom (no gensim) and prepares to
exactly the corpus it prepared to when it came from the gensim wheel."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

ROOT = Path(__file__).resolve().parents[2]

# The prepared sample as it was before the move (meta.json and the .bin files of the
# cache prepared from gensim's copy of the dump): same text, vocabulary and tokens.
BEFORE = {
    "sizes": {"test": 201455, "train": 2465183, "val": 176854},
    "unknown_tokens": {"test": 2, "train": 0, "val": 4},
    "text_sha256": {
        "test": "94ef7c7808ce7d3ca1723cccbab53cd03198f04addfa1fe60805df4a545eef9f",
        "train": "d3c09c81ceed849be644e6e587bab1cb2bf4f765adc10806b8fb74f72f17ee67",
        "val": "209d33f2012d92b7ac6fc87d8ad48b3b09137752a1f9a3d855b258b2de0ed4cf",
    },
    "dtype": "uint16",
}
BIN_SHA256 = {
    "test": "d9e102f1e7c6d62f4a9dcf0ddea29eda69722f01a016f18e934510918863b826",
    "train": "331c0e201b2dbf2b0b13e1593302be4b38b19e8bf2509d5fafea4492342071b6",
    "val": "a0b5371272af9f0ad6b1a91f4f029d927bc1a6ca1e69ad6ed74aba80f956819c",
}
VOCAB_DIGEST, VOCAB_SIZE = "1289ca8c13970a9d", 553
DUMP_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def names(requirements: list[str]) -> set[str]:
    return {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
            for r in requirements}


def test_core_dependencies_are_lean() -> None:
    core = names(pyproject()["project"]["dependencies"])
    assert core == {"torch", "numpy", "pandas", "pyarrow", "typer", "rich", "pyyaml",
                    "filelock", "mwparserfromhell"}
    assert not core & {"gensim", "scipy", "matplotlib", "markdown", "datasets",
                       "transformers", "ray", "tensorboard"}


def test_extras_are_named_for_what_they_enable() -> None:
    extras = pyproject()["project"]["optional-dependencies"]
    assert {"report", "data", "hf", "pretrained", "tensorboard", "ray", "demo", "test",
            "all"} <= set(extras)
    assert names(extras["report"]) == {"scipy", "matplotlib", "markdown"}
    assert names(extras["hf"]) == {"transformers"}
    assert extras["demo"] == ["qkgeom[report]"]  # make demo: train + report, nothing else
    assert names(extras["test"]) >= {"qkgeom", "pytest", "ruff"}
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert '-e ".[demo]"' in makefile and '-e ".[test]"' in makefile


def test_the_sample_ships_inside_qkgeom_with_its_licence() -> None:
    from qkgeom.data.sources import SAMPLE_DUMP_SHA256, sample_dump_path

    dump = sample_dump_path()
    assert dump.is_relative_to(Path(__import__("qkgeom").__file__).parent)
    assert hashlib.sha256(dump.read_bytes()).hexdigest() == SAMPLE_DUMP_SHA256 == DUMP_SHA256
    licence = (dump.parent.parent / "SAMPLE_LICENSE").read_text(encoding="utf-8")
    assert "CC BY-SA 3.0" in licence and DUMP_SHA256 in licence and "gensim" in licence
    data = pyproject()["tool"]["setuptools"]["package-data"]["qkgeom.data"]
    assert "sample/*.bz2" in data and "SAMPLE_LICENSE" in data


def test_the_prepared_sample_is_the_one_prepared_before(sample_data: Path) -> None:
    from qkgeom.data import load_prepared

    data = load_prepared(sample_data)
    assert {k: data.meta[k] for k in BEFORE} == BEFORE
    assert list(data.meta["inputs"].values()) == [DUMP_SHA256]
    assert (data.vocab.digest(), data.vocab.vocab_size) == (VOCAB_DIGEST, VOCAB_SIZE)
    for split, digest in BIN_SHA256.items():
        assert hashlib.sha256((sample_data / f"{split}.bin").read_bytes()).hexdigest() == digest
    assert "gensim" not in sys.modules


def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['scipy'] = None\n"
            "from qkgeom.cli import main\n"
            f"main(['report', {str(tmp_path)!r}])\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == ("qkgeom: error: this needs the scipy package: "
                                  "pip install 'qkgeom[report]'")


@pytest.mark.parametrize("module, extra", [("transformers.models", "hf"),
                                           ("datasets", "data"), ("matplotlib", "report")])
def test_every_optional_package_names_its_extra(module: str, extra: str) -> None:
    from qkgeom.cli import missing_package

    message = missing_package(ModuleNotFoundError(f"No module named {module!r}", name=module))
    assert message is not None and f"pip install 'qkgeom[{extra}]'" in message
    assert missing_package(ModuleNotFoundError("x", name="qkgeom.nope")) is None
