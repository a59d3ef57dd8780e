"""What the mixed-batch exchange costs per forward as the world grows, against the forward it sits in.

``python -m benchmarks exchange [--worlds 2,4,8,16,32] [--iters 200] [--warmup 20] [--columns 1]
[--forwards 3] [--threads 1] [--device cpu|cuda] [--timeout 240]``

Why: every forward of a sharded vision-language model makes one exchange
(``fsdp_compat.runtime.exchange.exchange``:
an all-reduce of a world x columns int64 table in host memory, on a gloo group of its own). At 2 ranks it is lost in
the step's noise; this measures how it grows with the world size and states it as a fraction of a forward.

- Per world size, fresh rank processes on loopback (``fsdp_compat.testing.launch.run_ranks``: a free port, one
  deadline, every process reaped) call ``_exchange(ranks, values)`` exactly as a forward does (one count per aligned
  tower: ``--columns`` 1 for a vision tower, 2 with an audio tower). The first call also makes the gloo group
  (``first`` column, once per job); then ``--warmup`` calls, then ``--iters`` timed ones back to back. An
  exchange is as slow as its slowest rank, so each iteration counts the maximum over the ranks; the table shows the
  median and p99 of that over the iterations.
- For comparison, in the same run, the parent process times no-grad forwards of the zoo's tiny GLM4V and of a
  mid-size Qwen2 (hidden 1024, 4 layers, 256 tokens, built from a config: no download), in rounds interleaved with
  the world sizes so both see the same machine load; medians. One torch thread by default (``--threads``), as each
  rank here gets: on a shared machine two intra-op threads wait for each other whenever one is descheduled (the
  tiny forward's median went from about 4 ms to 85 ms under load).
- A least-squares fit of the median against the world size and against log2(world) is extrapolated to 128 ranks
  and printed as an extrapolation, not a measurement.

``--device cuda`` (the default where ``FSDP_COMPAT_TEST_DEVICE=cuda``, as under tox's ``-gpu`` factor) makes NCCL
the job's backend (one all-reduce on it first, where every rank has a GPU of its own; above the GPU count ranks
share GPUs and NCCL is never used) and runs the forwards on the GPU; the exchange itself still runs on its gloo
host group, which is the design. Without CUDA it exits 2 with a message.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

from benchmarks import format_table, qwen2_of

WORLDS = (2, 4, 8, 16, 32)
EXTRAPOLATE_TO = 128
ENV_DEVICE = "FSDP_COMPAT_TEST_DEVICE"  # the -gpu tox factor sets it to cuda
MID = {"vocab": 8192, "hidden": 1024, "intermediate": 2816, "layers": 4, "heads": 16, "kv_heads": 4, "tokens": 256}


# ------------------------------------------------------------------------------------------------------ rank side


def _rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """One rank: join the job's group (gloo, or NCCL on a GPU), then time ``_exchange`` as a forward calls it."""
    import torch
    import torch.distributed as dist

    from fsdp_compat.runtime.exchange import exchange as _exchange
    from fsdp_compat.testing.parity import init_group

    dev = init_group(cfg, rank)
    if dev.type == "cuda" and cfg["nccl_probe"]:  # the job's NCCL communicator up, as before a training forward
        probe = torch.ones(1, device=dev)
        dist.all_reduce(probe)
        torch.cuda.synchronize()
    ranks = tuple(range(cfg["world_size"]))
    values = tuple(rank % 3 + c for c in range(cfg["columns"]))  # tower-call counts differ by rank, as in a mix
    expected = {r: tuple(r % 3 + c for c in range(cfg["columns"])) for r in ranks}
    t = time.perf_counter()
    first = _exchange(ranks, values)  # also makes the gloo host group: once per job
    extra["first_ms"] = (time.perf_counter() - t) * 1e3
    assert first == expected, (first, expected)
    times = []
    for i in range(cfg["warmup"] + cfg["iters"]):
        t = time.perf_counter()
        counts = _exchange(ranks, values)
        if i >= cfg["warmup"]:
            times.append((time.perf_counter() - t) * 1e6)
    assert counts == expected, (counts, expected)
    extra["times_us"] = [round(x, 2) for x in times]
    extra["backend"] = str(dist.get_backend())


