"""``fsdp-compat doctor`` (``fsdp_compat.doctor.report``): it names the switches and every adapter of the index, and
inspecting imports no adapter and no framework.
"""

from __future__ import annotations

import lab.fakes as fakes
import pytest
from fsdp_compat.adapters import ADAPTERS
from lab.fakes import (
    _run,
)

# the folder's fixtures live in lab.fakes (a conftest.py here would shadow tests/conftest.py, which test modules
# import by name); pytest finds a fixture by the name bound in the test module
_clean_env = fakes._clean_env


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
