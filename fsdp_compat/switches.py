"""The one reader of the ``FSDP_COMPAT*`` environment variables: one vocabulary of on and off for all of them.

Every switch is read here, so that ``off`` means the same everywhere (docs/activation.md, "Switches", lists them):

- on: ``1``, ``on``, ``true``, ``yes``, ``enable``, ``enabled``;
- off: ``0``, ``off``, ``false``, ``no``, ``disable``, ``disabled``;
- unset or empty: the variable's default. Case and surrounding spaces do not matter.

A variable with named choices (``FSDP_COMPAT_MIXED_BATCHES``, ``FSDP_COMPAT_LOG``, ``FSDP_COMPAT_POLICY``) takes its
choices, plus the on and off spellings where the variable has an on and an off choice.

Anything else is not guessed at. Where the switch is read at interpreter start or while a framework imports (the
``.pth`` hook, activation, the log filter: ``strict=False``) it is one warning naming the choices, once per process,
and the default: a typo never crashes the user's process from there. Where it is read when a model is sharded
(the guard, the mixed micro-batch alignment, the wrap policy: ``strict=True``) it is a
:class:`~fsdp_compat.errors.FsdpCompatError` naming the variable, the value and the choices.

Imports only ``os`` and ``sys``: the ``.pth`` start-up hook imports this module in every Python process.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not loaded at interpreter start; keep it that way
    from collections.abc import Iterable, Mapping

SWITCH = "FSDP_COMPAT"  #: off: no automatic activation at all (explicit patch() still works)
AUTOLOAD = "FSDP_COMPAT_AUTOLOAD"  #: off: only the .pth start-up hook is off
POLICY = "FSDP_COMPAT_POLICY"  #: the wrap policy the adapters use (default auto)
FORCE = "FSDP_COMPAT_FORCE"  #: on: patch a framework version outside the supported range
LOG = "FSDP_COMPAT_LOG"  #: quiet (or off): drop the INFO lines
GUARD = "FSDP_COMPAT_GUARD"  #: off: no run-time guard
MIXED_BATCHES = "FSDP_COMPAT_MIXED_BATCHES"  #: sync (on), always, off
GUARD_AGREE_S = "FSDP_COMPAT_GUARD_AGREE_S"  #: seconds a rank waits for the others at a run-time unshard
GENERIC = "FSDP_COMPAT_GENERIC"  #: off: FSDP2 roots fsdp-compat did not shard get no run-time layer

#: The choices of FSDP_COMPAT_MIXED_BATCHES (sync is on) and of FSDP_COMPAT_LOG (quiet is off).
MIXED_BATCHES_MODES = ("sync", "always", "off")
LOG_LEVELS = ("info", "quiet")

ON = ("1", "on", "true", "yes", "enable", "enabled")
OFF = ("0", "off", "false", "no", "disable", "disabled")

#: Every log line and warning starts with this, whatever handler formats it, so job logs can be grepped for it.
PREFIX = "fsdp-compat:"

_warned: set[tuple[str, str]] = set()


def warn(message: str) -> None:
    """Report on stderr without importing logging or warnings (this may run at interpreter start)."""
    try:  # noqa: SIM105 - contextlib is not imported at start; keep it that way
        sys.stderr.write(f"{PREFIX} {message}\n")
    except Exception:  # no usable stderr (pythonw, closed pipe): nothing more to do
        pass


def _raw(variable: str) -> str:
    return os.environ.get(variable, "").strip()


def text(variable: str, default: str = "") -> str:
    """A variable's value as written (stripped), or ``default`` when unset or empty: for the testing kit's own case
    parameters (``FSDP_COMPAT_VERL_LAYERS``, ``FSDP_COMPAT_SKYRL_CONFIG``), which take no on/off vocabulary."""
    return _raw(variable) or default


def shown(variable: str) -> str:
    """``NAME=value`` or ``NAME unset``, as ``fsdp-compat doctor`` prints a switch."""
    value = os.environ.get(variable)
    return f"{variable} unset" if value is None else f"{variable}={value}"


class switched:
    """``with switched(NAME, value):`` sets a switch for the block and restores it exactly (the fingerprint recorder
    imports adapter modules with ``FSDP_COMPAT=off``, so that importing them patches nothing)."""

    def __init__(self, variable: str, value: str) -> None:
        self.variable, self.value = variable, value
        self.before: str | None = None

    def __enter__(self) -> None:
        self.before = os.environ.get(self.variable)
        os.environ[self.variable] = self.value

    def __exit__(self, *_: object) -> None:
        if self.before is None:
            os.environ.pop(self.variable, None)
        else:
            os.environ[self.variable] = self.before


def _unknown(variable: str, raw: str, what: str, choices: Iterable[str], default: str, strict: bool) -> None:
    text = f"{variable}={raw!r} is not {what}; set it to one of {', '.join(choices)} or unset it for {default!r}"
    if strict:
        from fsdp_compat.errors import FsdpCompatError  # lazy: only on the error path

        raise FsdpCompatError(text)
    if (variable, raw) not in _warned:
        _warned.add((variable, raw))
        warn(f"{text}; using {default!r}")


def flag(variable: str, default: bool, *, strict: bool = False) -> bool:
    """An on/off switch: True for an on spelling, False for an off spelling, ``default`` when unset or empty."""
    raw = _raw(variable)
    value = raw.lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    _unknown(variable, raw, "on or off", (*ON, *OFF), ON[1] if default else OFF[1], strict)
    return default


def choice(
    variable: str,
    choices: Iterable[str],
    default: str,
    *,
    on: str | None = None,
    off: str | None = None,
    aliases: Mapping[str, str] | None = None,
    what: str = "",
    strict: bool = False,
) -> str:
    """A switch with named choices (lower-cased); the on/off spellings stand for ``on``/``off`` where given, and
    ``aliases`` maps further accepted spellings to a choice."""
    choices = tuple(choices)
    raw = _raw(variable)
    value = raw.lower()
    if not value:
        return default
    if value in choices:
        return value
    if on is not None and value in ON:
        return on
    if off is not None and value in OFF:
        return off
    if aliases and value in aliases:
        return aliases[value]
    accepted = (*choices, *(ON if on is not None else ()), *(OFF if off is not None else ()), *(aliases or ()))
    _unknown(variable, raw, what or "understood", accepted, default, strict)
    return default


def seconds(variable: str, default: float) -> float:
    """A positive number of seconds; unset or empty: ``default``; anything else is an error naming the variable."""
    raw = _raw(variable)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from fsdp_compat.errors import FsdpCompatError  # lazy: only on the error path

        raise FsdpCompatError(
            f"{variable}={raw!r} is not a positive number of seconds; set one or unset it for {default:g}"
        )
    return value


def mixed_batches_mode(*, strict: bool = True) -> str:
    """``FSDP_COMPAT_MIXED_BATCHES``: ``sync`` when unset (the on spellings mean ``sync``, the off ones ``off``)."""
    return choice(MIXED_BATCHES, MIXED_BATCHES_MODES, "sync", on="sync", off="off", strict=strict)


GUARD_MODES = ("on", "always", "off")


def guard_mode(*, strict: bool = True) -> str:
    """``FSDP_COMPAT_GUARD``: ``on`` when unset (the guard installed, its per-op check armed only where fsdp-compat's
    check of the groups cannot rule a sharded read out), ``always`` (the per-op check on every guarded root: it also
    catches reads no analysis sees, at its per-op cost) or ``off``; the on/off spellings mean ``on``/``off``."""
    return choice(GUARD, GUARD_MODES, "on", on="on", off="off", strict=strict)


def log_level(*, strict: bool = False) -> str:
    """``FSDP_COMPAT_LOG``: ``info`` when unset; ``quiet`` (or off, or ``warning``) drops the INFO lines."""
    return choice(LOG, LOG_LEVELS, "info", on="info", off="quiet", aliases={"warning": "quiet"}, strict=strict)


def invalid(policy_names: Iterable[str]) -> list[tuple[str, str]]:
    """(variable, why) for every ``FSDP_COMPAT*`` value the run would not take as it is, each read strictly as the
    run reads it (``fsdp-compat doctor`` shows them and exits non-zero)."""
    readers = {
        SWITCH: lambda: flag(SWITCH, True, strict=True),
        AUTOLOAD: lambda: flag(AUTOLOAD, True, strict=True),
        FORCE: lambda: flag(FORCE, False, strict=True),
        LOG: lambda: log_level(strict=True),
        POLICY: lambda: choice(POLICY, tuple(policy_names), "auto", what="a policy name", strict=True),
        GUARD: lambda: guard_mode(strict=True),
        GUARD_AGREE_S: lambda: seconds(GUARD_AGREE_S, 60.0),
        MIXED_BATCHES: lambda: mixed_batches_mode(strict=True),
        GENERIC: lambda: flag(GENERIC, True, strict=True),
    }
    found = []
    for variable, read in readers.items():
        try:
            read()
        except Exception as exc:  # FsdpCompatError, named lazily here
            found.append((variable, str(exc)))
    return found
