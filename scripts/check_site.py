"""The built documentation site as a reader sees it (``make docs`` runs this after ``mkdocs build --strict``).

Python-Markdown, unlike GitHub, reads a list that follows a line of text with no blank line between them as part
of that paragraph: the reader sees "vectors: - causality; - a key-validity vector ..." as run-on text. The same
happens to a table, and a fenced code block lands inside the paragraph (HTML a browser has to repair). ``--strict``
passes all of these. This script reads every page of the built site and prints one line per fault:

- a paragraph holding a line that starts a list item (``- ``, ``* ``, ``+ ``, ``1. ``) or a table row (``| ... |``);
- a paragraph holding a code block or a table;
- an indented paragraph outside any list item on a page written in Markdown (not the API reference): written
  for one, but indented by fewer than the 4 spaces Python-Markdown needs to keep it there;
- code in a table cell that shows GitHub's ``\\|`` (Python-Markdown keeps a pipe inside code in a table as it is,
  backslash and all: write the text without a pipe, which both render alike);
- an image whose source is not a file of the site;
- in the Markdown sources (``--docs``), what the HTML cannot show: a list item nested by other than a multiple of
  4 spaces (Python-Markdown makes it an item of the outer list), and a list item's later paragraph, code block or
  comment indented by 1-3 spaces (it leaves the list).

    python scripts/check_site.py build/site

Exit status 1 when it finds any (each line: the page, what, and the first words of the paragraph), 0 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# What starts a list in the middle of a paragraph on GitHub (CommonMark: a bullet, or an ordered list from 1), so
# the author meant a list there; a wrapped line that starts "2025. " is prose in both renderers.
LIST_ITEM = re.compile(r"\s*(?:[-*+]|1[.)])\s")
TABLE_ROW = re.compile(r"\s*\|.*\|\s*$")
BLOCKS = {"pre": "a code block", "table": "a table", "ul": "a list", "ol": "a list"}


class _Page(HTMLParser):
    """Collects each paragraph's, tight list item's and table cell's text, the blocks opened inside a paragraph, and
    every image's source."""

    def __init__(self, prose: bool):
        super().__init__(convert_charrefs=True)
        self.prose = prose  # a page written in Markdown (not docstrings rendered as written)
        self.paragraph = None  # the text of the open <p>, or None outside one
        self.items = []  # the text of each open <li> outside its paragraphs (a tight item's own lines)
        self.cell_code = None  # the text of a <code> open inside a table cell
        self.cells = []  # the text of each open <td>/<th>
        self.faults = []
        self.images = []

    def handle_starttag(self, tag, attrs):
        if tag == "li":
            self.items.append([])
        if tag in ("td", "th"):
            self.cells.append([])
        if tag == "code" and self.cells:
            self.cell_code = []
        if tag == "img":
            self.images.append(dict(attrs).get("src") or "")
        if self.paragraph is None:
            if tag == "p":
                self.paragraph = []
            return
        if tag in BLOCKS:
            self.faults.append(f"{BLOCKS[tag]} inside a paragraph")
            self._close()
        elif tag == "p":  # a <p> inside a <p> closes the first (HTML's rule)
            self._close()
            self.paragraph = []

    def handle_endtag(self, tag):
        if tag == "li" and self.items:
            first, *rest = "".join(self.items.pop()).split("\n")
            if any(TABLE_ROW.match(line) for line in rest):  # a table written right under an item's first line
                self.faults.append(f"a table row run into a list item: {first.strip()[:50]!r}")
        if tag in ("td", "th") and self.cells:
            text = "".join(self.cells.pop()).strip()
            if LIST_ITEM.match(text):  # a list written right under a table: its items become rows
                self.faults.append(f"a list item run into a table: {text[:50]!r}")
        if tag == "code" and self.cell_code is not None:
            code, self.cell_code = "".join(self.cell_code), None
            if "\\|" in code:  # GitHub's escape for a pipe in a table; Python-Markdown shows it in code as written
                self.faults.append(f"a table cell's code shows its escape: {code[:50]!r}")
        if tag == "p" and self.paragraph is not None:
            self._close()

    def handle_data(self, data):
        if self.cell_code is not None:
            self.cell_code.append(data)
        if self.cells:
            self.cells[-1].append(data)
        if self.paragraph is not None:
            self.paragraph.append(data)
        elif self.items:
            self.items[-1].append(data)

    def _close(self):
        text, self.paragraph = "".join(self.paragraph), None
        first, *rest = text.split("\n")
        for line in rest:
            kind = "a list item" if LIST_ITEM.match(line) else "a table row" if TABLE_ROW.match(line) else None
            if kind:
                self.faults.append(f"{kind} run into a paragraph: {first.strip()[:50]!r} then {line.strip()[:40]!r}")
                return
        if self.prose and not self.items and any(line[:1].isspace() for line in rest if line.strip()):
            # Python-Markdown keeps a paragraph in its list item only when indented by 4 spaces (2 leave it out)
            self.faults.append(f"a list item's paragraph outside its list (indent it by 4): {first.strip()[:50]!r}")


