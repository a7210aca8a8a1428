"""Wikipedia XML dump -> WikiText-style plain text.

The experiments train on WikiText-103, Wikipedia prose in a light layout (`` = Title = ``,
`` = = Section = = ``, one paragraph per line); the embedded sample and a user's
``enwiki-*-pages-articles*.xml.bz2`` are raw MediaWiki markup, so this module strips it with
``mwparserfromhell`` and drops boilerplate sections, streaming the dump in constant memory.
Unlike WikiText the text is not Moses-tokenised and templates are not expanded (a few
inline ones keep their visible text). Details: docs/data.md.
"""

from __future__ import annotations

import bz2
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import mwparserfromhell
from mwparserfromhell.nodes import (
    Comment,
    ExternalLink,
    Heading,
    HTMLEntity,
    Tag,
    Template,
    Text,
    Wikilink,
)
from mwparserfromhell.wikicode import Wikicode

from qkgeom.errors import QKGeomError
from qkgeom.io import atomic_write

__all__ = ["iter_articles", "convert_dump", "wikitext_to_plain", "BOILERPLATE_SECTIONS"]

#: Section titles (lower case) whose content is link lists or citations, not prose.
BOILERPLATE_SECTIONS: frozenset[str] = frozenset({
    "references", "external links", "see also", "further reading", "notes", "bibliography",
    "sources", "citations", "footnotes", "notes and references", "references and notes",
    "works cited"})
# Tags whose whole content is not prose (citations, tables, formulas, media, code).
_DROP_TAGS = frozenset({
    "ref", "references", "table", "gallery", "math", "chem", "ce", "timeline", "imagemap",
    "score", "graph", "hiero", "templatedata", "templatestyles", "categorytree", "inputbox",
    "section", "syntaxhighlight", "source", "pre", "noinclude", "mapframe", "maplink"})
# Link namespaces that are media or metadata, not text.
_DROP_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})
# Interlanguage prefix: "de:", "zh-min-nan:", "simple:".
_INTERLANG = re.compile(r"^[a-z]{2,3}(-[a-z]+)*$|^simple$")

# Inline templates whose visible output is worth keeping (name -> rendering rule).
_TEXT_PARAM_1 = frozenset({"nowrap", "nobr", "small", "smaller", "big", "sic", "not a typo",
                           "nowrap begin"})
_CHAR_TEMPLATES = {"nbsp": " ", "ndash": "–", "mdash": "—", "snd": " – ", "spaced ndash": " – "}
_RANGE_WORDS = frozenset({"-", "–", "to", "and", "or", "x", "by", "+"})

_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_SPACES = re.compile(r"[ \t\u00a0\u2009\u200b\u202f]+")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)")
_PAREN_LEAD_PUNCT = re.compile(r"\(\s*[,;:]\s*")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?])(?=\s|$)")
_HAS_WORD = re.compile(r"\w")

# Residue of markup that mwparserfromhell leaves as plain text when it is malformed
# (an unclosed <ref>, a table broken by a template, a file link with nested links).
_RESIDUE_REF = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?(?:</ref\s*>|$)", re.IGNORECASE)
_RESIDUE_TAG = re.compile(
    r"</?(?:ref|references|small|big|span|div|center|sup|sub|br|blockquote|u|s|font|nowiki|"
    r"abbr|cite|poem|onlyinclude|includeonly|noinclude|gallery)\b[^>]*>", re.IGNORECASE)
_RESIDUE_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_RESIDUE_MEDIA_LINK = re.compile(
    r"\[\[\s*(?:file|image|media|category)\s*:[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]",
    re.IGNORECASE)
_RESIDUE_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)*([^\[\]|]*)\]\]")
_RESIDUE_QUOTES = re.compile(r"'{2,}")


def _render(code: Wikicode | None) -> str:
    """Visible prose of ``code`` with all non-prose markup removed (may contain newlines)."""
    if code is None:
        return ""
    return "".join(_render_node(node) for node in code.nodes)