def _measure_world(world: int, gpus: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run one world size; a failure or a time-out becomes a row that says so instead of a hang."""
    from fsdp_compat.testing.launch import run_ranks

    cfg = {"device": args.device, "iters": args.iters, "warmup": args.warmup, "columns": args.columns,
           "nccl_probe": args.device == "cuda" and world <= gpus}  # fmt: skip
    result = run_ranks("benchmarks.exchange:_rank", cfg, world_size=world, timeout_s=args.timeout)
    if not result.ok:
        return {"world": world, "error": (result.exception or "failed").splitlines()[-1], "seconds": result.seconds}
    per_iter = [max(column) for column in zip(*(r.extra["times_us"] for r in result.ranks), strict=True)]
    return {
        "world": world,
        "median_us": statistics.median(per_iter),
        "p99_us": _percentile(per_iter, 99),
        "first_ms": max(r.extra["first_ms"] for r in result.ranks),
        "backend": result.ranks[0].extra["backend"],
        "seconds": result.seconds,
    }


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with 200 samples p99 is the 2nd largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# ---------------------------------------------------------------------------------------------- forwards, fits


class _Forwards:
    """The two comparison models on one device, timed a round at a time between the world sizes (shared load)."""

    def __init__(self, device: str) -> None:
        import torch

        from fsdp_compat.testing.zoo import build_model, make_batch

        self.torch, self.device = torch, torch.device(device)
        torch.manual_seed(0)
        ids = torch.randint(1, MID["vocab"], (1, MID["tokens"]), generator=torch.Generator().manual_seed(0))
        mid_batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        self.models = {
            "tiny GLM4V": (build_model("glm4v", device=self.device).eval(), make_batch("glm4v", device=self.device)),
            "mid Qwen2": (qwen2_of(MID).to(self.device).eval(), {k: v.to(self.device) for k, v in mid_batch.items()}),
        }
        self.times: dict[str, list[float]] = {name: [] for name in self.models}
        self.round(2, keep=False)  # warm-up

    def round(self, n: int, keep: bool = True) -> None:
        for _ in range(n):
            for name, (model, batch) in self.models.items():
                self._sync()
                t = time.perf_counter()
                with self.torch.no_grad():
                    model(**batch)
                self._sync()
                if keep:
                    self.times[name].append((time.perf_counter() - t) * 1e6)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def medians_us(self) -> dict[str, float]:
        return {name: statistics.median(v) for name, v in self.times.items()}


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``: (a, b, R²)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, 1.0 - ss_res / ss_tot if ss_tot else 1.0


def _load() -> float:
    """The 1-minute load average (NaN where the OS has none): a shared machine's timings need it beside them."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _pct(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``: two decimals below 10 %, whole numbers above."""
    p = 100 * part / whole
    return f"{p:.2f} %" if p < 10 else f"{p:.0f} %"


# ------------------------------------------------------------------------------------------------------ main


def _check_device(device: str) -> str | None:
    """Why ``device`` cannot run here, or None."""
    import torch
    import torch.distributed as dist

    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return (
            f"--device {device} (or {ENV_DEVICE}=cuda) needs CUDA, but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); run without it for gloo on the CPU"
        )
    if not dist.is_nccl_available():
        return f"--device {device} needs NCCL, and this torch ({torch.__version__}) was built without it"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks exchange", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated world sizes")
    parser.add_argument("--iters", type=int, default=200, help="timed exchanges per world size")
    parser.add_argument("--warmup", type=int, default=20, help="untimed exchanges before them")
    parser.add_argument("--columns", type=int, choices=(1, 2), default=1, help="counts per rank (2: an audio tower)")
    parser.add_argument("--forwards", type=int, default=3, help="forwards per model per round (one round per world)")
    env_device = "cuda" if os.environ.get(ENV_DEVICE, "").startswith("cuda") else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=env_device, help=f"default: from {ENV_DEVICE}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the comparison forwards")
    parser.add_argument("--timeout", type=float, default=240.0, help="deadline per world size, seconds")
    args = parser.parse_args(argv)
    try:
        worlds = sorted({int(w) for w in args.worlds.split(",") if w.strip()})
    except ValueError:
        parser.error(f"--worlds takes comma-separated integers, not {args.worlds!r}")
    if not worlds or min(worlds) < 2 or args.iters < 1 or args.warmup < 0 or args.forwards < 1:
        parser.error("world sizes must be >= 2, --iters and --forwards >= 1, --warmup >= 0")
    problem = _check_device(args.device)
    if problem:
        print(f"error: {problem}", flush=True)
        return 2

    import torch

    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    t0, load0 = time.monotonic(), _load()
    torch.set_num_threads(args.threads)
    forwards = _Forwards(args.device)
    rows = []
    for world in worlds:
        forwards.round(args.forwards)
        rows.append(_measure_world(world, gpus, args))
        done = rows[-1]
        what = f"median {done['median_us']:.0f} µs" if "median_us" in done else f"FAILED: {done['error']}"
        print(f"  world {world}: {what} ({done['seconds']:.0f}s)", flush=True)
    forwards.round(args.forwards)
    fwd = forwards.medians_us()
    tiny, mid = fwd["tiny GLM4V"], fwd["mid Qwen2"]

    backend = next((r["backend"] for r in rows if "backend" in r), args.device)
    print(f"\nMixed-batch exchange: {args.columns} int64 count(s) per rank, all-reduced on a gloo host group "
          f"(job backend: {backend}); {args.iters} exchanges after {args.warmup} warm-up per world size; each "
          "iteration's time is its slowest rank's\n")  # fmt: skip
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["world"], f"{r['world'] / cores:g}", "-", "-", "-", "-", "-", f"FAILED: {r['error']}"])
            continue
        table.append([
            r["world"], f"{r['world'] / cores:g}", f"{r['median_us']:.0f}", f"{r['p99_us']:.0f}",
            f"{r['first_ms']:.1f}", _pct(r["median_us"], tiny), _pct(r["median_us"], mid), f"{r['seconds']:.0f}",
        ])  # fmt: skip
    header = ["world", "ranks/core", "median µs", "p99 µs", "first (makes group) ms", "of tiny fwd", "of mid fwd", "s"]
    print(format_table(header, table, right=range(8)))
    fastest = {name: min(v) / 1e3 for name, v in forwards.times.items()}
    n = len(forwards.times["tiny GLM4V"])
    print(f"\nForward, no_grad, 1 process ({args.device}, {args.threads} thread(s)), median (fastest) of {n}: "
          f"tiny GLM4V {tiny / 1e3:.1f} ms ({fastest['tiny GLM4V']:.1f}); mid Qwen2 (hidden {MID['hidden']}, "
          f"{MID['layers']} layers, {MID['tokens']} tokens) {mid / 1e3:.1f} ms "
          f"({fastest['mid Qwen2']:.1f})")  # fmt: skip
    print(f"Machine: {cores} CPU cores; world sizes above {cores} are oversubscribed (ranks/core > 1), so their "
          f"latency includes the scheduler's; 1-min load average {load0:.1f} at the start, "
          f"{_load():.1f} at the end")  # fmt: skip
    shared = [w for w in worlds if args.device == "cuda" and w > gpus]
    if shared:
        print(f"World sizes {shared} share {gpus} GPU(s) between ranks: NCCL refuses two ranks on one GPU, so there "
              "the job's NCCL group is made but never used; the exchange is the same gloo all-reduce")  # fmt: skip

    ok = [r for r in rows if "error" not in r]
    sets = {"all measured world sizes": ok, f"world sizes <= {cores} (one core a rank)": [
        r for r in ok if r["world"] <= cores]}  # fmt: skip
    for label, chosen in sets.items():
        _extrapolate(label, chosen, tiny, mid)
    print(f"\n(exchange: {time.monotonic() - t0:.0f}s wall)")
    return 0 if len(ok) == len(rows) else 1


