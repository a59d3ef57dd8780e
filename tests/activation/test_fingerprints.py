"""Forward compatibility by fingerprint (``fsdp_compat.fingerprints``): a release newer than the tested range is
patched when what the adapter replaces is unchanged from the newest tested release, and left alone, with one warning
naming what changed, otherwise; the recorded data file is what the command writes and what the installed releases
give; ``doctor`` says which.

On throwaway packages (``lab.fakes``): their "releases" are the same files rewritten, recorded into a data file of the
test's own. The same gate on transformers' real code, with a real run, is in tests/stacks/transformers.
"""

from __future__ import annotations

import importlib
import logging
import re
import shutil
import sys
import textwrap
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import lab.fakes as fakes
import pytest
from fsdp_compat.adapters import ADAPTERS
from lab.fakes import FakeFramework, _fake_adapter_module, _run, tag
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_compat import fingerprints, log
from fsdp_compat.activation import Adapter, FsdpCompatWarning, Release, Replacement
from fsdp_compat.policies import Auto, Policy

# the folder's fixtures live in lab.fakes (a conftest.py here would shadow tests/conftest.py); bound by name here
_clean_env = fakes._clean_env
fw = fakes.fw

SPEC = ">=1.0,<2"


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data file of the test's own, in place of the package's."""
    path = tmp_path / "fingerprints.json"
    monkeypatch.setattr(fingerprints, "DATA", path)
    fingerprints.clear_cache()
    yield path
    fingerprints.clear_cache()


def _rewrite(fw: FakeFramework, suffix: str, text: str) -> None:
    """A new "release" of one module of the fake framework (the parse cache forgets the old one)."""
    (fw.root / fw.pkg / f"{suffix}.py").write_text(textwrap.dedent(text))
    shutil.rmtree(fw.root / fw.pkg / "__pycache__", ignore_errors=True)  # a same-size rewrite in the same second
    importlib.invalidate_caches()
    fingerprints.clear_cache()


def _adapter(fw: FakeFramework, version: str) -> Adapter:
    """The fake framework's adapter at ``version``: one row replacing ``utils.fn``, rebinding the importers."""

    class Pinned(Adapter):
        key: ClassVar[str] = fw.key
        releases: ClassVar[tuple[Release, ...]] = (
            Release(">=1.0", (Replacement(f"{fw.pkg}.utils", "fn", tag, tuple(fw.importer_names)),)),
        )

        def version_of(self, distribution: str) -> Version | None:
            return Version(version)

        def policy(self) -> Policy:
            return Auto()

    return Pinned()


def _record(fw: FakeFramework, version: str, path: Path) -> None:
    targets = fingerprints.targets_of(_adapter(fw, version).release_for("fakefw", Version(version)).replacements)
    fingerprints.write({"fakefw": {version: fingerprints.compute(targets)}}, path)
    fingerprints.clear_cache()


def _unpatched(fw: FakeFramework, originals: dict[str, Any]) -> None:
    """Exactly as without fsdp-compat: the original object in the definer and every importer, original behaviour."""
    assert fw.mod("utils").fn is originals["utils"]
    for name in fw.importer_names:
        module = importlib.import_module(name)
        assert module.fn is originals["utils"]
        assert module.call(3) == ("orig", 3)


# ------------------------------------------------------------------------------------------- the fingerprint


def test_fingerprint_ignores_docstrings_comments_and_layout(fw: FakeFramework) -> None:
    """Documentation and formatting edits keep the fingerprint; a changed body or signature does not, and the
    signature has its own hash so the warning can say which."""
    utils = f"{fw.pkg}.utils"
    before = fingerprints.fingerprint(utils, "fn")
    _rewrite(
        fw,
        "utils",
        '''
        # a comment
        calls = []


        def fn(
            x,
        ):
            """Now documented."""
            calls.append(x)  # and commented
            return (
                "orig",
                x,
            )
        ''',
    )
    assert fingerprints.fingerprint(utils, "fn") == before
    _rewrite(fw, "utils", "calls = []\ndef fn(x):\n    calls.append(x)\n    return ('orig', x, 1)\n")
    body = fingerprints.fingerprint(utils, "fn")
    assert body["code"] != before["code"] and body["signature"] == before["signature"]
    _rewrite(fw, "utils", "calls = []\ndef fn(x, y=None):\n    calls.append(x)\n    return ('orig', x)\n")
    assert fingerprints.fingerprint(utils, "fn")["signature"] != before["signature"]
    _rewrite(fw, "utils", "def other(x):\n    return x\n")
    assert fingerprints.fingerprint(utils, "fn")["code"] == fingerprints.ABSENT
    fingerprints.clear_cache()


