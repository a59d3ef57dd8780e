"""What keeping mixed micro-batches in step costs: step time per ``FSDP_COMPAT_MIXED_BATCHES`` mode and batch mix.

``python -m benchmarks mixed_batches [--models glm4v,qwen2-vl] [--warmup 2] [--steps 10]``
``python -m benchmarks mixed_batches --exchange [--iters 200] [--busy-ms 20]`` (the exchange alone; see below)

Per model, one pair of gloo ranks holds three wrapped copies (``apply_fsdp2`` as installed by default) that differ
only in the mode, and steps them round-robin (the order rotated per step) over three mixes, so every ratio comes
from one run under the same machine load (``python -m benchmarks schedule`` runs the same rank code at 2-32 ranks,
:func:`mix_kinds`):

- ``images everywhere``: both ranks have images. ``sync`` pays its one small all-reduce per forward; ``always``
  and ``off`` nothing.
- ``no images``: neither rank has images. ``sync`` skips the tower on both (after its all-reduce); ``always`` runs
  the tower on a dummy on both ranks (verl's way: no exchange, a wasted tower forward and backward); ``off`` skips it.
- ``mixed``: rank 0 images, rank 1 text. ``sync`` and ``always`` both run one dummy on rank 1; ``off`` cannot run
  it (the collectives fall out of step), so its cell is ``-``.

Ratios are against ``off`` on the same mix (``-`` where ``off`` cannot run) and, for ``always``, against ``sync``.

``--exchange``: what one exchange costs the CPU that issues FSDP2's work, on 2 ranks (NCCL, one GPU each, where 2
GPUs are visible; else gloo on the CPU, which cannot show the difference and says so). Per iteration: ``idle``, the
exchange alone; ``busy``, the exchange issued right after ``--busy-ms`` of queued GPU work (a chain of matmuls), as
in a forward where FSDP2 has queued its prefetches. ``host`` is fsdp-compat's exchange (a CPU tensor on a gloo group
of its own: the CPU returns without waiting for the GPU); ``device`` the way it was made before (a vector on the
GPU, all-reduced on the mesh's NCCL group and read back with ``.tolist()``: the CPU waits until the queue drains).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks import fmt_ratio, format_table, join_cpu_group

MODES = ("sync", "always", "off")
MIXES = ("images everywhere", "no images", "mixed")


def mix_kinds(world: int) -> dict[str, tuple[str, ...]]:
    """Each mix's micro-batch kind per rank: images on every rank, on none, on the even ranks (rank 0 at 2 ranks)."""
    return {
        "images everywhere": ("image",) * world,
        "no images": ("text",) * world,
        "mixed": tuple("image" if rank % 2 == 0 else "text" for rank in range(world)),
    }


