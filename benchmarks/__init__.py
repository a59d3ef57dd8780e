"""fsdp-compat benchmarks: not tests, figures. ``python -m benchmarks [policies|skeletons|startup]``.

- :mod:`benchmarks.policies`: every zoo model under every wrap policy on 2 gloo ranks (step time, all-gathers,
  peak unsharded parameter bytes measured from FSDP2 itself next to the plan's estimate).
- :mod:`benchmarks.skeletons`: full-size models on the meta device (planning time, groups, per-rank bytes at
  world sizes 2-64, predicted crashes).
- :mod:`benchmarks.startup`: interpreter start-up cost of the ``.pth`` hook and of ``import verl`` with it.
- :mod:`benchmarks.guard`, :mod:`benchmarks.no_grad`: the run-time layer's cost (the guard as ``apply_fsdp2``
  installs it; FSDP2's all-gathers per forward of a ``no_grad`` loop).
- :mod:`benchmarks.mixed_batches`, :mod:`benchmarks.exchange`, :mod:`benchmarks.schedule`: the mixed-batch
  alignment (per mode and mix on 2 ranks; the exchange alone; exchange against a static schedule at 2-32 ranks).

This module holds only the shared table and number formatting, so importing it costs nothing. It also puts the
checkout's ``tests/`` first on ``sys.path``: the benchmarks use the tests' lab (``lab.guard_models``,
``lab.transformers_smoke``), which the installed package does not ship; rank processes get it the same way, since
they import a ``benchmarks`` module first.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_compat import units
from fsdp_compat.policies import POLICY_ORDER  # one home: every policy, auto last

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

__all__ = [
    "POLICY_ORDER",
    "fmt_bytes",
    "fmt_ratio",
    "format_table",
    "fsdp2_unsharded_estimate",
    "join_cpu_group",
    "qwen2_of",
]


def fmt_bytes(n: float | None) -> str:
    """Binary units, 3 significant figures (:func:`fsdp_compat.units.fmt_bytes`); '-' for a missing value."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    return units.fmt_bytes(n, decimals=None)


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
    """Bytes a rank holds unsharded at the forward peak: the package's model (``WrapPlan.per_rank_bytes``), which
    matches FSDP2's measured storage on every zoo model and policy."""
    sizes = plan.per_rank_bytes(2)
    return sizes["peak_forward"] - sizes["resident"]


def join_cpu_group(cfg: dict[str, Any], rank: int, *, threads: int | None = None) -> int:
    """A CPU rank of a benchmark: its share of the cores (or ``threads``), then the job's gloo group on
    ``cfg["port"]`` with ``cfg["timeout_s"]``; returns the world size."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    world = int(cfg["world_size"])
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    return world


def qwen2_of(spec: dict[str, int]) -> Any:
    """A Qwen2ForCausalLM of the benchmark's shape ``spec`` (vocab, hidden, intermediate, layers, heads, kv_heads,
    tokens), untied, the one text model the cost benchmarks time."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=max(512, spec["tokens"]),
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config)