def _render_node(node: object) -> str:
    if isinstance(node, Text):
        return str(node.value)
    if isinstance(node, HTMLEntity):
        try:
            return node.normalize()
        except (ValueError, OverflowError):
            return ""
    if isinstance(node, Wikilink):
        return _render_wikilink(node)
    if isinstance(node, ExternalLink):
        # Keep the link text, never the URL; a bare URL or "[url]" shows no prose.
        return _render(node.title) if node.title is not None else ""
    if isinstance(node, Tag):
        tag = str(node.tag).strip().lower()
        if tag in _DROP_TAGS:
            return ""
        if tag == "br":  # separates words when rendered
            return " "
        return _render(node.contents) if node.contents is not None else ""
    if isinstance(node, Template):
        return _render_template(node)
    if isinstance(node, Heading):
        return _render(node.title)
    # Comment, Argument ({{{x}}}) and anything unknown: not prose.
    return ""


def _render_wikilink(link: Wikilink) -> str:
    title = str(link.title).strip()
    if title.startswith(":"):  # [[:Category:X]] is a visible link, not a categorisation
        title = title[1:]
    elif ":" in title:
        prefix = title.split(":", 1)[0].strip().lower()
        if prefix in _DROP_LINK_NAMESPACES or _INTERLANG.match(prefix):
            return ""
    if link.text is not None:
        return _render(link.text)
    return _render(link.title).strip().removeprefix(":")


def _render_template(template: Template) -> str:
    """Visible text of a few inline templates; every other template is removed."""
    name = str(template.name).strip().lower().replace("_", " ")
    if name in _CHAR_TEMPLATES:
        return _CHAR_TEMPLATES[name]
    args = [_render(p.value).strip() for p in template.params if not p.showkey]
    if name in ("convert", "cvt") and len(args) >= 2:
        if len(args) >= 4 and args[1] in _RANGE_WORDS:
            sep = " – " if args[1] in ("-", "–") else f" {args[1]} "
            return f"{args[0]}{sep}{args[2]} {args[3]}"
        return f"{args[0]} {args[1]}"
    if (name == "lang" or name == "transl") and len(args) >= 2:
        return args[-1]
    if name.startswith("lang-") and args:
        return args[0]
    if name in _TEXT_PARAM_1 and args:
        return args[0]
    return ""


def _clean_line(line: str) -> str:
    """Collapse whitespace and repair the punctuation left behind by removed markup."""
    line = _MAGIC_WORD.sub("", line)
    line = _SPACES.sub(" ", line)
    line = _PAREN_LEAD_PUNCT.sub("(", line)
    line = _EMPTY_PARENS.sub("", line)
    line = _SPACES.sub(" ", line)
    line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
    return line.strip()


def _scrub_residue(line: str) -> str:
    """Remove markup that survived parsing as plain text (see ``_RESIDUE_*``)."""
    if "<" in line:
        line = _RESIDUE_TAG.sub("", _RESIDUE_REF.sub("", line))
    if "{{" in line:
        removed = 1
        while removed:  # innermost templates first, until none is left
            line, removed = _RESIDUE_TEMPLATE.subn("", line)
        line = line.split("{{", 1)[0]  # an unclosed template runs to the end of the line
    if "[[" in line:
        line = _RESIDUE_LINK.sub(r"\1", _RESIDUE_MEDIA_LINK.sub("", line))
    return _RESIDUE_QUOTES.sub("", line)


def _paragraphs(nodes: list[object]) -> list[str]:
    text = _render(Wikicode(nodes))
    out = []
    table_depth = 0  # inside a table mwparserfromhell could not parse
    for raw in text.split("\n"):
        head = raw.lstrip()
        if head.startswith("{|"):
            table_depth += 1
            continue
        if table_depth and head.startswith("|}"):
            table_depth -= 1
            continue
        if table_depth or head.startswith(("|", "!")) or head.lower().startswith(
                ("[[file:", "[[image:")):
            continue
        line = _clean_line(_scrub_residue(raw))
        # A line with no letter or digit is a leftover of removed markup ("()", "|"); one
        # starting with "=" is a formula fragment (its <math> removed) and would read as a
        # heading in the WikiText layout.
        if line and _HAS_WORD.search(line) and not line.startswith("="):
            out.append(line)
    return out


def _heading_line(level: int, title: str) -> str:
    # WikiText: " = Title = " for the article, " = = Section = = " for level-2, and so on.
    return " " + "= " * level + title + " =" * level + " "


