"""``fsdp-compat doctor``: what is installed, what is supported, and what is patched in this process.

It reports without changing anything: versions come from importlib.metadata and the supported ranges from the
adapter index (:data:`fsdp_compat.adapters.ADAPTERS`); it never imports a framework or an adapter module (an
adapter imported here would patch what it inspects). An adapter that is already loaded is asked for its state.
Safe to run anywhere: a login node, a Ray worker through ``ray.get(remote(report))``, a notebook mid-training.
"""

from __future__ import annotations

import os
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
from fsdp_compat.adapters import ADAPTERS, AdapterEntry
from fsdp_compat.torch_versions import GUARD_MIN_TORCH, guard_supports, installed_torch

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


def _env(name: str) -> str:
    value = os.environ.get(name)
    return f"{name} unset" if value is None else f"{name}={value}"


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
    lines.append(_guard_line())
    return lines


def _guard_line() -> str:
    """Whether the run-time guard will be installed on the models fsdp-compat shards in this environment, and why."""
    supported = "torch >= {}.{}".format(*GUARD_MIN_TORCH)
    torch_version = installed_torch()
    if torch_version is None:
        return f"run-time guard: OFF (torch is not installed; it supports {supported})"
    if not guard_supports(torch_version):
        return f"run-time guard: OFF on torch {torch_version} (it supports {supported}; FSDP2 runs without it)"
    if not switches.flag(switches.GUARD, True):
        return f"run-time guard: OFF ({_env(switches.GUARD)}; torch {torch_version} would support it)"
    return f"run-time guard: on (torch {torch_version}, supported: {supported}; {_env(switches.GUARD)})"


def _distribution_line(distribution: str, spec: str, trigger: str, patched: dict[str, tuple]) -> str:
    try:
        raw = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return f"  {distribution}: not installed"
    try:
        verdict = "supported" if SpecifierSet(spec).contains(Version(raw), prereleases=True) else "NOT supported"
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
    return lines


def report() -> str:
    """A plain-text report for ``fsdp-compat doctor`` and for bug reports."""
    from fsdp_compat import __version__

    lines = [
        f"fsdp-compat {__version__}",
        f"python {sys.version.split()[0]} at {sys.executable}",
        *_activation_lines(),
    ]
    for key, entry in ADAPTERS.items():
        lines += _adapter_lines(key, entry)
    return "\n".join(lines)
