"""What every plan applier installs on the root model it shards, in one call: the run-time guard (a read the plan
did not foresee unshards its group instead of crashing) and mixed micro-batch alignment (a rank without images
still issues the vision tower's collectives; a vision-tower call outside the model's forward, as in ``generate``,
is unsharded and counted; ``generate`` keeps the ranks in step). A user of plain FSDP2 gets it from the generic
layer (:mod:`fsdp_compat.every_root`) at the root's first forward, or calls it after ``fully_shard``: the
outside-forward tower crash and the mixed-batch mismatch are FSDP2's, under every plan."""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["check_runtime_switches", "install_runtime", "runtime_installed"]

_INSTALLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def install_runtime(model: nn.Module, *, armed: bool = True) -> None:
    """Install both on ``model`` (idempotent; each has its own switch: ``FSDP_COMPAT_GUARD``,
    ``FSDP_COMPAT_MIXED_BATCHES``). It may run before ``fully_shard``: both find the FSDP2 groups at the first
    forward. ``armed=False`` installs the guard without its per-op check (:func:`fsdp_compat.guard.install_guard`)."""
    from fsdp_compat.guard import install_guard
    from fsdp_compat.mixed_batches import install_mixed_batches

    install_guard(model, armed=armed)
    install_mixed_batches(model)
    _INSTALLED.add(model)


def check_runtime_switches() -> None:
    """Read the run-time layer's switches strictly (``FSDP_COMPAT_GUARD``, ``FSDP_COMPAT_MIXED_BATCHES``,
    ``FSDP_COMPAT_GUARD_AGREE_S``): an applier calls it before its first ``fully_shard``, so a value the run would
    refuse raises there and changes nothing (not after the model was sharded)."""
    from fsdp_compat import switches
    from fsdp_compat.guard import _AGREE_S_DEFAULT, guard_enabled
    from fsdp_compat.mixed_batches import mixed_batches_mode

    guard_enabled()
    mixed_batches_mode()
    switches.seconds(switches.GUARD_AGREE_S, _AGREE_S_DEFAULT)


def runtime_installed(model: nn.Module) -> bool:
    """Whether :func:`install_runtime` ran on ``model`` (an adapter's applier, or the generic layer already)."""
    return model in _INSTALLED
