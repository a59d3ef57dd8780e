"""Every zoo model under every wrap policy on 2 gloo ranks: does it run, how fast, how much unsharded memory.

``python -m benchmarks.policies [--models a,b] [--warmup 1] [--steps 5] [--world-size 2]``

Why a runner of its own instead of :func:`fsdp_compat.testing.parity.run_training`: the harness trains a
single-process reference next to the FSDP model (parity, not speed) and starts 2 fresh interpreters per
(model, policy) pair. Here each model gets one pair of ranks that holds one wrapped copy *per policy* and steps
them round-robin (policy A step 1, policy B step 1, ...), so the policies of one model see the same machine load
and their ratio columns come from one run (this machine's 2 cores are shared).

Peak unsharded parameter bytes are measured from FSDP2 itself: in the rank, ``FSDPParamGroup.unshard``,
``wait_for_unshard`` and ``reshard`` (torch 2.13: ``torch.distributed.fsdp._fully_shard._fsdp_param_group``) are
wrapped; after each call the rank sums, over every ``FSDPParam`` of the model, the bytes of storage actually
allocated for its unsharded data (``FSDPParam.all_gather_outputs``, freed to 0 bytes by FSDP2 on reshard), and
keeps the maximum seen during the forward ("unsharded params"). "unsharded + AG buffers" also counts the flat
all-gather buffers alive at that moment (``FSDPParamGroup._all_gather_result`` and the one FSDP2 keeps in
``comm_ctx.all_gather_state`` until the next group's copy-out); "peak/rank (measured)" = resident + that, where
resident is the sum of the padded local shards (``FSDPParam._sharded_param_data``), which FSDP2 keeps while the
unsharded copy exists. All-gathers per forward count calls of ``foreach_all_gather``. The memory step is an extra,
untimed step; the timed steps run with the wrappers switched off. Targets are judged on the measured peak and
the median step time; policies that produced the very same plan give the machine's noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import POLICY_ORDER, fmt_bytes, fmt_ratio, format_table, fsdp2_unsharded_estimate
from fsdp_compat.testing.launch import _free_port, _kill_group, spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
TIME_TOLERANCE = 0.02  # the target: auto within 2 % of the fastest crash-free policy

# ---------------------------------------------------------------------------------------------------------------
# Rank side: FSDP2 instrumentation


class _Tracker:
    """Samples the unsharded parameter bytes of one model's FSDP2 groups after every unshard/reshard."""

    def __init__(self) -> None:
        self.enabled = False
        self.groups: list[Any] = []
        self.peak = 0
        self.peak_with_buffers = 0
        self.peak_groups: list[str] = []
        self.all_gathers = 0

    def start(self, groups: list[Any]) -> None:
        self.groups, self.peak, self.peak_with_buffers, self.peak_groups, self.all_gathers = groups, 0, 0, [], 0
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False

    def sample(self) -> None:
        if not self.enabled:
            return
        total, buffers, live, seen = 0, 0, [], set()
        for group in self.groups:
            nbytes = 0
            for fsdp_param in group.fsdp_params:
                for tensor in fsdp_param.all_gather_outputs:
                    storage = tensor.untyped_storage()
                    if storage.nbytes() and storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        nbytes += storage.nbytes()
            if nbytes:
                live.append(group._module_fqn or "<root>")
            total += nbytes
            pending = getattr(group, "_all_gather_result", None)
            if pending is not None:
                buffers += pending.all_gather_output.untyped_storage().nbytes()
        state = getattr(self.groups[0].comm_ctx, "all_gather_state", None) if self.groups else None
        if state is not None:
            buffers += state.all_gather_result.all_gather_output.untyped_storage().nbytes()
        if total > self.peak:
            self.peak, self.peak_groups = total, live
        self.peak_with_buffers = max(self.peak_with_buffers, total + buffers)


TRACKER = _Tracker()


