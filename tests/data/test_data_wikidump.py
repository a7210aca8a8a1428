"""The dump converter on the real shipped dump (qkgeom/data/sample/) and on a hand-written dump with a known answer."""

from __future__ import annotations

import bz2
import re
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from qkgeom.data import convert_dump, iter_articles, load_prepared, prepare_data
from qkgeom.data.sources import split_articles
from qkgeom.data.wikidump import wikitext_to_plain
from qkgeom.errors import QKGeomError

HEADING = re.compile(r"^ (=(?: =)*) (\S.*?) (=(?: =)*) $")


def _raw_pages(dump: Path) -> list[tuple[str, str, bool]]:
    """(title, ns, is_redirect) by regex over the raw XML: a ground truth independent of iterparse."""
    with bz2.open(dump, "rt", encoding="utf-8") as fh:
        xml = fh.read()
    pages = re.findall(r"<page>(.*?)</page>", xml, flags=re.S)
    return [
        (
            re.search(r"<title>(.*?)</title>", p).group(1),
            re.search(r"<ns>(\d+)</ns>", p).group(1),
            "<redirect" in p,
        )
        for p in pages
    ]


def test_real_dump_article_count_and_no_redirects(sample_dump, sample_articles):
    pages = _raw_pages(sample_dump)
    articles = [t for t, ns, redirect in pages if ns == "0" and not redirect]
    redirects = {t for t, ns, redirect in pages if redirect}
    titles = [title for title, _ in sample_articles]
    assert 100 <= len(titles) <= 110  # the shortened dump: 106 articles after redirects
    assert titles == [t.replace("&amp;", "&") for t in articles]  # every prose article, dump order
    assert len(redirects) >= 90 and not redirects & set(titles)


def test_real_dump_is_clean_wikitext_layout(sample_articles):
    text = "".join(body for _, body in sample_articles)
    assert 2_500_000 <= len(text) <= 3_200_000  # about 2.8 M characters of prose
    markup = ["{{", "}}", "[[", "]]", "<ref", "</ref", "{|", "|}", "''", "&amp;", "<!--"]
    for residue in [*markup, "http://", "https://"]:
        assert residue not in text, residue
    lines = text.split("\n")
    assert lines[-1] == ""
    for line in lines[:-1]:
        assert line.startswith(" ") and line.endswith(" "), repr(line[:80])
    headings = [line for line in lines if line.startswith(" = ")]
    for h in headings:
        m = HEADING.match(h)
        assert m and m.group(1) == m.group(3), h
    levels = [HEADING.match(h).group(1).count("=") for h in headings]
    assert (
        levels.count(1) == len(sample_articles) and levels.count(2) > 200 and levels.count(3) > 50
    )
    names = {HEADING.match(h).group(2).lower() for h in headings}
    assert not names & {
        "references",
        "external links",
        "see also",
        "further reading",
        "notes",
        "bibliography",
    }


def test_real_dump_articles_start_with_title_block(sample_articles):
    for title, body in sample_articles:
        assert body.startswith(f" \n = {title} = \n \n")
        # A heading is always followed by prose or by a deeper heading (no empty sections).
        lines = body.split("\n")
        for i, line in enumerate(lines):
            if line.startswith(" = = "):
                nxt = next(x for x in lines[i + 1 :] if x != " ")
                assert not nxt.startswith(" = ") or nxt.count("=") > line.count("="), (title, line)


TINY_LOBSTER = """{{Infobox animal|name=Lobster|image=Lobster.jpg}}
'''Lobsters''' are [[marine]] [[crustacean|crustaceans]].<ref>{{cite book|title=Crabs}}</ref> They live in [http://example.org the sea].

{| class="wikitable"
! Species !! Size
|-
| European || 60&nbsp;cm
|}
== Description ==
Lobsters have a ''hard'' shell.<!-- a comment --> They grow {{convert|60|cm}} long.
[[File:Lobster.jpg|thumb|A [[lobster]] claw]]

=== Claws ===
The claws are large &amp; strong.

== Empty ==
{{main|Crab}}

== See also ==
* [[Crab]]

== References ==
{{reflist}}
[[Category:Crustaceans]]
[[de:Hummer]]
"""

TINY_EXPECTED = (
    " \n = Lobster = \n \n"
    " Lobsters are marine crustaceans. They live in the sea. \n"
    " \n = = Description = = \n \n"
    " Lobsters have a hard shell. They grow 60 cm long. \n"
    " \n = = = Claws = = = \n \n"
    " The claws are large & strong. \n"
)


def _page(title: str, ns: int, text: str, redirect: str | None = None) -> str:
    red = f'<redirect title="{escape(redirect)}" />' if redirect else ""
    return (
        f"<page><title>{escape(title)}</title><ns>{ns}</ns><id>1</id>{red}"
        f'<revision><id>2</id><text xml:space="preserve">{escape(text)}</text></revision></page>\n'
    )


def _write_dump(path: Path, pages: list[str]) -> Path:
    xml = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
        "<siteinfo><sitename>Wikipedia</sitename></siteinfo>\n" + "".join(pages) + "</mediawiki>\n"
    )
    path.write_bytes(bz2.compress(xml.encode("utf-8")))
    return path


