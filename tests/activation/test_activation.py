"""The activation machinery on throwaway modules (not a framework stand-in: the adapters' own tests use the
real verl / SkyRL wheels). Each test writes a fresh package ``fakefw_<n>`` with a definer (``utils.fn``) and
modules that bind ``fn`` by name, so identities, late imports and threads can be checked exactly; its adapter
gets a row in the registry for the duration of the test.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import wrapt
from fsdp_compat.adapters import ADAPTERS, AdapterEntry
from packaging.version import Version

from fsdp_compat import _autoload, activation
from fsdp_compat.activation import (
    Adapter,
    FsdpCompatWarning,
    Reexport,
    Replacement,
    activate_on_import,
    policy_from_env,
)
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.patching import Patch

_counter = itertools.count()

ENV_VARS = (
    "FSDP_COMPAT",
    "FSDP_COMPAT_AUTOLOAD",
    "FSDP_COMPAT_FORCE",
    "FSDP_COMPAT_POLICY",
    "FSDP_COMPAT_LOG",
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

    def policy(self) -> str:
        return "auto"

    def _make(self, original: Any, policy: str) -> Any:
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


# ----------------------------------------------------------------------------------------------- patch basics


def test_patch_is_idempotent_and_unpatch_restores_identity(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    imp0 = fw.mod("imp0")  # imported before the patch
    original = utils.fn
    adapter = FakeAdapter(fw)

    assert adapter.patch() is True
    replacement = utils.fn
    assert replacement is not original
    assert adapter.patch() is True  # idempotent: same objects, factory called once
    assert utils.fn is replacement and adapter.make_calls == 1
    assert imp0.fn is replacement and imp0.call(1) == ("patched", ("orig", 1))
    assert adapter.is_patched() and adapter.activated_by == "explicit"

    imp1 = fw.mod("imp1")  # imported after the patch: gets the replacement through the definer
    stranger = fw.mod("stranger")
    assert imp1.fn is replacement and stranger.fn is replacement
    assert f"{fw.pkg}.imp1.fn -> fsdp-compat (policy auto)" in adapter.describe()

    adapter.unpatch()
    adapter.unpatch()  # idempotent too
    assert not adapter.is_patched()
    for module in (utils, imp0, imp1, stranger):
        assert module.fn is original, module.__name__
    assert adapter.describe() == []


def test_declared_importer_imported_later_is_rebound_by_hook_even_if_it_held_the_original(
    fw: FakeFramework,
) -> None:
    """A module that captured the original before the patch but finished importing after it gets rebound."""
    adapter = FakeAdapter(fw)
    utils = fw.mod("utils")
    original = utils.fn
    adapter.patch()
    # an importer that bound the original although the patch is in place: the post-import hook rebinds it
    _write(fw.root / fw.pkg / "imp0.py", f"import {fw.pkg}.utils as u\nfn = u.__dict__['_saved']\n")
    utils._saved = original
    imp0 = fw.mod("imp0")
    assert imp0.fn is utils.fn is not original
    adapter.unpatch()
    assert imp0.fn is original


def test_importer_holding_another_object_is_left_alone(fw: FakeFramework) -> None:
    imp0 = fw.mod("imp0")
    mine = object.__new__(type("Other", (), {}))
    imp0.fn = mine
    adapter = FakeAdapter(fw)
    adapter.patch()
    assert imp0.fn is mine
    adapter.unpatch()
    assert imp0.fn is mine


def test_post_import_hook_does_nothing_after_unpatch(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    original = utils.fn
    adapter = FakeAdapter(fw)
    adapter.patch()
    adapter.unpatch()
    imp1 = fw.mod("imp1")  # its hook fires now, while unpatched
    assert imp1.fn is original


def test_patch_imports_the_definer_when_not_loaded(fw: FakeFramework) -> None:
    adapter = FakeAdapter(fw)
    assert f"{fw.pkg}.utils" not in sys.modules
    assert adapter.patch()
    assert fw.mod("imp0").call(2) == ("patched", ("orig", 2))
    adapter.unpatch()


# ------------------------------------------------------------------------------------------------- threads


def test_concurrent_imports_and_patch_from_threads(tmp_path: Path) -> None:
    sys.path.insert(0, str(tmp_path))
    fw = FakeFramework(tmp_path, importers=16)
    try:
        utils = fw.mod("utils")
        original = utils.fn
        early = [importlib.import_module(n) for n in fw.importer_names[:4]]
        adapter = FakeAdapter(fw)
        adapter.make_delay = 0.05
        barrier = threading.Barrier(len(fw.importer_names) - 4 + 4)
        errors: list[BaseException] = []

        def import_one(name: str) -> None:
            try:
                barrier.wait()
                importlib.import_module(name)
            except BaseException as exc:
                errors.append(exc)

        def patch_one() -> None:
            try:
                barrier.wait()
                adapter.patch()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=import_one, args=(n,)) for n in fw.importer_names[4:]]
        threads += [threading.Thread(target=patch_one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors and not any(t.is_alive() for t in threads)
        assert adapter.make_calls == 1
        replacement = utils.fn
        modules = [importlib.import_module(n) for n in fw.importer_names]
        assert all(m.fn is replacement for m in modules), [
            m.__name__ for m in modules if m.fn is not replacement
        ]
        assert early[0].call(3) == ("patched", ("orig", 3))
        adapter.unpatch()
        assert all(m.fn is original for m in modules)
    finally:
        fw.cleanup()
        sys.path.remove(str(tmp_path))


# ----------------------------------------------------------------------------------------- versions / force


def test_unsupported_version_warns_once_and_patches_nothing(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    original = utils.fn
    adapter = FakeAdapter(fw, version="2.1")
    with pytest.warns(
        FsdpCompatWarning, match=r"fakefw 2\.1 is not supported.*>=1\.0,<2.*FSDP_COMPAT_FORCE=1"
    ):
        assert adapter.patch() is False
    assert utils.fn is original and not adapter.is_patched()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second attempt does not warn again
        assert adapter.patch() is False


def test_force_patches_an_unsupported_version(fw: FakeFramework, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMPAT_FORCE", "1")
    adapter = FakeAdapter(fw, version="0.3")
    with pytest.warns(
        FsdpCompatWarning, match=r"fakefw 0\.3 is outside the supported range.*patching anyway"
    ):
        assert adapter.patch() is True
    assert fw.mod("imp0").call(1)[0] == "patched"
    adapter.unpatch()


def test_prerelease_inside_the_range_is_supported(fw: FakeFramework) -> None:
    adapter = FakeAdapter(fw, version="1.9.0.dev0")
    assert adapter.patch() is True
    adapter.unpatch()
    assert not FakeAdapter(fw).is_supported("fakefw", Version("2.0.0.dev0"))


def test_missing_distribution_is_reported_not_guessed(
    fw: FakeFramework, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSDP_COMPAT_FORCE", "1")
    adapter = FakeAdapter(fw, version=None)
    with pytest.warns(FsdpCompatWarning, match="no installed distribution of fakefw was found"):
        assert adapter.patch() is False


def test_default_installed_reads_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = AdapterEntry("unused", {"definitely-not-installed-xyz": ("x.y", ">=1"), "packaging": ("p.q", ">=1")})
    monkeypatch.setitem(ADAPTERS, "packaging-probe", entry)

    class PackagingAdapter(Adapter):
        key: ClassVar[str] = "packaging-probe"

    ((dist, version),) = PackagingAdapter().installed()
    assert dist == "packaging" and version >= Version("21")


# -------------------------------------------------------------------------------------- other wrappers


def test_preexisting_wrapt_wrapper_keeps_working_and_is_restored(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    seen: list[Any] = []

    def spy(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.append(args)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(utils, "fn", spy)
    theirs = utils.fn
    imp0 = fw.mod("imp0")
    assert imp0.fn is theirs
    adapter = FakeAdapter(fw)
    adapter.patch()
    assert imp0.call(5) == ("patched", ("orig", 5)) and seen == [(5,)]  # their wrapper still runs inside ours
    adapter.unpatch()
    assert utils.fn is theirs and imp0.fn is theirs
    assert isinstance(utils.fn, wrapt.FunctionWrapper)


def test_preexisting_plain_wrapper_keeps_working_and_is_restored(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    inner = utils.fn

    @functools.wraps(inner)
    def theirs(x: Any) -> Any:
        return ("theirs", inner(x))

    utils.fn = theirs
    imp0 = fw.mod("imp0")
    adapter = FakeAdapter(fw)
    adapter.patch()
    assert imp0.call(1) == ("patched", ("theirs", ("orig", 1)))
    adapter.unpatch()
    assert utils.fn is theirs and imp0.fn is theirs


def test_wrapper_added_after_the_patch_is_left_in_place(fw: FakeFramework, caplog: Any) -> None:
    utils = fw.mod("utils")
    adapter = FakeAdapter(fw)
    adapter.patch()
    wrapt.wrap_function_wrapper(utils, "fn", lambda wrapped, instance, args, kwargs: ("late", wrapped(*args)))
    late = utils.fn
    with caplog.at_level(logging.WARNING, logger="fsdp_compat"):
        adapter.unpatch()
    assert utils.fn is late  # theirs stays; nothing breaks
    assert utils.fn(1) == ("late", ("patched", ("orig", 1)))
    assert "replaced again after fsdp-compat patched it" in caplog.text


# ------------------------------------------------------------------------------------------- all or nothing


def test_failed_second_replacement_rolls_back_everything(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    imp0 = fw.mod("imp0")
    fn, helper = utils.fn, utils.helper
    adapter = FakeAdapter(fw, fail_second=True)
    with pytest.raises(RuntimeError, match="second replacement failed on purpose"):
        adapter.patch()
    assert not adapter.is_patched()
    assert utils.fn is fn and utils.helper is helper and imp0.fn is fn and imp0.helper is helper
    # automatic activation: the same failure is a warning, never an exception in the user's import
    with pytest.warns(FsdpCompatWarning, match="rolled back; nothing stays patched"):
        assert adapter.patch(activated_by="import") is False
    assert utils.fn is fn and imp0.fn is fn


def test_missing_target_name_is_a_clear_error(fw: FakeFramework) -> None:
    class Missing(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            return Patch(
                (
                    Replacement(f"{self.fw.pkg}.utils", "fn", tag),
                    Replacement(f"{self.fw.pkg}.utils", "no_such_name", tag),
                )
            )

    utils = fw.mod("utils")
    fn = utils.fn
    with pytest.raises(FsdpCompatError, match=r"utils\.no_such_name does not exist in this release"):
        Missing(fw).patch()
    assert utils.fn is fn


# ------------------------------------------------------------------------------------- activate_on_import


def test_activate_on_import_patches_when_the_trigger_is_imported_later(fw: FakeFramework) -> None:
    adapter = FakeAdapter(fw)
    activate_on_import(adapter)
    assert not adapter.is_patched()
    assert fw.mod("imp0").call(1) == ("patched", ("orig", 1))  # importing imp0 imports the trigger
    assert adapter.is_patched() and adapter.activated_by == "import"
    adapter.unpatch()


def test_activate_on_import_patches_now_when_the_trigger_is_loaded(fw: FakeFramework) -> None:
    fw.mod("utils")
    adapter = FakeAdapter(fw)
    activate_on_import(adapter, source="entry-point")
    assert adapter.is_patched() and adapter.activated_by == "entry-point"
    adapter.unpatch()


@pytest.mark.parametrize("value", ["off", "0", "false", "NO"])
def test_fsdp_compat_off_disables_automatic_activation_only(
    fw: FakeFramework, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("FSDP_COMPAT", value)
    assert not activation.automatic_activation_enabled() and not activation.autoload_enabled()
    adapter = FakeAdapter(fw)
    fw.mod("utils")
    activate_on_import(adapter)
    assert not adapter.is_patched()
    assert adapter.patch() is True  # explicit patch() still works
    adapter.unpatch()


def test_switch_is_read_again_when_the_trigger_is_imported(
    fw: FakeFramework, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = FakeAdapter(fw)
    activate_on_import(adapter)
    monkeypatch.setenv("FSDP_COMPAT", "off")
    fw.mod("utils")
    assert not adapter.is_patched()


def test_autoload_switch_is_separate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMPAT_AUTOLOAD", "0")
    assert activation.automatic_activation_enabled() and not activation.autoload_enabled()


def test_failing_activation_never_breaks_the_import(fw: FakeFramework) -> None:
    adapter = FakeAdapter(fw, fail_second=True)
    activate_on_import(adapter)
    with pytest.warns(FsdpCompatWarning, match="second replacement failed on purpose"):
        utils = fw.mod("utils")
    assert utils.fn(1) == ("orig", 1) and not adapter.is_patched()


# ----------------------------------------------------------------------------------------- env, logging


def test_policy_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert policy_from_env() == "auto"
    monkeypatch.setenv("FSDP_COMPAT_POLICY", "Input-Only")
    assert policy_from_env() == "input-only"
    monkeypatch.setenv("FSDP_COMPAT_POLICY", "bogus")
    with pytest.raises(FsdpCompatError, match=r"FSDP_COMPAT_POLICY='bogus' is not a policy name.*auto"):
        policy_from_env()


def test_bad_policy_env_is_refused_before_patching(
    fw: FakeFramework, monkeypatch: pytest.MonkeyPatch
) -> None:
    class EnvPolicy(FakeAdapter):
        policy = Adapter.policy

    monkeypatch.setenv("FSDP_COMPAT_POLICY", "bogus")
    utils = fw.mod("utils")
    fn = utils.fn
    with pytest.raises(FsdpCompatError, match="bogus"):
        EnvPolicy(fw).patch()
    with pytest.warns(FsdpCompatWarning, match="bogus"):
        assert EnvPolicy(fw).patch(activated_by="pth-hook") is False
    assert utils.fn is fn


def test_logs_once_what_was_patched(fw: FakeFramework, caplog: Any) -> None:
    adapter = FakeAdapter(fw)
    with caplog.at_level(logging.INFO, logger="fsdp_compat"):
        adapter.patch(activated_by="pth-hook")
        adapter.patch()
        adapter.unpatch()
        adapter.patch()
    records = [r for r in caplog.records if r.levelno == logging.INFO and "patched fakefw" in r.getMessage()]
    assert len(records) == 1
    assert (
        f"patched fakefw 1.5 (policy auto, activated by pth-hook): {fw.pkg}.utils.fn"
        in records[0].getMessage()
    )
    adapter.unpatch()


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
        return "auto"

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


def test_default_handler_prints_to_stderr_once_and_quiet_silences(fw: FakeFramework) -> None:
    adapter_module = _fake_adapter_module(fw)
    code = f"""
        import {adapter_module} as a
        import {fw.pkg}.imp0 as imp0
        assert a.is_patched(), "not patched"
        a.patch(); a.unpatch(); a.patch()
        assert imp0.call(1) == ("patched", ("orig", 1))
    """
    done = _run(code, path=fw.root)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "patched fakefw" in line]
    assert len(lines) == 1 and "INFO" in lines[0] and "activated by import" in lines[0], done.stderr
    assert lines[0].startswith("fsdp-compat: patched fakefw 1.0"), lines
    quiet = _run(code, env={"FSDP_COMPAT_LOG": "quiet"}, path=fw.root)
    assert quiet.returncode == 0 and "patched fakefw" not in quiet.stderr, quiet.stderr
    # an application with its own logging config sees the record once, through its handler, package named
    configured = _run(
        "import logging; logging.basicConfig(format='APP %(message)s')\n" + textwrap.dedent(code),
        path=fw.root,
    )
    app_lines = [line for line in configured.stderr.splitlines() if "patched fakefw" in line]
    assert len(app_lines) == 1 and app_lines[0].startswith("APP fsdp-compat: patched fakefw"), configured.stderr


def test_every_record_and_warning_names_the_package(fw: FakeFramework, caplog: Any) -> None:
    """Whatever handler formats them (verl's, Ray's: they print only the message), the package is in the text."""
    adapter = FakeAdapter(fw, version="2.5")
    with caplog.at_level(logging.DEBUG, logger="fsdp_compat"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        activation.logger.debug("a debug line %s", 1)
        activation.logger.warning("a warning line")
        adapter.patch(activated_by="import")
    assert caplog.records and all(r.getMessage().startswith("fsdp-compat: ") for r in caplog.records)
    assert caught and all(str(w.message).startswith("fsdp-compat: ") for w in caught), caught


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
    """_autoload imports nothing of fsdp-compat but the adapter index, which imports nothing at all; activation and
    patching import _autoload, never the reverse. Once an adapter is loaded and patched, one finder of ours sits in
    sys.meta_path and wrapt is not loaded."""
    import ast

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        return found | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    package = Path(_autoload.__file__).parent
    assert {m for m in imports(package / "_autoload.py") if m.startswith("fsdp_compat")} == {"fsdp_compat.adapters"}
    index = Path(sys.modules["fsdp_compat.adapters"].__file__ or "")
    assert imports(index) == {"__future__"}
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


def test_index_is_the_one_home_of_triggers_and_ranges() -> None:
    """Oracle written independently of the index, on purpose (FACTS.md sections 4 and 5)."""
    from fsdp_compat.adapters import skyrl, verl

    assert (ADAPTERS["verl"].module, tuple(ADAPTERS["verl"].triggers)) == (
        "fsdp_compat.adapters.verl",
        ("verl.utils.fsdp_utils",),
    )
    assert (ADAPTERS["skyrl"].module, tuple(ADAPTERS["skyrl"].triggers)) == (
        "fsdp_compat.adapters.skyrl",
        ("skyrl_train.distributed.fsdp_utils", "skyrl.backends.skyrl_train.distributed.fsdp_utils"),
    )
    assert verl.SUPPORTED == {"verl": ">=0.4.0,<0.10.0a0"} and verl.ADAPTER.supported is not None
    assert skyrl.SUPPORTED == {"skyrl-train": ">=0.1.0,<0.4", "skyrl": ">=0.1.0,<0.5"}
    assert verl.ADAPTER.trigger_modules == ("verl.utils.fsdp_utils",)


#: every release fsdp-compat was run or read on (oracle, FACTS.md sections 4, 5, 9, 11, 14), and one outside each range
KNOWN_RELEASES = {
    ("verl", "verl"): ["0.4.0", "0.4.1", "0.5.0", "0.6.0", "0.6.1", "0.7.0", "0.7.1", "0.8.0", "0.9.0", "0.9.1"],
    ("skyrl", "skyrl-train"): ["0.1.0", "0.2.0", "0.3.0", "0.3.1"],
    ("skyrl", "skyrl"): ["0.1.0", "0.2.0", "0.3.0", "0.4.0"],
    ("transformers", "transformers"): ["5.16.1", "5.17.0", "5.20.0", "5.22.0", "5.23.0", "5.24.0"],
    ("areal", "areal"): ["1.0.4"],
    ("llamafactory", "llamafactory"): ["0.9.5"],
}
OUTSIDE = {"verl": "0.3.1", "skyrl-train": "0.4.0", "skyrl": "0.0.1", "transformers": "5.10.4", "areal": "1.0.3"}


@pytest.mark.parametrize(("key", "distribution"), list(KNOWN_RELEASES))
def test_every_supported_release_has_its_table_row(key: str, distribution: str) -> None:
    """The index says which versions are supported, the release table what to do for each: they must agree."""
    module = importlib.import_module(f"fsdp_compat.adapters.{key}")
    adapter = module.ADAPTER
    for raw in KNOWN_RELEASES[key, distribution]:
        version = Version(raw)
        assert adapter.is_supported(distribution, version), (distribution, raw)
        row = adapter.release_for(distribution, version)
        assert row is not None and row.replacements, (distribution, raw)
    outside = OUTSIDE.get(distribution)
    if outside is not None:
        assert not adapter.is_supported(distribution, Version(outside)), (distribution, outside)


def test_a_row_condition_is_checked_when_the_row_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Replacement(when=...)`` is read at apply time (verl's GLM4V repair: transformers >= 5), not at import."""
    import types

    from fsdp_compat.patching import apply

    module = types.ModuleType("fsdp_compat_when_probe")
    module.fn = lambda: "original"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    holds = {"now": False}
    conditional = Replacement(module.__name__, "fn", lambda original, _policy: lambda: "new", when=lambda: holds["now"])
    always = Replacement(module.__name__, "other", lambda original, _policy: original, optional=True)
    with pytest.raises(FsdpCompatError, match="nothing of this release matches"):
        apply(Patch((conditional, always)), "auto")  # condition false: left out, and nothing else applies
    assert module.fn() == "original"
    holds["now"] = True
    applied = apply(Patch((conditional,)), "auto")
    try:
        assert module.fn() == "new"
    finally:
        applied.restore()
    assert module.fn() == "original"
    from fsdp_compat.adapters import verl, verl_glm4v

    assert verl.RELEASES[-1].replacements[-1] == verl_glm4v.REPAIRS[0]  # the row is declared whatever is installed
    assert verl_glm4v.REPAIRS[0].when is verl_glm4v.transformers_5


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


