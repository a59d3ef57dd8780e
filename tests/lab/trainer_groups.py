"""A trainer's own FSDP2 groups, checked as they are by :mod:`fsdp_compat.group_check` (the unit tests of that
module): the zoo model is sharded by a rule the test names (module paths), as a trainer without an adapter does,
and the rank records what the check and its report say."""

from __future__ import annotations

import logging
from typing import Any

from lab.observe import LogLines

__all__ = ["checked_rank"]


def checked_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """``cfg``: ``model`` (a zoo name), ``groups`` (lists of module paths, one ``fully_shard`` call each, then the
    root), ``evidence`` ("before" or "after" sharding). ``extra``: the groups as the check reads them, what
    :func:`check_groups` / :func:`unsafe_groups` / :func:`report` return, and the report's log lines."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_compat.group_check import check_groups, evidence, report, sharded_groups, unsafe_groups
    from fsdp_compat.testing.parity import init_group
    from fsdp_compat.testing.zoo import build_model

    init_group(cfg, rank)
    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    model = build_model(cfg["model"], seed=0)
    found = evidence("trainer", model) if cfg["evidence"] == "before" else None
    modules = dict(model.named_modules())
    for paths in cfg["groups"]:
        fully_shard([modules[p] for p in paths] if len(paths) > 1 else modules[paths[0]], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if found is None:
        found = evidence("trainer", model)
    lines = LogLines()
    log = logging.getLogger("fsdp_compat")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        extra["groups"] = [list(paths) for paths, _ in sharded_groups(model)]
        extra["check"] = [list(x) for x in check_groups(*found, sharded_groups(model))]
        extra["unsafe"] = [list(x) for x in (unsafe_groups("trainer", model, found) or [])]
        extra["report"] = [list(x) for x in (report("trainer", model, found, "keep it out of the list") or [])]
        extra["none_report"] = report("trainer", model, None, "advice")
    finally:
        log.removeHandler(lines)
    extra["lines"] = lines.lines
