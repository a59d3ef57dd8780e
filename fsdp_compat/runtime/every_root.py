"""The generic layer: fsdp-compat's run-time layer on every FSDP2 root, whoever called ``fully_shard`` and how.

An adapter narrows one framework's selection (precision); this layer is the reach. A trainer fsdp-compat has never
seen (its own ``apply_fsdp2``, a release newer than an adapter's range, the user's own loop) gets what the
accelerate and NeMo adapters give: its groups checked, the run-time guard, and mixed micro-batch alignment.

**Where it hooks.** FSDP2 decides which state is the root lazily, in the root's first forward:
``FSDPState._root_pre_forward`` calls ``_lazy_init``, which marks the first state to run forward as the root.
``_root_pre_forward`` is looked up on the class at every call (``self._root_pre_forward(...)`` in
``FSDPState._pre_forward``), so replacing that class attribute reaches every root, however ``fully_shard`` was
bound (``from torch.distributed.fsdp import fully_shard`` before or after fsdp-compat loaded, the
``torch.distributed._composable.fsdp`` alias) and on every torch the guard supports (2.8 - 2.15: the contract test
checks the method and the state fields it reads). Wrapping the public ``fully_shard`` instead would miss every
module that bound it before the wrap, and could not tell the root from an inner group at wrap time.

**At the start of every pass** (the state becomes FSDP2's ``iter_forward_root``) the root's forward window opens
(:mod:`fsdp_compat.runtime.window`), for ``forward`` and for registered forward methods alike.

**At a new root** (once per root, rank-independent, so every rank decides the same):
1. nothing more, if an adapter's applier already installed the run-time layer on it (nothing is installed twice);
2. the groups somebody made are checked against the static evidence of the model's code
   (:mod:`fsdp_compat.group_check`; read after sharding: FSDP2's own hooks are its window, not a read). One
   WARNING (rank 0) per group that can be read while sharded, naming the read and the fix;
3. :func:`fsdp_compat.runtime.install_runtime` on the root, also where the root is the only group (its backward
   reduce-scatter covers only the parameters that got a gradient, so ranks that differ in images need the
   alignment there too): the guard is *armed* (its per-op check runs) only where the check could not rule a sharded
   read out (:mod:`fsdp_compat.runtime.arming`); a safe grouping costs no per-op check;
4. the window opens, and where the pass came through the module's ``__call__`` the pre-hooks just registered run
   for this forward too (FSDP2's pre-hook has already started it); a registered forward method runs no module hook.

Errors: a bad switch value raises on every rank before any collective; fsdp-compat's own failure to install warns
once and leaves nothing installed (FSDP2 then does run as without it); an error the run-time layer raises to
prevent a hang (mixed micro-batches it cannot align) reaches the user on every rank.
``FSDP_COMPAT_GENERIC=off`` turns the layer off (read at each new root); ``FSDP_COMPAT=off`` keeps it from being
installed at all. Declared like an
adapter (``adapters/fsdp2.py``: torch's row in the index), so ``fsdp-compat doctor`` shows it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fsdp_compat import switches
from fsdp_compat.policies import Policy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from fsdp_compat.runtime.arming import Arming

__all__ = ["ROOT_PRE_FORWARD", "generic_enabled", "make_root_pre_forward"]

ROOT_PRE_FORWARD = "FSDPState._root_pre_forward"
_warned: set[str] = set()


def generic_enabled() -> bool:
    """``FSDP_COMPAT_GENERIC`` (on by default): whether a new FSDP2 root gets fsdp-compat's run-time layer."""
    return switches.flag(switches.GENERIC, True)