def _install_instrumentation() -> None:
    """Wrap the FSDP2 group methods that allocate and free unsharded parameters (this process only)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    def after(method: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)
            TRACKER.sample()
            return result

        return wrapper

    for name in ("unshard", "wait_for_unshard", "reshard"):
        setattr(pg.FSDPParamGroup, name, after(getattr(pg.FSDPParamGroup, name)))
    original_all_gather = pg.foreach_all_gather

    def counting_all_gather(*args: Any, **kwargs: Any) -> Any:
        if TRACKER.enabled:
            TRACKER.all_gathers += 1
        return original_all_gather(*args, **kwargs)

    pg.foreach_all_gather = counting_all_gather


def _param_groups(model: Any) -> list[Any]:
    """Every FSDPParamGroup of ``model`` (each ``fully_shard`` call, the root included), de-duplicated."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    groups: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = fully_shard.state(module)
            found = getattr(state, "_fsdp_param_groups", None)
            if found is None:  # torch < 2.11: one group per state
                found = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
            for group in found:
                groups[id(group)] = group
    return list(groups.values())


def _resident_bytes(groups: list[Any]) -> int:
    return sum(p._sharded_param_data.untyped_storage().nbytes() for g in groups for p in g.fsdp_params)


def _first_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _rank_main() -> None:
    """Entry point of one rank: ``python -c ... WORKDIR RANK``; writes rankN.json after every phase."""
    work, rank = Path(sys.argv[1]), int(sys.argv[2])
    cfg = json.loads((work / "config.json").read_text())
    out = work / f"rank{rank}.json"
    report: dict[str, Any] = {"rank": rank, "entries": [], "error": None}

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, default=str))
        tmp.replace(out)

    try:
        _run_rank(cfg, rank, report, save)
    except BaseException:
        report["error"] = traceback.format_exc()
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report["error"] is None else 1)


def _run_rank(cfg: dict[str, Any], rank: int, report: dict[str, Any], save: Any) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.apply import apply_fsdp2
    from fsdp_compat.plan import plan_wrap, unsafe_reads
    from fsdp_compat.testing.zoo import build_model, make_batch

    world = cfg["world_size"]
    device = cfg.get("device", "cpu")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    _install_instrumentation()
    mesh = init_device_mesh(device, (world,))
    name = cfg["model"]
    batch = make_batch(name, seed=0, device=device)
    live: list[dict[str, Any]] = []
    for policy in cfg["policies"]:
        entry: dict[str, Any] = {"policy": policy, "outcome": "ok", "error": None, "times": []}
        report["entries"].append(entry)
        model = build_model(name, seed=0, device=device)
        try:
            plan = plan_wrap(model, policy=policy)
            entry["predicted"] = unsafe_reads(model, plan)
            t0 = time.perf_counter()
            plan = apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, policy=policy)
            entry["wrap_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as exc:
            entry.update(outcome="crash", error=_first_line(exc), phase="wrap")
            continue
        groups = _param_groups(model)
        entry.update(
            groups=len(plan.groups) + (1 if plan.root_bytes else 0),
            plan_key=[[list(g.paths), sorted(g.overrides.items())] for g in plan.groups],
            fsdp_param_groups=len(groups),
            total_bytes=plan.total_bytes,
            root_bytes=plan.root_bytes,
            plan_unsharded=plan.per_rank_bytes(world)["peak_forward"] - plan.per_rank_bytes(world)["resident"],
            model_unsharded=fsdp2_unsharded_estimate(plan),
            plan_peak=plan.per_rank_bytes(world)["peak_forward"],
            plan_resident=plan.per_rank_bytes(world)["resident"],
            resident=_resident_bytes(groups),
        )
        live.append(
            {"entry": entry, "model": model, "groups": groups, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3)}
        )
    save()

    def step(item: dict[str, Any], measure: bool) -> float:
        model, opt = item["model"], item["opt"]
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        if measure:
            TRACKER.start(item["groups"])
        loss = model(**batch).loss
        TRACKER.stop()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            if measure:  # CUDA peak of this policy's step above what was allocated before it (all policies' models)
                item["entry"]["cuda_peak_step"] = torch.cuda.max_memory_allocated() - before
        return time.perf_counter() - t

    # Warm-up (a crash shows here), then the untimed memory step, then the timed steps, round-robin.
    plan_steps = ["warmup"] * cfg["warmup"] + ["memory"] + ["timed"] * cfg["steps"]
    for kind in plan_steps:
        for item in list(live):
            entry = item["entry"]
            try:
                seconds = step(item, measure=kind == "memory")
            except Exception as exc:
                TRACKER.stop()
                entry.update(outcome="crash", error=_first_line(exc), phase=kind)
                live.remove(item)
                continue
            if kind == "memory":
                entry.update(
                    peak_unsharded=TRACKER.peak,
                    peak_unsharded_buffers=TRACKER.peak_with_buffers,
                    peak_groups=TRACKER.peak_groups,
                    all_gathers=TRACKER.all_gathers,
                    peak=entry["resident"] + TRACKER.peak_with_buffers,
                )
            elif kind == "timed":
                entry["times"].append(seconds)
        save()
    for item in live:
        item["entry"]["step_s"] = statistics.median(item["entry"]["times"])
        item["entry"]["step_min_s"] = min(item["entry"]["times"])
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Parent side


