"""The run-time guard's cost: step time with and without it, and the memory of a group it had to unshard.

``python -m benchmarks guard [--parts plans,cost] [--models glm4v,qwen2-512] [--warmup 2] [--steps 15]
[--world-size 2] [--cost-models qwen2-8x256,qwen2-4x1024] [--repeats 7] [--threads 0]``

Two parts, one after the other in one run (``--parts`` picks).

**cost** (1 gloo rank per model, ``apply_fsdp2`` with the default plan, fp32): why the armed guard costs what it
costs, predicted and measured side by side. The generic layer installs the guard on every FSDP2 root, so its
per-op cost becomes everyone's:

- per-op cost: ns per call of a cheap op (``torch.add`` of two 4-element tensors, N calls in a loop) with no mode,
  with an empty pass-through ``TorchFunctionMode`` (the floor of any mode-based check) and with the guard's own mode
  (its sharded-parameter index filled by a real forward); "guard - none" is the armed guard's cost per op;
- ops per step: a counting ``TorchFunctionMode`` entered exactly where the guard enters its mode (the root's
  forward, hooks registered after ``apply_fsdp2``), and, for reference, over the whole forward + backward;
- predicted overhead = per-op cost x ops in the guard's window, as ms and as a ratio of the guard-off step;
- measured: three copies of the model built from one seed (guard off = not installed; armed; installed and
  disarmed via ``guard_of(model).armed = False``) stepped interleaved: each repeat runs every copy (order rotated
  per repeat) for ``steps per repeat`` forward + backward passes and keeps the fastest (the 2 cores are shared: a
  step another job slowed down says nothing about the guard); per copy the median and min-max over the repeats,
  per ratio the median and min-max of the per-repeat ratios (each repeat's copies ran back to back).
  A step here is forward + backward (no optimizer step: the guard acts in the forward only, so this ratio bounds a
  full training step's from above); the three copies' losses must be equal (the guard changes no number).

**plans** (the earlier part, 2 gloo ranks): per model, one pair of ranks holds five wrapped copies side by side and
steps them round-robin, so every ratio comes from one run under the same machine load:

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

from benchmarks import fmt_bytes, fmt_ratio, format_table, join_cpu_group, qwen2_of

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

# The cost part's models: Qwen2ForCausalLM from an in-process config (no download), untied, default attention.
# steps: forward + backward passes per copy per repeat, the fastest counts (about 0.3-1 s per copy and repeat here).
COST_MODELS: dict[str, dict[str, int]] = {
    "qwen2-8x256": {"layers": 8, "hidden": 256, "intermediate": 704, "heads": 4, "kv_heads": 2, "vocab": 8192,
                    "tokens": 128, "steps": 4},
    "qwen2-4x1024": {"layers": 4, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "vocab": 8192,
                     "tokens": 256, "steps": 2},
}  # fmt: skip
COST_VARIANTS = ("off", "armed", "disarmed")  # guard not installed / installed and armed / installed, disarmed
MICRO_CALLS = 20_000  # calls of the cheap op per timing of the per-op microbenchmark
MICRO_REPEATS = 7


# ------------------------------------------------------------------------------------------------------ rank side


def _bench_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:

    import torch
    import torch.distributed as dist
    from lab.guard_models import apply_plan_without
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.policies import TRACKER, _install_instrumentation, _param_groups
    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.runtime.guard import ENV_GUARD, guard_of
    from fsdp_compat.testing.zoo import build_model, make_batch

    world = join_cpu_group(cfg, rank)
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


def _counting_mode() -> Any:
    """A ``TorchFunctionMode`` that counts the calls it sees (what the guard's mode would check) and runs them."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            self.calls += 1
            return func(*args, **(kwargs or {}))

    return Counting()


def _passthrough_mode() -> Any:
    """An empty ``TorchFunctionMode``: the floor any per-op check built on a mode pays, before its own test."""
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            return func(*args, **kwargs) if kwargs else func(*args)

    return Passthrough()


def _per_op_ns(modes: dict[str, Any], calls: int, repeats: int) -> dict[str, list[float]]:
    """ns per call of ``torch.add`` on two 4-element tensors under each mode (None: no mode), interleaved."""
    import contextlib

    import torch

    a, b, add = torch.ones(4), torch.ones(4), torch.add
    out: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(repeats):
        for name, mode in modes.items():
            with mode if mode is not None else contextlib.nullcontext():
                t = time.thread_time_ns()  # CPU time of this thread: a slice another job took is not counted
                for _ in range(calls):
                    add(a, b)
                out[name].append((time.thread_time_ns() - t) / calls)
    return out


def _cost_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """One model, one rank: count the ops, time the per-op cost, then step the three copies interleaved."""

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.runtime.guard import ENV_GUARD, guard_of

    world = join_cpu_group(cfg, rank, threads=cfg["threads"])
    extra["threads"] = torch.get_num_threads()
    mesh = init_device_mesh("cpu", (world,))
    spec = cfg["spec"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec["vocab"], (1, spec["tokens"]), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    models: dict[str, Any] = {}
    for variant in COST_VARIANTS:
        torch.manual_seed(0)  # the same weights in every copy
        model = qwen2_of(spec)
        os.environ[ENV_GUARD] = "off" if variant == "off" else "on"
        apply_fsdp2(model, {"mesh": mesh})
        guard = guard_of(model)
        assert (guard is not None) == (variant != "off"), variant  # off: not installed at all
        if guard is not None:
            assert guard.armed, "apply_fsdp2 installs the guard armed"
            guard.armed = variant == "armed"
        models[variant] = model
    extra["params"] = sum(p.numel() for p in models["off"].parameters())

    def step(model: Any) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    # Warm-up (lazy init, the guard's group discovery); the guard must change no number.
    losses = {}
    for _ in range(cfg["warmup"]):
        for variant, model in models.items():
            losses[variant] = step(model)
    extra["same_loss"] = all(torch.equal(losses["off"], loss) for loss in losses.values())

    # Ops per step, on the guard-off copy: in the guard's window (hooks placed as install_guard places its own,
    # after apply_fsdp2) and over the whole forward + backward.
    window = _counting_mode()
    root = models["off"]

    def enter(*_: Any) -> None:  # a hook that returned the mode would replace the forward's input
        window.__enter__()

    def leave(*_: Any) -> None:
        window.__exit__(None, None, None)

    handles = [root.register_forward_pre_hook(enter), root.register_forward_hook(leave, always_call=True)]
    step(root)
    for handle in handles:
        handle.remove()
    whole = _counting_mode()
    with whole:
        step(root)
    extra["ops_window"], extra["ops_step"] = window.calls, whole.calls

    # Per-op cost; the guard's mode as a forward leaves it (its index of sharded parameters filled).
    guard_mode = guard_of(models["armed"])._mode  # type: ignore[union-attr]
    assert len(guard_mode.keys) > 0, "the armed guard's mode saw no sharded parameter"
    micro = {"none": None, "empty mode": _passthrough_mode(), "guard mode": guard_mode}
    extra["per_op_ns"] = _per_op_ns(micro, cfg["micro_calls"], cfg["micro_repeats"])

    # Interleaved timing: every repeat steps every copy, in an order rotated per repeat.
    # Wall time, and CPU time of the process (every thread): on a shared machine the wall clock also counts the
    # slices other jobs took; the CPU time counts only this process's work (with 1 thread, no spinning workers).
    times: dict[str, list[float]] = {v: [] for v in COST_VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in COST_VARIANTS}
    order = list(COST_VARIANTS)
    for index in range(cfg["repeats"]):
        for variant in order[index % len(order) :] + order[: index % len(order)]:
            walls, cpus = [], []
            for _ in range(spec["steps"]):
                t, c = time.perf_counter(), time.process_time()
                step(models[variant])
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
            times[variant].append(min(walls))  # the machine is shared: a step another job slowed is not the guard's
            cpu[variant].append(min(cpus))
    extra["times"], extra["cpu"] = times, cpu
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


def run_cost_model(key: str, *, warmup: int, repeats: int, threads: int, timeout_s: float) -> dict[str, Any]:
    """One fresh rank for ``key``: ops per step, per-op cost and the interleaved step times (see the docstring)."""
    from fsdp_compat.testing.launch import run_ranks

    cfg = {
        "spec": COST_MODELS[key],
        "warmup": warmup,
        "repeats": repeats,
        "threads": threads,
        "micro_calls": MICRO_CALLS,
        "micro_repeats": MICRO_REPEATS,
    }
    path = [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env = {"PYTHONPATH": os.pathsep.join(path), "FSDP_COMPAT": "off"}  # no start-up hooks: the core only
    result = run_ranks("benchmarks.guard:_cost_rank", cfg, world_size=1, timeout_s=timeout_s, env=env)
    if not result.ok:
        return {"model": key, "error": result.error}
    return {"model": key, **result.ranks[0].extra, "seconds": result.seconds}


def _spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """``median (min-max)`` of ``values`` times ``scale``."""
    med, lo, hi = (f"{v * scale:.{digits}f}" for v in (statistics.median(values), min(values), max(values)))
    return f"{med} ({lo}-{hi})"


def format_cost(results: list[dict[str, Any]], *, repeats: int) -> str:
    """The cost part: predicted (per-op cost x ops) and measured overhead side by side, then the per-op detail."""
    header = [
        "model",
        "params",
        "tokens",
        "ops/fwd (guard window)",
        "ops/fwd+bwd (all)",
        "guard ns/op",
        "predicted +ms",
        "predicted armed/off (wall; CPU)",
        "off ms",
        "armed ms",
        "disarmed ms",
        "measured armed/off",
        "measured disarmed/off",
        "CPU s armed/off",
        "CPU s disarmed/off",
        "same loss",
    ]
    rows, micro_rows = [], []
    for res in results:
        if "error" in res:
            rows.append([res["model"], "FAILED", (res["error"] or "").splitlines()[-1][:80], *[""] * 13])
            continue
        spec, times, cpu, ns = COST_MODELS[res["model"]], res["times"], res["cpu"], res["per_op_ns"]
        per_op = statistics.median(ns["guard mode"]) - statistics.median(ns["none"])
        predicted_s = per_op * res["ops_window"] * 1e-9
        off, off_cpu = statistics.median(times["off"]), statistics.median(cpu["off"])
        armed = [a / o for a, o in zip(times["armed"], times["off"], strict=True)]
        disarmed = [d / o for d, o in zip(times["disarmed"], times["off"], strict=True)]
        armed_cpu = [a / o for a, o in zip(cpu["armed"], cpu["off"], strict=True)]
        disarmed_cpu = [d / o for d, o in zip(cpu["disarmed"], cpu["off"], strict=True)]
        rows.append(
            [
                res["model"],
                f"{res['params'] / 1e6:.1f}M",
                spec["tokens"],
                res["ops_window"],
                res["ops_step"],
                f"{per_op:.0f}",
                f"{predicted_s * 1e3:.1f}",
                f"{(off + predicted_s) / off:.3f}x; {(off_cpu + predicted_s) / off_cpu:.3f}x",
                _spread(times["off"], 1e3),
                _spread(times["armed"], 1e3),
                _spread(times["disarmed"], 1e3),
                _spread(armed, digits=3),
                _spread(disarmed, digits=3),
                _spread(armed_cpu, digits=3),
                _spread(disarmed_cpu, digits=3),
                "yes" if res["same_loss"] else "NO",
            ]
        )
        micro_rows.append(
            [
                res["model"],
                _spread(ns["none"], digits=0),
                _spread(ns["empty mode"], digits=0),
                _spread(ns["guard mode"], digits=0),
                f"{statistics.median(ns['empty mode']) - statistics.median(ns['none']):.0f}",
                f"{per_op:.0f}",
            ]
        )
    micro_header = ["model (rank)", "no mode ns", "empty mode ns", "guard mode ns", "empty - none", "guard - none"]
    steps = ", ".join(f"{k} {v['steps']}" for k, v in COST_MODELS.items() if k in {r["model"] for r in results})
    threads = sorted({r["threads"] for r in results if "threads" in r})
    return (
        f"Armed guard cost on 1 gloo rank, {'/'.join(map(str, threads)) or '?'} torch thread(s) (apply_fsdp2 default "
        "plan, fp32; step = forward + backward; ms: median "
        f"(min-max) over {repeats} interleaved repeats of the fastest of k steps (k: {steps}); ratios: median "
        "(min-max) of the per-repeat ratios, of wall time and of the process's CPU time)\n\n"
        f"{format_table(header, rows, right=tuple(range(1, 15)))}\n\n"
        f"Per-op cost: CPU ns per call of torch.add on two 4-element tensors, {MICRO_CALLS} calls, median (min-max) of "
        f"{MICRO_REPEATS} interleaved timings\n\n"
        f"{format_table(micro_header, micro_rows, right=(1, 2, 3, 4, 5))}"
    )


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
    parser.add_argument("--parts", default="plans,cost", help="comma-separated, from plans, cost")
    parser.add_argument("--models", default=",".join(MODELS), help=f"plans: comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="plans: timed steps per variant (median reported)")
    parser.add_argument("--world-size", type=int, default=2, help="plans: gloo ranks (the cost part runs 1)")
    parser.add_argument(
        "--cost-models", default=",".join(COST_MODELS), help=f"cost: comma-separated, from {', '.join(COST_MODELS)}"
    )
    parser.add_argument("--repeats", type=int, default=7, help="cost: interleaved repeats (>= 5)")
    parser.add_argument("--threads", type=int, default=0, help="cost: torch intra-op threads (0: every core)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or any(part not in ("plans", "cost") for part in parts):
        parser.error(f"--parts: choose from plans, cost, not {args.parts!r}")
    if args.repeats < 5:
        parser.error("--repeats: at least 5 (a median and a spread)")
    for option, keys, known in (("--models", args.models, MODELS), ("--cost-models", args.cost_models, COST_MODELS)):
        unknown = [key for key in keys.split(",") if key not in known]
        if unknown:
            parser.error(f"{option}: unknown model(s) {unknown}; choose from {', '.join(known)}")
    ok = True
    if "plans" in parts:
        results = [
            run_model(key, world_size=args.world_size, warmup=args.warmup, steps=args.steps, timeout_s=args.timeout)
            for key in args.models.split(",")
        ]
        print(format_results(results, world_size=args.world_size, steps=args.steps), flush=True)
        ok = ok and all("error" not in r for r in results)
    if "cost" in parts:
        if "plans" in parts:
            print(flush=True)
        costs = [
            run_cost_model(key, warmup=args.warmup, repeats=args.repeats, threads=args.threads, timeout_s=args.timeout)
            for key in args.cost_models.split(",")
        ]
        print(format_cost(costs, repeats=args.repeats), flush=True)
        ok = ok and all("error" not in r and r["same_loss"] for r in costs)
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
