"""The README's install block, run as written, in order, in a fresh venv, with no network:
the CPU-only torch first, then the core and the extras, and no CUDA torch or nvidia
package pulled in on the way.

The commands are read from the README (so the README cannot drift from what is tested).
pip sees only this machine's local package sources, the ones its pip configuration names
(``pip config list``: find-links folders and ``file://`` indexes; the user's own and
``PIP_*`` settings are left out), given as ``--index-url``/``--find-links``, so nothing
reaches the network. Two stand-ins, both because of what those sources hold:

- the first line's CPU index cannot be reached offline; the line the README gives for this
  project's machines (``pip install torch==2.13.0``: the CPU wheel kept on the machine) runs
  in its place, and the first line is checked to be the CPU-only command;
- a requirement the local sources do not hold (``mwparserfromhell`` on the development
  machines: it comes from PyPI) is wheeled from the copy installed in this test environment,
  the same version and files.

``--no-compile`` (no .pyc files) changes nothing pip resolves, and saves a minute of CPU.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shlex
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from .test_readme import ROOT, blocks, commands

CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
LOCAL_TORCH = "pip install torch==2.13.0"


def install_block() -> tuple[list[str], str]:
    """The commands of the README's install block and the text of its section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    found = [code for page, _, _, code in blocks(ROOT / "README.md", "bash")
             if code in section]
    assert found, "no bash block in the README's Install section"
    return commands(found[0]), section


def test_the_readme_installs_the_cpu_torch_first() -> None:
    cmds, section = install_block()
    assert cmds[0] == CPU_TORCH, cmds
    assert all(c.startswith("pip install -e ") for c in cmds[1:]), cmds
    assert f"`{LOCAL_TORCH}`" in section  # the line for this project's machines, said plainly
    assert re.search(r"\d(\.\d)? GB", section)  # with what each install weighs


def local_sources() -> list[str]:
    """pip options naming only the local package sources of this machine's pip
    configuration: ``--index-url`` (the first ``file://`` index, the others as
    ``--extra-index-url``) and ``--find-links`` folders."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env,
                            capture_output=True, text=True, timeout=120).stdout
    indexes, links = [], []
    for key, value in re.findall(r"(?m)^(?:global|install)\.([\w-]+)='(.*)'$", listed):
        for item in value.split():
            local = item.startswith("file://") or item.startswith("/")
            if key in ("index-url", "extra-index-url") and item.startswith("file://"):
                indexes.append(item)
            elif key == "find-links" and local:
                links.append(item)
    if not indexes and not links:
        pytest.skip("this machine's pip configuration names no local package source")
    options = []
    for i, url in enumerate(dict.fromkeys(indexes)):
        options += ["--index-url" if i == 0 else "--extra-index-url", url]
    for folder in dict.fromkeys(links):
        options += ["--find-links", folder]
    return options or ["--no-index"]


def _held(name: str, options: list[str]) -> bool:
    """Whether a local source (an index folder, a find-links folder) holds ``name``."""
    canonical = re.sub(r"[-_.]+", "-", name).lower()
    for option, value in zip(options, options[1:], strict=False):
        path = Path(value.removeprefix("file://"))
        if option.endswith("index-url") and (path / canonical).is_dir():
            return True
        if option == "--find-links" and path.is_dir() and any(
                re.sub(r"[-_.]+", "-", f.name).lower().startswith(canonical + "-")
                for f in path.iterdir()):
            return True
    return False


def wheel_installed(name: str, folder: Path) -> Path:
    """A wheel of the distribution ``name`` installed here, from its installed files."""
    dist = metadata.distribution(name)
    files = list(dist.files or [])
    info = next((f.parent for f in files if f.name == "WHEEL"), None)
    if info is None:
        pytest.fail(f"{name} is not in the local package sources and was not installed from "
                    "a wheel here: nothing to install it from offline")
    tags = [line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines()
            if line.startswith("Tag:")]
    path = folder / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tags[0]}.whl"
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for f in files:
            skip = f.parent == info and f.name in ("RECORD", "INSTALLER", "REQUESTED",
                                                   "direct_url.json")
            if skip or "__pycache__" in f.parts or str(f).startswith(".."):
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            wheel.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append((str(f), f"sha256={digest.decode()}", str(len(data))))
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows([*rows, (f"{info}/RECORD", "", "")])
        wheel.writestr(f"{info}/RECORD", record.getvalue())
    return path


def _requirements(extras: set[str]) -> list[str]:
    """The names pyproject.toml requires for the core and ``extras`` (qkgeom's own extras
    expanded)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted, seen, names = list(extras), set(), list(project["dependencies"])
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in project["optional-dependencies"].get(extra, []):
            inner = re.fullmatch(r"qkgeom\[([\w,]+)\]", req)
            if inner:
                wanted += inner.group(1).split(",")
            else:
                names.append(req)
    return list(dict.fromkeys(re.split(r"[\s\[<>=!~;]", n.strip())[0] for n in names))


@pytest.mark.slow
def test_the_documented_install_works_offline(tmp_path: Path) -> None:
    cmds, _ = install_block()
    assert cmds[0] == CPU_TORCH, cmds  # the torch first; here its local stand-in (module doc)
    options = local_sources()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    extras = {e for c in cmds for e in re.findall(r"\[([\w,]+)\]", c)
              for e in e.split(",")}
    lacking = [n for n in _requirements(extras) if not _held(n, options)]
    for name in lacking:
        wheel_installed(name, wheels)
    options += ["--find-links", str(wheels)]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")
           and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INPUT="1")
    ran = [LOCAL_TORCH, *cmds[1:]]  # the first line's stand-in here (module doc)
    for command in ran:
        args = shlex.split(command)
        assert args[:2] == ["pip", "install"], command
        res = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", *options,
                              *args[2:]], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=1800)
        assert res.returncode == 0, (command, res.stdout[-2000:], res.stderr[-4000:])
        listed = subprocess.run([python, "-m", "pip", "list", "--format", "freeze"], env=env,
                                capture_output=True, text=True, timeout=300).stdout
        assert "torch==2.13.0+cpu" in listed.splitlines(), (command, listed)
        assert not re.search(r"(?im)^nvidia", listed), (command, listed)
    check = ("import qkgeom, scipy, matplotlib, transformers, torch; "
             "print(qkgeom.__file__, torch.__version__, torch.cuda.is_available())")
    res = subprocess.run([python, "-c", check], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    where, version, cuda = res.stdout.split()
    assert Path(where).is_relative_to(ROOT / "src") and (version, cuda) == ("2.13.0+cpu",
                                                                            "False")
    version = subprocess.run([str(venv / "bin" / "qkgeom"), "--version"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert version.returncode == 0 and version.stdout.startswith("qkgeom "), version.stderr
