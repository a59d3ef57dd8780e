"""The README's Python snippets run as written, and the README names no internal notes.

A fenced ``python`` block directly after an HTML comment ``<!-- runs-as-written -->`` is executed in a fresh
interpreter (the installed package, no test helpers on the path); it must exit 0. The README's claims that are
figures are asserted by the tests and benchmarks they name; this file only keeps the snippets and the prose honest.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- runs-as-written -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\s*```python\n(.*?)```", re.S)


def _snippets() -> list[str]:
    return _BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_marks_at_least_one_runnable_snippet() -> None:
    assert len(_snippets()) >= 1, f"no {MARKER} python block in README.md"


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_readme_snippet_runs_as_written(index: int, tmp_path: Path) -> None:
    code = _snippets()[index]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"README snippet {index} failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize(
    "pattern",
    [r"\bissue \d+\b", r"\bthis session\b", r"shared/DESIGN\.md", r"shared/FACTS\.md"],
)
def test_readme_has_no_internal_notes(pattern: str) -> None:
    hits = [line for line in README.read_text(encoding="utf-8").splitlines() if re.search(pattern, line, re.I)]
    assert hits == [], f"internal note in README.md: {hits[:3]}"