class _ExchangeClock:
    """Wall time this rank spent in the mixed-batch exchange (``fsdp_compat.runtime.exchange.exchange``, as the
    alignment calls it) since the last :meth:`take`: waiting for the slowest rank included."""

    def __init__(self) -> None:
        from fsdp_compat.runtime import exchange as wire

        self.seconds = 0.0
        original = wire.exchange

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        wire.exchange = timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _copies(cfg: dict[str, Any], mesh: Any) -> dict[str, tuple[Any, Any]]:
    """One wrapped copy per mode of ``cfg["modes"]`` (apply_fsdp2's default, then the mode), each with AdamW."""
    import torch

    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.runtime.mixed_batches import install_mixed_batches
    from fsdp_compat.testing.zoo import build_model

    os.environ["FSDP_COMPAT_MIXED_BATCHES"] = "off"  # apply_fsdp2 installs nothing; each copy gets its own mode
    copies = {}
    for mode in cfg["modes"]:
        model = build_model(cfg["model"])
        apply_fsdp2(model, {"mesh": mesh})
        install_mixed_batches(model, mode)
        copies[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return copies


def _rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """The copies stepped round-robin over the mixes (``cfg``: model, modes, warmup, steps, threads); per mode and
    mix the median step and the median time spent in the exchange, and the dummy tower calls per mode."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.runtime.mixed_batches import mixed_batches_of
    from fsdp_compat.testing.zoo import make_batch

    join_cpu_group(cfg, rank, threads=cfg.get("threads"))
    mesh = init_device_mesh("cpu", (cfg["world_size"],))
    clock = _ExchangeClock()
    copies = _copies(cfg, mesh)
    kinds = mix_kinds(cfg["world_size"])
    batches = {mix: make_batch(cfg["model"], seed=rank, variant=kinds[mix][rank]) for mix in MIXES}
    times = {mode: {mix: [] for mix in MIXES} for mode in copies}
    exchange = {mode: {mix: [] for mix in MIXES} for mode in copies}
    modes = list(copies)
    for step in range(cfg["warmup"] + cfg["steps"]):
        order = modes[step % len(modes) :] + modes[: step % len(modes)]  # rotated per step: no copy always first
        for mix, batch in batches.items():
            for mode in order:
                if mode == "off" and mix == "mixed":
                    continue  # off cannot run it: the collectives fall out of step
                clock.take()
                seconds = _train_step(*copies[mode], batch)
                if step >= cfg["warmup"]:
                    times[mode][mix].append(seconds)
                    exchange[mode][mix].append(clock.take())
    extra["median_s"] = _medians(times)
    extra["exchange_s"] = _medians(exchange)
    extra["dummy_calls"] = {m: sum(h.dummy_calls for h in mixed_batches_of(copies[m][0])) for m in copies}


def _train_step(model: Any, opt: Any, batch: dict[str, Any]) -> float:
    """Forward, backward, AdamW: its wall time."""
    t = time.perf_counter()
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def _medians(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float | None]]:
    return {m: {x: statistics.median(v) if v else None for x, v in d.items()} for m, d in samples.items()}


def across_ranks(
    ranks: list[dict[str, Any]], key: str, modes: tuple[str, ...], pick: Any = max
) -> dict[str, dict[str, float | None]]:
    """Per mode and mix ``pick`` (default the largest: a step is as slow as its slowest rank) of the ranks' medians
    under ``key``; None where no rank has one."""
    return {m: {x: pick(r[key][m][x] or 0.0 for r in ranks) or None for x in MIXES} for m in modes}


def run(model: str, warmup: int, steps: int) -> dict[str, Any]:
    from fsdp_compat.testing.launch import run_ranks

    cfg = {"model": model, "warmup": warmup, "steps": steps, "modes": MODES}
    result = run_ranks("benchmarks.mixed_batches:_rank", cfg, world_size=2, timeout_s=900)
    result.raise_for_error()
    ranks = [r.extra for r in result.ranks]
    return {"median": across_ranks(ranks, "median_s", MODES), "dummy_calls": [r["dummy_calls"] for r in ranks],
            "seconds": result.seconds}  # fmt: skip


def _exchange_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_compat.runtime.exchange import exchange as _exchange
    from fsdp_compat.testing.parity import init_group

    dev = init_group(cfg, rank)
    ranks = tuple(range(cfg["world_size"]))
    cuda = dev.type == "cuda"
    if cuda:
        a = torch.randn(2048, 2048, device=dev)
        t = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        per_matmul = (time.perf_counter() - t) / 10
        chain = max(1, round(cfg["busy_ms"] / 1e3 / per_matmul))

    def device_way(value: int) -> list[int]:
        vector = torch.zeros(len(ranks), dtype=torch.int64, device=dev)
        vector[rank] = value
        dist.all_reduce(vector)
        return vector.tolist()

    ways = {"host": lambda v: list(_exchange(ranks, v).values()), "device": device_way}
    times: dict[str, list[float]] = {f"{w} {s}": [] for w in ways for s in ("idle", "busy")}
    for i in range(cfg["iters"] + 5):
        for way, call in ways.items():
            for state in ("idle", "busy") if cuda else ("idle",):
                if cuda:
                    torch.cuda.synchronize()
                    dist.barrier()
                    if state == "busy":
                        for _ in range(chain):
                            a @ a
                t = time.perf_counter()
                assert call(rank + 1) == [r + 1 for r in ranks]
                if i >= 5:
                    times[f"{way} {state}"].append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
    extra["median_us"] = {k: statistics.median(v) * 1e6 if v else None for k, v in times.items()}
    extra["backend"] = dist.get_backend()


def exchange_main(iters: int, busy_ms: float) -> int:
    import torch

    from fsdp_compat.testing.launch import run_ranks

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    cfg = {"iters": iters, "busy_ms": busy_ms, "device": "cuda" if gpu else "cpu"}
    result = run_ranks("benchmarks.mixed_batches:_exchange_rank", cfg, world_size=2, timeout_s=600)
    result.raise_for_error()
    medians = [r.extra["median_us"] for r in result.ranks]
    print(f"Mixed-batch exchange: median CPU time of one exchange, {iters} iterations, 2 ranks "
          f"({result.ranks[0].extra['backend']})\n")  # fmt: skip
    rows = [[k, *(f"{m[k]:.0f} us" if m[k] is not None else "-" for m in medians)] for k in medians[0]]
    print(format_table(["exchange", "rank 0", "rank 1"], rows, right=(1, 2)))
    if not gpu:
        print("\nNo 2 GPUs here: gloo on the CPU only, where both ways run on host memory and neither waits for a "
              "device. The device-to-host sync the host exchange removes shows only with NCCL: run this on 2 GPUs "
              f"(busy = {busy_ms:g} ms of queued matmuls).")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks mixed_batches")
    parser.add_argument("--models", default="glm4v,qwen2-vl")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--exchange", action="store_true", help="measure the exchange alone (host vs device way)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--busy-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.exchange:
        return exchange_main(args.iters, args.busy_ms)
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
