"""The tests' own support has one home, ``tests/lab`` (docs/development.md): no rank routine, fake or settings
module sits beside the tests, and every ``"lab.MODULE:FUNCTION"`` a test names to ``run_ranks`` and every
``lab`` import names a module and a top-level name that exist (a module that makes its names on demand, with a
module-level ``__getattr__``, e.g. ``lab.vlms``' one tiny model per family of the installed transformers, is checked
to exist). Read from the syntax trees, so a stack folder whose
framework this env lacks is checked too: a renamed routine fails here, not minutes into a labelled env."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
LAB = TESTS / "lab"
ROUTINE = re.compile(r"^(lab(?:\.\w+)+):(\w+)$")
#: folders under tests/ that hold tests only (each of their helper files would be a second home)
TEST_FOLDERS = ("core", "runtime", "activation", "families", "stacks")
#: vendored upstream tests, run as they are (not our support)
VENDORED = ("_verl_upstream",)


def _module_file(dotted: str) -> Path | None:
    base = TESTS.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if path.name == "__init__.py":
        names.update(p.stem for p in path.parent.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file())
    return names


def _references(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every ``lab`` routine string and ``lab`` import in ``path``."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := ROUTINE.match(node.value)):
            found.append((node.lineno, m.group(1), m.group(2)))
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = str(node.values[0].value)
            if re.match(r"^lab(\.\w+)+:$", head):
                found.append((node.lineno, head[:-1], None))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "lab"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lab" and not node.level:
            found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if not any(v in p.parts for v in VENDORED))


def test_no_support_module_sits_beside_the_tests() -> None:
    strays = [
        str(p.relative_to(TESTS))
        for folder in TEST_FOLDERS
        for p in (TESTS / folder).rglob("*.py")
        if not p.name.startswith("test_") and p.name != "__init__.py" and not any(v in p.parts for v in VENDORED)
    ]
    strays += [p.name for p in TESTS.glob("*.py") if p.name != "conftest.py"]
    assert strays == [], f"test support belongs in tests/lab (docs/development.md): {strays}"


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_every_lab_routine_and_import_resolves(path: Path) -> None:
    broken = []
    for line, module, name in _references(path):
        target = _module_file(module)
        if target is None:
            broken.append(f"line {line}: no module {module} under tests/")
        elif name is not None and name != "*" and not {name, "__getattr__"} & _top_level_names(target):
            broken.append(f"line {line}: {module} has no top-level {name!r}")
    assert broken == []


def test_the_check_sees_a_broken_routine(tmp_path: Path) -> None:
    """The resolver is not vacuous: a misspelt routine, a missing module and a good reference, told apart."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        'A = "lab.stacks.verl_engine_ranks:engine_ranks"\n'
        'B = "lab.stacks.verl_engine_ranks:engine_rankz"\n'
        'C = "lab.stacks.no_such_module:f"\n'
    )
    refs = _references(probe)
    assert [(m, n) for _, m, n in refs] == [
        ("lab.stacks.verl_engine_ranks", "engine_ranks"),
        ("lab.stacks.verl_engine_ranks", "engine_rankz"),
        ("lab.stacks.no_such_module", "f"),
    ]
    target = _module_file("lab.stacks.verl_engine_ranks")
    assert target is not None
    names = _top_level_names(target)
    assert "engine_ranks" in names and "engine_rankz" not in names
    assert _module_file("lab.stacks.no_such_module") is None
