"""The mixed-batch alignment's schedule at 2-32 ranks: an exchange per forward (``sync``) against a static schedule
(``always``: every rank whose micro-batch lacks images runs a dummy tower call, no exchange).

``python -m benchmarks schedule [--worlds 2,4,8,16,32] [--model glm4v] [--warmup 1] [--steps 3] [--threads 1]
[--timeout 300]``

Per world size, fresh gloo ranks over loopback run :func:`benchmarks.mixed_batches._rank` with two copies of the
zoo model (``apply_fsdp2`` as installed by default, then ``FSDP_COMPAT_MIXED_BATCHES`` ``sync`` or ``always``; the
zoo's GLM4V calls its vision tower once per forward, so ``always`` is a complete schedule for an image-only job),
stepped round-robin (forward, backward, AdamW) over three mixes (:func:`benchmarks.mixed_batches.mix_kinds`):

- ``images everywhere``: nobody needs a dummy; ``sync`` pays its exchange, ``always`` nothing. The difference is the
  exchange's cost in a step.
- ``mixed`` (images on the even ranks): both run one dummy on each odd rank; ``sync`` also pays the exchange.
- ``no images`` (a text-only step): ``sync`` runs no tower at all (after its exchange), ``always`` a dummy tower
  forward and backward on every rank, with the tower's all-gathers and reduce-scatters. The difference is the
  dummy's cost.

Step: the median over ``--steps`` steps (after ``--warmup``) of each rank, the slowest rank's; "exchange in step":
the median time a ``sync`` step spent inside the exchange on the rank that spent the most (waiting for the other
ranks to arrive included). Every world size has one deadline (``--timeout``); a world size that misses it or fails
becomes a row that says so, and the next one runs. From the two differences the summary derives where ``always``
is the faster schedule: with E the exchange's cost on a step with images and D the extra cost of ``always`` on a
text-only step, ``always`` wins while the share of steps on which no rank has images stays below E / (E + D).
Above the machine's core count the ranks share cores (the table says how many per core): those times include the
scheduler's, as in ``python -m benchmarks exchange``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks import format_table
from benchmarks.mixed_batches import MIXES, across_ranks

WORLDS = (2, 4, 8, 16, 32)
MODES = ("sync", "always")


def measure_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One world size under one deadline; a failure or a time-out is a record that says so."""
    from fsdp_compat.testing.launch import run_ranks

    cfg = {"model": args.model, "warmup": args.warmup, "steps": args.steps, "modes": MODES, "threads": args.threads}
    result = run_ranks("benchmarks.mixed_batches:_rank", cfg, world_size=world, timeout_s=args.timeout)
    if not result.ok:
        why = (result.exception or result.error or "failed").splitlines()[-1][:100]
        return {"world": world, "error": why, "seconds": result.seconds}
    ranks = [r.extra for r in result.ranks]
    return {
        "world": world,
        "step": across_ranks(ranks, "median_s", MODES),
        "exchange": across_ranks(ranks, "exchange_s", MODES),  # the rank that waited longest in it
        "exchange_last": across_ranks(ranks, "exchange_s", MODES, min),  # the last rank to arrive: the net cost
        "dummy_calls": {m: sum(r["dummy_calls"][m] for r in ranks) for m in MODES},
        "seconds": result.seconds,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def step_rows(record: dict[str, Any], cores: int) -> list[list[Any]]:
    """The per-mix rows of one world size."""
    world = record["world"]
    if "error" in record:
        return [[world, f"{world / cores:g}", f"FAILED after {record['seconds']:.0f}s: {record['error']}", *[""] * 5]]
    rows = []
    for mix in MIXES:
        sync, always = record["step"]["sync"][mix], record["step"]["always"][mix]
        ratio = "-" if sync is None or always is None else f"{always / sync:.3f}x"
        rows.append([world, f"{world / cores:g}", mix, _ms(sync), _ms(always), ratio,
                     _ms(_diff(always, sync)), _ms(record["exchange"]["sync"][mix])])  # fmt: skip
    return rows


def summary_row(record: dict[str, Any]) -> list[Any]:
    """E (the exchange's net cost: the last-arriving rank's time in it, images everywhere), D (the dummy's cost on a
    text-only step: always - sync + sync's exchange there), the break-even share E / D, the step-time difference."""
    if "error" in record:
        return [record["world"], "FAILED", *[""] * 6]
    step, last = record["step"], record["exchange_last"]["sync"]
    exchange = last["images everywhere"]
    dummy = _diff(step["always"]["no images"], step["sync"]["no images"])
    dummy = None if dummy is None else dummy + (last["no images"] or 0.0)
    share = "-" if not exchange or dummy is None or dummy <= 0 else f"{min(100.0, 100 * exchange / dummy):.1f} %"
    calls = record["dummy_calls"]
    return [record["world"], _ms(exchange), _ms(record["exchange"]["sync"]["images everywhere"]),
            _ms(_diff(step["sync"]["images everywhere"], step["always"]["images everywhere"])), _ms(dummy), share,
            f"{calls['sync']} / {calls['always']}", f"{record['seconds']:.0f}"]  # fmt: skip


def _worlds(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        worlds = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        parser.error(f"--worlds takes comma-separated integers, not {text!r}")
    if not worlds or min(worlds) < 2:
        parser.error("world sizes must be >= 2")
    return worlds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated world sizes")
    parser.add_argument("--model", default="glm4v", help="a zoo vision-language model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per copy and mix")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per copy and mix (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline per world size, seconds")
    args = parser.parse_args(argv)
    worlds = _worlds(parser, args.worlds)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps >= 1, --warmup >= 0")
    cores, t0, load0 = os.cpu_count() or 1, time.monotonic(), os.getloadavg()[0]
    records = []
    for world in worlds:
        records.append(measure_world(world, args))
        done = records[-1]
        print(f"  world {world}: {'FAILED: ' + done['error'] if 'error' in done else 'ok'} ({done['seconds']:.0f}s)",
              flush=True)  # fmt: skip
    print(f"\nMixed-batch schedule, {args.model}: sync (exchange per forward) vs always (static: a dummy where a "
          f"micro-batch lacks images, no exchange); gloo over loopback, {args.threads} torch thread(s) per rank; "
          f"step = forward + backward + AdamW, median of {args.steps} after {args.warmup} warm-up, slowest "
          "rank\n")  # fmt: skip
    header = ["world", "ranks/core", "mix", "sync ms", "always ms", "always/sync", "always - sync ms",
              "exchange in sync step ms"]  # fmt: skip
    print(format_table(header, [row for r in records for row in step_rows(r, cores)], right=(0, 1, 3, 4, 5, 6, 7)))
    header = ["world", "E: exchange, last rank in ms", "exchange, longest wait ms",
              "sync - always step ms (images everywhere)", "D: dummy, always - sync + E (no images) ms",
              "always faster below this share of text-only steps (E / D)",
              "dummy tower calls sync / always (all ranks)", "s"]  # fmt: skip
    print()
    print(format_table(header, [summary_row(r) for r in records], right=(0, 1, 2, 3, 4, 5, 6, 7)))
    print(f"\nMachine: {cores} CPU cores; world sizes above {cores} are oversubscribed; 1-min load average "
          f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (schedule: {time.monotonic() - t0:.0f}s "
          "wall)")  # fmt: skip
    return 0 if all("error" not in r for r in records) else 1
