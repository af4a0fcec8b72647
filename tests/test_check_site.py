"""scripts/check_site.py, the built site as a reader sees it (``make docs`` runs it on build/site): each fault it
names is planted in HTML as Python-Markdown writes it (the shapes were read off its output), and the same page
written right passes. scripts/docs_screens.py's page list, and one capture where Chromium is installed."""

import importlib.util
import shutil
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_site = _load("check_site")
docs_screens = _load("docs_screens")

# What Python-Markdown makes of "The mask comes from per-token vectors:\n- causality;\n- padding." (no blank line)
RUN_ON_LIST = "<p>The mask comes from per-token vectors:\n- causality;\n- padding.</p>"
RIGHT_LIST = "<p>The mask comes from per-token vectors:</p>\n<ul>\n<li>causality;</li>\n<li>padding.</li>\n</ul>"


# (what Python-Markdown writes for the fault, the fault named, what it writes for the page written right)
CASES = [
    (RUN_ON_LIST, "a list item run into a paragraph", RIGHT_LIST),
    ("<p>Steps:\n1. build\n2. check</p>", "a list item run into a paragraph",
     "<p>Steps:</p>\n<ol>\n<li>build</li>\n<li>check</li>\n</ol>"),
    ("<p>Rows:\n| a | b |\n| - | - |</p>", "a table row run into a paragraph",
     "<p>Rows:</p>\n<table><thead><tr><th>a</th><th>b</th></tr></thead></table>"),
    ('<p>Run:\n<div class="highlight"><pre><span></span><code>make\n</code></pre></div></p>',
     "a code block inside a paragraph",
     '<p>Run:</p>\n<div class="highlight"><pre><span></span><code>make\n</code></pre></div>'),
    # a list item's second paragraph indented by 2: Python-Markdown closes the list and keeps the indentation
    ("<ul>\n<li>one</li>\n</ul>\n<p>Second paragraph of one\n  goes on here.</p>",
     "a list item's paragraph outside its list",
     "<ul>\n<li>\n<p>one</p>\n<p>Second paragraph of one\ngoes on here.</p>\n</li>\n</ul>"),
    # `-m·\\|d\\|` in a table cell: GitHub's escape, shown by Python-Markdown as written
    ("<table><tr><td><code>-m·\\|d\\|</code></td></tr></table>", "a table cell's code shows its escape",
     "<table><tr><td><code>-m·abs(d)</code></td></tr></table>"),
    ("<ul>\n<li>item\n| a | b |\n| - | - |</li>\n</ul>", "a table row run into a list item",
     "<ul>\n<li>item</li>\n</ul>\n<table><thead><tr><th>a</th><th>b</th></tr></thead></table>"),
    ("<table><tbody><tr><td>1</td><td>2</td></tr><tr><td>- item</td><td></td></tr></tbody></table>",
     "a list item run into a table",
     "<table><tbody><tr><td>1</td><td>2</td></tr></tbody></table>\n<ul>\n<li>item</li>\n</ul>"),
]


@pytest.mark.parametrize("html, fault, right", CASES, ids=[case[1] for case in CASES])
def test_each_fault_is_named_and_its_right_form_passes(html, fault, right):
    faults, _ = check_site.check_page(html)
    assert len(faults) == 1 and faults[0].startswith(fault), faults
    assert check_site.check_page(right) == ([], [])


def test_what_is_not_a_fault():
    page = ("<p>A range 1-3\nthen a dash - here, and 2 - 1 = 1.</p>"  # a hyphen inside a line is prose
            "<p>Lin et al.\n2025. FoX, a year wrapped to the line's start</p>"  # no list in either renderer
            "<ul><li><p>an item's own paragraph\n  keeps its indentation</p></li></ul>"
            "<p>a sentence that wraps\nonto a second line</p>"
            "<table><tr><td><code>-m·abs(d)</code> or x | y</td></tr></table><p><code>a\\|b</code> outside a table</p>")
    assert check_site.check_page(page)[0] == []
    # the API reference renders docstrings as written: their indented lines are not a fault there
    assert check_site.check_page("<p>Args:\n    x: the input</p>", prose=False)[0] == []
    assert check_site.check_page("<p>Args:\n    x: the input</p>", prose=True)[0]


def _site(tmp_path, page_html):
    site = tmp_path / "site"
    (site / "guides" / "one").mkdir(parents=True)
    (site / "results").mkdir()
    (site / "results" / "plot.png").write_bytes(b"png")
    (site / "index.html").write_text("<p>home</p>")
    (site / "guides" / "one" / "index.html").write_text(page_html)
    return site