def run_model(
    model: str,
    policies: tuple[str, ...],
    *,
    world_size: int = 2,
    warmup: int = 1,
    steps: int = 5,
    timeout_s: float = 240.0,
    device: str = "cpu",
) -> dict[str, Any]:
    """One pair of ranks for ``model``: every policy wrapped side by side; returns the merged per-policy figures."""
    cfg = {
        "device": device,
        "model": model,
        "policies": list(policies),
        "world_size": world_size,
        "warmup": warmup,
        "steps": steps,
        "timeout_s": timeout_s,
        "port": _free_port(),
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.setdefault("FSDP_COMPAT", "off")  # no start-up hooks in the ranks: they measure the core only
    env.setdefault("FSDP_COMPAT_GUARD", "off")  # plans as planned: upstream rules crash; `benchmarks guard` measures it
    start = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    failure = None
    with tempfile.TemporaryDirectory(prefix="fsdp_compat_bench_") as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(cfg))
        code = "from benchmarks.policies import _rank_main; _rank_main()"
        try:
            procs.extend(spawn_ranks(work, code, world_size, env, cwd=str(ROOT)))
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > 5:
                    failure = "a rank failed; the other was killed"
                    break
                if now - start > timeout_s:
                    failure = f"timed out after {timeout_s:g}s"
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                _kill_group(p)
        reports = []
        for rank in range(world_size):
            path = work / f"rank{rank}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else None)
            if reports[-1] is None or reports[-1].get("error"):
                log = (work / f"rank{rank}.log").read_text(errors="replace")[-3000:]
                failure = failure or f"rank {rank} failed"
                print(f"[policies] {model}: rank {rank}: {(reports[-1] or {}).get('error') or log}", file=sys.stderr)
    return {
        "model": model,
        "seconds": time.monotonic() - start,
        "failure": failure,
        "entries": _merge(policies, [r for r in reports if r], failure),
    }


def _merge(
    policies: tuple[str, ...], reports: list[dict[str, Any]], failure: str | None = None
) -> dict[str, dict[str, Any]]:
    """Per policy: rank 0's figures, with times and peaks taken as the max over ranks (the slowest rank rules)."""
    merged: dict[str, dict[str, Any]] = {}
    for policy in policies:
        rows = [e for r in reports for e in r["entries"] if e["policy"] == policy]
        if not rows:
            merged[policy] = {"policy": policy, "outcome": "not run", "error": failure or "no rank reported it"}
            continue
        row = dict(rows[0])
        if any(r["outcome"] != "ok" for r in rows):
            bad = next(r for r in rows if r["outcome"] != "ok")
            row.update(outcome=bad["outcome"], error=bad["error"], phase=bad.get("phase"))
        for key in ("step_s", "step_min_s", "peak", "peak_unsharded", "peak_unsharded_buffers", "cuda_peak_step"):
            values = [r[key] for r in rows if r.get(key) is not None]
            row[key] = max(values) if values and len(values) == len(rows) else None
        if row["outcome"] == "ok" and row.get("step_s") is None:
            row.update(outcome="incomplete", error=failure or "a rank stopped before the timed steps ended")
        merged[policy] = row
    return merged


# ---------------------------------------------------------------------------------------------------------------
# Tables


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _crash_free(entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries.values() if e["outcome"] == "ok" and e.get("step_s") is not None]


