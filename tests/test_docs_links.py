"""The documentation's relative links resolve, and the README stays short.

Every relative markdown link `[text](path)` or `[text](path#anchor)` in README.md and docs/*.md
must name an existing file; an anchor into a markdown file must name one of its headings, slugged
as GitHub does (lowercase, spaces to '-', punctuation other than '-' and '_' removed; a repeated
heading gets '-1', '-2', ...). Links inside fenced or indented code and inline code are not links.
"""
import glob
import os
import re
import unicodedata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 220

LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")


def pages():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def outside_fences(text):
    """(line number, line) of the lines outside fenced code blocks, as written."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield number, line


def prose_lines(text):
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    for number, line in outside_fences(text):
        yield number, re.sub(r"(`+)(?:(?!\1).)+?\1", lambda c: " " * len(c.group(0)), line)


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading)                                 # inline HTML
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)                   # links: their text
    text = text.replace("`", "").strip().lower()
    kept = []
    for ch in text:
        if ch in "-_ " or unicodedata.category(ch)[0] in "LN":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


def headings_raw(path):
    """Headings read with code spans kept (prose_lines blanks them, which would change the slug)."""
    for _, line in outside_fences(open(path, encoding="utf-8").read()):
        h = re.match(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if h:
            yield h.group(2)


def heading_anchors(path):
    seen, found = {}, set()
    for heading in headings_raw(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(path):
    for number, line in prose_lines(open(path, encoding="utf-8").read()):
        if line.startswith("    ") or line.startswith("\t"):
            continue                                                       # indented code
        for pattern in (LINK, IMAGE):
            for m in pattern.finditer(line):
                target = m.group(1)
                if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                    continue                                               # http:, mailto:, ...
                yield number, target


def test_slug_follows_githubs_rules():
    assert slug("The CPU kernels: one portable build, the widest variant at run time") == \
        "the-cpu-kernels-one-portable-build-the-widest-variant-at-run-time"
    assert slug("Uneven data: `hvd.join()`") == "uneven-data-hvdjoin"
    assert slug("Measured: 2 hosts x 2 ranks over 1 Gbit/s host links (CPU, Gloo)") == \
        "measured-2-hosts-x-2-ranks-over-1-gbits-host-links-cpu-gloo"
    assert slug("`make gpu-check-horovod`: the adapter under horovodrun") == \
        "make-gpu-check-horovod-the-adapter-under-horovodrun"
    assert slug("Error feedback (`hvd_qsgd/error_feedback.py`)") == "error-feedback-hvd_qsgderror_feedbackpy"


def test_link_extraction_skips_code_and_absolute_links(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("a [x](a.md) `[y](b.md)` [w](https://e.org/c.md)\n```\n[z](c.md)\n```\n"
                    "    [v](d.md)\n![img](e.png \"title\")\n")
    assert [t for _, t in relative_links(str(page))] == ["a.md", "e.png"]


@pytest.mark.parametrize("page", pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    problems = []
    for number, target in relative_links(page):
        where = f"{os.path.relpath(page, ROOT)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        resolved = page if not file_part else os.path.normpath(
            os.path.join(os.path.dirname(page), file_part.split("?")[0]))
        if not os.path.exists(resolved):
            problems.append(f"{where}: no such file")
            continue
        if anchor:
            if not resolved.endswith(".md"):
                problems.append(f"{where}: anchor into a file that is not markdown")
            elif anchor not in heading_anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{anchor} in "
                                f"{os.path.relpath(resolved, ROOT)}")
    assert not problems, "\n".join(problems)


def test_readme_fits_on_two_screens():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().rstrip("\n").split("\n")
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_docs_index_lists_every_page():
    index = open(os.path.join(ROOT, "docs", "README.md"), encoding="utf-8").read()
    listed = {os.path.normpath(t) for _, t in relative_links(os.path.join(ROOT, "docs", "README.md"))}
    missing = [os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
               if os.path.basename(p) != "README.md" and os.path.basename(p) not in listed]
    assert index and not missing, f"docs/README.md does not list {missing}"
