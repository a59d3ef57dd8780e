"""What keeping mixed micro-batches in step costs: step time per ``FSDP_COMPAT_MIXED_BATCHES`` mode and batch mix.

``python -m benchmarks mixed_batches [--models glm4v,qwen2-vl] [--warmup 2] [--steps 10]``

Per model, one pair of gloo ranks holds three wrapped copies (policy auto, guard on) that differ only in the mode,
and steps them round-robin over three mixes, so every ratio comes from one run under the same machine load:

- ``images everywhere``: both ranks have images. ``sync`` pays its one small all-reduce per forward; ``always``
  and ``off`` nothing.
- ``no images``: neither rank has images. ``sync`` skips the tower on both (after its all-reduce); ``always`` runs
  the tower on a dummy on both ranks (verl's way: no exchange, a wasted tower forward and backward); ``off`` skips it.
- ``mixed``: rank 0 images, rank 1 text. ``sync`` and ``always`` both run one dummy on rank 1; ``off`` cannot run
  it (the collectives fall out of step), so its cell is ``-``.

Ratios are against ``off`` on the same mix (``-`` where ``off`` cannot run) and, for ``always``, against ``sync``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks import fmt_ratio, format_table

MODES = ("sync", "always", "off")
MIXES = {"images everywhere": ("image", "image"), "no images": ("text", "text"), "mixed": ("image", "text")}


def _rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.mixed_batches import install_mixed_batches, mixed_batches_of
    from fsdp_compat.testing.zoo import build_model, make_batch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg["world_size"]))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=cfg["world_size"], timeout=timedelta(seconds=cfg["timeout_s"]))  # fmt: skip
    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    os.environ["FSDP_COMPAT_MIXED_BATCHES"] = "off"  # apply_fsdp2 installs nothing; each copy gets its own mode
    copies = {}
    for mode in MODES:
        model = build_model(cfg["model"])
        apply_fsdp2(model, {"mesh": mesh})
        install_mixed_batches(model, mode)
        copies[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = {mix: make_batch(cfg["model"], seed=rank, variant=kinds[rank]) for mix, kinds in MIXES.items()}
    times: dict[str, dict[str, list[float]]] = {mode: {mix: [] for mix in MIXES} for mode in MODES}
    for step in range(cfg["warmup"] + cfg["steps"]):
        for mix, batch in batches.items():
            for mode, (model, opt) in copies.items():
                if mode == "off" and mix == "mixed":
                    continue
                t = time.perf_counter()
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= cfg["warmup"]:
                    times[mode][mix].append(time.perf_counter() - t)
    extra["median_s"] = {m: {x: statistics.median(v) if v else None for x, v in d.items()} for m, d in times.items()}
    extra["dummy_calls"] = {m: sum(h.dummy_calls for h in mixed_batches_of(copies[m][0])) for m in MODES}


def run(model: str, warmup: int, steps: int) -> dict[str, Any]:
    from fsdp_compat.testing.launch import run_ranks

    result = run_ranks("benchmarks.mixed_batches:_rank", {"model": model, "warmup": warmup, "steps": steps},
                       world_size=2, timeout_s=900)  # fmt: skip
    result.raise_for_error()
    ranks = [r.extra for r in result.ranks]
    # a step takes as long as its slowest rank
    median = {m: {x: max(r["median_s"][m][x] or 0.0 for r in ranks) or None for x in MIXES} for m in MODES}
    return {"median": median, "dummy_calls": [r["dummy_calls"] for r in ranks], "seconds": result.seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks mixed_batches")
    parser.add_argument("--models", default="glm4v,qwen2-vl")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    print("Mixed micro-batches: median step (forward, backward, AdamW) per mode and mix; 2 gloo ranks, "
          f"{args.steps} steps after {args.warmup} warm-up, copies stepped round-robin\n")  # fmt: skip
    for name in args.models.split(","):
        out = run(name, args.warmup, args.steps)
        med = out["median"]
        rows = []
        for mix in MIXES:
            ms = {m: med[m][mix] for m in MODES}
            rows.append([
                mix,
                *(f"{ms[m] * 1e3:.1f} ms" if ms[m] else "-" for m in MODES),
                fmt_ratio(ms["sync"], ms["off"]),
                fmt_ratio(ms["always"], ms["off"]),
                fmt_ratio(ms["always"], ms["sync"]),
            ])  # fmt: skip
        print(f"{name} ({out['seconds']:.0f}s; dummy tower calls per rank {out['dummy_calls']})")
        header = ["mix", "sync", "always", "off", "sync/off", "always/off", "always/sync"]
        print(format_table(header, rows, right=range(1, 7)))
        print()
    return 0
