"""The package's rooms and the arrows between them, read from the syntax trees (docs/development.md, "Rooms"):
the low modules import nothing above them, the planner neither the run-time layer nor the adapter machinery, the
run-time layer no adapter machinery, no room outside the shipped test kit imports a framework, and the environment
is read in ``switches.py`` alone. A new import that breaks a rule fails here with the module and the line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_compat"

#: imports nothing of the package outside this set
LOW = {"errors", "switches", "adapter_index", "log", "units", "paths", "runtime.torch_versions"}
#: the planner: which modules get their own fully_shard group, and why (framework-free)
PLANNER = {"analysis", "tree", "policies", "safety", "plan", "export", "audit", "repair", "group_check", *LOW}
#: what only activation, the adapters and the tools above them may import
ADAPTER_MACHINERY = {"activation", "_autoload", "patching", "fingerprints", "adapters", "doctor", "cli", "testing"}
FRAMEWORKS = {
    "verl", "skyrl", "skyrl_train", "accelerate", "areal", "llamafactory", "nemo_automodel", "axolotl", "peft",
    "transformers", "liger_kernel", "lmms_engine", "siirl", "trinity",
}  # fmt: skip
#: modules that may touch ``os.environ`` besides switches.py, and why
ENVIRON_ALLOWED = {"testing.launch": "builds the environment of the rank processes it starts"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    """``analysis.refs`` -> ``analysis``; ``runtime.guard`` stays itself (the run-time room is checked whole)."""
    return module if module in LOW else module.split(".")[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, inside functions too."""
    module = _name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["fsdp_compat", *package[: len(package) - node.level + 1]]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            elif node.module == "fsdp_compat":  # from fsdp_compat import switches
                found += [(node.lineno, f"fsdp_compat.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module or ""))
    return found


def _inner(target: str) -> str | None:
    return target.removeprefix("fsdp_compat.") if target.startswith("fsdp_compat.") else None


MODULES = sorted(PACKAGE.rglob("*.py"))


def _ids(path: Path) -> str:
    return _name(path) or "fsdp_compat"


@pytest.mark.parametrize("path", MODULES, ids=_ids)
def test_no_arrow_points_up(path: Path) -> None:
    module, broken = _name(path), []
    for line, target in _imports(path):
        inner = _inner(target)
        if inner is None:
            continue
        if module in LOW and inner not in LOW:
            broken.append(f"line {line}: low module imports {inner}")
        if _room(module) in PLANNER and _room(inner) not in PLANNER:
            broken.append(f"line {line}: the planner imports {inner}")
        if module.startswith("runtime") and _room(inner) in ADAPTER_MACHINERY:
            broken.append(f"line {line}: the run-time layer imports {inner}")
    assert broken == [], f"{module}: {broken}"


@pytest.mark.parametrize("path", [p for p in MODULES if not _name(p).startswith("testing")], ids=_ids)
def test_no_room_imports_a_framework(path: Path) -> None:
    """The core is framework-free: a model library is something its callers hand it, never something it imports
    (the shipped test kit, ``fsdp_compat.testing``, builds tiny models and drives verl and SkyRL, and is exempt)."""
    bad = [(line, t) for line, t in _imports(path) if t.split(".")[0] in FRAMEWORKS]
    assert bad == []


@pytest.mark.parametrize("path", MODULES, ids=_ids)
def test_the_environment_is_read_in_switches_alone(path: Path) -> None:
    module = _name(path)
    if module == "switches" or module in ENVIRON_ALLOWED:
        return
    text = path.read_text()
    assert "os.environ" not in text and "getenv" not in text, module


def test_the_rules_see_a_broken_import(tmp_path: Path) -> None:
    """Not vacuous: the import reader resolves relative, absolute and ``from fsdp_compat import x`` forms."""
    probe = PACKAGE / "runtime" / "guard.py"
    targets = {t for _, t in _imports(probe)}
    assert "fsdp_compat.switches" in targets and "fsdp_compat.log" in targets
    assert _room("runtime.guard") == "runtime" and _room("runtime.torch_versions") == "runtime.torch_versions"
    adapters_init = PACKAGE / "adapter_index.py"
    assert {t for _, t in _imports(adapters_init)} == {"__future__"}
