"""``fsdp-compat doctor``: what is installed, what is supported, and what is patched in this process.

Reads versions with importlib.metadata and never imports a framework, so it is safe to run anywhere (a login
node, a Ray worker through ``ray.get(remote(report))``, a notebook mid-training).
"""

from __future__ import annotations

import importlib
import os
import site
import sys
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

from fsdp_compat import _autoload
from fsdp_compat.activation import (
    ADAPTER_MODULES,
    ENV_AUTOLOAD,
    ENV_FORCE,
    ENV_POLICY,
    ENV_SWITCH,
    Adapter,
    autoload_enabled,
    automatic_activation_enabled,
    force_enabled,
    policy_from_env,
)

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
        policy = policy_from_env()
    except Exception as exc:
        policy = f"INVALID: {exc}"
    lines.append(f"policy: {policy} ({_env(ENV_POLICY)})")
    lines.append(f"force unsupported versions: {'yes' if force_enabled() else 'no'} ({_env(ENV_FORCE)})")
    return lines


def _installed_versions(adapter: Adapter) -> list[str]:
    lines = []
    for distribution in adapter.supported:
        try:
            raw = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            lines.append(f"  {distribution}: not installed")
            continue
        try:
            verdict = "supported" if adapter.is_supported(distribution, Version(raw)) else "NOT supported"
        except InvalidVersion:
            verdict = "invalid version"
        lines.append(f"  {distribution} {raw}: {verdict} (supported: {adapter.supported[distribution]})")
    return lines


def _adapter_lines(key: str, module_name: str, triggers: tuple[str, ...]) -> list[str]:
    lines = [f"{key} adapter ({module_name}; activates on import of {', '.join(triggers)})"]
    try:
        module = importlib.import_module(module_name)
        adapter = module.ADAPTER
    except Exception as exc:
        return [*lines, f"  adapter not importable: {type(exc).__name__}: {exc}"]
    lines += _installed_versions(adapter)
    loaded = [t for t in triggers if t in sys.modules]
    if adapter.is_patched():
        lines.append(f"  patched in this process (activated by {adapter.activated_by}):")
        lines += [f"    {line}" for line in adapter.describe()]
    elif loaded:
        lines.append(f"  NOT patched in this process, although {', '.join(loaded)} is imported")
    else:
        lines.append("  not patched in this process (the framework is not imported here)")
    return lines


def report() -> str:
    """A plain-text report for ``fsdp-compat doctor`` and for bug reports."""
    from fsdp_compat import __version__

    lines = [
        f"fsdp-compat {__version__}",
        f"python {sys.version.split()[0]} at {sys.executable}",
        *_activation_lines(),
    ]
    for key, (module_name, triggers) in ADAPTER_MODULES.items():
        lines += _adapter_lines(key, module_name, triggers)
    return "\n".join(lines)