def test_an_image_must_be_a_file_of_the_site(tmp_path):
    good = _site(tmp_path / "a", '<p><img src="../../results/plot.png" alt="x"></p>')
    assert check_site.check_site(good) == []
    for n, source in enumerate(("../../results/missing.png", "../../../outside.png")):
        bad = _site(tmp_path / f"b{n}", f'<p><img src="{source}" alt="x"></p>')
        (bad.parent / "outside.png").write_bytes(b"png")  # exists, but not in the site
        faults = check_site.check_site(bad)
        assert faults == [f"guides/one/index.html: the image {source!r} is not a file of the site"]


def test_the_command_exits_1_on_a_fault_and_0_on_a_clean_site(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text("- a\n    - nested by 4\n")
    assert check_site.main([str(_site(tmp_path / "ok", RIGHT_LIST)), "--docs", str(docs)]) == 0
    assert check_site.main([str(_site(tmp_path / "bad", RUN_ON_LIST)), "--docs", str(docs)]) == 1
    out = capsys.readouterr().out
    assert "guides/one/index.html: a list item run into a paragraph" in out and "1 faults" in out
    assert check_site.main([str(tmp_path / "none"), "--docs", str(docs)]) == 1


def test_what_the_html_cannot_show_is_named_in_the_sources(tmp_path):
    """A list nested by other than 4 spaces (flattened), and an item's later paragraph, code or comment indented by
    1-3 spaces (it leaves the list): invisible as faults in the HTML, named from the Markdown."""
    (tmp_path / "page.md").write_text(
        "1. step:\n   - three spaces\n2. next\n\n```text\n  - in a fence is code\n```\n"
        "- a\n    - four spaces\n      - six spaces\n\n"
        "- one\n\n  second paragraph, by 2\n\n    third, by 4\n\n  ```bash\n  make\n  ```\n\n"
        "A paragraph at the margin ends the list.\n\n  an indented line after it is no list's\n")
    where = (tmp_path / "page.md").as_posix()
    assert check_site.check_sources(tmp_path) == [
        f"{where}:2: a list item nested by 3 spaces, not a multiple of 4: '- three spaces'",
        f"{where}:10: a list item nested by 6 spaces, not a multiple of 4: '- six spaces'",
        f"{where}:14: a list item's paragraph, code or comment indented by 2 spaces, fewer than 4: 'second paragraph, by 2'",
        f"{where}:18: a list item's paragraph, code or comment indented by 2 spaces, fewer than 4: '```bash'",
    ]


def test_the_documentation_sources_pass_their_own_rule():
    """The rule the built-site check cannot see (a shallow nest renders as a flat list) holds for docs/ today."""
    assert check_site.check_sources(ROOT / "docs") == []


def test_screens_cover_the_front_page_and_every_guide(tmp_path):
    site = _site(tmp_path, RIGHT_LIST)
    (site / "guides" / "two").mkdir()
    (site / "guides" / "two" / "index.html").write_text("<p>two</p>")
    assert docs_screens.pages(site) == [("index", "index.html"), ("guides-one", "guides/one/index.html"),
                                        ("guides-two", "guides/two/index.html")]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (make docs-screens only)")
def test_a_screen_holds_the_whole_page(tmp_path):
    """A page taller than any window is captured whole: the PNG's height is the page's (the body sets it)."""
    site = _site(tmp_path, '<html><body style="margin:0"><div style="height:3000px">tall</div></body></html>')
    assert docs_screens.main([str(site), "--output", str(tmp_path / "screens")]) == 0
    header = (tmp_path / "screens" / "guides-one.png").read_bytes()[:24]
    width, height = struct.unpack(">II", header[16:24])
    assert (width, height) == (docs_screens.WIDTH, 3000)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (make docs-screens only)")
def test_a_page_that_never_loads_is_a_timeout_not_a_hang(tmp_path, monkeypatch):
    """An image from a socket that accepts and never answers keeps the page's load event from firing: the capture
    gives up at PAGE_TIMEOUT (the read waits with a deadline), and the browser is closed."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    monkeypatch.setattr(docs_screens, "PAGE_TIMEOUT", 3.0)
    page = tmp_path / "page.html"
    page.write_text(f'<p>waiting</p><img src="http://127.0.0.1:{port}/never.png">')
    devtools = docs_screens.DevTools(shutil.which("chromium"))
    try:
        with pytest.raises(TimeoutError):
            docs_screens.capture(devtools, page.as_uri(), tmp_path / "page.png")
    finally:
        devtools.close()
        listener.close()
    assert devtools.process.poll() is not None
