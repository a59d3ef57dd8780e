"""``fsdp-compat doctor``: what is installed, what is supported, and what is patched in this process.

It reports without changing anything: versions come from importlib.metadata and the supported ranges from the
adapter index (:data:`fsdp_compat.adapters.ADAPTERS`); it never imports a framework or an adapter module (an
adapter imported here would patch what it inspects). An adapter that is already loaded is asked for its state.
Safe to run anywhere: a login node, a Ray worker through ``ray.get(remote(report))``, a notebook mid-training.
"""

from __future__ import annotations

import site
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from fsdp_compat import _autoload, switches
from fsdp_compat._autoload import (
    ENV_AUTOLOAD,
    ENV_FORCE,
    ENV_LOG,
    ENV_POLICY,
    ENV_SWITCH,
    autoload_enabled,
    automatic_activation_enabled,
    force_enabled,
)
from fsdp_compat.adapter_index import ADAPTERS
from fsdp_compat.runtime.torch_versions import GUARD_MIN_TORCH, guard_supports, installed_torch

PTH_NAME = "fsdp_compat.pth"


def find_pth() -> list[Path]:
    """Every ``fsdp_compat.pth`` in a site directory of this interpreter (normally zero or one)."""
    dirs: list[str] = []
    if hasattr(site, "getsitepackages"):  # old virtualenv's site.py lacks it
        dirs += site.getsitepackages()
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs += [p for p in sys.path if p]
    found: list[Path] = []
    for directory in dict.fromkeys(dirs):
        candidate = Path(directory) / PTH_NAME
        if candidate.is_file() and candidate not in found:
            found.append(candidate)
    return found


_env = switches.shown


def _activation_lines() -> list[str]:
    lines = [
        f"automatic activation: {'on' if automatic_activation_enabled() else 'OFF'} ({_env(ENV_SWITCH)})",
    ]
    pth = find_pth()
    if pth:
        where = ", ".join(str(p) for p in pth)
        state = "active" if _autoload.is_installed() else "NOT active"
        lines.append(f".pth start-up hook: installed at {where}; {state} in this process")
    else:
        lines.append(
            f".pth start-up hook: not installed (a wheel install puts {PTH_NAME} into site-packages; "
            "editable installs and source checkouts do not: copy src_pth/fsdp_compat.pth there, or import "
            "the adapter)"
        )
    if not autoload_enabled():
        lines.append(f"  the .pth hook is off: {_env(ENV_AUTOLOAD)}, {_env(ENV_SWITCH)}")
    try:
        from fsdp_compat.activation import policy_from_env  # imports no adapter

        policy = policy_from_env()
    except Exception as exc:
        policy = f"INVALID: {exc}"
    lines.append(
        f"policy: {policy} ({_env(ENV_POLICY)}); force unsupported versions: {'yes' if force_enabled() else 'no'} "
        f"({_env(ENV_FORCE)}); log: {'quiet (INFO lines dropped)' if _autoload.quiet() else 'info'} ({_env(ENV_LOG)})"
    )
    lines.append(f"mixed micro-batches: {_mixed_batches_mode()} ({_env(switches.MIXED_BATCHES)})")
    lines.append(_guard_line())
    lines.append(_generic_line())
    return lines


def _generic_line() -> str:
    """Whether FSDP2 roots fsdp-compat did not shard itself get its run-time layer (the generic layer)."""
    if not automatic_activation_enabled():
        return f"generic layer: OFF ({_env(ENV_SWITCH)})"
    if not switches.flag(switches.GENERIC, True):
        return f"generic layer: OFF ({_env(switches.GENERIC)})"
    return (
        "generic layer: on (group check, run-time guard and mixed micro-batch alignment at every FSDP2 root's first "
        f"forward, however fully_shard was called; {_env(switches.GENERIC)})"
    )


def _mixed_batches_mode() -> str:
    try:
        return switches.mixed_batches_mode(strict=True)
    except Exception:
        return "INVALID (the run refuses it)"


def _guard_line() -> str:
    """Whether the run-time guard will be installed on the models fsdp-compat shards in this environment, and why."""
    supported = "torch >= {}.{}".format(*GUARD_MIN_TORCH)
    torch_version = installed_torch()
    if torch_version is None:
        return f"run-time guard: OFF (torch is not installed; it supports {supported})"
    if not guard_supports(torch_version):
        return f"run-time guard: OFF on torch {torch_version} (it supports {supported}; FSDP2 runs without it)"
    try:
        guard_on = switches.guard_mode() != "off"
    except Exception:
        return f"run-time guard: INVALID value ({_env(switches.GUARD)}; the run refuses it)"
    if not guard_on:
        return f"run-time guard: OFF ({_env(switches.GUARD)}; torch {torch_version} would support it)"
    return f"run-time guard: on (torch {torch_version}, supported: {supported}; {_env(switches.GUARD)})"


#: What happens to an installed distribution (``Installed.action``, ``--json``'s ``action``).
ACTIONS = ("patched", "patched-on-import", "stands-aside")
#: What fsdp-compat makes of an installed release (``Installed.verdict``).
VERDICTS = ("tested", "fingerprint", "left-alone", "untested", "invalid-version")


