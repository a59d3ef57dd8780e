"""The run-time layer, one room: what runs while a sharded model trains, installed on its root in one call.

=======================  ==========================================================================================
module                   holds
=======================  ==========================================================================================
``guard``                the run-time guard: a read the plan did not foresee unshards its group instead of crashing
``mixed_batches``        mixed micro-batch alignment: install and mode, the hooks (a rank without images still
                         issues the vision tower's collectives; a tower call outside the forward, as in
                         ``generate``, is unsharded and counted)
``exchange``             the per-forward count exchange between the ranks (one host all-reduce)
``vlm_families``         the family table and its dummy builders
``torch_versions``       the torch-version gate
``process_world``        what the layer caches or numbers across ranks belongs to one process group; the job's
                         timeout
``every_root``           the generic layer: every FSDP2 root gets this layer at its first forward
=======================  ==========================================================================================

:func:`install_runtime` is what every plan applier calls (``fsdp_compat.apply_fsdp2``, the adapters, the generic
layer); a user of plain FSDP2 gets it from the generic layer, or calls it after ``fully_shard``: the outside-forward
tower crash and the mixed-batch mismatch are FSDP2's, under every plan. Importing this package imports no torch
(``fsdp-compat doctor`` reads the version gate from here)."""

from __future__ import annotations

import weakref
from typing import Any

TYPE_CHECKING = False
if TYPE_CHECKING:
    from torch import nn

__all__ = ["check_runtime_switches", "install_runtime", "marked", "runtime_installed"]

_INSTALLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # type: ignore[name-defined]


def marked(hook: Any) -> Any:
    """``hook`` as a hook of the run-time layer: it reads no parameter, so the static analysis skips it (a partial, so
    the mark is on this registration and on nothing else)."""
    import functools

    from fsdp_compat.analysis.names import RUNTIME_HOOK_MARK

    hook = functools.partial(hook)
    setattr(hook, RUNTIME_HOOK_MARK, True)
    return hook


def install_runtime(model: nn.Module, *, armed: bool = True) -> None:
    """Install both on ``model`` (idempotent; each has its own switch: ``FSDP_COMPAT_GUARD``,
    ``FSDP_COMPAT_MIXED_BATCHES``). It may run before ``fully_shard``: both find the FSDP2 groups at the first
    forward. ``armed=False`` installs the guard without its per-op check (:func:`.guard.install_guard`)."""
    from fsdp_compat.runtime.guard import install_guard
    from fsdp_compat.runtime.mixed_batches import install_mixed_batches

    install_guard(model, armed=armed)
    install_mixed_batches(model)
    _INSTALLED.add(model)


def check_runtime_switches() -> None:
    """Read the run-time layer's switches strictly (``FSDP_COMPAT_GUARD``, ``FSDP_COMPAT_MIXED_BATCHES``,
    ``FSDP_COMPAT_GUARD_AGREE_S``): an applier calls it before its first ``fully_shard``, so a value the run would
    refuse raises there and changes nothing (not after the model was sharded)."""
    from fsdp_compat import switches
    from fsdp_compat.runtime.guard import _AGREE_S_DEFAULT, guard_enabled
    from fsdp_compat.runtime.mixed_batches import mixed_batches_mode

    guard_enabled()
    mixed_batches_mode()
    switches.seconds(switches.GUARD_AGREE_S, _AGREE_S_DEFAULT)


def runtime_installed(model: nn.Module) -> bool:
    """Whether :func:`install_runtime` ran on ``model`` (an adapter's applier, or the generic layer already)."""
    return model in _INSTALLED
