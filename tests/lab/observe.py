"""What a stack's rank routine observes of a model a framework sharded: fsdp-compat's log lines and the FSDP2 groups
the framework made (the accelerate and NeMo Automodel stack tests read both)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["LogLines", "fsdp_groups"]


class LogLines(logging.Handler):
    """Keeps fsdp-compat's log lines of this rank (the activation line comes when the framework's module loads);
    ``levels``: each line starts with its level name (``WARNING ...``)."""

    def __init__(self, *, levels: bool = False) -> None:
        super().__init__(logging.DEBUG)
        self.levels = levels
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}" if self.levels else record.getMessage())


def fsdp_groups(model: Any) -> list[list[str]]:
    """The FSDP2 groups as module paths, one entry per ``fully_shard`` call (``fully_shard([a, b])``: both paths;
    ``""`` is the root), in ``named_modules`` order."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    groups: dict[int, list[str]] = {}
    for path, module in model.named_modules():
        if isinstance(module, FSDPModule):
            groups.setdefault(id(fully_shard.state(module)), []).append(path)
    return list(groups.values())
