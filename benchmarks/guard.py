"""The run-time guard's cost: step time with and without it, and the memory of a group it had to unshard.

``python -m benchmarks guard [--parts plans,cost] [--models glm4v,qwen2-512] [--warmup 2] [--steps 15]
[--world-size 2] [--cost-models qwen2-8x256,qwen2-4x1024] [--repeats 7] [--threads 0]``

Two parts, one after the other in one run (``--parts`` picks).

**cost** (1 gloo rank per model, ``apply_fsdp2`` with the default policy, fp32): what the guard costs on a plan that
needs none, as ``apply_fsdp2`` installs it now, and what its per-op check costs where it is armed, predicted and
measured side by side. ``apply_fsdp2`` installs the guard disarmed where the policy's analysis made the plan (the
default ``auto``): the per-op check runs only where fsdp-compat's check cannot rule a sharded read out.

- four copies of the model built from one seed: ``off`` (``FSDP_COMPAT_GUARD=off``: no guard), ``default`` (what
  ``apply_fsdp2`` installs with nothing set; the table shows its ``armed`` as installed and after the run),
  ``armed`` (the default copy with ``guard_of(model).armed = True``) and ``off (2nd copy)`` (the same work as
  ``off``: its ratio to ``off`` is the run's noise floor), each with its own AdamW, stepped
  interleaved: each repeat runs every copy (order rotated per repeat) for ``steps per repeat`` steps and keeps the
  fastest (the 2 cores are shared: a step another job slowed down says nothing about the guard). Every step times
  forward + backward and then the whole step with AdamW, as wall time and as the process's CPU time; per copy the
  median and min-max over the repeats, per ratio the median and min-max of the per-repeat ratios. The bar:
  ``default``/``off`` <= 1.02x the step. The copies' losses must be equal at the last step (the guard changes no
  number);
- per-op cost: ns per call of a cheap op (``torch.add`` of two 4-element tensors, N calls in a loop) with no mode,
  with an empty pass-through ``TorchFunctionMode`` (the floor of any mode-based check) and with the guard's own mode
  (its sharded-parameter index filled by a real forward); "guard - none" is the armed guard's cost per op;
- ops per step: a counting ``TorchFunctionMode`` entered exactly where the guard enters its mode (the root's
  forward, hooks registered after ``apply_fsdp2``), and, for reference, over the whole forward + backward;
- predicted overhead of the armed guard = per-op cost x ops in the guard's window, as ms and as a ratio of the
  guard-off forward + backward.

**plans** (the earlier part, 2 gloo ranks): per model, one pair of ranks holds five wrapped copies side by side and
steps them round-robin, so every ratio comes from one run under the same machine load:

- ``safe, guard off`` / ``safe, guard on``: a plan with nothing to fix (``input-only``); the guard is installed
  as ``apply_fsdp2`` installs it for that policy (armed: ``input-only`` skips fsdp-compat's analysis), so the
  ratio is the armed per-op check's overhead where nothing needs it (the ``cost`` part measures the default
  policy, where it is disarmed). ``safe, guard off (2nd copy)`` repeats the first copy: the ratio of the two is the
  run's noise floor.
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
# guard not installed (FSDP_COMPAT_GUARD=off) / as apply_fsdp2 installs it (nothing set) / that, per-op check forced
# on / off again (the same work as off: its ratio to off is the run's noise floor)
COST_VARIANTS = ("off", "default", "armed", "off (2nd copy)")
# what each timed step records (the fastest of k per repeat): wall and CPU of forward + backward, and of the whole
# step with AdamW
SAMPLE_KEYS = ("fwd+bwd wall", "fwd+bwd CPU", "step wall", "step CPU")
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


def _cost_copies(spec: dict[str, int], mesh: Any) -> dict[str, Any]:
    """One copy per :data:`COST_VARIANTS` from one seed, each through ``apply_fsdp2`` as a user calls it."""
    import torch

    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.runtime.guard import ENV_GUARD, guard_of

    copies: dict[str, Any] = {}
    for variant in COST_VARIANTS:
        torch.manual_seed(0)  # the same weights in every copy
        model = qwen2_of(spec)
        if variant.startswith("off"):
            os.environ[ENV_GUARD] = "off"
        else:
            os.environ.pop(ENV_GUARD, None)  # the default: what apply_fsdp2 installs when nothing is set
        apply_fsdp2(model, {"mesh": mesh})
        guard = guard_of(model)
        assert (guard is None) == variant.startswith("off"), variant  # off: not installed at all
        installed = None if guard is None else guard.armed
        if variant == "armed":
            guard.armed = True  # type: ignore[union-attr]  # the per-op check forced on: what it costs where it runs
        copies[variant] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4),
                           "installed_armed": installed}  # fmt: skip
    return copies


def _train_step(copy: dict[str, Any], batch: dict[str, Any]) -> tuple[float, float, float, float, Any]:
    """Forward + backward, then AdamW: (wall, CPU) of forward + backward, (wall, CPU) of the whole step, the loss.
    CPU time is the process's (every thread): a slice another job took is not counted."""
    t, c = time.perf_counter(), time.process_time()
    loss = copy["model"](**batch).loss
    loss.backward()
    wall_fb, cpu_fb = time.perf_counter() - t, time.process_time() - c
    copy["opt"].step()
    copy["opt"].zero_grad(set_to_none=True)
    return wall_fb, cpu_fb, time.perf_counter() - t, time.process_time() - c, loss.detach()