def _noise_floor(ok: list[dict[str, Any]]) -> tuple[float, str] | None:
    """Policies that produced the very same plan measure the same work: their time ratio is the noise floor."""
    same: dict[str, list[dict[str, Any]]] = {}
    for e in ok:
        same.setdefault(json.dumps(e.get("plan_key")), []).append(e)
    worst: tuple[float, str] | None = None
    for entries in same.values():
        if len(entries) < 2:
            continue
        slow, fast = max(entries, key=lambda e: e["step_s"]), min(entries, key=lambda e: e["step_s"])
        ratio = slow["step_s"] / fast["step_s"]
        if worst is None or ratio > worst[0]:
            worst = (ratio, f"{slow['policy']}/{fast['policy']}")
    return worst


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: auto against the best crash-free policy, on time and on peak bytes (the targets)."""
    out: dict[str, dict[str, Any]] = {}
    for res in results:
        entries = res["entries"]
        auto = entries.get("auto", {})
        ok = _crash_free(entries)
        fastest = min(ok, key=lambda e: e["step_s"], default=None)
        smallest = min(ok, key=lambda e: e["peak"], default=None)
        summary: dict[str, Any] = {"auto_ok": auto.get("outcome") == "ok"}
        if summary["auto_ok"] and fastest and smallest:
            summary["time_vs_fastest"] = auto["step_s"] / fastest["step_s"]
            summary["fastest"] = fastest["policy"]
            summary["peak_vs_smallest"] = auto["peak"] / smallest["peak"]
            summary["smallest"] = smallest["policy"]
            summary["time_ok"] = summary["time_vs_fastest"] <= 1 + TIME_TOLERANCE
            summary["peak_ok"] = auto["peak"] <= smallest["peak"]
            summary["extra_all_gathers"] = auto.get("all_gathers", 0) - fastest.get("all_gathers", 0)
        summary["noise"] = _noise_floor(ok)
        out[res["model"]] = summary
    return out


def format_results(results: list[dict[str, Any]], *, world_size: int) -> str:
    """The detail table (model x policy) and the per-model ratio/target table."""
    header = [
        "model",
        "policy",
        "outcome",
        "step ms median",
        "step ms min",
        "groups",
        "all-gathers/fwd",
        "resident",
        "unsharded params",
        "unsharded + AG buffers",
        "FSDP2 model",
        "plan (package)",
        "peak/rank (measured)",
        "peak/rank (package)",
        "predicted",
    ]
    rows = []
    for res in results:
        for policy, e in res["entries"].items():
            ok = e["outcome"] == "ok"
            predicted = "crash" if e.get("predicted") else ("ok" if "predicted" in e else "-")
            error = (e.get("error") or "")[:64]
            if ok:
                outcome = "ok"
            elif e["outcome"] == "crash":
                outcome = f"CRASH ({e.get('phase', '?')}): {error}…"
            else:
                outcome = f"{e['outcome'].upper()}: {error}"
            rows.append(
                [
                    res["model"],
                    policy,
                    outcome,
                    _ms(e.get("step_s")),
                    _ms(e.get("step_min_s")),
                    e.get("groups", "-"),
                    e.get("all_gathers", "-") if ok else "-",
                    fmt_bytes(e.get("resident")),
                    fmt_bytes(e.get("peak_unsharded")),
                    fmt_bytes(e.get("peak_unsharded_buffers")),
                    fmt_bytes(e.get("model_unsharded")),
                    fmt_bytes(e.get("plan_unsharded")),
                    fmt_bytes(e.get("peak")),
                    fmt_bytes(e.get("plan_peak")),
                    predicted,
                ]
            )
    detail = format_table(header, rows, right=(3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13))
    summaries = summarize(results)
    header2 = [
        "model",
        "auto step / fastest ok",
        "auto peak / smallest ok",
        "time auto/input-only",
        "peak auto/input-only",
        "time auto/legacy",
        "peak auto/legacy",
        "auto ≤ every peak",
        "auto within 2 %",
        "extra all-gathers vs fastest",
        "noise: same plan, time ratio",
    ]
    rows2 = []
    for res in results:
        e, s = res["entries"], summaries[res["model"]]
        auto, inp, leg = e.get("auto", {}), e.get("input-only", {}), e.get("legacy", {})
        if not s["auto_ok"]:
            status = res["entries"].get("auto", {}).get("outcome", "not run")
            rows2.append([res["model"], f"auto: {status}", "-", "-", "-", "-", "-", "NO", "NO", "-", "-"])
            continue
        rows2.append(
            [
                res["model"],
                f"{s.get('time_vs_fastest', float('nan')):.3f}x ({s.get('fastest')})",
                f"{s.get('peak_vs_smallest', float('nan')):.3f}x ({s.get('smallest')})",
                fmt_ratio(auto.get("step_s"), inp.get("step_s")),
                fmt_ratio(auto.get("peak"), inp.get("peak")),
                fmt_ratio(auto.get("step_s"), leg.get("step_s")) if leg.get("outcome") == "ok" else "legacy crashed",
                fmt_ratio(auto.get("peak"), leg.get("peak")) if leg.get("outcome") == "ok" else "legacy crashed",
                "yes" if s.get("peak_ok") else "NO",
                "yes" if s.get("time_ok") else "NO",
                f"{s.get('extra_all_gathers', 0):+d}",
                f"{s['noise'][0]:.3f}x ({s['noise'][1]})" if s.get("noise") else "-",
            ]
        )
    ratios = format_table(header2, rows2, right=(1, 2, 3, 4, 5, 6, 9, 10))
    legend = (
        "unsharded params / + AG buffers: measured peak during the forward (FSDP2 storage, see the module doc); "
        "FSDP2 model / plan (package): the unsharded part of WrapPlan.per_rank_bytes (root + no-reshard + "
        "multi-module groups + max(root, largest) + largest group); peak/rank (measured) = resident + unsharded + AG "
        "buffers; peak/rank (package) = WrapPlan.per_rank_bytes(W)['peak_forward']"
    )
    return (
        f"Policies on {world_size} gloo ranks (bytes per rank; fp32; ratios from the same run)\n{legend}\n\n"
        f"{detail}\n\n"
        f"auto against the others (targets: peak <= every crash-free policy; step time within 2 % of the "
        f"fastest crash-free policy)\n\n{ratios}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.policies", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated zoo names (default: the whole zoo)")
    parser.add_argument("--policies", default=",".join(POLICY_ORDER))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=21, help="timed steps per policy (median reported)")
    parser.add_argument("--world-size", type=int, default=None, help="default: 2 on cpu, one rank per GPU on cuda")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, one rank per GPU")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per model (both ranks killed after)")
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    args = parser.parse_args(argv)
    from fsdp_compat.testing.zoo import ZOO

    if args.world_size is None:
        import torch

        args.world_size = max(1, torch.cuda.device_count()) if args.device == "cuda" else 2

    models = args.models.split(",") if args.models else list(ZOO)
    policies = tuple(args.policies.split(","))
    results = []
    t0 = time.monotonic()
    for model in models:
        res = run_model(
            model,
            policies,
            world_size=args.world_size,
            warmup=args.warmup,
            steps=args.steps,
            timeout_s=args.timeout,
            device=args.device,
        )
        print(
            f"[policies] {model}: {res['seconds']:.1f}s{'; ' + res['failure'] if res['failure'] else ''}",
            file=sys.stderr,
            flush=True,
        )
        results.append(res)
    print(format_results(results, world_size=args.world_size))
    if args.device == "cuda":
        print(
            "\nCUDA peak per policy (torch.cuda.max_memory_allocated during the memory step, above the bytes "
            "allocated before it; the other policies' models are resident too and cancel out of the difference)\n"
        )
        rows = [
            [res["model"], policy, fmt_bytes(entry["cuda_peak_step"])]
            for res in results
            for policy, entry in res["entries"].items()
            if entry.get("cuda_peak_step") is not None
        ]
        print(format_table(["model", "policy", "CUDA peak of one step"], rows, right=(2,)))
    print(
        f"\n(policies: {time.monotonic() - t0:.0f}s wall; {args.warmup} warm-up + 1 memory + {args.steps} timed "
        "steps per policy, round-robin)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 1 if any(r["failure"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
