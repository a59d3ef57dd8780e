"""The README and the docs/ pages: their Python snippets run as written, they name no internal notes, and every
relative link leads somewhere.

A fenced ``python`` block directly after an HTML comment ``<!-- runs-as-written -->`` is executed in a fresh
interpreter (the installed package, no test helpers on the path); it must exit 0. When the block is followed by
``<!-- prints -->`` and a fenced ``text`` block, every non-empty line of that block must appear in the snippet's
output, in order (a page that says what a snippet prints is asserted, not trusted); a snippet's comments state no
figures (those belong in the printed block). The pages' other figures are asserted by the tests and benchmarks they
name; this file keeps the snippets, the links and the prose honest. Links are checked the way GitHub renders them:
a relative path must exist, and an ``#anchor`` must be a heading of the target page (GitHub's slug: lower case,
punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runs-as-written -->"
PRINTS = "<!-- prints -->"
_BLOCK = re.compile(
    re.escape(MARKER) + r"\s*```python\n(.*?)```(?:\s*" + re.escape(PRINTS) + r"\s*```text\n(.*?)```)?", re.S
)
#: a figure in a snippet's comment (a parameter count, a difference): it must be printed and shown instead
_FIGURE_COMMENT = re.compile(r"#.*(\d[\d,.]*\s*(?:[KMB] )?params|\b0\.0\b|\d{1,3}(?:,\d{3})+)")
_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")

#: Notes that belong to the people who wrote the pages, not to their readers.
INTERNAL_NOTES = [
    r"\bissue \d+\b",
    r"\bthis session\b",
    r"shared/DESIGN\.md",
    r"shared/FACTS\.md",
    r"design sketch",
    r"this machine has no GPU",
    r"(?<![\w.])/tmp/(?!ray/)",  # a temp folder of the machine that measured (Ray's /tmp/ray logs are Ray's path)
    r"(?<![\w.])/work/",
    r"\bbefore \([0-9a-f]{7,40}\)",  # release history: CHANGELOG.md
]


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _snippets() -> list[tuple[str, int, str, str]]:
    """(page, index, code, what the page says it prints: "" when it says nothing)."""
    found = []
    for page in PAGES:
        for index, (code, prints) in enumerate(_BLOCK.findall(page.read_text(encoding="utf-8"))):
            found.append((_rel(page), index, code, prints))
    return found


def missing_output(expected: str, output: str) -> list[str]:
    """The lines of ``expected`` not found in ``output`` in order (each a substring of a later output line)."""
    lines, at, missing = output.splitlines(), 0, []
    for want in (w.strip() for w in expected.splitlines()):
        if not want:
            continue
        hit = next((i for i in range(at, len(lines)) if want in lines[i]), None)
        if hit is None:
            missing.append(want)
        else:
            at = hit + 1
    return missing


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, with their 1-based numbers."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's slug of a heading's text: inline code marks and punctuation dropped, lower case, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    text = page.read_text(encoding="utf-8")
    for _, line in _prose_lines(text):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_anchor(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    result.update(_HTML_ID.findall(text))
    return result


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` whose file or heading does not exist, as 'line N: target (why)'."""
    broken = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"line {number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"line {number}: {target} (no heading #{anchor} in {dest.name})")
    return broken


def test_pages_mark_runnable_snippets() -> None:
    assert len(_snippets()) >= 1, f"no {MARKER} python block in README.md or docs/*.md"
    assert len(PAGES) > 1, "docs/ has no pages"


def test_readme_keeps_the_two_set_up_commands() -> None:
    text = README.read_text(encoding="utf-8")
    for command in (
        'python3 -m pip install torch==2.13.0 ".[models]" && fsdp-compat smoke',
        'python3 -m pip install "tox>=4.20" && tox',
    ):
        assert command in text, f"README.md lost the set-up command {command!r}"


@pytest.mark.parametrize(
    ("page", "index", "code", "prints"), _snippets(), ids=[f"{p}:{i}" for p, i, _, _ in _snippets()]
)
def test_snippet_runs_as_written(page: str, index: int, code: str, prints: str, tmp_path: Path) -> None:
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != TESTS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(parts)}  # tests/conftest.py put tests/ there: not for readers
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, f"{page} snippet {index} failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert missing_output(prints, proc.stdout) == [], f"{page} snippet {index} printed:\n{proc.stdout[-4000:]}"


@pytest.mark.parametrize(
    ("page", "index", "code"), [s[:3] for s in _snippets()], ids=[f"{p}:{i}" for p, i, _, _ in _snippets()]
)
def test_snippet_comments_state_no_figures(page: str, index: int, code: str) -> None:
    figures = [line.strip() for line in code.splitlines() if _FIGURE_COMMENT.search(line)]
    assert figures == [], f"{page} snippet {index}: print the figure and show it in a {PRINTS} block: {figures}"


def test_the_output_check_can_fail() -> None:
    out = "WrapPlan for X\n  groups: 3 + root\n0.0 0.0\n"
    assert missing_output("WrapPlan for X\n\n0.0 0.0", out) == []
    assert missing_output("0.0 0.0\nWrapPlan for X", out) == ["WrapPlan for X"]  # order matters
    assert missing_output("0.0 1e-07", out) == ["0.0 1e-07"]
    page = f"{MARKER}\n```python\nprint(1)\n```\n\n{PRINTS}\n```text\n1\n```\n{MARKER}\n```python\npass\n```\n"
    assert _BLOCK.findall(page) == [("print(1)\n", "1\n"), ("pass\n", "")]
    assert _FIGURE_COMMENT.search("model = build_model('glm4v')  # 141,536 params")
    assert _FIGURE_COMMENT.search("print(a, b)  # 0.0 0.0")
    assert not _FIGURE_COMMENT.search("dist.init_process_group('gloo', rank=0, world_size=1)  # torchrun sets these")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
@pytest.mark.parametrize("pattern", INTERNAL_NOTES)
def test_page_has_no_internal_notes(page: Path, pattern: str) -> None:
    hits = [line for line in page.read_text(encoding="utf-8").splitlines() if re.search(pattern, line, re.I)]
    assert hits == [], f"internal note in {_rel(page)}: {hits[:3]}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_link_checker_can_fail(tmp_path: Path) -> None:
    """The checker itself: a missing file, a missing heading and a repeated heading's suffix are all seen."""
    (tmp_path / "other.md").write_text(
        "# Title\n\n## Same `x`, here\n\n## Same `x`, here\n\n```\n# not a heading\n```\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#same-x-here-1) [ok](#top) `[skip](nowhere.md)`\n"
        "[bad](missing.md) [bad](other.md#not-a-heading) [bad](other.md#same-x-here-2)\n\n<a id=\"top\"></a>\n"
    )
    assert anchors(tmp_path / "other.md") == {"title", "same-x-here", "same-x-here-1"}
    assert broken_links(page) == [
        "line 2: missing.md (no such file)",
        "line 2: other.md#not-a-heading (no heading #not-a-heading in other.md)",
        "line 2: other.md#same-x-here-2 (no heading #same-x-here-2 in other.md)",
    ]
    assert github_anchor("transformers' native FSDP2 (`from_pretrained(..., distributed_config=...)`)") == (
        "transformers-native-fsdp2-from_pretrained-distributed_config"
    )
