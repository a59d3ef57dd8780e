"""fsdp-compat benchmarks: not tests, figures. ``python -m benchmarks [policies|skeletons|startup]``.

- :mod:`benchmarks.policies`: every zoo model under every wrap policy on 2 gloo ranks (step time, all-gathers,
  peak unsharded parameter bytes measured from FSDP2 itself next to the plan's estimate).
- :mod:`benchmarks.skeletons`: full-size models on the meta device (planning time, groups, per-rank bytes at
  world sizes 2-64, predicted crashes).
- :mod:`benchmarks.startup`: interpreter start-up cost of the ``.pth`` hook and of ``import verl`` with it.

This module holds only the shared table and number formatting, so importing it costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

POLICY_ORDER = ("legacy", "legacy-skyrl", "input-only", "layers-only", "auto")


def fmt_bytes(n: float | None) -> str:
    """Binary units, 3 significant figures; '-' for a missing value."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def fmt_ratio(num: float | None, den: float | None) -> str:
    """``num/den`` as ``1.23x``; '-' when either side is missing (e.g. the other policy crashed)."""
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return "-"
    return f"{num / den:.3f}x"


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """A plain-text (and Markdown-compatible) pipe table; columns in ``right`` are right-aligned."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def fsdp2_unsharded_estimate(plan: Any) -> int:
    """Bytes a rank holds unsharded at the forward peak, modelled on what FSDP2 2.13 does (CPU, sync all-gather).

    Not the package's formula (``WrapPlan.per_rank_bytes``); shown next to it and to the measurement because it
    matches the measurement on every zoo model and policy. Terms: the root (unsharded for the whole forward) and
    groups with ``reshard_after_forward=False``; multi-module groups (``fully_shard([a, b])``, e.g. tied
    embed_tokens + lm_head), which were measured staying unsharded from the first member's forward to the last's;
    and the transient: a group's flat all-gather buffer lives until the *next* group's copy-out, so the largest
    single-module group is held twice (buffer + parameters), and the root's buffer is still alive while the first
    group all-gathers (``max(root, largest)``).
    """
    no_reshard = sum(g.num_bytes for g in plan.groups if g.overrides.get("reshard_after_forward") is False)
    rest = [g for g in plan.groups if g.overrides.get("reshard_after_forward") is not False]
    spanning = sum(g.num_bytes for g in rest if len(g.modules) > 1)
    largest = max((g.num_bytes for g in rest if len(g.modules) == 1), default=0)
    return plan.root_bytes + no_reshard + spanning + max(plan.root_bytes, largest) + largest