def test_importers_are_the_modules_that_bind_the_name(fw: FakeFramework) -> None:
    """By-name bindings at module level, relative ones, under another name, and through a re-export count; a
    function-local import or a module import does not (neither holds the name in its namespace)."""
    pkg = fw.pkg
    (fw.root / pkg / "rel.py").write_text("from .utils import fn\n")
    (fw.root / pkg / "alias.py").write_text(f"from {pkg}.utils import fn as g\n")
    (fw.root / pkg / "reexport.py").write_text(f"from {pkg}.rel import fn\n")
    (fw.root / pkg / "guarded.py").write_text(f"try:\n    from {pkg}.utils import fn\nexcept ImportError:\n    pass\n")
    (fw.root / pkg / "local.py").write_text(f"def call():\n    from {pkg}.utils import fn\n    return fn\n")
    (fw.root / pkg / "whole.py").write_text(f"from {pkg} import utils\nfn = None  # not the replaced fn\n")
    found = fingerprints.fingerprint(f"{pkg}.utils", "fn")["importers"]
    assert found == sorted(
        [
            *fw.importer_names,
            f"{pkg}.alias (as g)",
            f"{pkg}.guarded",
            f"{pkg}.reexport",
            f"{pkg}.rel",
            f"{pkg}.stranger",
        ]
    )


def test_locating_a_module_imports_nothing(fw: FakeFramework) -> None:
    assert fingerprints.locate(f"{fw.pkg}.imp0") == fw.root / fw.pkg / "imp0.py"
    assert fingerprints.locate(f"{fw.pkg}.missing") is None
    assert not [m for m in sys.modules if m.startswith(fw.pkg)]


# -------------------------------------------------------------------------------------------------- the gate


def test_newer_release_over_unchanged_code_is_patched_and_says_so(fw: FakeFramework, data: Path, caplog: Any) -> None:
    """Patched with no warning; the one INFO line comes when the replacement is first used and says both why
    (unchanged from 1.5, by fingerprint) and what is installed."""
    _record(fw, "1.5", data)
    log.reset_announcement()
    with caplog.at_level(logging.INFO, logger="fsdp_compat"), warnings.catch_warnings():
        warnings.simplefilter("error", FsdpCompatWarning)  # no warning: this is the supported path
        adapter = _adapter(fw, "2.1")
        assert adapter.patch()
        assert [r for r in caplog.records if r.levelno >= logging.INFO] == []  # nothing used yet
        try:
            assert importlib.import_module(fw.importer_names[0]).call(3) == ("patched", ("orig", 3))
            assert adapter.patched()["fakefw"][0] == Version("2.1")
        finally:
            adapter.unpatch()
            log.reset_announcement()
    lines = [r.getMessage() for r in caplog.records if "newer than the tested range" in r.getMessage()]
    assert lines == [
        f"fsdp-compat: fakefw 2.1 is newer than the tested range (fakefw {SPEC}); what fsdp-compat replaces is "
        f"unchanged from 1.5 (fingerprint), patched (policy auto, activated by explicit): {fw.pkg}.utils.fn; "
        f"{fw.importer_names[0]}.fn"  # the importers loaded when it was first used
    ]
    assert fw.mod("utils").fn(1) == ("orig", 1)


