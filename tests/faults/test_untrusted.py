"""Attack 5: untrusted files. A checkpoint with a pickled ``os.system`` payload is refused in
one line and the payload never runs (the same file, loaded the unsafe way, does run it: the
payload is live); values from result files (grid names, run ids, error texts, model and
checkpoint names) reach report.html as text, never as live HTML, and no image from outside
the report folder is embedded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch
from fault_helpers import assert_clean_error, cli, figure, status, train_args, train_in_process

from qkgeom.training.checkpoint import read_checkpoint

STEPS, EVERY = 8, 4
RESULTS: dict[str, bool] = {}
# What the attack pass injected: live HTML, a script, a backtick breaking out of a code span,
# a javascript: link, an image from elsewhere on the machine.
INJECTIONS = ("<img src=x onerror=alert(1)>", "<script>alert(1)</script>", "a`b<script>c`",
              "[c](javascript:alert(1))", "![p](/etc/qkgeom-secret.png)")


class _Payload:
    """Pickles as a call to ``os.system`` (what a malicious checkpoint would carry)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


@pytest.fixture(scope="module")
def base_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_in_process(sample_data, tmp_path_factory.mktemp("untrusted") / "base",
                            STEPS, EVERY, keep_checkpoints=3)


def _poison(run: Path, marker: Path) -> Path:
    """The run's newest checkpoint, with a payload that creates ``marker`` when unpickled
    (everything else as qkgeom wrote it)."""
    path = run / "checkpoints" / f"ckpt_{STEPS:08d}.pt"
    state = read_checkpoint(path)
    state["evil"] = _Payload(f"touch {marker}")
    torch.save(state, path)
    return path


def _payload_is_live(path: Path, marker: Path) -> bool:
    """Control: load the file the unsafe way in a throw-away process; the marker appears."""
    code = f"import torch; torch.load({str(path)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    live = marker.exists()
    marker.unlink(missing_ok=True)
    return live


