"""``fsdp-compat doctor`` (``fsdp_compat.doctor.report``, ``as_dict``): what is installed and what happens to each
first, every distribution not installed in one line, then the switches; one screen for a verl or SkyRL environment;
``--json`` for scripts; inspecting imports no adapter and no framework.

Installed releases are faked as the other doctor tests fake them: a ``NAME-VERSION.dist-info`` folder on ``sys.path``
(importlib.metadata finds it first), and a throwaway package with its index row (``lab.fakes``).
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import lab.fakes as fakes
import pytest
from fsdp_compat.adapters import ADAPTERS
from lab.fakes import FakeAdapter, FakeFramework, _run

from fsdp_compat.cli import main

# the folder's fixtures live in lab.fakes (a conftest.py here would shadow tests/conftest.py, which test modules
# import by name); pytest finds a fixture by the name bound in the test module
_clean_env = fakes._clean_env
fw = fakes.fw

#: One screen: what a user reads without scrolling.
SCREEN = 25
#: A verl job's environment and a SkyRL one's (the releases their tox envs pin; torch and accelerate are real here).
VERL_ENV = {"verl": "0.9.1", "transformers": "5.25.0"}
SKYRL_ENV = {"skyrl-train": "0.3.1", "skyrl": "0.4.0", "transformers": "5.25.0"}


def _dist_info(root: Path, name: str, version: str) -> None:
    """An installed distribution ``name`` at ``version`` (importlib.metadata finds it on sys.path)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Fakes an environment: ``environment.install({"verl": "0.9.1"})`` puts those releases first on sys.path."""

    def install(releases: dict[str, str]) -> None:
        for name, version in releases.items():
            _dist_info(tmp_path, name, version)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    return types.SimpleNamespace(install=install)


def _every_distribution() -> list[str]:
    return [dist for entry in ADAPTERS.values() for dist in entry.distributions]


def test_doctor_report_names_switches_and_every_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_compat.doctor import report

    monkeypatch.setenv("FSDP_COMPAT_AUTOLOAD", "0")
    monkeypatch.setenv("FSDP_COMPAT_POLICY", "nonsense")
    text = report()
    assert "automatic activation: on (FSDP_COMPAT unset)" in text
    assert "the .pth hook is off: FSDP_COMPAT_AUTOLOAD=0" in text
    assert "policy: INVALID: FSDP_COMPAT_POLICY='nonsense' is not a policy name" in text
    for dist in _every_distribution():  # each one, installed or in the one "not installed" line
        assert f"  {dist} " in text or dist in text.split("not installed: ", 1)[1].splitlines()[0].split(", "), dist


def test_doctor_reports_without_patching() -> None:
    """doctor imports no adapter and no framework: inspecting never changes what it inspects."""
    done = _run(
        """
        import sys
        from fsdp_compat.doctor import report
        text = report()
        from fsdp_compat.doctor import as_dict
        facts = as_dict()
        frameworks = ("fsdp_compat.adapters.", "verl", "skyrl", "transformers", "accelerate", "torch")
        loaded = sorted(m for m in sys.modules if m.startswith(frameworks))
        assert loaded == [], loaded
        print(text)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "accelerate 1.16.0: supported (supported: >=1.15.0,<1.17); patched by tested range on import of "
        "accelerate.utils.fsdp_utils (not imported yet)" in done.stdout
    ), done.stdout


def test_doctor_says_whether_the_guard_runs_on_this_torch_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard line reads the installed torch's metadata (doctor imports no torch) and the switch."""
    from importlib import metadata

    from fsdp_compat import doctor

    monkeypatch.delenv("FSDP_COMPAT_GUARD", raising=False)
    here = metadata.version("torch")
    assert f"run-time guard: on (torch {here}, supported: torch >= 2.8; FSDP_COMPAT_GUARD unset)" in doctor.report()
    monkeypatch.setenv("FSDP_COMPAT_GUARD", "disable")
    assert f"run-time guard: OFF (FSDP_COMPAT_GUARD=disable; torch {here} would support it)" in doctor.report()
    monkeypatch.delenv("FSDP_COMPAT_GUARD")
    for old in ("2.7.1+cu126", "2.6.0"):
        monkeypatch.setattr(doctor, "installed_torch", lambda old=old: old)
        line = f"run-time guard: OFF on torch {old} (it supports torch >= 2.8; FSDP2 runs without it)"
        assert line in doctor.report()
    monkeypatch.setattr(doctor, "installed_torch", lambda: None)
    assert "run-time guard: OFF (torch is not installed; it supports torch >= 2.8)" in doctor.report()


@pytest.mark.parametrize("releases", [VERL_ENV, SKYRL_ENV], ids=["verl", "skyrl"])
def test_doctor_fits_one_screen_with_what_is_installed_first(
    environment: types.SimpleNamespace, releases: dict[str, str]
) -> None:
    """A verl (or SkyRL) job's environment: the installed frameworks and what happens to each come first, every
    distribution not installed in one line, then the switches; at most one screen."""
    from fsdp_compat.doctor import report

    environment.install(releases)
    lines = report().splitlines()
    assert len(lines) <= SCREEN, "\n".join(lines)
    assert lines[1] == "installed, and what fsdp-compat does with it:"
    rows = {line.split()[0]: i for i, line in enumerate(lines) if line.startswith("  ") and not line.startswith("    ")}
    assert set(rows) == {"torch", "accelerate", *releases}, rows  # nothing else: one row per installed distribution
    (none,) = [i for i, line in enumerate(lines) if line.startswith("not installed: ")]
    settings = lines.index("automatic activation: on (FSDP_COMPAT unset)")
    assert max(rows.values()) < none < settings, "\n".join(lines)
    missing = lines[none].removeprefix("not installed: ").split(", ")
    assert missing == [d for d in _every_distribution() if d not in rows]
    for dist, version in releases.items():
        trigger = next(e.distributions[dist][0] for e in ADAPTERS.values() if dist in e.distributions)
        assert lines[rows[dist]].endswith(f"; patched by tested range on import of {trigger} (not imported yet)"), (
            lines[rows[dist]]
        )
        assert lines[rows[dist]].startswith(f"  {dist} {version}: supported (supported: ")
    assert "the generic layer on every FSDP2 root, patched by tested range" in lines[rows["torch"]]