@pytest.mark.parametrize(
    ("utils", "extra", "changed"),
    [
        (
            "calls = []\ndef fn(x, y=None):\n    calls.append(x)\n    return ('orig', x)\n",
            None,
            r"\.utils\.fn: signature changed",
        ),
        ("calls = []\ndef fn(x):\n    calls.append(x)\n    return ('orig', x)\n\nOTHER = 1\n", None, None),
        ("calls = []\ndef fn(x):\n    calls.append(-x)\n    return ('orig', x)\n", None, r"\.utils\.fn: body changed"),
        (None, "from .utils import fn\n", r"by-name importers of .*\.utils\.fn changed \(\+fakefw_\w+\.newcomer\)"),
        ("def fn2(x):\n    return ('orig', x)\n", None, r"\.utils\.fn: no longer defined"),
    ],
    ids=["signature", "unrelated-edit", "body", "new-importer", "removed"],
)
def test_newer_release_with_changed_code_is_left_alone_with_one_warning(
    fw: FakeFramework, data: Path, utils: str | None, extra: str | None, changed: str | None
) -> None:
    """Never worse than unpatched: a changed signature, body, importer list or a removed function leaves every
    binding as the framework made it, with one warning naming the change (an edit elsewhere in the module is no
    change). The fake's ``helper`` is not replaced: the "unrelated-edit" release only changes it."""
    originals = {"utils": fw.mod("utils").fn}
    _record(fw, "1.5", data)
    if utils is not None:
        _rewrite(fw, "utils", utils + "\ndef helper(x):\n    return ('helper', x)\n")
        sys.modules.pop(f"{fw.pkg}.utils")
        for name in fw.importer_names:
            sys.modules.pop(name, None)
        originals["utils"] = fw.mod("utils").__dict__.get("fn")
    if extra is not None:
        _rewrite(fw, "newcomer", extra)
    adapter = _adapter(fw, "2.1")
    if changed is None:
        assert adapter.patch()
        adapter.unpatch()
        return
    with pytest.warns(FsdpCompatWarning, match=r"fakefw 2\.1 is newer than the tested range") as caught:
        assert not adapter.patch()
        assert not adapter.patch()  # once per process
    (warning,) = [w for w in caught if issubclass(w.category, FsdpCompatWarning)]
    assert re.search(changed, str(warning.message)), str(warning.message)
    assert "changed since 1.5" in str(warning.message) and "nothing was patched" in str(warning.message)
    if originals["utils"] is not None:
        _unpatched(fw, originals)


def test_force_still_patches_a_changed_release(fw: FakeFramework, data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _record(fw, "1.5", data)
    _rewrite(fw, "newcomer", "from .utils import fn\n")
    monkeypatch.setenv("FSDP_COMPAT_FORCE", "1")
    with pytest.warns(FsdpCompatWarning, match="outside the supported range"):
        adapter = _adapter(fw, "2.1")
        assert adapter.patch()
    adapter.unpatch()


def test_older_release_and_unrecorded_framework_keep_the_range_rule(fw: FakeFramework, data: Path) -> None:
    """Only a release newer than the newest recorded one is judged by fingerprint."""
    with pytest.warns(FsdpCompatWarning, match=r"fakefw 2\.1 is not supported"):
        assert not _adapter(fw, "2.1").patch()  # nothing recorded
    _record(fw, "1.5", data)
    with pytest.warns(FsdpCompatWarning, match=r"fakefw 0\.9 is not supported"):
        assert not _adapter(fw, "0.9").patch()
    assert fingerprints.judge("fakefw", Version("1.7"), SPEC) is None  # inside the range


def test_a_stale_data_file_is_a_difference_never_a_guess(fw: FakeFramework, data: Path) -> None:
    """The recorded targets must be what the row for the newest tested release replaces."""
    fingerprints.write({"fakefw": {"1.5": fingerprints.compute([(f"{fw.pkg}.utils", "helper", ())])}}, data)
    with pytest.warns(FsdpCompatWarning, match="fingerprints.json is stale for fakefw 1.5"):
        assert not _adapter(fw, "2.1").patch()


def test_the_judgement_is_cached_and_imports_no_framework(fw: FakeFramework, data: Path) -> None:
    _record(fw, "1.5", data)
    for name in [m for m in sys.modules if m.startswith(fw.pkg)]:
        del sys.modules[name]
    first = fingerprints.judge("fakefw", Version("2.1"), SPEC)
    assert first is not None and first.unchanged and first.describe() == "patched by fingerprint (unchanged from 1.5)"
    assert fingerprints.judge("fakefw", Version("2.1"), SPEC) is first
    assert not [m for m in sys.modules if m.startswith(fw.pkg)]


# ------------------------------------------------------------------------------------------- doctor and CLI


def test_doctor_says_patched_by_fingerprint_or_left_alone(fw: FakeFramework, data: Path, tmp_path: Path) -> None:
    from fsdp_compat import doctor

    _record(fw, "1.5", data)
    _dist_info(tmp_path, "2.1")
    assert "fakefw 2.1: newer than tested, patched by fingerprint (unchanged from 1.5)" in doctor.report()
    _rewrite(fw, "utils", "calls = []\ndef fn(x, y=None):\n    return ('orig', x)\n")
    text = doctor.report()
    assert f"fakefw 2.1: newer than tested, left alone: {fw.pkg}.utils.fn: signature changed" in text


def _dist_info(root: Path, version: str) -> None:
    """An installed ``fakefw`` distribution at ``version`` (importlib.metadata finds it on sys.path)."""
    for old in root.glob("fakefw-*.dist-info"):
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    info = root / f"fakefw-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakefw\nVersion: {version}\n")
    importlib.invalidate_caches()


