"""A loop of ``no_grad`` forwards gains no all-gather per step: FSDP2's collectives per forward, fsdp-compat's
run-time layer against plain FSDP2.

``python -m benchmarks no_grad [--model qwen2] [--forwards 20] [--world-size 2] [--timeout 300]``

Why: after a ``no_grad`` first forward of a root, the run-time layer reshards the groups that pass left unsharded
(``fsdp_compat.runtime.first_pass``), so an optimizer built then holds the real, sharded parameters. Only the first
pass: a loop of ``no_grad`` forwards (decode, log-prob passes) must pay no all-gather per forward that plain FSDP2
does not pay.

Two runs of ``--world-size`` fresh gloo ranks, one with fsdp-compat's defaults (nothing set) and one with
``FSDP_COMPAT=off`` (plain FSDP2: no activation, no run-time layer). Each rank holds six copies of the zoo model
(``fsdp_compat.testing.zoo.build_model``), stepped interleaved, one ``no_grad`` forward each per round:

- ``own rule``: a trainer's own ``fully_shard`` calls (every ``_no_split_modules`` layer, every untied embedding,
  the root; ``lab.every_root.own_apply_fsdp2``): with the defaults the generic layer installs the run-time layer at
  the root's first forward;
- ``auto plan``: ``fsdp_compat.apply_fsdp2`` with the defaults; with ``FSDP_COMPAT=off`` the same plan's
  ``fully_shard`` calls without the run-time layer (``lab.guard_models.apply_plan_without``);

each with ``reshard_after_forward`` not passed (FSDP2's default: True for inner groups, the root kept unsharded
after its forward, for the backward), True and False. Per forward the rank counts FSDP2's all-gathers (calls of
``foreach_all_gather``, as :mod:`benchmarks.policies` counts them) and the other collectives issued through
``torch.distributed`` (``all_reduce``, ``broadcast``, ``barrier``: the mixed-batch exchange would show here). The
table gives the first forward, the second (the one after the first pass's reshard) and the mean per forward over
the ``--forwards`` forwards after the first, with the slowest rank's median wall time of those forwards (2 shared
cores: the times are indications, the counts are exact).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks import format_table, join_cpu_group

SHARDINGS = ("own rule", "auto plan")
RESHARD = (None, True, False)  # reshard_after_forward; None: not passed (FSDP2 keeps the root unsharded)
DEFAULTS = "fsdp-compat defaults"
RUNS = {DEFAULTS: None, "FSDP_COMPAT=off (plain FSDP2)": "off"}  # label -> FSDP_COMPAT
OTHER_COLLECTIVES = ("all_reduce", "broadcast", "barrier")


# ------------------------------------------------------------------------------------------------------ rank side


class _Counts:
    """Collectives of this rank since the last :meth:`take`: FSDP2's all-gathers, and the others named above."""

    def __init__(self) -> None:
        self.all_gathers = 0
        self.others = 0

    def install(self) -> None:
        import torch.distributed as dist

        from benchmarks.policies import TRACKER, _install_instrumentation

        _install_instrumentation()  # counts foreach_all_gather while TRACKER is enabled
        TRACKER.start([])
        self._tracker = TRACKER
        for name in OTHER_COLLECTIVES:
            setattr(dist, name, self._counting(getattr(dist, name)))

    def _counting(self, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.others += 1
            return original(*args, **kwargs)

        return call

    def take(self) -> tuple[int, int]:
        """(all-gathers, other collectives) since the last call."""
        counts = (self._tracker.all_gathers, self.others)
        self._tracker.all_gathers, self.others = 0, 0
        return counts


def _shard(model: Any, sharding: str, reshard: bool | None, mesh: Any, plain: bool) -> None:
    """``model`` sharded by ``sharding`` (see the module doc); ``plain``: this run has ``FSDP_COMPAT=off``."""
    from lab.every_root import own_apply_fsdp2
    from lab.guard_models import apply_plan_without

    from fsdp_compat.apply import apply_fsdp2

    kwargs: dict[str, Any] = {"mesh": mesh}
    if reshard is not None:
        kwargs["reshard_after_forward"] = reshard
    if sharding == "own rule":
        own_apply_fsdp2(model, kwargs)
    elif plain:
        apply_plan_without(model, kwargs, "auto", [])
    else:
        apply_fsdp2(model, kwargs)


def _layer_state(model: Any) -> dict[str, Any]:
    """What the run-time layer did on ``model``: installed, guard armed, groups the first pass resharded, and whether
    every parameter is sharded (a DTensor) now, as an optimizer built now would see them."""
    from torch.distributed.tensor import DTensor

    from fsdp_compat.runtime import runtime_of
    from fsdp_compat.runtime.first_pass import FirstPass

    runtime = runtime_of(model)
    first = [p for p in getattr(runtime, "_parts", []) if isinstance(p, FirstPass)]
    return {
        "runtime": runtime is not None,
        "armed": None if runtime is None or runtime.guard is None else runtime.guard.armed,
        "resharded": first[0].resharded if first else None,
        "sharded_params": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def _forwards(copies: dict[Any, dict[str, Any]], batch: dict[str, Any], counts: _Counts, n: int) -> None:
    """``n`` rounds of one forward per copy: each forward's time and collectives; the layer's state after the first."""
    for index in range(n):
        for copy in copies.values():
            t = time.perf_counter()
            copy["model"](**batch)
            copy["times"].append(time.perf_counter() - t)
            copy["counts"].append(counts.take())
            if index == 0:
                copy["after_first"] = _layer_state(copy["model"])


def _rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat.testing.zoo import build_model, make_batch

    world = join_cpu_group(cfg, rank)
    mesh = init_device_mesh("cpu", (world,))
    counts = _Counts()
    counts.install()
    batch = make_batch(cfg["model"], seed=rank)
    copies = {}
    for sharding in SHARDINGS:
        for reshard in RESHARD:
            model = build_model(cfg["model"], seed=0).eval()
            _shard(model, sharding, reshard, mesh, cfg["plain"])
            copies[(sharding, reshard)] = {"model": model, "counts": [], "times": []}
    counts.take()
    with torch.no_grad():
        _forwards(copies, batch, counts, 1 + cfg["forwards"])
    extra["copies"] = [
        {"sharding": s, "reshard": r, "counts": c["counts"], "times": c["times"], **c["after_first"]}
        for (s, r), c in copies.items()
    ]
    dist.barrier()


# ---------------------------------------------------------------------------------------------------- parent side


def run(label: str, switch: str | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run of ranks with ``FSDP_COMPAT`` = ``switch``: per copy rank 0's record (every rank's counts must be
    equal) with the slowest rank's median forward time (forwards after the first); a failure is one record."""
    from fsdp_compat.testing.launch import run_ranks

    cfg = {"model": args.model, "forwards": args.forwards, "plain": switch == "off"}
    result = run_ranks("benchmarks.no_grad:_rank", cfg, world_size=args.world_size, timeout_s=args.timeout,
                       env={"FSDP_COMPAT": switch})  # fmt: skip
    if not result.ok:
        return [{"run": label, "error": (result.exception or "failed").splitlines()[-1][:80]}]
    ranks = [r.extra["copies"] for r in result.ranks]
    records = []
    for index, copy in enumerate(ranks[0]):
        assert all(r[index]["counts"] == copy["counts"] for r in ranks), "ranks disagree on their collectives"
        median_s = max(statistics.median(r[index]["times"][1:]) for r in ranks)
        records.append({**copy, "run": label, "median_s": median_s})
    return records


def _row(copy: dict[str, Any], plain: dict[str, Any] | None) -> list[Any]:
    """One table row; ``plain``: the same sharding's record under ``FSDP_COMPAT=off`` (the extra all-gathers)."""
    if "error" in copy:
        return [copy["run"], "FAILED", copy["error"], *[""] * 10]
    gathers, others = [c[0] for c in copy["counts"]], [c[1] for c in copy["counts"]]
    loop, steady = len(gathers) - 1, len(gathers) - 2
    extra = "-" if plain is None else f"{sum(gathers[1:]) - sum(c[0] for c in plain['counts'][1:]):+d}"
    return [
        copy["run"], copy["sharding"], "not passed" if copy["reshard"] is None else copy["reshard"],
        "no layer" if not copy["runtime"] else "-" if copy["armed"] is None else str(copy["armed"]),
        "-" if copy["resharded"] is None else copy["resharded"], "yes" if copy["sharded_params"] else "NO",
        f"{gathers[0]} / {others[0]}", f"{gathers[1]} / {others[1]}",
        f"{sum(gathers[2:]) / steady:.2f} / {sum(others[2:]) / steady:.2f}",
        f"{sum(gathers[1:]) / loop:.2f} / {sum(others[1:]) / loop:.2f}", extra, f"{copy['median_s'] * 1e3:.1f}",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks no_grad", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2", help="a zoo model (fsdp_compat.testing.zoo)")
    parser.add_argument("--forwards", type=int, default=20, help="no_grad forwards after the first")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args(argv)
    if args.forwards < 2 or args.world_size < 2:
        parser.error("--forwards and --world-size: at least 2")
    t0 = time.monotonic()
    records = [record for label, switch in RUNS.items() for record in run(label, switch, args)]
    plain = {(r["sharding"], r["reshard"]): r for r in records if r["run"] != DEFAULTS and "error" not in r}
    rows = [_row(r, plain.get((r["sharding"], r["reshard"])) if r["run"] == DEFAULTS else None) for r in records]
    n = args.forwards + 1
    header = ["run", "sharding", "reshard_after_forward", "guard armed", "resharded by 1st pass",
              "params sharded after 1st fwd", "1st fwd AG / other", "2nd fwd AG / other",
              f"per fwd, fwds 3-{n}: AG / other", f"per fwd, fwds 2-{n}: AG / other",
              f"AG fwds 2-{n} vs plain", "median fwd ms"]  # fmt: skip
    print(f"no_grad forwards of the zoo's {args.model} on {args.world_size} gloo ranks: collectives per forward (AG: "
          "FSDP2 all-gathers; other: all_reduce, broadcast, barrier), 1 + "
          f"{args.forwards} forwards per copy, copies interleaved\n")  # fmt: skip
    print(format_table(header, rows, right=range(4, 12)))
    print(f"\n(no_grad: {time.monotonic() - t0:.0f}s wall)")
    return 0 if all("error" not in r for r in records) else 1