def test_poisoned_checkpoint_is_refused_on_resume_and_the_payload_never_runs(
        sample_data: Path, base_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    marker = tmp_path / "pwned-resume"
    path = _poison(run, marker)
    (run / "status.json").write_text(json.dumps({"state": "running", "step": EVERY}))
    res = cli(*train_args(sample_data, run, STEPS, EVERY, "--set", "keep_checkpoints=3"),
              "--resume")
    assert_clean_error(res.returncode, res.stderr, words=(str(path), "need unpickling",
                                                          "weights only"))
    assert not marker.exists(), "the payload ran"
    # refused before the resume wrote anything: the file left in place, the status as it was
    assert path.exists() and status(run)["state"] == "running"
    assert _payload_is_live(path, marker)  # the same file does run code when unpickled
    RESULTS["pickle payload on train --resume"] = True


def test_poisoned_checkpoint_is_refused_by_analyze(base_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    marker = tmp_path / "pwned-analyze"
    path = _poison(run, marker)
    res = cli("analyze", str(run), "--revisions", str(STEPS), "--out", str(tmp_path / "an"),
              "--quiet")
    assert_clean_error(res.returncode, res.stderr, words=(str(path), "need unpickling"))
    assert not marker.exists(), "the payload ran"
    assert _payload_is_live(path, marker)
    RESULTS["pickle payload on analyze"] = True


def test_own_checkpoints_load_weights_only_with_key_control(sample_data: Path,
                                                            tmp_path: Path) -> None:
    run = train_in_process(sample_data, tmp_path / "kc", 4, 4,
                           key_control={"mode": "shrink", "dose": 0.8})
    state = read_checkpoint(run / "checkpoints" / "ckpt_00000004.pt")
    assert state["callbacks"][0]["pr0"] and state["step"] == 4


def test_a_state_that_would_need_pickle_is_refused_before_it_is_written(tmp_path: Path) -> None:
    import numpy as np

    from qkgeom.errors import QKGeomError
    from qkgeom.training.checkpoint import save_checkpoint

    with pytest.raises(QKGeomError, match=r"callbacks.*numpy.float64"):
        save_checkpoint(tmp_path, 4, {"callbacks": [{"pr0": np.float64(1.0)}]}, keep=2)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints")
                                                               .iterdir())


# ------------------------------------------------------------------------------ reports


class _Page(HTMLParser):
    """Every start tag with its attributes, and the text, of an HTML page."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def live_html(page: str) -> list[str]:
    """What in ``page`` could run or fetch: script tags, on* handlers, javascript: links,
    images that are not embedded PNGs."""
    found = []
    for tag, attrs in _Page(page).tags:
        if tag in ("script", "iframe", "object", "embed"):
            found.append(f"<{tag}>")
        found += [f"{tag} {k}=" for k in attrs if k.lower().startswith("on")]
        href = (attrs.get("href") or "").strip().lower()
        if href.startswith(("javascript:", "data:")):
            found.append(f"{tag} href={href}")
        if tag == "img" and not (attrs.get("src") or "").startswith("data:image/png;base64,"):
            found.append(f"img src={attrs.get('src')}")
    return found


def _sweep_with_injections(base: Path, root: Path) -> Path:
    """A sweep folder whose sweep.json, run ids and error texts carry the injections."""
    from qkgeom.io import write_json

    runs = []
    for i, text in enumerate(INJECTIONS):
        run_id = f"r{i}{text}".replace("/", "_")  # a folder name cannot hold "/"
        folder = root / "runs" / run_id
        shutil.copytree(base, folder)
        record = json.loads((folder / "config.json").read_text())
        write_json(folder / "config.json", {**record, "run_id": run_id,
                                            "config": {**record["config"], "seed": i}})
        if i % 2:  # a failed run: its error text goes into the excluded-runs table
            write_json(folder / "status.json", {"state": "failed", "step": 4,
                                                "error": f"boom {text}"})
        runs.append({"run_id": run_id, "axes": {"seed": i}, "config_hash": "h", "steps": STEPS})
    write_json(root / "sweep.json", {"grid": {"name": " ".join(INJECTIONS), "preset": "smoke",
                                              "base": {}, "axes": {"seed": list(range(5))}},
                                     "runs": runs})
    return root


def test_injections_in_a_sweep_report_stay_text(base_run: Path, tmp_path: Path) -> None:
    from qkgeom.analysis import write_report

    sweep = _sweep_with_injections(base_run, tmp_path / "sweep")
    md = write_report(sweep, figures=False).read_text()
    page = (sweep / "report" / "report.html").read_text()
    assert live_html(page) == []
    text = "".join(_Page(page).text)
    # The values did reach the page, as text: the H1, the excluded runs' ids and errors.
    assert "onerror=alert(1)" in text and "<script>alert(1)</script>" in text
    assert "boom <script>alert(1)</script>" in text and "a`b<script>c`" in text
    assert "boom [c](javascript:alert(1))" in text
    assert "[c](javascript:alert(1))" in text
    assert "![p](/etc/qkgeom-secret.png)" in text  # shown, not fetched
    title = md.splitlines()[0]  # Markdown text: escaped, not merely left to the renderer
    assert "<" not in title and "&lt;script&gt;" in title and "\\[c\\](javascript" in title
    RESULTS["injections in grid name, run ids, error texts"] = True


def test_injections_in_an_e4_report_stay_text(base_run: Path, tmp_path: Path) -> None:
    from qkgeom.analysis import write_report
    from qkgeom.io import write_json, write_parquet

    res = cli("analyze", str(base_run), "--out", str(tmp_path / "an"), "--quiet")
    assert res.returncode == 0, res.stderr
    folder = tmp_path / "an"
    meta = json.loads((folder / "analysis.json").read_text())
    write_json(folder / "analysis.json", {**meta, "model": INJECTIONS[1] + INJECTIONS[3],
                                          "settings": {**meta["settings"],
                                                       "text": INJECTIONS[0]}})
    for name in ("checkpoints.parquet", "metrics.parquet"):
        table = pd.read_parquet(folder / name)
        table["checkpoint"] = table["checkpoint"] + INJECTIONS[2] + INJECTIONS[4]
        write_parquet(folder / name, table)
    write_report(folder, figures=False)
    page = (folder / "report" / "report.html").read_text()
    assert live_html(page) == []
    text = "".join(_Page(page).text)
    assert "<script>alert(1)</script>[c](javascript:alert(1))" in text  # the model id
    assert "ckpt_00000004a`b<script>c`![p](/etc/qkgeom-secret.png)" in text  # checkpoints
    RESULTS["injections in E4 model id, text, checkpoint names"] = True


def test_escaped_values_render_as_exactly_themselves(tmp_path: Path) -> None:
    """md_code keeps a value whole in one code span (backticks and all), md_text shows it
    verbatim as text."""
    from qkgeom.analysis.kit import md_code, md_table, md_text, render_html

    for value in (*INJECTIONS, "``x``", "`", "| pipe | &amp; *star* _u_ #h"):
        page = _Page(render_html(f"{md_code(value)}\n\n{md_text(value)}\n\n"
                                 + md_table(["v"], [[md_text(value)]]), tmp_path, "t"))
        assert [t for t, _ in page.tags if t == "code"] == ["code"]
        shown = [x for x in page.text if x.strip()][2:]  # after the <title> and <style>
        assert shown == [value, value, "v", value], (value, shown)


def _png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (4, 4), (200, 30, 30)).save(path)
    return path


def test_only_pngs_inside_the_report_folder_are_embedded(tmp_path: Path) -> None:
    from qkgeom.analysis.kit import render_html

    report = tmp_path / "report"
    report.mkdir()
    _png(report / "inside.png")
    outside = _png(tmp_path / "outside.png")
    md = "\n\n".join([
        "![in](inside.png)", f"![abs]({outside})", "![up](../outside.png)",
        "![url](https://example.org/x.png)", "![file](file:///etc/passwd.png)",
        f'<img src="{outside}">', "[js](javascript&#58;alert(1)) [tab](java\tscript:x)",
        "[svg](inside.svg) [web](https://example.org)"])
    page = render_html(md, report, "t")
    tags = _Page(page).tags
    images = [a["src"] for t, a in tags if t == "img"]
    assert len(images) == 1 and images[0].startswith("data:image/png;base64,")  # inside only
    assert live_html(page) == []
    assert [a.get("href") for t, a in tags if t == "a"] == [None, None, "inside.svg",
                                                            "https://example.org"]
    text = "".join(_Page(page).text)
    assert "abs" in text and "up" in text and f'<img src="{outside}">' in text
    RESULTS["images and links from outside the report"] = True
    figure("untrusted inputs", f"{sum(RESULTS.values())}/{len(RESULTS)} handled cleanly "
           f"({'; '.join(RESULTS)})")
