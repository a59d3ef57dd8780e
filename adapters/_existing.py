"""The group check of FSDP2 groups a framework applied itself: its one home is :mod:`fsdp_compat.group_check`
(the generic layer uses it too); the adapters that cannot narrow a framework's choice import it from here."""

from __future__ import annotations

from fsdp_compat.group_check import (
    check_groups,
    evidence,
    is_rank_zero,
    report,
    root_module,
    sharded_groups,
    unsafe_groups,
)

__all__ = ["check_groups", "evidence", "is_rank_zero", "report", "root_module", "sharded_groups", "unsafe_groups"]