# ------------------------------------------------------------------------------ distributions and repairs


class TwoDistributions(Adapter):
    """One adapter, two distributions (as skyrl-train and skyrl): each trigger is its own transaction."""

    def __init__(self, first: FakeFramework, second: FakeFramework) -> None:
        super().__init__()
        self.key = first.key  # type: ignore[misc]
        ADAPTERS[self.key] = AdapterEntry(
            "unused", {"fw-a": (f"{first.pkg}.utils", ">=1"), "fw-b": (f"{second.pkg}.utils", ">=1")}
        )
        self.releases = tuple(  # type: ignore[misc]
            activation.Release(">=1", (Replacement(f"{f.pkg}.utils", "fn", tag, tuple(f.importer_names)),), (), d)
            for d, f in (("fw-a", first), ("fw-b", second))
        )

    def version_of(self, distribution: str) -> Version | None:
        return Version("1.0")

    def policy(self) -> str:
        return "auto"


@pytest.mark.parametrize("order", ["a-first", "b-first"])
def test_each_distribution_is_patched_when_its_trigger_loads(tmp_path: Path, caplog: Any, order: str) -> None:
    sys.path.insert(0, str(tmp_path))
    first, second = FakeFramework(tmp_path), FakeFramework(tmp_path)
    adapter = TwoDistributions(first, second)
    try:
        with caplog.at_level(logging.INFO, logger="fsdp_compat"):
            activate_on_import(adapter, source="import")
            assert not adapter.is_patched()
            frameworks = [first, second] if order == "a-first" else [second, first]
            frameworks[0].mod("imp0")
            assert adapter.is_patched() and len(adapter.patched()) == 1
            frameworks[1].mod("imp0")
        assert set(adapter.patched()) == {"fw-a", "fw-b"}
        for f in (first, second):
            assert f.mod("imp0").call(1) == ("patched", ("orig", 1)), f.pkg
        logged = [r.getMessage() for r in caplog.records if "patched fw-" in r.getMessage()]
        assert len(logged) == 2 and {m.split()[2] for m in logged} == {"fw-a", "fw-b"}, logged
        adapter.unpatch()
        assert first.mod("imp0").call(1) == ("orig", 1) and second.mod("imp0").call(1) == ("orig", 1)
    finally:
        ADAPTERS.pop(first.key, None)
        _autoload.hooks().unwatch(("fsdp-compat adapter", first.key))
        first.cleanup()
        second.cleanup()
        sys.path.remove(str(tmp_path))