@dataclass
class Installed:
    """One installed distribution of the index: what fsdp-compat makes of its release and what happens to it.

    ``verdict``: one of :data:`VERDICTS` (inside the tested range; newer with what fsdp-compat replaces unchanged;
    newer and changed; outside the range with nothing to compare; unreadable). ``action``: one of :data:`ACTIONS`;
    ``how``: by what it is patched (tested range, fingerprint, ``FSDP_COMPAT_FORCE=1``; torch's row is the generic
    layer on every FSDP2 root), or why it stands aside."""

    distribution: str
    version: str
    adapter: str
    trigger: str
    supported: str
    verdict: str
    verdict_text: str
    imported: bool
    action: str = "stands-aside"
    how: str = ""
    policy: str | None = None
    activated_by: str | None = None
    bindings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rebound: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        head = f"  {self.distribution} {self.version}: {self.verdict_text} (supported: {self.supported}); "
        if self.action == "patched":
            head += f"patched in this process (policy {self.policy}, activated by {self.activated_by}; {self.how})"
        elif self.action == "patched-on-import":
            head += f"{self.how} on import of {self.trigger} (not imported yet)"
        elif self.imported:
            head += f"NOT patched in this process, although {self.trigger} is imported: {self.how}"
        else:
            head += f"stands aside: {self.how}"
        return [head, *(f"    {line}" for line in [*self.bindings, *self.notes, *self.rebound])]


def _verdict(distribution: str, raw: str, spec: str) -> tuple[str, str]:
    """(verdict, its text) for an installed release; nothing imported (fingerprints read source files)."""
    try:
        version = Version(raw)
    except InvalidVersion:
        return "invalid-version", "invalid version"
    if SpecifierSet(spec).contains(version, prereleases=True):
        return "tested", "supported"
    text = _by_fingerprint(distribution, version, spec)
    if text is None:
        return "untested", "NOT supported"
    return ("fingerprint" if "patched by fingerprint" in text else "left-alone"), text


_BY = {"tested": "patched by tested range", "fingerprint": "patched by fingerprint"}
_GENERIC = "the generic layer on every FSDP2 root"


def _how(key: str, verdict: str) -> str | None:
    """By what a release is (or would be) patched, None where it stands aside by its version."""
    how = _BY.get(verdict) or (f"patched because {ENV_FORCE}=1" if force_enabled() else None)
    return None if how is None else (f"{_GENERIC}, {how}" if key == "fsdp2" else how)


def _older(raw: str, spec: str) -> bool:
    """Whether ``raw`` is below every lower bound of ``spec``."""
    try:
        version = Version(raw)
        lower = [Version(s.version) for s in SpecifierSet(spec) if s.operator in (">=", ">", "~=", "==")]
    except InvalidVersion:
        return False
    return bool(lower) and version < min(lower)


def _aside(key: str, verdict: str, version: str, spec: str) -> str:
    """Why a release that is not patched in this process stands aside (or will)."""
    if not automatic_activation_enabled():
        return f"automatic activation is OFF ({_env(ENV_SWITCH)}; an explicit patch() still works)"
    if key == "fsdp2" and not switches.flag(switches.GENERIC, True):
        return f"the generic layer is OFF ({_env(switches.GENERIC)})"
    runs = f"it runs as without fsdp-compat; {ENV_FORCE}=1 patches anyway"
    if verdict == "untested" and _older(version, spec):
        return f"older than the tested range ({runs})"
    if verdict == "left-alone":
        return f"what fsdp-compat replaces changed ({runs})"
    if verdict == "invalid-version":
        return f"its version is unreadable ({runs})"
    return f"outside the tested range, no fingerprint to compare ({runs})"


def _installed_item(key: str, distribution: str, raw: str, patched: dict[str, tuple]) -> Installed:
    trigger, spec = ADAPTERS[key].distributions[distribution]
    verdict, text = _verdict(distribution, raw, spec)
    item = Installed(distribution, raw, key, trigger, spec, verdict, text, trigger in sys.modules)
    how = _how(key, verdict)
    if distribution in patched:
        _, item.activated_by, item.policy = patched[distribution]
        item.action, item.how = "patched", how or "patched explicitly"
    elif (
        how is not None
        and not item.imported
        and automatic_activation_enabled()
        and (key != "fsdp2" or switches.flag(switches.GENERIC, True))
    ):
        item.action, item.how = "patched-on-import", how
    else:
        # imported but not patched: the log says why, unless activation is off, which is the reason then
        known = how is None or not item.imported or not automatic_activation_enabled()
        item.how = _aside(key, verdict, raw, spec) if known else "the log says why"
    item.notes = _notes(distribution, raw)
    return item