def test_record_and_check_commands(fw: FakeFramework, data: Path, tmp_path: Path, capsys: Any) -> None:
    """``record`` writes the installed release's entry through the adapter's own table (merging), ``check`` compares
    the installed code with it; neither patches nor imports the framework."""
    _fake_adapter_module(fw)
    _dist_info(tmp_path, "1.5")
    out = tmp_path / "out.json"
    fingerprints.write({"other": {"1.0": {}}}, out)
    try:
        assert fingerprints.main(["record", "fakefw", "--file", str(out)]) == 0
        assert fingerprints.main(["check", "fakefw", "--file", str(out)]) == 0
        recorded = fingerprints.load(out)
        assert set(recorded) == {"other", "fakefw"}
        (entry,) = recorded["fakefw"]["1.5"].values()
        assert entry["importers"] == sorted([*fw.importer_names, f"{fw.pkg}.stranger"])
        assert not [m for m in sys.modules if m.startswith(fw.pkg + ".")]
        _rewrite(fw, "utils", "calls = []\ndef fn(x):\n    return ('orig', x, 2)\n")
        assert fingerprints.main(["check", "fakefw", "--file", str(out)]) == 1
        assert "utils.fn: body changed" in capsys.readouterr().out
    finally:
        ADAPTERS.pop("fake", None)
        sys.modules.pop(f"{fw.pkg}_adapter", None)


def test_check_judges_by_code_not_by_the_version_string(
    fw: FakeFramework, data: Path, tmp_path: Path, capsys: Any
) -> None:
    """A local build's suffix names no other release: ``record`` on 1.5+cu128 replaces the entry of 1.5+cpu by one of
    1.5. ``check`` on a release nobody recorded (1.7) passes where its code equals a recorded one, and fails, naming
    what differs from the closest recorded release, where it does not."""
    _fake_adapter_module(fw)
    out = tmp_path / "out.json"
    try:
        _dist_info(tmp_path, "1.5+cpu")
        fingerprints.write({}, out)
        assert fingerprints.main(["record", "fakefw", "--file", str(out)]) == 0
        assert list(fingerprints.load(out)["fakefw"]) == ["1.5"]
        fingerprints.write({"fakefw": {"1.5+cpu": fingerprints.load(out)["fakefw"]["1.5"]}}, out)
        _dist_info(tmp_path, "1.5+cu128")
        assert fingerprints.main(["check", "fakefw", "--file", str(out)]) == 0
        assert "fakefw 1.5+cu128: matches the fingerprint recorded for 1.5+cpu" in capsys.readouterr().out
        assert fingerprints.main(["record", "fakefw", "--file", str(out)]) == 0
        assert list(fingerprints.load(out)["fakefw"]) == ["1.5"]
        _dist_info(tmp_path, "1.7")
        assert fingerprints.main(["check", "fakefw", "--file", str(out)]) == 0
        assert "fakefw 1.7: matches the fingerprint recorded for 1.5" in capsys.readouterr().out
        _rewrite(fw, "utils", "calls = []\ndef fn(x):\n    return ('orig', x, 2)\n")
        assert fingerprints.main(["check", "fakefw", "--file", str(out)]) == 1
        assert "fakefw 1.7: differs from 1.5: " in capsys.readouterr().out
    finally:
        ADAPTERS.pop("fake", None)
        sys.modules.pop(f"{fw.pkg}_adapter", None)


