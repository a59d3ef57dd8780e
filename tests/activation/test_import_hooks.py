"""The import-hook engine (``fsdp_compat._autoload``): what the ``.pth`` start-up code imports, ``install`` /
``uninstall`` and the switches, no import cycle and one finder in ``sys.meta_path``, and the trigger finder activating
an adapter in a fresh interpreter (broken adapters, threads, together with the adapter's own hook).
"""

from __future__ import annotations

from pathlib import Path

import lab.fakes as fakes
import pytest
from lab.fakes import (
    FakeFramework,
    _fake_adapter_module,
    _register,
    _run,
)

from fsdp_compat import _autoload

# the folder's fixtures live in lab.fakes (a conftest.py here would shadow tests/conftest.py, which test modules
# import by name); pytest finds a fixture by the name bound in the test module
_clean_env = fakes._clean_env
fw = fakes.fw


# ------------------------------------------------------------------------------------------- _autoload


def test_autoload_imports_nothing_and_honours_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    done = _run(
        """
        import sys
        before = set(sys.modules)
        import fsdp_compat._autoload as a
        new = set(sys.modules) - before
        heavy = {"torch", "wrapt", "packaging", "logging", "inspect", "asyncio", "importlib.metadata", "typing",
                 "threading", "fsdp_compat.activation", "fsdp_compat.patching", "verl", "skyrl", "skyrl_train"}
        assert not new & heavy, sorted(new & heavy)
        assert a.install() and a.is_installed() and a.install()
        assert sum(isinstance(f, a.ImportHooks) for f in sys.meta_path) == 1
        a.uninstall(); assert not a.is_installed()
        """
    )
    assert done.returncode == 0, done.stderr
    for env in ({"FSDP_COMPAT": "off"}, {"FSDP_COMPAT_AUTOLOAD": "0"}):
        done = _run(
            "import sys, fsdp_compat._autoload as a\nassert not a.install()\nassert not a.is_installed()",
            env=env,
        )
        assert done.returncode == 0, (env, done.stderr)


