"""ensure_sample_data: the real offline corpus (token arrays and raw text) prepared once,
reused, safe under concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from qkgeom.data import default_data_dir, ensure_sample_data, load_data, load_prepared
from qkgeom.data import prepare as prepare_mod
from qkgeom.data import sources as sources_mod
from qkgeom.data.text import open_text
from qkgeom.errors import QKGeomError


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QKGEOM_CACHE", str(tmp_path))
    assert default_data_dir() == tmp_path / "data" / "sample"
    monkeypatch.delenv("QKGEOM_CACHE")
    assert default_data_dir() == Path.home() / ".cache" / "qkgeom" / "data" / "sample"


def test_real_sample_prepared_once_then_reused(monkeypatch, tmp_path, sample_articles):
    monkeypatch.setenv("QKGEOM_CACHE", str(tmp_path))
    folder = ensure_sample_data()
    assert folder == tmp_path / "data" / "sample"
    data = load_prepared(folder)
    assert data.meta["source"] == "sample"
    sizes = data.sizes
    # A partition by article of exactly the converted dump.
    assert sum(sizes.values()) == sum(len(text) for _, text in sample_articles)
    assert (
        sizes["val"] >= 100_000
        and sizes["test"] >= 100_000
        and sizes["train"] >= 0.85 * sum(sizes.values())
    )
    assert data.vocab.decode(data.val[:4]) == " \n =" and data.meta["unknown_tokens"]["train"] == 0
    first = {s: data.vocab.decode(getattr(data, s)) for s in ("train", "val", "test")}
    # Each article lands whole in exactly one split (unknown characters decode as U+FFFD).
    seen = {t: data.vocab.decode(data.vocab.encode(body)) for t, body in sample_articles}
    titles = {s: [t for t, body in seen.items() if body in first[s]] for s in first}
    assert sorted(sum(titles.values(), [])) == sorted(t for t, _ in sample_articles)
    # The raw text (held-out splits first) is in the same cache: --text sample reads it.
    text = (folder / "sample.txt").read_text(encoding="utf-8")
    val = data.vocab.decode(data.vocab.encode(text[:sizes["val"]]))
    assert len(text) == sum(sizes.values()) and val == first["val"]
    assert "".join(open_text("sample")()) == text
    stamp = (folder / "meta.json").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the sample must not be converted again")

    monkeypatch.setattr(sources_mod, "sample_splits", fail)  # a re-parse would fail here
    assert ensure_sample_data() == folder
    assert (folder / "meta.json").stat().st_mtime_ns == stamp  # nothing rewritten
    assert not [p for p in tmp_path.joinpath("data").iterdir() if p.name.endswith(".tmp")]


class FakeSample:
    """A small stand-in for the (slow) conversion, counting how often it runs (``calls``).

    While it runs it waits (on an event, never a sleep) until ``callers`` callers have
    reached the lock: each of them looked for the cache and found none, so they really
    overlap the preparation, and without the lock each would prepare again."""

    def __init__(self, lock_class: type) -> None:
        self.calls: list[int] = []
        self.callers = 1
        self.arrived = 0
        self.all_arrived = threading.Event()
        count = threading.Lock()
        fake = self

        class CountingLock(lock_class):  # the lock ensure_sample_data takes, counted
            def acquire(self, *args, **kwargs):
                with count:
                    fake.arrived += 1
                    if fake.arrived >= fake.callers:
                        fake.all_arrived.set()
                return super().acquire(*args, **kwargs)

        self.lock_class = CountingLock

    def __call__(self) -> dict[str, str]:
        self.calls.append(threading.get_ident())
        assert self.all_arrived.wait(timeout=60), "the other callers never reached the lock"
        return {"train": "abc " * 100, "val": "cab " * 50, "test": "bca " * 50}


@pytest.fixture
def counted_fake_sample(monkeypatch) -> FakeSample:
    fake = FakeSample(prepare_mod.FileLock)
    monkeypatch.setattr(prepare_mod, "FileLock", fake.lock_class)
    monkeypatch.setattr(sources_mod, "sample_splits", fake)
    return fake


def test_concurrent_callers_prepare_once(tmp_path, counted_fake_sample):
    target = tmp_path / "cache" / "sample"
    counted_fake_sample.callers = 3
    results, errors = [], []

    def call() -> None:
        try:
            results.append(ensure_sample_data(target))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target] * 3
    assert counted_fake_sample.arrived == 3  # all three overlapped the preparation ...
    assert len(counted_fake_sample.calls) == 1  # ... which ran once
    assert load_prepared(target).sizes == {"train": 400, "val": 200, "test": 200}


def test_load_data_sample_and_the_empty_name_are_the_embedded_sample(
        monkeypatch, tmp_path, counted_fake_sample):
    monkeypatch.setenv("QKGEOM_CACHE", str(tmp_path))
    assert load_data("sample").dir == load_data("").dir == load_data().dir == default_data_dir()
    assert len(counted_fake_sample.calls) == 1  # prepared once, then found


def test_corrupt_cache_is_rebuilt_foreign_folder_refused(tmp_path, counted_fake_sample):
    target = tmp_path / "sample"
    ensure_sample_data(target)
    (target / "val.bin").write_bytes(b"torn")
    ensure_sample_data(target)
    assert len(counted_fake_sample.calls) == 2 and load_prepared(target).sizes["val"] == 200
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(
        QKGeomError, match=r"mine: holds files that are not prepared data \(notes.txt\)"
    ):
        ensure_sample_data(other)
    assert (other / "notes.txt").read_text() == "keep me"


def test_a_cache_of_arrays_only_gets_its_text_added_in_place(tmp_path, counted_fake_sample):
    """A cache from before the raw text was kept with the arrays: the text is added and the
    arrays (maybe memory-mapped by a running job) stay where they are."""
    target = tmp_path / "sample"
    ensure_sample_data(target)
    (target / "sample.txt").unlink()
    inode = (target / "train.bin").stat().st_ino
    ensure_sample_data(target)
    assert (target / "sample.txt").read_text() == "cab " * 50 + "bca " * 50 + "abc " * 100
    assert (target / "train.bin").stat().st_ino == inode and len(counted_fake_sample.calls) == 2