def test_repair_is_part_of_the_transaction(fw: FakeFramework) -> None:
    """A re-export repair is applied with the replacements, rolled back with them, undone by unpatch."""
    utils = fw.mod("utils")
    repair = Reexport(f"{fw.pkg}.utils", "Restored", "collections:OrderedDict", why="test")

    class Repairing(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            return Patch(super().plan(distribution, version).replacements, (repair,))

    failing = Repairing(fw, fail_second=True)
    with pytest.raises(RuntimeError, match="on purpose"):
        failing.patch()
    assert not hasattr(utils, "Restored")  # rolled back together with the replacements
    adapter = Repairing(fw)
    assert adapter.patch()
    import collections

    assert utils.Restored is collections.OrderedDict
    assert any("Restored re-exported from collections:OrderedDict (test)" in line for line in adapter.describe())
    adapter.unpatch()
    assert not hasattr(utils, "Restored")


def test_deferred_replacement_waits_for_its_module(fw: FakeFramework) -> None:
    """A replacement in a module the framework imports late (verl's model code) is applied when it loads."""

    class Deferred(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            late = Replacement(f"{self.fw.pkg}.imp1", "call", lambda original, policy: tag(original), deferred=True)
            return Patch((*super().plan(distribution, version).replacements, late))

    adapter = Deferred(fw)
    adapter.patch()
    assert f"{fw.pkg}.imp1" not in sys.modules
    assert any("deferred" in line for line in adapter.describe())
    imp1 = fw.mod("imp1")
    assert imp1.call(2) == ("patched", ("patched", ("orig", 2)))
    adapter.unpatch()
    assert imp1.call(2) == ("orig", 2)


# ---------------------------------------------------------------------------------------------------- doctor


def test_doctor_report_names_switches_and_every_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_compat.doctor import report

    monkeypatch.setenv("FSDP_COMPAT_AUTOLOAD", "0")
    monkeypatch.setenv("FSDP_COMPAT_POLICY", "nonsense")
    text = report()
    assert "automatic activation: on (FSDP_COMPAT unset)" in text
    assert "the .pth hook is off: FSDP_COMPAT_AUTOLOAD=0" in text
    assert "policy: INVALID: FSDP_COMPAT_POLICY='nonsense' is not a policy name" in text
    for key, entry in ADAPTERS.items():
        assert f"{key} adapter ({entry.module}; activates on import of" in text


def test_doctor_reports_without_patching() -> None:
    """doctor imports no adapter and no framework: inspecting never changes what it inspects."""
    done = _run(
        """
        import sys
        from fsdp_compat.doctor import report
        text = report()
        loaded = sorted(m for m in sys.modules if m.startswith(("fsdp_compat.adapters.", "verl", "skyrl")))
        assert loaded == [], loaded
        print(text)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "adapter not loaded in this process" in done.stdout


def test_public_names_keep_working() -> None:
    """What users and the entry point import (stable across the redesign)."""
    from fsdp_compat.adapters import skyrl, verl

    for module in (verl, skyrl):
        assert module.patch == module.ADAPTER.patch and module.unpatch == module.ADAPTER.unpatch
        assert module.is_patched == module.ADAPTER.is_patched and isinstance(module.SUPPORTED, dict)
        assert callable(module.make_apply_fsdp2) and module.RELEASES
    assert callable(verl.make_select_fsdp2_wrap_targets) and callable(skyrl.make_modules_to_wrap_fsdp2)
    assert verl.release_for(Version("0.9.1")).name == "_select_fsdp2_wrap_targets"
    assert verl.release_for(Version("0.6.0")).importers[-1] == "verl.workers.engine.fsdp.transformer_impl"
    assert {activation.ENV_SWITCH, activation.ENV_AUTOLOAD, activation.ENV_POLICY, activation.ENV_FORCE} == {
        "FSDP_COMPAT",
        "FSDP_COMPAT_AUTOLOAD",
        "FSDP_COMPAT_POLICY",
        "FSDP_COMPAT_FORCE",
    }
    assert activation.ENV_LOG == "FSDP_COMPAT_LOG"
    from importlib import metadata

    points = [ep.value for ep in metadata.entry_points(group="verl.plugins") if ep.name == "fsdp_compat"]
    assert points == ["fsdp_compat.adapters.verl"], points
