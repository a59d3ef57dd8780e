"""Activation on throwaway modules (``lab.fakes``): which versions an adapter patches (range, ``FSDP_COMPAT_FORCE``,
pre-releases, a missing distribution), ``activate_on_import`` and the switches ``FSDP_COMPAT`` /
``FSDP_COMPAT_AUTOLOAD`` / ``FSDP_COMPAT_POLICY`` / ``FSDP_COMPAT_LOG``, the log lines, and one adapter with two
distributions.
"""

from __future__ import annotations

import logging
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, ClassVar

import lab.fakes as fakes
import pytest
from fsdp_compat.adapters import ADAPTERS, AdapterEntry
from lab.fakes import (
    FakeAdapter,
    FakeFramework,
    _fake_adapter_module,
    _run,
    tag,
)
from packaging.version import Version

from fsdp_compat import _autoload, activation, log
from fsdp_compat.activation import (
    Adapter,
    FsdpCompatWarning,
    Replacement,
    activate_on_import,
    policy_from_env,
)
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.policies import Auto, Policy

# the folder's fixtures live in lab.fakes (a conftest.py here would shadow tests/conftest.py, which test modules
# import by name); pytest finds a fixture by the name bound in the test module
_clean_env = fakes._clean_env
fw = fakes.fw


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


@pytest.fixture
def announcement() -> Any:
    """A process with no ``fsdp-compat: patched ...`` line yet (the line is once per process)."""
    log.reset_announcement()
    yield
    log.reset_announcement()


def test_logs_what_was_patched_once_when_first_used(fw: FakeFramework, caplog: Any, announcement: None) -> None:
    """Patching logs no INFO line: the job has not used anything yet. The replacement's first call logs one, naming
    what is installed; later calls, a second patch() and a re-patch after unpatch() log none."""
    adapter = FakeAdapter(fw)
    imp0 = fw.mod("imp0")
    with caplog.at_level(logging.INFO, logger="fsdp_compat"):
        adapter.patch(activated_by="pth-hook")
        adapter.patch()
        assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
        assert imp0.call(1) == ("patched", ("orig", 1)) and imp0.call(2) == ("patched", ("orig", 2))
        adapter.unpatch()
        adapter.patch()
        assert imp0.call(3) == ("patched", ("orig", 3))
    records = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.getMessage() for r in records] == [
        f"fsdp-compat: patched fakefw 1.5 (policy auto, activated by pth-hook): {fw.pkg}.utils.fn; {fw.pkg}.imp0.fn"
    ]
    assert log.announced() == records[0].getMessage().removeprefix("fsdp-compat: ")
    adapter.unpatch()


def test_the_first_use_wrapper_looks_like_the_replacement(fw: FakeFramework, announcement: None) -> None:
    """What the framework and unpatch() see: the replacement's name and marks, ``__wrapped__`` the original."""
    original = fw.mod("utils").fn
    adapter = FakeAdapter(fw)
    adapter.patch()
    try:
        bound = fw.mod("utils").fn
        assert bound is not original and bound.__name__ == original.__name__
        assert bound.__wrapped__ is original and fw.mod("imp0").fn is bound
    finally:
        adapter.unpatch()
    assert fw.mod("utils").fn is original and fw.mod("imp0").fn is original


def test_one_info_line_per_process_whatever_is_used(tmp_path: Path, caplog: Any, announcement: None) -> None:
    """Two adapters' replacements used in one process: the first use is the process's INFO line, the second is
    DEBUG only (``fsdp_compat.log.announce_once``)."""
    sys.path.insert(0, str(tmp_path))
    first, second = FakeFramework(tmp_path), FakeFramework(tmp_path)
    adapters = [FakeAdapter(first), FakeAdapter(second)]
    try:
        with caplog.at_level(logging.DEBUG, logger="fsdp_compat"):
            assert all(a.patch() for a in adapters)
            assert second.mod("imp0").call(1) == ("patched", ("orig", 1))
            assert first.mod("imp0").call(1) == ("patched", ("orig", 1))
        used = [r for r in caplog.records if r.getMessage().startswith("fsdp-compat: patched fakefw 1.5 (policy")]
        info = [r.getMessage() for r in used if r.levelno == logging.INFO]
        debug = [r.getMessage() for r in used if r.levelno == logging.DEBUG and "when first used" not in r.getMessage()]
        assert len(info) == 1 and f"{second.pkg}.utils.fn" in info[0], info
        assert len(debug) == 1 and f"{first.pkg}.utils.fn" in debug[0], debug
    finally:
        for adapter in adapters:
            adapter.unpatch()
        first.cleanup()
        second.cleanup()
        sys.path.remove(str(tmp_path))


def test_default_handler_prints_to_stderr_once_and_quiet_silences(fw: FakeFramework) -> None:
    adapter_module = _fake_adapter_module(fw)
    imported = f"""
        import {adapter_module} as a
        import {fw.pkg}.imp0 as imp0
        assert a.is_patched(), "not patched"
    """
    code = imported + """
        assert imp0.call(1) == ("patched", ("orig", 1))
        a.patch(); a.unpatch(); a.patch()
        assert imp0.call(1) == ("patched", ("orig", 1))
    """
    only_imported = _run(imported, path=fw.root)
    assert only_imported.returncode == 0 and "fsdp-compat" not in only_imported.stderr, only_imported.stderr
    done = _run(code, path=fw.root)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "fsdp-compat" in line]
    assert len(lines) == 1 and "INFO" in lines[0] and "activated by import" in lines[0], done.stderr
    assert lines[0].startswith("fsdp-compat: patched fakefw 1.0"), lines
    quiet = _run(code, env={"FSDP_COMPAT_LOG": "quiet"}, path=fw.root)
    assert quiet.returncode == 0 and "fsdp-compat" not in quiet.stderr, quiet.stderr
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


# ------------------------------------------------------------------------ one adapter, two distributions


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

    def policy(self) -> Policy:
        return Auto()


@pytest.mark.parametrize("order", ["a-first", "b-first"])
def test_each_distribution_is_patched_when_its_trigger_loads(
    tmp_path: Path, caplog: Any, order: str, announcement: None
) -> None:
    sys.path.insert(0, str(tmp_path))
    first, second = FakeFramework(tmp_path), FakeFramework(tmp_path)
    adapter = TwoDistributions(first, second)
    try:
        with caplog.at_level(logging.DEBUG, logger="fsdp_compat"):
            activate_on_import(adapter, source="import")
            assert not adapter.is_patched()
            frameworks = [first, second] if order == "a-first" else [second, first]
            frameworks[0].mod("imp0")
            assert adapter.is_patched() and len(adapter.patched()) == 1
            frameworks[1].mod("imp0")
            assert set(adapter.patched()) == {"fw-a", "fw-b"}
            for f in (first, second):
                assert f.mod("imp0").call(1) == ("patched", ("orig", 1)), f.pkg
        logged = [r for r in caplog.records if "patched fw-" in r.getMessage() and "first used" not in r.getMessage()]
        assert {r.getMessage().split()[2] for r in logged} == {"fw-a", "fw-b"}, logged  # each when first used
        assert [r.levelno for r in logged] == [logging.INFO, logging.DEBUG], logged  # one INFO line per process
        adapter.unpatch()
        assert first.mod("imp0").call(1) == ("orig", 1) and second.mod("imp0").call(1) == ("orig", 1)
    finally:
        ADAPTERS.pop(first.key, None)
        _autoload.hooks().unwatch(("fsdp-compat adapter", first.key))
        first.cleanup()
        second.cleanup()
        sys.path.remove(str(tmp_path))
