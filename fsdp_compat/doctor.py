"""``fsdp-compat doctor``: what is installed, what is supported, and what is patched in this process.

It reports without changing anything: versions come from importlib.metadata and the supported ranges from the
adapter index (:data:`fsdp_compat.adapters.ADAPTERS`); it never imports a framework or an adapter module (an
adapter imported here would patch what it inspects). An adapter that is already loaded is asked for its state.
Safe to run anywhere: a login node, a Ray worker through ``ray.get(remote(report))``, a notebook mid-training.
"""

from __future__ import annotations

import site
import sys
from importlib import metadata
from pathlib import Path

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
from fsdp_compat.adapter_index import ADAPTERS, AdapterEntry
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
    lines.append(f"policy: {policy} ({_env(ENV_POLICY)})")
    lines.append(f"force unsupported versions: {'yes' if force_enabled() else 'no'} ({_env(ENV_FORCE)})")
    lines.append(f"log: {'quiet (INFO lines dropped)' if _autoload.quiet() else 'info'} ({_env(ENV_LOG)})")
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
        "generic layer: on (every FSDP2 root gets the group check, the run-time guard and the mixed micro-batch "
        f"alignment at its first forward, however fully_shard was called; {_env(switches.GENERIC)})"
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
        guard_on = switches.flag(switches.GUARD, True, strict=True)
    except Exception:
        return f"run-time guard: INVALID value ({_env(switches.GUARD)}; the run refuses it)"
    if not guard_on:
        return f"run-time guard: OFF ({_env(switches.GUARD)}; torch {torch_version} would support it)"
    return f"run-time guard: on (torch {torch_version}, supported: {supported}; {_env(switches.GUARD)})"


def _distribution_line(distribution: str, spec: str, trigger: str, patched: dict[str, tuple]) -> str:
    try:
        raw = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return f"  {distribution}: not installed"
    try:
        verdict = "supported" if SpecifierSet(spec).contains(Version(raw), prereleases=True) else "NOT supported"
        if verdict != "supported":
            verdict = _by_fingerprint(distribution, Version(raw), spec) or verdict
    except InvalidVersion:
        verdict = "invalid version"
    line = f"  {distribution} {raw}: {verdict} (supported: {spec})"
    if distribution in patched:
        _, activated_by, policy = patched[distribution]
        line = f"{line}; patched in this process (policy {policy}, activated by {activated_by})"
    elif trigger in sys.modules:
        line = f"{line}; NOT patched in this process, although {trigger} is imported"
    else:
        line = f"{line}; not imported in this process"
    return "\n".join([line, *(f"    {note}" for note in _notes(distribution, raw))])


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


def _adapter_lines(key: str, entry: AdapterEntry) -> list[str]:
    triggers = ", ".join(entry.triggers)
    lines = [f"{key} adapter ({entry.module}; activates on import of {triggers})"]
    module = sys.modules.get(entry.module)  # never imported here: importing an adapter activates it
    adapter = getattr(module, "ADAPTER", None)
    patched = adapter.patched() if adapter is not None else {}
    for distribution, (trigger, spec) in entry.distributions.items():
        lines.append(_distribution_line(distribution, spec, trigger, patched))
    if adapter is None:
        lines.append("  adapter not loaded in this process")
    else:
        lines += [f"    {line}" for line in adapter.describe()]
    return lines + _rebound_lines(key)


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
    """A plain-text report for ``fsdp-compat doctor`` and for bug reports."""
    from fsdp_compat import __version__

    lines = [
        f"fsdp-compat {__version__}",
        f"python {sys.version.split()[0]} at {sys.executable}",
        *(f"INVALID: {why}" for _, why in invalid_switches()),
        *_activation_lines(),
    ]
    for key, entry in ADAPTERS.items():
        lines += _adapter_lines(key, entry)
    return "\n".join(lines)
