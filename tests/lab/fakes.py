"""Shared fakes of tests/activation: throwaway packages, not a framework stand-in (the adapters' own tests use the
real verl / SkyRL wheels). Each test writes a fresh package ``fakefw_<n>`` with a definer (``utils.fn``) and
modules that bind ``fn`` by name, so identities, late imports and threads can be checked exactly; its adapter
gets a row in the registry for the duration of the test.

A helper module, not a conftest.py: a second conftest.py would replace ``conftest`` in ``sys.modules``, and test
modules elsewhere import ``DEVICE`` from tests/conftest.py by that name. Test modules bind the fixtures
(``_clean_env``, ``fw``) to their own names; ``tests/`` is on ``sys.path`` (pytest's prepend import mode).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from fsdp_compat.adapters import ADAPTERS, AdapterEntry
from packaging.version import Version

from fsdp_compat import _autoload
from fsdp_compat.activation import Adapter, Replacement
from fsdp_compat.patching import Patch
from fsdp_compat.policies import Auto, Policy

_counter = itertools.count()


ENV_VARS = (
    "FSDP_COMPAT",
    "FSDP_COMPAT_AUTOLOAD",
    "FSDP_COMPAT_FORCE",
    "FSDP_COMPAT_POLICY",
    "FSDP_COMPAT_LOG",
    "FSDP_COMPAT_GUARD",
    "FSDP_COMPAT_MIXED_BATCHES",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


class FakeFramework:
    """A throwaway package: ``utils`` defines ``fn`` and ``helper``; importers bind them by name"""

    def __init__(self, root: Path, importers: int = 2) -> None:
        self.pkg = f"fakefw_{os.getpid()}_{next(_counter)}"
        self.root = root
        base = root / self.pkg
        _write(base / "__init__.py", "")
        _write(
            base / "utils.py",
            """
            calls = []

            def fn(x):
                calls.append(x)
                return ("orig", x)

            def helper(x):
                return ("helper", x)
            """,
        )
        self.importer_names = [f"{self.pkg}.imp{i}" for i in range(importers)]
        for name in self.importer_names:
            _write(
                root / (name.replace(".", "/") + ".py"),
                f"from {self.pkg}.utils import fn, helper\n\ndef call(x):\n    return fn(x)\n",
            )
        # binds fn by name but is not declared as an importer: restored by unpatch's sweep
        _write(base / "stranger.py", f"from {self.pkg}.utils import fn\n")

        self.key = f"fake-{self.pkg}"
        entry = AdapterEntry(f"{self.pkg}_adapter", {"fakefw": (f"{self.pkg}.utils", ">=1.0,<2")})
        ADAPTERS[self.key] = entry

    def mod(self, suffix: str) -> Any:
        return importlib.import_module(f"{self.pkg}.{suffix}")

    def cleanup(self) -> None:
        ADAPTERS.pop(self.key, None)
        _autoload.hooks().unwatch(("fsdp-compat adapter", self.key))
        for name in [m for m in sys.modules if m == self.pkg or m.startswith(self.pkg + ".")]:
            del sys.modules[name]


@pytest.fixture
def fw(tmp_path: Path) -> Any:
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    framework = FakeFramework(tmp_path)
    yield framework
    framework.cleanup()
    sys.path.remove(str(tmp_path))


def tag(original: Any, policy: str = "auto") -> Any:
    @functools.wraps(original)
    def patched(x: Any) -> Any:
        return ("patched", original(x))

    return patched


class FakeAdapter(Adapter):
    def __init__(self, fw: FakeFramework, version: str | None = "1.5", *, fail_second: bool = False) -> None:
        super().__init__()
        self.key = fw.key  # type: ignore[misc]
        self.fw = fw
        self.fake_version = version
        self.fail_second = fail_second
        self.make_calls = 0
        self.make_delay = 0.0

    def version_of(self, distribution: str) -> Version | None:
        return None if self.fake_version is None else Version(self.fake_version)

    def policy(self) -> Policy:
        return Auto()

    def _make(self, original: Any, policy: Policy) -> Any:
        self.make_calls += 1
        time.sleep(self.make_delay)  # widens the window in which racing patch() calls could double-apply
        return tag(original)

    def plan(self, distribution: str, version: Version) -> Patch:
        reps = [Replacement(f"{self.fw.pkg}.utils", "fn", self._make, tuple(self.fw.importer_names))]
        if self.fail_second:

            def broken(original: Any, policy: str) -> Any:
                raise RuntimeError("second replacement failed on purpose")

            reps.append(Replacement(f"{self.fw.pkg}.utils", "helper", broken, tuple(self.fw.importer_names)))
        return Patch(tuple(reps))


def _run(code: str, env: dict[str, str] | None = None, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with the installed package (``fsdp_compat.adapters`` exists only there: the wheel maps
    ``adapters/`` into it), its ``.pth`` hook included, and ``path`` for a fake framework."""
    full_env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    pythonpath = [str(path)] if path else []
    full_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


FAKE_ADAPTER = """
from packaging.version import Version
from fsdp_compat.adapters import ADAPTERS, AdapterEntry
from fsdp_compat.activation import Adapter, Release, Replacement, activate_on_import

ADAPTERS.setdefault("fake", AdapterEntry(__name__, {{"fakefw": ("{pkg}.utils", ">=1")}}))

def _make(original, policy):
    def patched(x):
        return ("patched", original(x))
    return patched

class FakeAdapter(Adapter):
    key = "fake"
    releases = (Release(">=1", (Replacement("{pkg}.utils", "fn", _make, ("{pkg}.imp0",)),)),)
    def version_of(self, distribution):
        return Version("1.0")
    def policy(self):
        from fsdp_compat.policies import Auto

        return Auto()

ADAPTER = FakeAdapter()
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
activate_on_import(ADAPTER)
"""


def _fake_adapter_module(fw: FakeFramework) -> str:
    name = f"{fw.pkg}_adapter"
    _write(fw.root / f"{name}.py", FAKE_ADAPTER.format(pkg=fw.pkg))
    return name


def _register(fw: FakeFramework, module: str) -> str:
    """Code that gives the fake adapter its index row before install() (as a real row in fsdp_compat.adapters does)."""
    return (
        "from fsdp_compat.adapters import ADAPTERS as _index, AdapterEntry as _Entry; "
        f"_index['fake'] = _Entry({module!r}, {{'fakefw': ('{fw.pkg}.utils', '>=1')}})"
    )