def _count_ops(model: Any, batch: dict[str, Any]) -> tuple[int, int]:
    """Torch-function calls of one forward + backward (no optimizer step: the copies stay in step): in the guard's
    window (a counting mode entered by hooks registered after ``apply_fsdp2``, where the guard enters its own) and
    over the whole forward + backward."""
    window = _counting_mode()

    def enter(*_: Any) -> None:  # a hook that returned the mode would replace the forward's input
        window.__enter__()

    def leave(*_: Any) -> None:
        window.__exit__(None, None, None)

    def probe() -> None:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    probe()
    for handle in handles:
        handle.remove()
    whole = _counting_mode()
    with whole:
        probe()
    return window.calls, whole.calls


def _interleaved(copies: dict[str, Any], batch: dict[str, Any], repeats: int, k: int) -> dict[str, Any]:
    """Every repeat steps every copy k times, in an order rotated per repeat; per copy, clock and part the fastest
    of the k steps (the machine is shared: a step another job slowed is not the guard's)."""
    samples = {key: {v: [] for v in copies} for key in SAMPLE_KEYS}
    losses: dict[str, Any] = {}
    order = list(copies)
    for index in range(repeats):
        for variant in order[index % len(order) :] + order[: index % len(order)]:
            steps = [_train_step(copies[variant], batch) for _ in range(k)]
            for position, key in enumerate(SAMPLE_KEYS):
                samples[key][variant].append(min(s[position] for s in steps))
            losses[variant] = steps[-1][-1]
    return {"samples": samples, "losses": losses}


def _armed_now(model: Any) -> bool | None:
    """Whether ``model``'s guard runs its per-op check now (None: no guard)."""
    from fsdp_compat.runtime.guard import guard_of

    guard = guard_of(model)
    return None if guard is None else guard.armed


