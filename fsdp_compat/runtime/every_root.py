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

**At a new root** (once per root, rank-independent, so every rank decides the same):
1. nothing, if an adapter's applier already installed the run-time layer on it (nothing is installed twice), or if
   the root is the only group (unsharded for the whole forward: nothing to check, guard or align);
2. the groups somebody made are checked against the static evidence of the model's code
   (:mod:`fsdp_compat.group_check`; read after sharding: FSDP2's own hooks are its window, not a read). One
   WARNING (rank 0) per group that can be read while sharded, naming the read and the fix;
3. :func:`fsdp_compat.runtime.install_runtime` on the root: the guard is *armed* (its per-op check runs) only where
   the check could not rule a sharded read out (an unsafe group, an analysis that could not run, a policy that
   skips the analysis); a safe grouping costs no per-op check. Mixed micro-batch alignment as everywhere;
4. the hooks it just registered run for this first forward too (FSDP2's pre-hook has already started it).

Never breaks a job: any failure here warns once and leaves FSDP2 as it was. ``FSDP_COMPAT_GENERIC=off`` turns the
layer off (read at each new root); ``FSDP_COMPAT=off`` keeps it from being installed at all. Declared like an
adapter (``adapters/fsdp2.py``: torch's row in the index), so ``fsdp-compat doctor`` shows it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fsdp_compat import switches
from fsdp_compat.policies import Policy

__all__ = ["ROOT_PRE_FORWARD", "generic_enabled", "make_root_pre_forward"]

ROOT_PRE_FORWARD = "FSDPState._root_pre_forward"
_warned: set[str] = set()


def generic_enabled() -> bool:
    """``FSDP_COMPAT_GENERIC`` (on by default): whether a new FSDP2 root gets fsdp-compat's run-time layer."""
    return switches.flag(switches.GENERIC, True)


def make_root_pre_forward(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """FSDP2's ``FSDPState._root_pre_forward(self, module, args, kwargs)``, unchanged, plus the run-time layer on
    the root the first time a state runs it as the root."""

    @functools.wraps(original)
    def _root_pre_forward(self: Any, module: Any, *rest: Any, **kw: Any) -> Any:
        fresh = getattr(self, "_is_root", False) is None  # the root is decided in this call
        result = original(self, module, *rest, **kw)
        if fresh and getattr(self, "_is_root", False) is True:
            result = _on_new_root(self, result, policy)
        return result

    _root_pre_forward.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return _root_pre_forward


def _on_new_root(state: Any, result: Any, policy: Policy) -> Any:
    """Install the run-time layer on ``state``'s module and run its pre-hooks for this forward; never raises."""
    try:
        if not generic_enabled():
            return result
        modules = tuple(getattr(state, "_modules", ()))
        if len(modules) != 1:
            return result  # FSDP2 itself refuses a root of several modules
        root = modules[0]
        from fsdp_compat.runtime import install_runtime, runtime_installed

        if runtime_installed(root) or not _has_inner_groups(root):
            return result  # installed already; or one group for the whole model: nothing is ever sharded in forward
        from fsdp_compat.runtime.guard import guard_of

        # A caller that installed the guard itself (armed) has made its choice: only what is missing is added.
        armed = True if guard_of(root) is not None else _check(root, policy)
        before = set(root._forward_pre_hooks)
        install_runtime(root, armed=armed)
        args, kwargs = result
        return _run_new_pre_hooks(root, before, args, kwargs)
    except Exception as exc:  # a drop-in never turns a working job into a crash
        _warn_once(
            f"{type(exc).__name__}: {exc}",
            f"generic layer: the run-time layer could not be installed on an FSDP2 root ({type(exc).__name__}: "
            f"{exc}); FSDP2 runs as without fsdp-compat",
        )
        return result


def _has_inner_groups(root: Any) -> bool:
    """Whether ``fully_shard`` was applied below the root too (a root group alone is unsharded for the whole
    forward: no read can find it sharded and every rank all-gathers it the same way)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in root.modules() if m is not root)


def _check(root: Any, policy: Policy) -> bool:
    """Check the groups below ``root`` and log the verdict (rank 0); returns whether the guard must be armed."""
    from fsdp_compat.group_check import evidence, is_rank_zero, sharded_groups, unsafe_groups
    from fsdp_compat.log import logger
    if not policy.analyzed:
        return True  # legacy & co: no analysis, so nothing is ruled out
    name = type(root).__name__.removeprefix("FSDP")
    unsafe = unsafe_groups("fully_shard", root, evidence("fully_shard", root))
    if unsafe is None:
        return True
    if is_rank_zero():
        if not unsafe:
            guard = (
                "run-time guard installed (its per-op check off: no read to catch)"
                if switches.flag(switches.GUARD, True)
                else f"run-time guard off ({switches.GUARD})"
            )
            logger.info(
                "generic layer: %s: its %d FSDP2 groups pass fsdp-compat's safety check; %s, mixed micro-batch "
                "alignment installed",
                name,
                len(sharded_groups(root)),
                guard,
            )
        for group, why in unsafe:
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
    return bool(unsafe)


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
