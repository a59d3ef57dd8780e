"""Full-size reference models on the meta device: planning time, groups and per-rank bytes of every policy.

``python -m benchmarks.skeletons [--warm 5]``

The skeletons come from :func:`fsdp_compat.testing.skeleton.reference_skeleton` (transformers config class
defaults: GLM-4.1V-9B for ``Glm4vConfig``, the GLM-4.5V-style MoE for ``Glm4vMoeConfig``, Gemma3n-E4B text for
``Gemma3nConfig``, plus Qwen2-7B). No weights are allocated. Figures:

- plan cold: the first ``plan_wrap(model)`` (policy auto) on that model in this process: it reads and parses
  the source of the model's classes. The package and transformers are already imported (their import is
  reported separately), so "cold" is the per-model cost, not interpreter start-up.
- plan warm: the median of the next ``--warm`` calls on the same model object.
- bytes per rank are analytic (``WrapPlan.per_rank_bytes``): resident = every parameter sharded; peak forward
  adds what is unsharded at once (the root group for the whole forward, groups with ``reshard_after_forward=
  False``, and the largest other group twice: running and prefetched).
- predicted: ``fsdp_compat.plan.unsafe_reads`` (static evidence: a read that finds its group sharded, or one
  Parameter split across groups).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from benchmarks import POLICY_ORDER, fmt_bytes, fmt_ratio, format_table, fsdp2_unsharded_estimate

WORLD_SIZES = (2, 4, 8, 64)
WARM_TARGET_MS = 100.0


def measure(name: str, *, warm: int = 9) -> dict[str, Any]:
    """Everything for one reference model (build, plan timings, every policy's plan and verdict)."""
    from fsdp_compat.plan import plan_wrap, unsafe_reads
    from fsdp_compat.testing.skeleton import reference_skeleton

    t = time.perf_counter()
    model = reference_skeleton(name)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    plan = plan_wrap(model)
    cold_s = time.perf_counter() - t
    warm_times = []
    for _ in range(warm):
        t = time.perf_counter()
        plan_wrap(model)
        warm_times.append(time.perf_counter() - t)
    policies: dict[str, dict[str, Any]] = {}
    for policy in POLICY_ORDER:
        p = plan if policy == "auto" else plan_wrap(model, policy=policy)
        problems = unsafe_reads(model, p)
        policies[policy] = {
            "groups": len(p.groups) + (1 if p.root_params else 0),
            "root_params": p.root_params,
            "problems": problems,
            "peak": {w: p.per_rank_bytes(w)["peak_forward"] for w in WORLD_SIZES},
            "resident": {w: p.per_rank_bytes(w)["resident"] for w in WORLD_SIZES},
            "largest_group": max((g.num_bytes for g in p.groups), default=0),
            "fsdp2_model": {w: p.total_bytes // w + fsdp2_unsharded_estimate(p) for w in WORLD_SIZES},
        }
    return {
        "name": name,
        "model_class": plan.model_class,
        "total_params": plan.total_params,
        "build_s": build_s,
        "cold_ms": cold_s * 1e3,
        "warm_ms": statistics.median(warm_times) * 1e3 if warm_times else float("nan"),
        "warm_max_ms": max(warm_times) * 1e3 if warm_times else float("nan"),
        "policies": policies,
    }


def _ratios(auto: dict[str, Any], other: dict[str, Any]) -> str:
    """auto/other at W=8: the package's estimate, then the FSDP2 model."""
    plan = fmt_ratio(auto["peak"][8], other["peak"][8])
    return f"{plan} / {fmt_ratio(auto['fsdp2_model'][8], other['fsdp2_model'][8])}"


def format_results(results: list[dict[str, Any]], import_s: float) -> str:
    timing = format_table(
        [
            "model",
            "class",
            "params",
            "build on meta s",
            "plan cold ms",
            "plan warm ms (median)",
            "warm max ms",
            "warm < 100 ms",
        ],
        [
            [
                r["name"],
                r["model_class"],
                f"{r['total_params'] / 1e9:.2f} B",
                f"{r['build_s']:.2f}",
                f"{r['cold_ms']:.0f}",
                f"{r['warm_ms']:.0f}",
                f"{r['warm_max_ms']:.0f}",
                "yes" if r["warm_ms"] < WARM_TARGET_MS else "NO",
            ]
            for r in results
        ],
        right=(2, 3, 4, 5, 6),
    )
    rows = []
    for r in results:
        pol = r["policies"]
        resident = pol["auto"]["resident"]
        rows.append(
            [
                r["name"],
                "(resident, any policy)",
                "",
                "",
                "",
                *[fmt_bytes(resident[w]) for w in WORLD_SIZES],
                "",
                "",
                "",
                "",
                "",
            ]
        )
        for policy, p in pol.items():
            verdict = "ok" if not p["problems"] else f"CRASH: {p['problems'][0][:90]}"
            ratio_in = ratio_leg = ""
            if policy == "auto":
                inp, leg = pol["input-only"], pol["legacy"]
                ratio_in, ratio_leg = _ratios(p, inp), _ratios(p, leg)
            rows.append(
                [
                    r["name"],
                    policy,
                    p["groups"],
                    f"{p['root_params']:,}",
                    fmt_bytes(p["largest_group"]),
                    *[fmt_bytes(p["peak"][w]) for w in WORLD_SIZES],
                    fmt_bytes(p["fsdp2_model"][8]),
                    fmt_bytes(p["fsdp2_model"][64]),
                    ratio_in,
                    ratio_leg,
                    verdict,
                ]
            )
    header = [
        "model",
        "policy",
        "groups",
        "root params",
        "largest group",
        *[f"peak fwd W={w}" for w in WORLD_SIZES],
        "W=8 FSDP2 model",
        "W=64 FSDP2 model",
        "auto/input-only W=8 (plan / model)",
        "auto/legacy W=8 (plan / model)",
        "predicted",
    ]
    memory = format_table(header, rows, right=(2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12))
    return (
        f"Full-size skeletons on meta (import of fsdp_compat + transformers: {import_s:.1f}s, not included)\n\n"
        f"{timing}\n\nPer-rank parameter bytes, analytic, fp32 as built. groups = all-gathers per forward, root "
        "included. 'peak fwd' = WrapPlan.per_rank_bytes(W)['peak_forward'] (the package's estimate); 'FSDP2 model' = "
        "resident + benchmarks.fsdp2_unsharded_estimate (the formula that matches the measured peaks of the "
        f"policies benchmark; it counts the local shard as still allocated, as FSDP2 does)\n\n{memory}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.skeletons", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated reference names (default: all)")
    parser.add_argument("--warm", type=int, default=9, help="warm plan_wrap calls per model (median reported)")
    args = parser.parse_args(argv)
    t = time.perf_counter()
    import transformers  # noqa: F401 - timed here so the first build does not carry it

    from fsdp_compat.plan import plan_wrap  # noqa: F401
    from fsdp_compat.testing.skeleton import REFERENCE_NAMES

    import_s = time.perf_counter() - t
    names = args.models.split(",") if args.models else list(REFERENCE_NAMES)
    t0 = time.monotonic()
    results = [measure(name, warm=args.warm) for name in names]
    print(format_results(results, import_s))
    print(f"\n(skeletons: {time.monotonic() - t0:.0f}s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