def test_no_import_cycle_and_one_hook_engine() -> None:
    """_autoload imports nothing of fsdp-compat but the switch reader (``os`` and ``sys``; the error class only on its
    error path) and the adapter index, which imports nothing at all; activation and patching import _autoload,
    never the reverse. Once an adapter is loaded and patched, one finder of ours sits in
    sys.meta_path and wrapt is not loaded."""
    import ast

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        return found | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    package = Path(_autoload.__file__).parent
    assert {m for m in imports(package / "_autoload.py") if m.startswith("fsdp_compat")} == {
        "fsdp_compat.adapter_index",
        "fsdp_compat.switches",
    }
    assert imports(package / "switches.py") == {"__future__", "os", "sys", "collections.abc", "fsdp_compat.errors"}
    assert imports(package / "errors.py") == {"__future__"}
    assert imports(package / "adapter_index.py") == {"__future__"}  # the low module the core rooms read
    assert "fsdp_compat._autoload" in imports(package / "activation.py")
    assert "fsdp_compat._autoload" in imports(package / "patching.py")
    assert "fsdp_compat.activation" not in imports(package / "patching.py")
    done = _run(
        """
        import sys
        import fsdp_compat._autoload as a
        a.install()
        import fsdp_compat.adapters.skyrl, fsdp_compat.adapters.verl
        finders = [f for f in sys.meta_path if type(f).__module__.startswith(("fsdp_compat", "wrapt"))]
        assert finders == [a.hooks()], finders
        assert "wrapt" not in sys.modules
        print("OK")
        """,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


def test_trigger_finder_activates_the_adapter_in_a_fresh_interpreter(fw: FakeFramework) -> None:
    adapter_module = _fake_adapter_module(fw)
    code = f"""
        import sys
        import fsdp_compat._autoload as a
        {_register(fw, adapter_module)}
        assert a.install()
        import {fw.pkg}.imp0 as imp0           # imports the trigger {fw.pkg}.utils
        adapter = sys.modules["{adapter_module}"].ADAPTER
        assert adapter.is_patched() and adapter.activated_by == "pth-hook", adapter.activated_by
        assert imp0.call(1) == ("patched", ("orig", 1))
        utils = sys.modules["{fw.pkg}.utils"]
        assert type(utils.__loader__).__name__ == "SourceFileLoader", utils.__loader__
        assert utils.__spec__.loader is utils.__loader__
        import inspect; assert "def fn" in inspect.getsource(utils)
        print("OK")
    """
    done = _run(code, path=fw.root)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
    assert "activated by pth-hook" in done.stderr
    off = _run(code, env={"FSDP_COMPAT": "off"}, path=fw.root)
    assert off.returncode != 0  # install() refuses, so the adapter never loads
    late_off = _run(
        code.replace(
            "assert a.install()", "assert a.install(); import os; os.environ['FSDP_COMPAT_AUTOLOAD'] = '0'"
        ),
        path=fw.root,
    )
    assert (
        "KeyError" in late_off.stderr and late_off.returncode != 0
    )  # hook honours the switch at import time


def test_trigger_finder_survives_a_broken_adapter(fw: FakeFramework) -> None:
    code = f"""
        import fsdp_compat._autoload as a
        {_register(fw, "no_such_adapter_module_xyz")}
        assert a.install()
        import {fw.pkg}.utils as utils
        assert utils.fn(1) == ("orig", 1)
        print("IMPORTED")
    """
    done = _run(code, path=fw.root)
    assert done.returncode == 0 and "IMPORTED" in done.stdout, done.stderr
    assert "fsdp-compat: the fake adapter could not be activated after importing" in done.stderr
    assert "no_such_adapter_module_xyz" in done.stderr


def test_trigger_finder_with_concurrent_imports_from_threads(fw: FakeFramework) -> None:
    adapter_module = _fake_adapter_module(fw)
    code = f"""
        import importlib, sys, threading
        import fsdp_compat._autoload as a
        {_register(fw, adapter_module)}
        a.install()
        barrier = threading.Barrier(8); errors = []
        def go(name):
            try:
                barrier.wait(); importlib.import_module(name)
            except BaseException as exc:
                errors.append(exc)
        names = ["{fw.pkg}.imp0", "{fw.pkg}.imp1", "{fw.pkg}.stranger", "{fw.pkg}.utils"] * 2
        threads = [threading.Thread(target=go, args=(n,)) for n in names]
        [t.start() for t in threads]; [t.join(60) for t in threads]
        assert not errors, errors
        adapter = sys.modules["{adapter_module}"].ADAPTER
        assert adapter.is_patched()
        utils = sys.modules["{fw.pkg}.utils"]
        for n in ("imp0", "imp1", "stranger"):
            assert sys.modules["{fw.pkg}." + n].fn is utils.fn, n
        adapter.unpatch()
        assert all(sys.modules["{fw.pkg}." + n].fn is utils.fn for n in ("imp0", "imp1", "stranger"))
        assert utils.fn(2) == ("orig", 2)
        print("OK")
    """
    done = _run(code, path=fw.root)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


def test_pth_hook_and_adapter_import_together_patch_once(fw: FakeFramework) -> None:
    """Adapter imported first (entry point / explicit import) and the .pth hook both watch the trigger."""
    adapter_module = _fake_adapter_module(fw)
    code = f"""
        import sys
        import fsdp_compat._autoload as a
        {_register(fw, adapter_module)}
        assert a.install()
        import {adapter_module} as m          # watches the trigger itself
        assert not m.is_patched()
        import {fw.pkg}.imp0 as imp0
        assert m.is_patched() and imp0.call(1) == ("patched", ("orig", 1))
        utils = sys.modules["{fw.pkg}.utils"]
        assert type(utils.__loader__).__name__ == "SourceFileLoader", type(utils.__loader__)
        assert utils.__spec__.loader is utils.__loader__
        print("OK", m.ADAPTER.activated_by)
    """
    done = _run(code, path=fw.root)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
    assert sum("patched fakefw" in line for line in done.stderr.splitlines()) == 1, done.stderr
