"""What the generic mechanism costs: a text-only job pays nothing, a media model without a row pays its stops.

``python -m benchmarks mechanism [--steps 8] [--warmup 2] [--threads 1] [--world-size 2] [--timeout 300]``

Why: the mechanism (``fsdp_compat.runtime.replay``) is installed only on roots whose forward takes media; a text-only
job must show no new collective and no new cost. A media model without a family row pays one exchange per forward
and, in a forward where the ranks' media differ, one host all-reduce per FSDP2 group (the stops) plus the replay.

Three runs of fresh gloo ranks (``--world-size``), each rank on its own micro-batch, AdamW steps (forward, backward,
step), models sharded by a trainer's own ``fully_shard`` calls (every block, then the root):

- ``FSDP_COMPAT=off`` (plain FSDP2): the text model (the zoo's Qwen2) and the user's own VLM
  (``lab.own_vlm``) with images on every rank;
- fsdp-compat's defaults: the same two, and the user's VLM with images on rank 0 only (the mechanism replays);
- the defaults with the VLM's row registered (``fsdp_compat.register_family``): images on rank 0 only (the table's
  path: one exchange, a dummy call, no stops).

Per case: collectives outside FSDP2 per step (``all_reduce``, ``broadcast``, ``barrier`` through
``torch.distributed``: the exchange and the stops show here), the text rank's replays or dummies per step, the
slowest rank's median step time (wall and process CPU) and their ratios to plain FSDP2's same model (2 shared cores:
the times are indications, the counts are exact).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks import format_table, join_cpu_group
from benchmarks.no_grad import _Counts

RUNS = {"FSDP_COMPAT=off": ("off", False), "defaults": (None, False), "defaults, row registered": (None, True)}
OWN = "lab.own_vlm:TINY"
CASES = {  # run -> (label, model, variants by rank parity)
    "FSDP_COMPAT=off": [("text model", "qwen2", None), ("own VLM, images everywhere", OWN, ("image", "image"))],
    "defaults": [
        ("text model", "qwen2", None),
        ("own VLM, images everywhere", OWN, ("image", "image")),
        ("own VLM, image|text (mechanism)", OWN, ("image", "text")),
    ],
    "defaults, row registered": [("own VLM, image|text (row)", OWN, ("image", "text"))],
}


def _shard(model: Any, mesh: Any) -> None:
    from lab.every_root import own_apply_fsdp2
    from torch.distributed.fsdp import fully_shard

    if hasattr(model, "encoder"):  # the user's VLM: no _no_split_modules, its blocks by hand
        for block in [*model.encoder.blocks, *model.decoder.blocks]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        own_apply_fsdp2(model, {"mesh": mesh})


def _rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.runtime.mixed_batches import mixed_batches_of
    from fsdp_compat.testing.zoo import build_model, is_vlm, make_batch

    torch.set_num_threads(cfg["threads"])
    world = join_cpu_group(cfg, rank)
    mesh = init_device_mesh("cpu", (world,))
    if cfg["row"]:
        from lab.own_vlm import row

        import fsdp_compat

        fsdp_compat.register_family(row())
    counts = _Counts()
    counts.install()
    records = []
    for label, name, variants in cfg["cases"]:
        model = build_model(name, seed=0)
        _shard(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        kw = {"variant": variants[rank % 2]} if variants and is_vlm(name) else {}
        batch = make_batch(name, seed=rank, **kw)
        times, cpu, others = [], [], []
        for step in range(cfg["warmup"] + cfg["steps"]):
            counts.take()
            t, c = time.perf_counter(), time.process_time()
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= cfg["warmup"]:
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
                others.append(counts.take()[1])
        installed = mixed_batches_of(model)
        replays = sum(m.dummy_calls for m in installed) / (cfg["warmup"] + cfg["steps"])
        records.append({"label": label, "median_s": statistics.median(times), "cpu_s": statistics.median(cpu),
                        "others": others,
                        "installed": [type(m).__name__ for m in installed], "replays": replays})  # fmt: skip
        dist.barrier()
    extra["records"] = records


def run(label: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from fsdp_compat.testing.launch import run_ranks

    switch, row = RUNS[label]
    cfg = {"cases": CASES[label], "row": row, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
    result = run_ranks("benchmarks.mechanism:_rank", cfg, world_size=args.world_size, timeout_s=args.timeout,
                       env={"FSDP_COMPAT": switch, "FSDP_COMPAT_GENERIC": None})  # fmt: skip
    if not result.ok:
        return [{"run": label, "label": "-", "error": (result.exception or "failed").splitlines()[-1][:80]}]
    ranks = [r.extra["records"] for r in result.ranks]
    out = []
    for index, first in enumerate(ranks[0]):
        out.append({
            "run": label, "label": first["label"], "installed": first["installed"],
            "median_s": max(r[index]["median_s"] for r in ranks),
            "cpu_s": max(r[index]["cpu_s"] for r in ranks),
            "others": max(statistics.mean(r[index]["others"]) for r in ranks),
            "replays": max(r[index]["replays"] for r in ranks),
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks mechanism", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    records = [rec for label in RUNS for rec in run(label, args)]
    plain = {r["label"]: r for r in records if r["run"] == "FSDP_COMPAT=off" and "error" not in r}
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["run"], "FAILED", r["error"], "", "", "", "", "", ""])
            continue
        base = plain.get(r["label"], plain.get("own VLM, images everywhere") if "own VLM" in r["label"] else None)
        ratios = (
            ["-", "-"]
            if not base or r["run"] == "FSDP_COMPAT=off"
            else [f"{r['median_s'] / base['median_s']:.3f}x", f"{r['cpu_s'] / base['cpu_s']:.3f}x"]
        )
        times = [f"{r['median_s'] * 1e3:.1f}", f"{r['cpu_s'] * 1e3:.1f}"]
        installed = ", ".join(r["installed"]) or "nothing"
        rows.append([r["run"], r["label"], installed, f"{r['others']:.1f}", f"{r['replays']:.1f}", *times, *ratios])
    print(f"\nGeneric mechanism cost: {args.world_size} gloo ranks, {args.threads} torch thread(s) each, step = "
          f"forward + backward + AdamW, median of {args.steps} after {args.warmup} warm-up, slowest rank; "
          "ratio: to plain FSDP2's same model (image|text: to plain FSDP2 with images everywhere)\n")  # fmt: skip
    header = ["run", "case", "alignment installed", "collectives outside FSDP2 / step", "replays or dummies / step",
              "step ms", "step CPU ms", "vs plain FSDP2 (wall)", "(CPU)"]  # fmt: skip
    print(format_table(header, rows, right=(3, 4, 5, 6, 7, 8)))
    return 0
