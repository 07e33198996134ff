"""Every relative markdown link in the docs resolves: README.md, ARCHITECTURE.md, bench/README.md and docs/**/*.md.

A link `[text](target)` that is not http(s), mailto or a pure `#anchor` must name an existing file or directory,
relative to the file that holds it; with `#anchor` into a .md file, the anchor must be one of that file's headings
(GitHub's slugs). Fenced code blocks and inline code are not markdown, so their brackets are skipped."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files() -> list[str]:
    files = [os.path.join(ROOT, name) for name in ("README.md", "ARCHITECTURE.md", os.path.join("bench", "README.md"))]
    for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += [os.path.join(folder, name) for name in sorted(names) if name.endswith(".md")]
    return [path for path in files if os.path.isfile(path)]


def prose_lines(path: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
            elif not fenced:
                yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but '-' and ' ' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found, seen = set(), {}
    for _, line in prose_lines(path):
        if re.match(r"#{1,6}\s", line):
            base = slug(line.lstrip("#"))
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return found


def broken_links() -> list[str]:
    broken = []
    for path in doc_files():
        shown = os.path.relpath(path, ROOT)
        for number, line in prose_lines(path):
            for target in LINK.findall(re.sub(r"`+[^`]*`+", "", line)):
                if re.match(r"(https?:|mailto:|#)", target):
                    continue
                file_part, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if not os.path.exists(resolved):
                    broken.append(f"{shown}:{number}: {target} (no such file or directory)")
                elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                    broken.append(f"{shown}:{number}: {target} (no heading '#{anchor}' in {file_part})")
    return broken


def test_relative_links_resolve():
    broken = broken_links()
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)
