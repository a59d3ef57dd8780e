"""Checking FSDP2 groups that somebody else applied already: a framework fsdp-compat cannot narrow, or any caller
of ``fully_shard`` (the generic layer, :mod:`fsdp_compat.runtime.every_root`).

accelerate imports ``fully_shard`` inside its function; NeMo Automodel sets FSDP2 prefetch chains on every group
right after making it; a trainer we have no adapter for calls ``fully_shard`` by its own rule. Such groups are
checked as they are with fsdp-compat's one safety checker (:func:`fsdp_compat.safety.settle`) against the static
evidence (read before sharding, or after it: FSDP2's own hooks are its window, not a read): safe, one INFO line on
rank 0; unsafe, one WARNING there naming each group and why, and the run-time guard unshards such a group on demand.
A failing check only warns (a drop-in never turns a working job into a crash).
"""

from __future__ import annotations

from typing import Any

from fsdp_compat.log import logger

__all__ = ["check_groups", "evidence", "is_rank_zero", "report", "root_module", "sharded_groups", "unsafe_groups"]


def is_rank_zero() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except Exception:  # pragma: no cover - torch without distributed
        return True


def root_module(model: Any) -> Any:
    """The module the framework sharded: a ``torch.compile`` wrapper's ``_orig_mod`` when that is the FSDP2 root."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, FSDPModule) and not isinstance(model, FSDPModule) else model


def _reshards(state: Any) -> bool:
    """Whether a ``fully_shard`` state reshards after its forward (its param groups keep a post-forward mesh)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.10: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return any(getattr(group, "post_forward_mesh_info", None) is not None for group in groups)


def sharded_groups(model: Any) -> list[tuple[tuple[str, ...], bool]]:
    """The FSDP2 groups below ``model``'s root as they are: (module paths of one ``fully_shard`` call, whether it
    reshards after forward), in ``named_modules`` order; the root's own group, if it has one yet, is left out."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    root = root_module(model)
    root_state = fully_shard.state(root) if isinstance(root, FSDPModule) else None
    groups: dict[int, tuple[Any, list[str]]] = {}
    for path, module in root.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)
        if state is root_state:
            continue
        groups.setdefault(id(state), (state, []))[1].append(path)
    return [(tuple(paths), _reshards(state)) for state, paths in groups.values()]


def evidence(framework: str, model: Any) -> tuple[Any, list[Any]] | None:
    """The module tree and the static evidence of ``model`` before the framework shards it (its code and its
    Parameter objects as they are), or None (with one warning) when the analysis cannot run."""
    try:
        from fsdp_compat.analysis import find_raw_reads
        from fsdp_compat.tree import ModuleTree

        tree = ModuleTree.build(model)
        return tree, list(find_raw_reads(model, tree).events)
    except Exception as exc:
        logger.warning(
            "%s: the safety check of %s could not read its code (%s: %s); %s's FSDP2 groups are kept as they "
            "are, with fsdp-compat's run-time guard",
            framework,
            type(model).__name__,
            type(exc).__name__,
            exc,
            framework,
        )
        return None


def check_groups(tree: Any, events: list[Any], groups: list[tuple[tuple[str, ...], bool]]) -> list[tuple[str, str]]:
    """fsdp-compat's safety checker on a grouping that exists already: (group, why) for each group that some
    evidence shows would be read while it is sharded, or that splits a Parameter's sharers (deepest first, as
    :func:`fsdp_compat.safety.settle` finds them); empty when the grouping is safe."""
    from fsdp_compat.safety import Layout, settle, sharer_sets

    known = [(paths, {} if reshards else {"reshard_after_forward": False}) for paths, reshards in groups]
    layout = Layout.of((paths, overrides) for paths, overrides in known if all(p in tree.modules for p in paths))
    return [(" + ".join(p.key), p.describe()) for p in settle(tree, layout, events, sharer_sets(tree))]


def unsafe_groups(framework: str, model: Any, found: tuple[Any, list[Any]] | None) -> list[tuple[str, str]] | None:
    """(group, why) for each of the FSDP2 groups below ``model``'s root that the evidence ``found`` shows read while
    sharded; None (one warning) when no evidence could be read or the check failed."""
    return _checked(framework, model, found)[0]


def _checked(
    framework: str, model: Any, found: tuple[Any, list[Any]] | None
) -> tuple[list[tuple[str, str]] | None, int]:
    """:func:`unsafe_groups`, and how many groups were checked (the groups are read once)."""
    if found is None:
        return None, 0
    try:
        groups = sharded_groups(model)
        return check_groups(*found, groups), len(groups)
    except Exception as exc:
        logger.warning(
            "%s: the safety check of %s's FSDP2 groups failed (%s: %s); they are kept as they are, with "
            "fsdp-compat's run-time guard",
            framework,
            type(model).__name__,
            type(exc).__name__,
            exc,
        )
        return None, 0


def report(
    framework: str, model: Any, found: tuple[Any, list[Any]] | None, advice: str, *, installed: str = ""
) -> list[tuple[str, str]] | None:
    """Check the framework's groups below ``model``'s root and say so on rank 0 (never raises: a failing check
    warns); returns what :func:`unsafe_groups` found. ``advice``: how a user keeps an unsafe module out of this
    framework's groups; ``installed``: what the INFO line says was installed."""
    unsafe, count = _checked(framework, model, found)
    if unsafe is None or not is_rank_zero():
        return unsafe
    name = type(root_module(model)).__name__.removeprefix("FSDP")
    if not unsafe:
        logger.info(
            "%s: %s: %s's %d FSDP2 groups below the root pass fsdp-compat's safety check (kept as they are); %s",
            framework,
            name,
            framework,
            count,
            installed or "run-time guard and mixed micro-batch alignment installed",
        )
        return unsafe
    logger.warning(
        "%s: %s: fsdp-compat's safety check cannot show that these FSDP2 groups of %s are unsharded whenever "
        "their parameters are read: %s. %s's grouping is kept as it is (%s applies it itself); if such a read finds "
        "its group sharded, fsdp-compat's run-time guard unshards the group there (one more all-gather; the group "
        "then stays unsharded until the end of backward) and logs it.%s To avoid it, %s, or shard with "
        "fsdp_compat.apply_fsdp2.",
        framework,
        name,
        framework,
        "; ".join(f"{group} ({why})" for group, why in unsafe),
        framework,
        framework,
        _split_sentence(unsafe),
        advice,
    )
    return unsafe


def _split_sentence(unsafe: list[tuple[str, str]]) -> str:
    """What the guard cannot mend: a Parameter whose sharers sit in different groups. torch >= 2.13 refuses it at
    the first forward's lazy init (``ValueError: Parameter '...' is shared with a parameter already managed by
    another FSDP group``), all-image or not; older torch shards it twice."""
    from fsdp_compat.safety import SPLIT_SHARERS

    split = [group for group, why in unsafe if why.endswith(SPLIT_SHARERS)]
    if not split:
        return ""
    return (
        f" The guard cannot mend {' and '.join(split)}: a Parameter whose sharers sit in different groups is refused "
        "by torch >= 2.13 at the first forward (\"shared with a parameter already managed by another FSDP group\") "
        "and sharded twice by older torch; keep all its sharers in one group."
    )