def installed() -> tuple[list[Installed], list[str]]:
    """Every installed distribution of the index in index order, and every one not installed (nothing imported:
    an adapter that is loaded already is asked for its state)."""
    found: list[Installed] = []
    missing: list[str] = []
    for key, entry in ADAPTERS.items():
        adapter = getattr(sys.modules.get(entry.module), "ADAPTER", None)  # importing an adapter would activate it
        patched = adapter.patched() if adapter is not None else {}
        mine: list[Installed] = []
        for distribution in entry.distributions:
            try:
                raw = metadata.version(distribution)
            except metadata.PackageNotFoundError:
                missing.append(distribution)
                continue
            mine.append(_installed_item(key, distribution, raw, patched))
        if mine:
            mine[-1].bindings = adapter.describe() if adapter is not None else []
            mine[-1].rebound = _rebound_lines(key)
        found += mine
    return found, missing


def _by_fingerprint(distribution: str, version: Version, spec: str) -> str | None:
    """A release newer than the tested range: patched by fingerprint or left alone, and why (read from source
    files, nothing imported); None for any other version."""
    from fsdp_compat import fingerprints

    try:
        verdict = fingerprints.judge(distribution, version, spec)
    except Exception as exc:
        return f"newer than tested, left alone: the fingerprint check failed ({type(exc).__name__}: {exc})"
    return None if verdict is None else f"newer than tested, {verdict.describe()}"


def _notes(distribution: str, raw: str) -> list[str]:
    from fsdp_compat.known_limits import notes

    try:
        return notes(distribution, Version(raw))
    except InvalidVersion:
        return []


#: Bindings other code is known to replace: adapter key -> (module, name, the module that defines the function).
#: axolotl assigns its own ``fsdp2_prepare_model`` to ``accelerate.accelerator``: the accelerate adapter's wrapper,
#: bound there too, is then never called (the axolotl adapter wraps axolotl's function instead).
REBOUND = {"accelerate": ("accelerate.accelerator", "fsdp2_prepare_model", "accelerate.utils.fsdp_utils")}


def _rebound_lines(key: str) -> list[str]:
    """Whose function a binding of :data:`REBOUND` holds when it is not its definer's; only where that module is
    imported already (doctor imports no framework)."""
    if key not in REBOUND:
        return []
    module_name, name, definer = REBOUND[key]
    bound = vars(sys.modules[module_name]).get(name) if module_name in sys.modules else None
    ours = bool(getattr(bound, "__fsdp_compat__", False))
    inner = getattr(bound, "__wrapped__", bound) if ours else bound
    if inner is None or getattr(inner, "__module__", None) == definer:
        return []
    where = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"
    if ours:
        return [f"  {module_name}.{name} was replaced by someone else: it holds {where}, wrapped by fsdp-compat"]
    return [
        f"  {module_name}.{name} was replaced by someone else: it holds {where}, not fsdp-compat's; the {key} "
        "adapter does not run on that path"
    ]


def invalid_switches() -> list[tuple[str, str]]:
    """(variable, why) for each ``FSDP_COMPAT*`` value the run would refuse or not understand."""
    from fsdp_compat.policies import POLICY_NAMES

    return switches.invalid(POLICY_NAMES)


def report() -> str:
    """A plain-text report for ``fsdp-compat doctor`` and for bug reports: what is installed and what happens to each
    first, then every distribution not installed in one line, then the switches."""
    from fsdp_compat import __version__

    found, missing = installed()
    lines = [
        f"fsdp-compat {__version__} (python {sys.version.split()[0]} at {sys.executable})",
        *(f"INVALID: {why}" for _, why in invalid_switches()),
        "installed, and what fsdp-compat does with it:" if found else "installed: none of the frameworks it patches",
    ]
    for item in found:
        lines += item.lines()
    lines.append(f"not installed: {', '.join(missing) if missing else 'none'}")
    return "\n".join([*lines, *_activation_lines()])


#: The version of :func:`as_dict`'s layout; a key is only ever added (a changed meaning gets a new number).
SCHEMA = 1


def as_dict() -> dict[str, Any]:
    """The report as a stable, JSON-ready dict (``fsdp-compat doctor --json``)."""
    from fsdp_compat import __version__

    found, missing = installed()
    try:
        from fsdp_compat.activation import policy_from_env  # imports no adapter

        policy: str | None = str(policy_from_env())
    except Exception:
        policy = None
    torch_version = installed_torch()
    try:
        guard_on = switches.guard_mode() != "off"
    except Exception:
        guard_on = False
    guard = bool(torch_version and guard_supports(torch_version)) and guard_on
    mixed = _mixed_batches_mode()
    return {
        "schema": SCHEMA,
        "fsdp_compat": __version__,
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "invalid": [{"variable": variable, "why": why} for variable, why in invalid_switches()],
        "installed": [asdict(item) for item in found],
        "not_installed": missing,
        "settings": {
            "automatic_activation": automatic_activation_enabled(),
            "autoload": autoload_enabled(),
            "pth": [str(path) for path in find_pth()],
            "pth_active": _autoload.is_installed(),
            "policy": policy,
            "force": force_enabled(),
            "log": "quiet" if _autoload.quiet() else "info",
            "mixed_batches": None if mixed.startswith("INVALID") else mixed,
            "guard": guard,
            "generic": automatic_activation_enabled() and _generic_on(),
            "torch": torch_version,
        },
    }


def _generic_on() -> bool:
    try:
        return switches.flag(switches.GENERIC, True, strict=True)
    except Exception:
        return False