def check_page(html: str, prose: bool = True) -> tuple:
    """(faults, image sources) of one page's HTML; ``prose=False`` for the API reference, whose docstrings
    mkdocstrings renders as written (indented lines included)."""
    page = _Page(prose)
    page.feed(html)
    page.close()
    if page.paragraph is not None:
        page._close()
    return page.faults, page.images


def _resolves(site: Path, page: Path, source: str) -> bool:
    parts = urlsplit(source)
    if parts.scheme or parts.netloc or source.startswith("data:"):
        return True  # not the site's to check (and the site links nothing external: mkdocs.yml)
    path = unquote(parts.path)
    target = (site / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
    target = target.resolve()
    return target.is_file() and target.is_relative_to(site.resolve())


MARKER = re.compile(r"( *)(?:[-*+]|\d+[.)])\s")


def check_sources(docs: Path) -> list:
    """One line per list the HTML cannot show as broken, in the Markdown under ``docs``: GitHub nests by 2 spaces,
    Python-Markdown by 4, so

    - a list item indented by other than a multiple of 4 spaces becomes an item of the list above it;
    - inside a list, after a blank line, a paragraph, code block or comment indented by 1-3 spaces leaves the list
      (the list is split in two around it)."""
    lines = []
    for page in sorted(docs.rglob("*.md")):
        fence, in_list, after_blank = None, False, False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            stripped = line.strip()
            where = f"{page.as_posix()}:{number}:"
            indent = len(line) - len(line.lstrip(" "))
            if fence is not None:  # inside a code block: its lines are code, only its closing fence matters
                fence = None if stripped.startswith(fence) and stripped.strip(fence[0]) == "" else fence
                continue
            if not stripped:
                after_blank = True
                continue
            marker = MARKER.match(line)
            if marker and indent % 4:
                lines.append(f"{where} a list item nested by {indent} spaces, not a multiple of 4: {stripped[:40]!r}")
            elif not marker and in_list and after_blank and 0 < indent < 4:
                lines.append(f"{where} a list item's paragraph, code or comment indented by {indent} spaces, "
                             f"fewer than 4: {stripped[:40]!r}")
            if marker:
                in_list = True
            elif indent == 0 and after_blank:
                in_list = False  # a paragraph at the margin after a blank line ends the list
            if stripped.startswith(("```", "~~~")):
                fence = stripped[:3]
            after_blank = False
    return lines


def check_site(site: Path) -> list:
    """One line per fault of every page under ``site``: ``PAGE: what``."""
    pages = sorted(site.rglob("*.html"))
    if not pages:
        return [f"{site}: no HTML page (build the site first: make docs)"]
    lines = []
    for page in pages:
        name = page.relative_to(site).as_posix()
        faults, images = check_page(page.read_text(encoding="utf-8"), prose=not name.startswith("api/"))
        lines += [f"{name}: {fault}" for fault in faults]
        lines += [f"{name}: the image {source!r} is not a file of the site" for source in images
                  if not _resolves(site, page, source)]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, nargs="?", default=Path("build/site"), help="the built site (build/site)")
    parser.add_argument("--docs", type=Path, default=Path("docs"), help="the site's Markdown sources (docs)")
    args = parser.parse_args(argv)
    faults = check_site(args.site) + check_sources(args.docs)
    for line in faults:
        print(line)
    pages = len(list(args.site.rglob("*.html")))
    print(f"check_site: {pages} pages, {len(faults)} faults" if faults else f"check_site: {pages} pages read as written")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