def _cost_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """One model, one rank: count the ops, time the per-op cost, then step the copies interleaved."""

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.runtime.guard import guard_of

    world = join_cpu_group(cfg, rank, threads=cfg["threads"])
    extra["threads"] = torch.get_num_threads()
    mesh = init_device_mesh("cpu", (world,))
    spec = cfg["spec"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec["vocab"], (1, spec["tokens"]), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    copies = _cost_copies(spec, mesh)
    extra["params"] = sum(p.numel() for p in copies["off"]["model"].parameters())
    for _ in range(cfg["warmup"]):  # lazy init, the guard's first pass (where armed=None is decided)
        for copy in copies.values():
            _train_step(copy, batch)
    extra["ops_window"], extra["ops_step"] = _count_ops(copies["off"]["model"], batch)

    # Per-op cost; the guard's mode as a forward leaves it (its index of sharded parameters filled).
    guard_mode = guard_of(copies["armed"]["model"])._mode  # type: ignore[union-attr]
    assert len(guard_mode.keys) > 0, "the armed guard's mode saw no sharded parameter"
    micro = {"none": None, "empty mode": _passthrough_mode(), "guard mode": guard_mode}
    extra["per_op_ns"] = _per_op_ns(micro, cfg["micro_calls"], cfg["micro_repeats"])

    timed = _interleaved(copies, batch, cfg["repeats"], spec["steps"])
    extra["samples"] = timed["samples"]
    # every copy made the same AdamW steps on the same batch: the guard changes no number
    extra["same_loss"] = all(torch.equal(timed["losses"]["off"], loss) for loss in timed["losses"].values())
    extra["armed"] = {v: (c["installed_armed"], _armed_now(c["model"])) for v, c in copies.items()}
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


def _ratios(samples: dict[str, dict[str, list[float]]], key: str, variant: str) -> list[float]:
    """Per-repeat ratios ``variant``/off of one sample key (each repeat's copies ran back to back)."""
    return [v / o for v, o in zip(samples[key][variant], samples[key]["off"], strict=True)]


def _armed_label(armed: tuple[bool | None, bool | None]) -> str:
    """``as installed -> after the run`` of a copy's guard (None: not armed yet, decided at the first pass)."""
    installed, now = armed
    if now is None and installed is None:
        return "no guard"
    return f"{installed} -> {now}" if installed != now else str(now)


def _cost_rows(res: dict[str, Any]) -> tuple[list[Any], list[list[Any]], list[list[Any]], list[Any]]:
    """One model's rows: prediction, per copy, per ratio, per-op detail."""
    spec, samples, ns = COST_MODELS[res["model"]], res["samples"], res["per_op_ns"]
    per_op = statistics.median(ns["guard mode"]) - statistics.median(ns["none"])
    predicted_s = per_op * res["ops_window"] * 1e-9
    off_cpu = statistics.median(samples["fwd+bwd CPU"]["off"])
    prediction = [res["model"], f"{res['params'] / 1e6:.1f}M", spec["tokens"], res["ops_window"], res["ops_step"],
                  f"{per_op:.0f}", f"{predicted_s * 1e3:.1f}", f"{(off_cpu + predicted_s) / off_cpu:.3f}x"]  # fmt: skip
    copies = []
    for variant in COST_VARIANTS:
        times = [_spread(samples[key][variant], 1e3) for key in SAMPLE_KEYS]
        copies.append([res["model"], variant, _armed_label(res["armed"][variant]), *times])
    ratios = []
    for variant in COST_VARIANTS[1:]:
        cells = [_spread(_ratios(samples, key, variant), digits=3) for key in SAMPLE_KEYS]
        step = [statistics.median(_ratios(samples, key, variant)) for key in ("step wall", "step CPU")]
        verdict = "; ".join("yes" if r <= TARGET else "NO" for r in step) if variant == "default" else ""
        ratios.append([res["model"], f"{variant}/off", *cells, verdict])
    micro = [res["model"], *(_spread(ns[k], digits=0) for k in ("none", "empty mode", "guard mode")),
             f"{statistics.median(ns['empty mode']) - statistics.median(ns['none']):.0f}", f"{per_op:.0f}"]  # fmt: skip
    return prediction, copies, ratios, micro


def format_cost(results: list[dict[str, Any]], *, repeats: int) -> str:
    """The cost part: the copies as installed, the measured ratios (the bar: default/off), then the armed guard's
    predicted cost (per-op cost x ops) and the per-op detail."""
    predictions, copies, ratios, micro = [], [], [], []
    for res in results:
        if "error" in res:
            copies.append([res["model"], "FAILED", (res["error"] or "").splitlines()[-1][:80], *[""] * 4])
            continue
        prediction, model_copies, model_ratios, model_micro = _cost_rows(res)
        predictions.append(prediction)
        copies.extend(model_copies)
        ratios.extend(model_ratios)
        micro.append(model_micro)
        ratios.append([res["model"], "same loss, last step", *[""] * 4, "yes" if res["same_loss"] else "NO"])
    steps = ", ".join(f"{k} {v['steps']}" for k, v in COST_MODELS.items() if k in {r["model"] for r in results})
    threads = sorted({r["threads"] for r in results if "threads" in r})
    copy_header = ["model", "copy", "armed (installed -> after run)", *(f"{k} ms" for k in SAMPLE_KEYS)]
    ratio_header = ["model", "ratio", *SAMPLE_KEYS, f"default/off step <= {TARGET:.2f}x (wall; CPU)"]
    prediction_header = ["model", "params", "tokens", "ops/fwd (guard window)", "ops/fwd+bwd (all)", "guard ns/op",
                         "predicted +ms (armed)", "predicted armed/off (fwd+bwd CPU)"]  # fmt: skip
    micro_header = ["model (rank)", "no mode ns", "empty mode ns", "guard mode ns", "empty - none", "guard - none"]
    return (
        f"Run-time guard cost on 1 gloo rank, {'/'.join(map(str, threads)) or '?'} torch thread(s) (apply_fsdp2, "
        "default policy, fp32). Copies from one seed: off = FSDP_COMPAT_GUARD=off (no guard); default = as "
        "apply_fsdp2 installs it with nothing set; armed = default with guard.armed = True; off (2nd copy) = off "
        "again, the noise floor. ms: median (min-max) over "
        f"{repeats} interleaved repeats of the fastest of k steps (k: {steps}); ratios: median (min-max) of the "
        "per-repeat ratios; step = forward + backward + AdamW; CPU = the process's CPU time\n\n"
        f"{format_table(copy_header, copies, right=(3, 4, 5, 6))}\n\n"
        f"{format_table(ratio_header, ratios, right=(2, 3, 4, 5))}\n\n"
        "The armed guard, predicted: guard ns per op x torch-function calls in its window\n\n"
        f"{format_table(prediction_header, predictions, right=tuple(range(1, 8)))}\n\n"
        f"Per-op cost: CPU ns per call of torch.add on two 4-element tensors, {MICRO_CALLS} calls, median (min-max) of "
        f"{MICRO_REPEATS} interleaved timings\n\n"
        f"{format_table(micro_header, micro, right=(1, 2, 3, 4, 5))}"
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
