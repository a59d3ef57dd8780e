"""The run-time guard's cost: step time with and without it, and the memory of a group it had to unshard.

``python -m benchmarks guard [--models glm4v,qwen2-512] [--warmup 2] [--steps 15] [--world-size 2]``

Per model, one pair of gloo ranks holds five wrapped copies side by side and steps them round-robin, so every
ratio comes from one run under the same machine load:

- ``safe, guard off`` / ``safe, guard on``: a plan with nothing to fix (``input-only``); the guard is installed
  and idle, so the ratio is its pure overhead (a ``TorchFunctionMode`` that checks every op's arguments during
  the forward). The target is <= 1.02x on the text model with realistic op sizes. ``safe, guard off (2nd copy)``
  repeats the first copy: the ratio of the two is the run's noise floor.
- ``legacy, guard on``: the upstream rule, which crashes without the guard (a raw read of a table with its own
  group); the guard unshards that group at the read, every step.
- ``recommended, guard off``: ``legacy`` minus that group (the change the guard's log line recommends).

Memory: "guard unsharded" is the unsharded bytes of the group the guard had to unshard (``GuardEvent``), held from
the read to the end of backward; "peak unsharded (fwd)" is measured from FSDP2 during the forward with the policy
benchmark's instrumentation (:mod:`benchmarks.policies`: allocated storage of every group's unsharded parameters).
Models: the zoo's tiny GLM4V (op overhead dominates) and Qwen2 with hidden 512, 4 layers, 256 tokens, whose root
forward computes logits from ``lm_head.weight`` (the fused-kernel pattern; ``legacy`` gives ``lm_head`` a group).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from lab.guard_models import GuardModel

from benchmarks import fmt_bytes, fmt_ratio, format_table

MODELS = {
    "glm4v": ("glm4v", ["position_embedding"]),
    "qwen2-512": ("benchmarks.guard:qwen2_512", ["lm_head"]),
}
VARIANTS = (  # label, policy, guard on, leave
    ("safe, guard off", "input-only", False, False),
    ("safe, guard on", "input-only", True, False),
    ("safe, guard off (2nd copy)", "input-only", False, False),  # same work twice: the run's noise floor
    ("legacy, guard on", "legacy", True, False),
    ("recommended, guard off", "legacy", False, True),
)
TARGET = 1.02
ROOT = Path(__file__).resolve().parents[1]


def _qwen2_512() -> Any:
    from transformers import Qwen2Config

    from fsdp_compat.testing import zoo

    config = Qwen2Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    return zoo.Qwen2FusedLmHeadForCausalLM(config)


def _qwen2_512_batch(g: Any) -> dict[str, Any]:
    import torch

    ids = torch.randint(3, 8192, (1, 256), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


qwen2_512 = GuardModel(_qwen2_512, _qwen2_512_batch)


# ------------------------------------------------------------------------------------------------------ rank side


def _bench_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from lab.guard_models import apply_plan_without
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.policies import TRACKER, _install_instrumentation, _param_groups
    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.guard import ENV_GUARD, guard_of
    from fsdp_compat.testing.zoo import build_model, make_batch

    world = cfg["world_size"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    _install_instrumentation()
    mesh = init_device_mesh("cpu", (world,))
    name, leave = cfg["model"], cfg["leave"]
    batch = make_batch(name)
    live = []
    for label, policy, guard_on, without in VARIANTS:
        model = build_model(name)
        os.environ[ENV_GUARD] = "on" if guard_on else "off"
        kwargs = {"mesh": mesh, "reshard_after_forward": True}
        if without:
            apply_plan_without(model, kwargs, policy, leave)
        else:
            apply_fsdp2(model, kwargs, policy=policy)
        live.append(
            {
                "label": label,
                "model": model,
                "groups": _param_groups(model),
                "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
                "times": [],
            }
        )

    def step(item: dict[str, Any], measure: bool) -> float:
        t = time.perf_counter()
        if measure:
            TRACKER.start(item["groups"])
        loss = item["model"](**batch).loss
        TRACKER.stop()
        loss.backward()
        item["opt"].step()
        item["opt"].zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for kind in ["warmup"] * cfg["warmup"] + ["memory"] + ["timed"] * cfg["steps"]:
        for item in live:
            seconds = step(item, measure=kind == "memory")
            if kind == "memory":
                item["peak_unsharded"], item["all_gathers"] = TRACKER.peak, TRACKER.all_gathers
            elif kind == "timed":
                item["times"].append(seconds)
    rows = []
    for item in live:
        guard = guard_of(item["model"])
        rows.append(
            {
                "label": item["label"],
                "step_s": statistics.median(item["times"]),
                "peak_unsharded": item["peak_unsharded"],
                "all_gathers": item["all_gathers"],
                "guard": guard is not None,
                "guard_groups": [e.group for e in guard.events] if guard else [],
                "guard_bytes": sum(e.unsharded_bytes for e in guard.events) if guard else 0,
            }
        )
    extra["rows"] = rows
    dist.barrier()


# ---------------------------------------------------------------------------------------------------- parent side


def run_model(key: str, *, world_size: int, warmup: int, steps: int, timeout_s: float) -> dict[str, Any]:
    """One pair of ranks for ``key``: the four variants side by side; per variant the slowest rank's time."""
    from fsdp_compat.testing.launch import run_ranks

    model, leave = MODELS[key]
    cfg = {"model": model, "leave": leave, "warmup": warmup, "steps": steps}
    path = [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env = {"PYTHONPATH": os.pathsep.join(path), "FSDP_COMPAT": "off"}  # no start-up hooks: the core only
    result = run_ranks("benchmarks.guard:_bench_rank", cfg, world_size=world_size, timeout_s=timeout_s, env=env)
    if not result.ok:
        return {"model": key, "error": result.error}
    rows = result.ranks[0].extra["rows"]
    for index, row in enumerate(rows):
        row["step_s"] = max(r.extra["rows"][index]["step_s"] for r in result.ranks)
    return {"model": key, "rows": {row["label"]: row for row in rows}, "seconds": result.seconds}


def format_results(results: list[dict[str, Any]], *, world_size: int, steps: int) -> str:
    header = [
        "model",
        "variant",
        "step ms",
        "all-gathers/fwd",
        "peak unsharded (fwd)",
        "guard unsharded",
        "guarded group",
    ]
    detail = []
    ratios = []
    for res in results:
        if "error" in res:
            detail.append([res["model"], "FAILED", (res["error"] or "").splitlines()[-1][:80], "", "", "", ""])
            ratios.append([res["model"], "-", "-", "-", "-", "-"])
            continue
        rows = res["rows"]
        for label, row in rows.items():
            detail.append(
                [
                    res["model"],
                    label,
                    f"{row['step_s'] * 1e3:.1f}",
                    row["all_gathers"],
                    fmt_bytes(row["peak_unsharded"]),
                    fmt_bytes(row["guard_bytes"]) if row["guard"] else "-",
                    ", ".join(row["guard_groups"]) or "-",
                ]
            )
        idle = rows["safe, guard on"]["step_s"] / rows["safe, guard off"]["step_s"]
        copies = [rows["safe, guard off"]["step_s"], rows["safe, guard off (2nd copy)"]["step_s"]]
        legacy, recommended = rows["legacy, guard on"], rows["recommended, guard off"]
        ratios.append(
            [
                res["model"],
                f"{idle:.3f}x",
                "yes" if idle <= TARGET else "NO",
                f"{max(copies) / min(copies):.3f}x",
                fmt_ratio(legacy["step_s"], recommended["step_s"]),
                fmt_bytes(legacy["peak_unsharded"] - recommended["peak_unsharded"]),
            ]
        )
    ratio_header = [
        "model",
        "idle guard: step on/off (safe plan)",
        f"<= {TARGET:.2f}x",
        "noise: same plan twice",
        "legacy+guard / recommended: step",
        "peak unsharded (fwd): legacy+guard - recommended",
    ]
    return (
        f"Run-time guard on {world_size} gloo ranks (fp32; median of {steps} timed steps, round-robin in one run; "
        "bytes per rank)\n\n"
        f"{format_table(header, detail, right=(2, 3, 4, 5))}\n\n"
        f"{format_table(ratio_header, ratios, right=(1, 3, 4, 5))}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks guard", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per variant (median reported)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model")
    args = parser.parse_args(argv)
    results = []
    for key in args.models.split(","):
        if key not in MODELS:
            parser.error(f"unknown model {key!r}; choose from {', '.join(MODELS)}")
        results.append(
            run_model(key, world_size=args.world_size, warmup=args.warmup, steps=args.steps, timeout_s=args.timeout)
        )
    print(format_results(results, world_size=args.world_size, steps=args.steps), flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