def test_doctor_says_why_a_release_stands_aside(environment: types.SimpleNamespace) -> None:
    """An older release than the range stands aside, and says so; FSDP_COMPAT=off makes every row stand aside."""
    from fsdp_compat.doctor import report

    environment.install({"verl": "0.3.0"})
    text = report()
    assert (
        "  verl 0.3.0: NOT supported (supported: >=0.4.0,<0.10.0a0); stands aside: older than the tested range "
        "(it runs as without fsdp-compat; FSDP_COMPAT_FORCE=1 patches anyway)" in text
    ), text


def test_doctor_stands_aside_when_switched_off(
    environment: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_compat.doctor import installed

    environment.install(VERL_ENV)
    monkeypatch.setenv("FSDP_COMPAT", "off")
    for entry in ADAPTERS.values():  # a process started with FSDP_COMPAT=off loads none (tests before this one may)
        monkeypatch.delitem(sys.modules, entry.module, raising=False)
    found, _ = installed()
    assert [item.action for item in found] == ["stands-aside"] * len(found)
    assert {item.how for item in found} == {
        "automatic activation is OFF (FSDP_COMPAT=off; an explicit patch() still works)"
    }


def test_doctor_shows_a_distribution_patched_in_this_process(
    fw: FakeFramework, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter that is loaded is asked for its state: the row says patched, by what, and lists the bindings."""
    from fsdp_compat.doctor import report

    _dist_info(fw.root, "fakefw", "1.5")
    importlib.invalidate_caches()
    adapter = FakeAdapter(fw)
    monkeypatch.setitem(sys.modules, ADAPTERS[fw.key].module, types.SimpleNamespace(ADAPTER=adapter))
    before = report()
    assert "  fakefw 1.5: supported (supported: >=1.0,<2); patched by tested range on import of " in before
    assert adapter.patch() is True
    try:
        lines = report().splitlines()
    finally:
        adapter.unpatch()
    row = lines.index(
        "  fakefw 1.5: supported (supported: >=1.0,<2); patched in this process (policy auto, activated by "
        "explicit; patched by tested range)"
    )
    assert lines[row + 1].startswith(f"    {fw.pkg}.utils.fn"), lines[row + 1]


#: ``--json``'s keys: scripts read them, so a change is deliberate (add a key, or bump ``doctor.SCHEMA``).
JSON_KEYS = {"schema", "fsdp_compat", "python", "invalid", "installed", "not_installed", "settings"}
JSON_ROW_KEYS = {
    "distribution", "version", "adapter", "trigger", "supported", "verdict", "verdict_text", "imported", "action",
    "how", "policy", "activated_by", "bindings", "notes", "rebound",
}  # fmt: skip
JSON_SETTINGS = {
    "automatic_activation", "autoload", "pth", "pth_active", "policy", "force", "log", "mixed_batches", "guard",
    "generic", "torch",
}  # fmt: skip


def test_doctor_json_is_the_same_facts_for_scripts(
    environment: types.SimpleNamespace, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_compat import doctor

    environment.install(VERL_ENV)
    assert main(["doctor", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert set(facts) == JSON_KEYS and facts["schema"] == doctor.SCHEMA == 1
    assert set(facts["settings"]) == JSON_SETTINGS
    rows = facts["installed"]
    assert all(set(row) == JSON_ROW_KEYS for row in rows)
    assert [row["distribution"] for row in rows] == ["torch", "verl", "transformers", "accelerate"]  # index order
    verl = rows[1]
    assert (verl["version"], verl["verdict"], verl["action"], verl["how"]) == (
        "0.9.1",
        "tested",
        "patched-on-import",
        "patched by tested range",
    )
    assert {row["verdict"] for row in rows} <= set(doctor.VERDICTS)
    assert {row["action"] for row in rows} <= set(doctor.ACTIONS)
    assert facts["not_installed"] == [d for d in _every_distribution() if d not in {r["distribution"] for r in rows}]
    assert facts["invalid"] == [] and facts["settings"]["policy"] == "auto" and facts["settings"]["guard"] is True
    text = doctor.report()  # the text says the same
    for row in rows:
        assert (
            f"  {row['distribution']} {row['version']}: {row['verdict_text']} (supported: {row['supported']})" in text
        )

    monkeypatch.setenv("FSDP_COMPAT_POLICY", "best")
    assert main(["doctor", "--json"]) == 1  # a value the run refuses: the same exit status as the text
    facts = json.loads(capsys.readouterr().out)
    assert [i["variable"] for i in facts["invalid"]] == ["FSDP_COMPAT_POLICY"] and facts["settings"]["policy"] is None