def wikitext_to_plain(title: str, wikitext: str) -> str:
    """One article's MediaWiki source as a WikiText-style block (``""`` when no prose is
    left): `` \\n = Title = \\n \\n``, one paragraph per line wrapped in single spaces, and
    `` \\n = = Section = = \\n \\n`` before each section with prose in it or below it;
    boilerplate sections are dropped with their subsections."""
    code = mwparserfromhell.parse(wikitext)
    # (level, heading title, paragraphs); level 1 = the lead before the first heading.
    sections: list[tuple[int, str, list[str]]] = []
    level, heading, body = 1, title, []
    skip_below: int | None = None  # inside a boilerplate section of this level

    def flush() -> None:
        if skip_below is None:
            sections.append((level, heading, _paragraphs(body)))

    for node in code.nodes:
        if isinstance(node, Heading):
            flush()
            level = min(max(int(node.level), 2), 6)
            heading = _clean_line(_render(node.title).replace("\n", " "))
            body = []
            if skip_below is not None and level <= skip_below:
                skip_below = None
            if skip_below is None and heading.lower().rstrip(":") in BOILERPLATE_SECTIONS:
                skip_below = level
        elif not isinstance(node, Comment):
            body.append(node)
    flush()

    keep = []
    for i, (lvl, _, paras) in enumerate(sections):
        has_text = bool(paras)
        j = i + 1
        while not has_text and j < len(sections) and sections[j][0] > lvl:
            has_text = bool(sections[j][2])
            j += 1
        keep.append(has_text)
    if not any(keep):
        return ""

    lines = [" ", _heading_line(1, title), " "]
    for (lvl, head, paras), kept in zip(sections, keep, strict=True):
        if not kept:
            continue
        if lvl > 1 and head:  # an empty "== ==" heading adds its prose to the section above
            lines += [" ", _heading_line(lvl, head), " "]
        lines += [f" {p} " for p in paras]
    return "\n".join(lines) + "\n"


def _open_dump(path: Path) -> IO[bytes]:
    if not path.is_file():
        raise QKGeomError(f"{path}: Wikipedia dump not found; pass an existing "
                          "enwiki-*-pages-articles*.xml.bz2 file")
    return bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _iter_pages(path: Path) -> Iterator[tuple[str, int, bool, str]]:
    """Yield (title, namespace, is_redirect, wikitext) for each <page>, in constant memory."""
    with _open_dump(path) as fh:
        root = None
        try:
            for event, elem in ET.iterparse(fh, events=("start", "end")):
                if root is None:
                    root = elem
                    continue
                if event != "end" or _local(elem.tag) != "page":
                    continue
                title, ns, redirect, text = "", -1, False, ""
                for child in elem.iter():
                    name = _local(child.tag)
                    if name == "title":
                        title = child.text or ""
                    elif name == "ns":
                        ns = int((child.text or "-1").strip())
                    elif name == "redirect":
                        redirect = True
                    elif name == "text":
                        text = child.text or ""
                yield title, ns, redirect, text
                elem.clear()
                root.clear()  # drop the cleared page from the root too: constant memory
        except ET.ParseError as err:
            raise QKGeomError(f"{path}: not a valid MediaWiki XML dump ({err}); re-download "
                              "the dump") from None
        except (OSError, EOFError) as err:
            raise QKGeomError(f"{path}: could not be decompressed ({err}); the file is "
                              "truncated or not bzip2, re-download it") from None
        if root is None:
            raise QKGeomError(f"{path}: empty dump file; re-download it")


def iter_articles(path: str | Path) -> Iterator[tuple[str, str]]:
    """``(title, WikiText-style text)`` of every article (namespace 0, no redirect) with
    prose in a ``.xml.bz2`` or ``.xml`` dump: ``"".join(texts)`` is the converted corpus."""
    path = Path(path)
    for title, ns, redirect, wikitext in _iter_pages(path):
        if ns != 0 or redirect or wikitext.lstrip()[:9].lower() == "#redirect":
            continue
        text = wikitext_to_plain(title, wikitext)
        if text:
            yield title, text


def convert_dump(path: str | Path, out_path: str | Path) -> int:
    """Convert a dump to one WikiText-style UTF-8 file, atomically; returns the articles."""
    count = 0

    def write(tmp: Path) -> None:
        nonlocal count
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            for _, text in iter_articles(path):
                out.write(text)
                count += 1

    atomic_write(out_path, write)
    if count == 0:
        Path(out_path).unlink(missing_ok=True)
        raise QKGeomError(f"{path}: no articles with prose found in the dump; check it is a "
                          "pages-articles dump")
    return count