def make_root_pre_forward(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """FSDP2's ``FSDPState._root_pre_forward(self, module, args, kwargs)``, unchanged, plus, where it starts a pass
    (the state becomes ``iter_forward_root``): the run-time layer on a new root, and the root's forward window
    opened (:mod:`.window`)."""

    @functools.wraps(original)
    def _root_pre_forward(self: Any, module: Any, *rest: Any, **kw: Any) -> Any:
        fresh = getattr(self, "_is_root", False) is None  # the root is decided in this call
        context = getattr(self, "_state_ctx", None)
        before = getattr(context, "iter_forward_root", None)
        result = original(self, module, *rest, **kw)
        if before is not None or getattr(context, "iter_forward_root", None) is not self:
            return result  # not the start of a pass
        from fsdp_compat.runtime.window import root_pre_forward_done  # torch is loaded by now

        if fresh and getattr(self, "_is_root", False) is True:
            return _on_new_root(self, result, policy)
        root_pre_forward_done(self, module)
        return result

    _root_pre_forward.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return _root_pre_forward


def _on_new_root(state: Any, result: Any, policy: Policy) -> Any:
    """Install the run-time layer on ``state``'s module, open its window and, where the pass came through the
    module's ``__call__``, run the pre-hooks it just registered for this forward.

    What may fail here and how: a bad switch value raises (:func:`~fsdp_compat.runtime.check_runtime_switches`, the
    same error on every rank, before any collective); fsdp-compat's own failure to install warns once, and then
    nothing of it stays installed (installing is all or nothing), so FSDP2 does run as without it; an error the
    run-time layer raises in this forward (the mixed micro-batch error that prevents a hang) reaches the user, as in
    every later forward."""
    if not generic_enabled():
        return result
    modules = tuple(getattr(state, "_modules", ()))
    if len(modules) != 1:
        return result  # FSDP2 itself refuses a root of several modules
    root = modules[0]
    from fsdp_compat.runtime import check_runtime_switches, install_runtime, runtime_installed
    from fsdp_compat.runtime.window import from_module_call, root_pre_forward_done

    if runtime_installed(root):  # an adapter's applier installed it already: only the window is opened
        root_pre_forward_done(state, root)
        return result
    check_runtime_switches()
    before = set(root._forward_pre_hooks)
    try:
        from fsdp_compat.runtime.guard import guard_of

        if guard_of(root) is not None:  # the caller installed the guard itself: its choice, only the rest is added
            install_runtime(root)
        else:
            verdict = _check(root, policy)
            _announce(root, install_runtime(root, armed=verdict.armed), verdict)
    except Exception as exc:  # a drop-in never turns a working job into a crash
        _warn_once(
            f"{type(exc).__name__}: {exc}",
            f"generic layer: the run-time layer could not be installed on an FSDP2 root ({type(exc).__name__}: "
            f"{exc}); nothing of it was installed, FSDP2 runs as without fsdp-compat",
        )
        return result
    root_pre_forward_done(state, root)
    if not from_module_call():
        return result  # a registered forward method: no module hook runs in this pass
    args, kwargs = result
    return _run_new_pre_hooks(root, before, args, kwargs)


def _check(root: Any, policy: Policy) -> Arming:
    """Check the groups below ``root`` and warn (rank 0) about each unsafe one; the verdict says whether the guard
    must be armed (:mod:`fsdp_compat.runtime.arming`)."""
    from fsdp_compat.group_check import is_rank_zero
    from fsdp_compat.log import logger
    from fsdp_compat.runtime.arming import decide

    verdict = decide(root, policy)
    name = type(root).__name__.removeprefix("FSDP")
    if is_rank_zero():
        for group, why in verdict.unsafe:
            logger.warning(
                "generic layer: %s: the FSDP2 group %s can be read while sharded: %s. fsdp-compat's run-time guard "
                "unshards it at that read (one more all-gather; the group then stays unsharded until the end of "
                "backward). To avoid it: give %s no fully_shard call of its own (its parameters join the enclosing "
                "group), or choose the groups with fsdp_compat.select_wrap_targets / apply_fsdp2.",
                name,
                group,
                why,
                group,
            )
    return verdict


def _announce(root: Any, runtime: Any, verdict: Arming) -> None:
    """The process's one ``fsdp-compat: ...`` INFO line (:func:`fsdp_compat.log.announce_once`), where the layer
    changes what this job runs: the guard's per-op check armed, or mixed micro-batch alignment installed. A root
    whose groups pass the check and that has nothing to align gets a DEBUG line only (nothing of the run changes)."""
    from fsdp_compat.group_check import sharded_groups
    from fsdp_compat.log import announce_once, logger

    if runtime.guard is not None:
        runtime.guard.unsafe_groups = verdict.unsafe_names
    name = type(root).__name__.removeprefix("FSDP")
    groups = len(sharded_groups(root))
    changes = []
    if runtime.guard is not None and runtime.guard.armed:
        from fsdp_compat.runtime.guard import guard_always_armed

        why = "unsafe groups" if verdict.unsafe else "FSDP_COMPAT_GUARD=always" if guard_always_armed() else "unchecked"
        changes.append(f"run-time guard armed ({why})")
    if runtime.mixed:
        changes.append("mixed micro-batch alignment installed")
    if changes:
        announce_once("fsdp-compat: generic layer on FSDP2 root %s (%d groups below it): %s", name, groups,
                      ", ".join(changes))  # fmt: skip
    else:
        logger.debug("fsdp-compat: generic layer: %s: its %d FSDP2 groups pass fsdp-compat's safety check; nothing "
                     "to guard or align", name, groups)  # fmt: skip


def _run_new_pre_hooks(root: Any, before: set[int], args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Run the forward pre-hooks registered on ``root`` since ``before`` as ``nn.Module.__call__`` would have: it
    took its list of pre-hooks before FSDP2's (the one running now) installed them. Its post-hooks are read after
    the forward, so the new ones run in this forward already."""
    for hook_id, hook in list(root._forward_pre_hooks.items()):
        if hook_id in before:
            continue
        if hook_id in root._forward_pre_hooks_with_kwargs:
            out = hook(root, args, kwargs)
            if out is not None:
                args, kwargs = out
        else:
            out = hook(root, args)
            if out is not None:
                args = out if isinstance(out, tuple) else (out,)
    return args, kwargs


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    from fsdp_compat.log import logger

    logger.warning(message)
