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
``window``               one forward window per root, opened and closed by FSDP2's own root pre/post-forward (for
                         ``forward`` and every registered forward method); the guard subscribes to it
``arming``               whether the guard's per-op check must run (fsdp-compat's check of the groups)
``first_pass``           after a ``no_grad`` first pass, the root's groups are sharded again (an optimizer built
                         then holds the real parameters)
=======================  ==========================================================================================

:func:`install_runtime` is what every plan applier calls (``fsdp_compat.apply_fsdp2``, the adapters, the generic
layer); a user of plain FSDP2 gets it from the generic layer, or calls it after ``fully_shard``: the outside-forward
tower crash and the mixed-batch mismatch are FSDP2's, under every plan. It keeps plain FSDP2's contract: one
:class:`Runtime` per root, stored on the module (nothing process-global keeps a model alive), installed all or
nothing, removed exactly by :meth:`Runtime.remove`. Importing this package imports no torch
(``fsdp-compat doctor`` reads the version gate from here)."""

from __future__ import annotations

from typing import Any

TYPE_CHECKING = False
if TYPE_CHECKING:
    from torch import nn

    from fsdp_compat.runtime.guard import Guard
    from fsdp_compat.runtime.mixed_batches import MixedBatches

__all__ = ["RUNTIME_ATTR", "Runtime", "check_runtime_switches", "install_runtime", "marked", "runtime_installed",
           "runtime_of"]  # fmt: skip

#: Where a root keeps its run-time layer (``module.__dict__``): the module owns it, so it dies with the module.
RUNTIME_ATTR = "_fsdp_compat_runtime"


def marked(hook: Any) -> Any:
    """``hook`` as a hook of the run-time layer: it reads no parameter, so the static analysis skips it (a partial, so
    the mark is on this registration and on nothing else)."""
    import functools

    from fsdp_compat.analysis.names import RUNTIME_HOOK_MARK

    hook = functools.partial(hook)
    setattr(hook, RUNTIME_HOOK_MARK, True)
    return hook


class Runtime:
    """fsdp-compat's run-time layer on one root: its guard (None when off), its mixed micro-batch hooks, and the
    first-pass rule (:class:`~fsdp_compat.runtime.first_pass.FirstPass`), all on the root's one forward window
    (:mod:`.window`). Stored on the module; :meth:`remove` takes everything off again and leaves the module as it
    was before :func:`install_runtime`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.guard: Guard | None = None
        self.mixed: list[MixedBatches] = []
        self._parts: list[Any] = []  # everything installed, in order (each has .remove())

    @property
    def installed(self) -> bool:
        return self.model.__dict__.get(RUNTIME_ATTR) is self

    def remove(self) -> None:
        """Take the layer off ``model`` (idempotent), newest part first."""
        while self._parts:
            self._parts.pop().remove()
        self.guard, self.mixed = None, []
        if self.model.__dict__.get(RUNTIME_ATTR) is self:
            del self.model.__dict__[RUNTIME_ATTR]


def install_runtime(model: nn.Module, *, armed: bool | None = None) -> Runtime:
    """Install the run-time layer on ``model`` and return its :class:`Runtime` (idempotent: a second call returns
    the same one, armed if either call armed it). Each part has its own switch (``FSDP_COMPAT_GUARD``,
    ``FSDP_COMPAT_MIXED_BATCHES``); a bad switch value raises :class:`~fsdp_compat.errors.FsdpCompatError` before
    anything is installed. It may run before ``fully_shard``: every part finds the FSDP2 groups at the first pass.
    ``armed``: the guard's per-op check (:func:`.guard.install_guard`; None: decided at the first pass by fsdp-compat's
    check of the groups). All or nothing: a part that fails to install takes the others off before the error
    propagates."""
    from fsdp_compat.runtime.first_pass import FirstPass
    from fsdp_compat.runtime.guard import install_guard
    from fsdp_compat.runtime.mixed_batches import install_mixed_batches

    check_runtime_switches()
    existing = runtime_of(model)
    if existing is not None:
        if armed and existing.guard is not None:
            existing.guard.armed = True
        return existing
    runtime = Runtime(model)
    try:
        runtime.guard = install_guard(model, armed=armed)
        if runtime.guard is not None:
            runtime._parts.append(runtime.guard)
        runtime.mixed = install_mixed_batches(model)
        runtime._parts.append(_MixedPart(model))
        runtime._parts.append(FirstPass(model))
    except BaseException:
        runtime.remove()
        raise
    model.__dict__[RUNTIME_ATTR] = runtime
    return runtime


class _MixedPart:
    """The mixed micro-batch hooks as one removable part (``install_mixed_batches`` may install none or several)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def remove(self) -> None:
        from fsdp_compat.runtime.mixed_batches import remove_mixed_batches

        remove_mixed_batches(self.model)


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


def runtime_of(model: nn.Module) -> Runtime | None:
    """The run-time layer installed on ``model``, if any."""
    runtime = model.__dict__.get(RUNTIME_ATTR)
    return runtime if isinstance(runtime, Runtime) and runtime.installed else None


def runtime_installed(model: nn.Module) -> bool:
    """Whether :func:`install_runtime` ran on ``model`` (an adapter's applier, or the generic layer already)."""
    return runtime_of(model) is not None