@pytest.fixture
def tiny_dump(tmp_path: Path) -> Path:
    return _write_dump(
        tmp_path / "enwiki-test-pages-articles.xml.bz2",
        [
            _page("Old lobster", 0, "#REDIRECT [[Lobster]]", redirect="Lobster"),
            _page("Homard", 0, "#redirect [[Lobster]] {{R from French}}"),  # no <redirect> element
            _page("Talk:Lobster", 1, "Talk pages are not articles."),
            _page("Lobster", 0, TINY_LOBSTER),
            _page("Stub", 0, "{{Infobox|x=1}}\n[[Category:Stubs]]"),  # no prose left
        ],
    )


def test_tiny_dump_exact_output(tiny_dump: Path, tmp_path: Path):
    assert list(iter_articles(tiny_dump)) == [("Lobster", TINY_EXPECTED)]
    out = tmp_path / "out" / "wiki.txt"
    assert convert_dump(tiny_dump, out) == 1
    assert out.read_text(encoding="utf-8") == TINY_EXPECTED
    assert not list(out.parent.glob(".*.tmp"))  # written atomically, no temp left


@pytest.mark.parametrize(
    ("wikitext", "expected"),
    [
        ("A {{lang|fr|mot}} and {{nowrap|two words}}.", " A mot and two words. "),
        ("Range {{convert|5|-|10|km}} wide.", " Range 5 – 10 km wide. "),
        ("Born ({{IPA|x}}; 1900) in [[:Category:Paris|Paris]].", " Born (1900) in Paris. "),
        ("Line one<br/>two <math>x^2</math>done.", " Line one two done. "),
    ],
)
def test_inline_rules(wikitext: str, expected: str):
    assert wikitext_to_plain("T", wikitext) == f" \n = T = \n \n{expected}\n"


def test_boilerplate_subsections_dropped_and_later_sections_kept():
    text = "Lead.\n== Notes ==\n=== Sub ===\nCited.\n== Legacy ==\nKept."
    assert (
        wikitext_to_plain("T", text) == " \n = T = \n \n Lead. \n \n = = Legacy = = \n \n Kept. \n"
    )


def test_missing_and_corrupt_dumps(tmp_path: Path):
    with pytest.raises(QKGeomError, match="not found"):
        list(iter_articles(tmp_path / "nope.xml.bz2"))
    bad = tmp_path / "bad.xml.bz2"
    bad.write_bytes(b"this is not bzip2")
    with pytest.raises(QKGeomError, match=r"bad\.xml\.bz2.*decompress"):
        list(iter_articles(bad))
    broken = tmp_path / "broken.xml.bz2"
    broken.write_bytes(bz2.compress(b"<mediawiki><page><title>x</title>"))
    with pytest.raises(QKGeomError, match=r"broken\.xml\.bz2.*not a valid MediaWiki XML"):
        list(iter_articles(broken))
    none = _write_dump(tmp_path / "none.xml.bz2", [_page("R", 0, "#REDIRECT [[X]]")])
    with pytest.raises(QKGeomError, match="no articles"):
        convert_dump(none, tmp_path / "none.txt")
    assert not (tmp_path / "none.txt").exists()


def test_split_by_article_is_deterministic_and_order_free(sample_articles):
    splits = split_articles(sample_articles)
    total = sum(len(t) for _, t in sample_articles)
    assert sum(len(s) for s in splits.values()) == total
    assert len(splits["val"]) >= 0.05 * total and len(splits["test"]) >= 0.05 * total
    assert len(splits["val"]) >= 100_000 and len(splits["test"]) >= 100_000
    for _, body in sample_articles:  # every article whole in exactly one split
        assert sum(body in s for s in splits.values()) == 1
    shuffled = split_articles(list(reversed(sample_articles)))
    for name in splits:  # same articles per split whatever the dump order
        assert sorted(splits[name].split(" \n = ")) == sorted(shuffled[name].split(" \n = "))


def test_prepare_wikidump_source(tmp_path: Path):
    pages = [
        _page(
            f"Article {i}",
            0,
            f"'''Article {i}''' is about topic {i}.\n== History ==\nIt began in {1900 + i}.",
        )
        for i in range(40)
    ]
    dump = _write_dump(tmp_path / "enwiki-x-pages-articles1.xml.bz2", pages)
    data = load_prepared(prepare_data("wikidump", tmp_path / "out", path=dump))
    assert data.meta["source"] == "wikidump" and data.meta["path"] == str(dump.resolve())
    text = {s: data.vocab.decode(getattr(data, s)) for s in ("train", "val", "test")}
    counts = {s: t.count(" \n = Article ") for s, t in text.items()}
    assert sum(counts.values()) == 40 and counts["val"] >= 2 and counts["test"] >= 2
    assert text["val"].startswith(" \n = Article ") and " = = History = = " in text["test"]
    again = prepare_data("wikidump", tmp_path / "again", path=dump)
    for split in ("train", "val", "test"):
        assert (again / f"{split}.bin").read_bytes() == (
            tmp_path / "out" / f"{split}.bin"
        ).read_bytes()
    with pytest.raises(QKGeomError, match="too small to split by article"):
        prepare_data(
            "wikidump", tmp_path / "small", path=_write_dump(tmp_path / "s.xml.bz2", pages[:2])
        )