def test_check_torch_on_a_newer_torch_over_the_same_code(tmp_path: Path) -> None:
    """The generic layer's torch row: ``check torch`` on a torch reporting 2.15.0 (a dist-info first on the path,
    over the installed code) matches the recorded fingerprint instead of failing with "not recorded"."""
    info = tmp_path / "torch-2.15.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.15.0\n")
    done = _run(
        "import sys; from importlib import metadata; from fsdp_compat.fingerprints import main\n"
        "assert metadata.version('torch') == '2.15.0', metadata.version('torch')\n"
        "sys.exit(main(['check', 'torch']))",
        path=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = ", ".join(sorted(fingerprints.recorded("torch"), key=Version))
    assert f"torch 2.15.0: matches the fingerprint recorded for {recorded}" in done.stdout, done.stdout


def test_release_drops_the_local_suffix_only() -> None:
    assert [fingerprints.release(v) for v in ("2.13.0+cpu", "2.13.0", "0.10.0.dev3+g1", "nonsense")] == [
        "2.13.0",
        "2.13.0",
        "0.10.0.dev3",
        "nonsense",
    ]


def test_record_command_runs_as_a_module() -> None:
    done = _run("import sys; from fsdp_compat.fingerprints import main; sys.exit(main(['show']))")
    assert done.returncode == 0, done.stderr
    assert '"transformers"' in done.stdout


# ------------------------------------------------------------------------------------------- the data file


def test_data_file_ships_with_the_package() -> None:
    assert fingerprints.DATA.is_file()
    data = fingerprints.load()
    assert {"5.23.0", "5.24.0", "5.25.0"} <= set(data["transformers"])
    assert {"1.15.0", "1.16.0"} <= set(data["accelerate"])


def test_data_file_agrees_with_the_release_tables() -> None:
    """Every recorded release is inside its adapter's range, and its targets (module, name, declared importers) are
    what the adapter's row for it replaces now: a changed table without a new record fails here."""
    for key, entry in ADAPTERS.items():
        for distribution, (_, spec) in entry.distributions.items():
            releases = fingerprints.recorded(distribution)
            if not releases:
                continue
            adapter = importlib.import_module(entry.module).ADAPTER
            for raw, prints in releases.items():
                assert SpecifierSet(spec).contains(Version(raw)), (key, distribution, raw, spec)
                row = adapter.release_for(distribution, Version(raw))
                targets = {(f"{m}:{n}", tuple(sorted(w))) for m, n, w in fingerprints.targets_of(row.replacements)}
                assert targets == {(k, tuple(v["watched"])) for k, v in prints.items()}, (distribution, raw)


def _installed_recorded() -> list[tuple[str, str]]:
    """(distribution, recorded release) for every installed release with a record (a local build's suffix aside)."""
    found = []
    for distribution, releases in fingerprints.load().items():
        try:
            raw = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        found += [(distribution, v) for v in releases if fingerprints.release(v) == fingerprints.release(raw)]
    return found


@pytest.mark.skipif(not _installed_recorded(), reason="no framework release with recorded fingerprints installed")
@pytest.mark.parametrize(("distribution", "raw"), _installed_recorded() or [("", "")])
def test_recorded_fingerprint_equals_the_installed_release(distribution: str, raw: str) -> None:
    """The data file cannot go stale: the installed release's code gives exactly what was recorded for it."""
    fingerprints.clear_cache()
    before = fingerprints.recorded(distribution)[raw]
    watched = [(k.partition(":")[0], k.partition(":")[2], v["watched"]) for k, v in before.items()]
    assert fingerprints.differences(before, fingerprints.compute(watched)) == []
    assert fingerprints.compute(watched) == before
