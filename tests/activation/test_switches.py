"""One vocabulary for every ``FSDP_COMPAT*`` switch (``fsdp_compat.switches``), read through each switch's own reader:
every variable, every spelling of on and off (any case, spaces around), unset and empty, and an unknown value (a
warning and the default at interpreter start, an error naming the choices where a model is sharded).

The spellings are written out here again on purpose (a test oracle, not an import): a spelling dropped from the
reader fails below, and docs/activation.md is checked to list the same ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import lab.fakes as fakes
import pytest
from lab.fakes import _run

from fsdp_compat import _autoload, switches
from fsdp_compat.activation import policy_from_env
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.policies import POLICY_NAMES
from fsdp_compat.runtime.guard import guard_enabled
from fsdp_compat.runtime.mixed_batches import mixed_batches_mode

_clean_env = fakes._clean_env

ON = ["1", "on", "true", "yes", "enable", "enabled"]
OFF = ["0", "off", "false", "no", "disable", "disabled"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "activation.md"


def _spellings(words: list[str]) -> list[str]:
    return [*words, *(w.upper() for w in words), *(f"  {w.title()} " for w in words)]


# (variable, reader, value when unset)
FLAGS: list[tuple[str, Callable[[], bool], bool]] = [
    ("FSDP_COMPAT", _autoload.automatic_activation_enabled, True),
    ("FSDP_COMPAT_AUTOLOAD", _autoload.autoload_enabled, True),
    ("FSDP_COMPAT_FORCE", _autoload.force_enabled, False),
    ("FSDP_COMPAT_GUARD", guard_enabled, True),
]


@pytest.mark.parametrize(("variable", "reader", "default"), FLAGS, ids=[f[0] for f in FLAGS])
def test_every_on_off_switch_reads_every_spelling(monkeypatch: pytest.MonkeyPatch, variable, reader, default) -> None:
    monkeypatch.delenv(variable, raising=False)
    assert reader() is default
    for empty in ("", "   "):
        monkeypatch.setenv(variable, empty)
        assert reader() is default, repr(empty)
    for value in _spellings(ON):
        monkeypatch.setenv(variable, value)
        assert reader() is True, value
    for value in _spellings(OFF):
        monkeypatch.setenv(variable, value)
        assert reader() is False, value


def test_fsdp_compat_off_in_any_spelling_turns_the_start_up_hook_off_too(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in OFF:
        monkeypatch.setenv("FSDP_COMPAT", value)
        assert not _autoload.autoload_enabled() and not _autoload.install(), value


def test_the_log_switch_takes_its_levels_and_on_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSDP_COMPAT_LOG", raising=False)
    assert not _autoload.quiet()
    for value in [*_spellings(OFF), "quiet", "QUIET", "warning"]:
        monkeypatch.setenv("FSDP_COMPAT_LOG", value)
        assert _autoload.quiet(), value
    for value in [*_spellings(ON), "info", "Info", ""]:
        monkeypatch.setenv("FSDP_COMPAT_LOG", value)
        assert not _autoload.quiet(), value


def test_the_mixed_batches_switch_takes_its_modes_and_on_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSDP_COMPAT_MIXED_BATCHES", raising=False)
    assert mixed_batches_mode() == "sync"
    expected = {"sync": "sync", "always": "always", "ALWAYS ": "always", "off": "off", "": "sync"}
    expected |= dict.fromkeys(_spellings(ON), "sync") | dict.fromkeys(_spellings(OFF), "off")
    for value, mode in expected.items():
        monkeypatch.setenv("FSDP_COMPAT_MIXED_BATCHES", value)
        assert mixed_batches_mode() == mode, value


def test_the_policy_switch_takes_policy_names_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSDP_COMPAT_POLICY", raising=False)
    assert policy_from_env() == "auto"
    for name in POLICY_NAMES:
        monkeypatch.setenv("FSDP_COMPAT_POLICY", f" {name.upper()} ")
        assert policy_from_env() == name
    for value in ("on", "off", "1"):  # not a policy: an error, never a guess
        monkeypatch.setenv("FSDP_COMPAT_POLICY", value)
        with pytest.raises(FsdpCompatError, match=rf"FSDP_COMPAT_POLICY='{value}' is not a policy name.*auto"):
            policy_from_env()


# --------------------------------------------------------------------------------------------- unknown values


@pytest.mark.parametrize(
    ("variable", "read", "choices"),
    [
        ("FSDP_COMPAT_GUARD", guard_enabled, ["on", "off", "enabled", "disabled"]),
        ("FSDP_COMPAT_MIXED_BATCHES", mixed_batches_mode, ["sync", "always", "off", "on"]),
    ],
)
def test_an_unknown_value_where_a_model_is_sharded_is_an_error_naming_the_choices(
    monkeypatch: pytest.MonkeyPatch, variable: str, read: Callable[[], object], choices: list[str]
) -> None:
    monkeypatch.setenv(variable, "sometimes")
    with pytest.raises(FsdpCompatError, match=rf"{variable}='sometimes' is not") as raised:
        read()
    listed = str(raised.value).split("set it to one of ", 1)[1]
    assert all(re.search(rf"\b{c}\b", listed) for c in choices), str(raised.value)


def test_an_unknown_value_at_interpreter_start_warns_once_names_the_choices_and_keeps_the_default() -> None:
    """The installed .pth runs in this fresh interpreter: FSDP_COMPAT=maybe and FSDP_COMPAT_LOG=loud must not stop
    it; the hook stays on (the default), and each value is reported once however often it is read."""
    done = _run(
        """
        import fsdp_compat._autoload as a
        assert a.is_installed()  # the .pth ran and kept the default: on
        assert all(a.automatic_activation_enabled() for _ in range(3))
        assert not any(a.quiet() for _ in range(3))
        print("OK")
        """,
        env={"FSDP_COMPAT": "maybe", "FSDP_COMPAT_LOG": "loud"},
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
    lines = done.stderr.splitlines()
    compat = [line for line in lines if line.startswith("fsdp-compat: FSDP_COMPAT='maybe' is not on or off")]
    log = [line for line in lines if line.startswith("fsdp-compat: FSDP_COMPAT_LOG='loud' is not understood")]
    assert len(compat) == 1 and len(log) == 1, done.stderr
    assert compat[0].endswith("or unset it for 'on'; using 'on'") and "disable" in compat[0], compat[0]
    assert "info, quiet" in log[0] and log[0].endswith("using 'info'"), log[0]


def test_doctor_says_off_for_every_off_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user's ``FSDP_COMPAT=disable`` used to leave activation on while doctor said so."""
    from fsdp_compat.doctor import report

    for value in OFF:
        monkeypatch.setenv("FSDP_COMPAT", value)
        assert f"automatic activation: OFF (FSDP_COMPAT={value})" in report(), value


def test_the_docs_list_the_spellings_the_reader_takes() -> None:
    text = DOCS.read_text()
    on = re.search(r"^- on: (.+)$", text, re.MULTILINE)
    off = re.search(r"^- off: (.+)$", text, re.MULTILINE)
    assert on and off, "docs/activation.md lost its vocabulary lines"
    assert re.findall(r"`([^`]+)`", on.group(1)) == ON == list(switches.ON)
    assert re.findall(r"`([^`]+)`", off.group(1)) == OFF == list(switches.OFF)
    for variable in ("FSDP_COMPAT", "FSDP_COMPAT_AUTOLOAD", "FSDP_COMPAT_POLICY", "FSDP_COMPAT_FORCE",
                     "FSDP_COMPAT_LOG", "FSDP_COMPAT_GUARD", "FSDP_COMPAT_MIXED_BATCHES"):
        assert f"| `{variable}" in text, variable