def _extrapolate(label: str, rows: list[dict[str, Any]], tiny: float, mid: float) -> None:
    """Fit the medians of ``rows`` two ways and print both at :data:`EXTRAPOLATE_TO` ranks, labelled as such."""
    if len(rows) < 3:
        print(f"\nNo extrapolation from {label}: {len(rows)} measured, a fit needs 3")
        return
    xs, ys = [float(r["world"]) for r in rows], [r["median_us"] for r in rows]
    fits = {"linear in world": _fit(xs, ys), "linear in log2(world)": _fit([math.log2(x) for x in xs], ys)}
    best = max(fits, key=lambda k: fits[k][2])
    print(f"\nEXTRAPOLATION to {EXTRAPOLATE_TO} ranks from {label} (a fit of the medians, not a measurement):")
    for name, (a, b, r2) in fits.items():
        linear = name == "linear in world"
        y = a + b * (EXTRAPOLATE_TO if linear else math.log2(EXTRAPOLATE_TO))
        unit = "per rank" if linear else "per doubling"
        note = ", better fit" if name == best else ""
        print(f"  {name:<22} {a:.0f} µs + {b:.1f} µs {unit} (R² {r2:.3f}{note}) -> {y:.0f} µs at {EXTRAPOLATE_TO} "
              f"ranks = {_pct(y, tiny)} of the tiny forward, {_pct(y, mid)} of the mid forward")  # fmt: skip
