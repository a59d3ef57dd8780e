"""fsdp-compat: safe FSDP2 wrap plans, a run-time guard and mixed micro-batch alignment for verl, SkyRL and other
FSDP2 trainers. Commands: plan (explain a wrap plan), smoke (prove the fix on 2 CPU ranks), doctor (what is
installed, supported and patched)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from fsdp_compat.paths import within
from fsdp_compat.policies import POLICY_ORDER
from fsdp_compat.units import fmt_bytes


def _cmd_plan(args: argparse.Namespace) -> int:
    from fsdp_compat.plan import plan_wrap, unsafe_reads
    from fsdp_compat.testing.skeleton import build_skeleton, reference_skeleton

    if args.model.startswith("full:"):
        model = reference_skeleton(args.model.removeprefix("full:"))
    else:
        model = build_skeleton(args.model)
    layer_classes = args.layer_classes.split(",") if args.layer_classes else None
    plan = plan_wrap(model, layer_classes, policy=args.policy)
    print(plan.format(all_rows=args.all_rows))
    shown = [e for e in plan.evidence if args.all_evidence or _costs_sharding(e, plan)]
    if shown:
        print("  evidence (static analysis of the code that runs):")
        for event in shown:
            print(f"    - {event.describe()}")
    hidden = len(plan.evidence) - len(shown)
    if hidden:
        print(
            f"  ({hidden} more reads stay inside the group that owns them and cost no sharding; "
            "--all-evidence lists them)"
        )
    print()
    world = args.world_size
    print(f"Policies side by side (world size {world}; bytes per rank, analytic):")
    header = f"  {'policy':<13} {'groups':>6} {'root params':>12} {'resident':>11} {'peak fwd':>11}  verdict"
    print(header)
    for name in POLICY_ORDER:
        other = plan_wrap(model, layer_classes, policy=name)
        problems = unsafe_reads(model, other)
        sizes = other.per_rank_bytes(world)
        verdict = "ok" if not problems else f"crash: {problems[0]}"
        resident, peak = (fmt_bytes(sizes[k], decimals=2) for k in ("resident", "peak_forward"))
        print(f"  {name:<13} {len(other.groups):>6} {other.root_params:>12,} {resident:>11} {peak:>11}  {verdict}")
    return 0


def _costs_sharding(event: Any, plan: Any) -> bool:
    """Whether a piece of evidence explains a module that is not its own group (the rest is noise for a reader)."""
    kept = [entry.path for entry in plan.root]
    if event.kind == "opaque":
        return any(within(path, event.reader) for path in kept)
    return any(within(event.owner, path) or within(path, event.owner) for path in kept)


def _check_smoke_request(framework: str, device: str) -> None:
    """Refuse what cannot run with one line naming the fix (no traceback, no ZeroDivisionError)."""
    from fsdp_compat.errors import FsdpCompatError

    if device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            raise FsdpCompatError(
                f"--device cuda needs a CUDA GPU, but torch {torch.__version__} sees none "
                f"(torch.cuda.is_available() is False); run with --device cpu (2 gloo ranks)"
            )
    if framework in ("verl", "skyrl") and not _installed(framework):
        package = {"verl": "verl", "skyrl": "skyrl (or skyrl-train)"}[framework]
        raise FsdpCompatError(
            f"--framework {framework}: {package} is not installed in this environment ({sys.executable}); install "
            f"it here, or run --framework core (no framework needed) or --framework all (skips what is missing)"
        )


def _cmd_smoke(args: argparse.Namespace) -> int:
    import importlib

    from fsdp_compat.testing.smoke import format_smoke_table

    _check_smoke_request(args.framework, args.device)
    frameworks = ["core", "verl", "skyrl"] if args.framework == "all" else [args.framework]
    world_size = args.world_size
    if world_size is None:  # one NCCL rank per GPU (NCCL refuses two ranks on one GPU); 2 gloo ranks on CPU
        import torch

        world_size = torch.cuda.device_count() if args.device == "cuda" else 2
    rows = []
    for framework in frameworks:
        if args.framework == "all" and framework != "core" and not _installed(framework):
            print(f"{framework}: not installed in this environment, not run")
            continue
        module = importlib.import_module(f"fsdp_compat.testing.{framework}_smoke")
        rows.extend(module.run(world_size=world_size, steps=args.steps, device=args.device))
    print(format_smoke_table(rows))
    failed = [row for row in rows if not row.passed]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not rows else 0


def _installed(framework: str) -> bool:
    from importlib import metadata

    names = {"verl": ("verl",), "skyrl": ("skyrl", "skyrl-train")}[framework]
    for name in names:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return True
    return False


def _cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from fsdp_compat.doctor import as_dict, invalid_switches, report

    print(json.dumps(as_dict(), indent=2) if args.json else report())
    return 1 if invalid_switches() else 0  # a value the run would refuse, or not take as written


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (an impossible number is refused before any work)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from fsdp_compat import __version__

    parser = argparse.ArgumentParser(prog="fsdp-compat", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fsdp-compat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the wrap plan of a model and the policies side by side")
    plan.add_argument("model", help="a zoo name (glm4v, glm4v-moe, qwen2, ...), full:NAME for a full-size "
                      "reference (full:glm4v is GLM-4.1V-9B), a config.json, or a model folder (meta device)")
    plan.add_argument("--policy", default="auto", help="auto (default), legacy, legacy-skyrl, input-only, layers-only")
    plan.add_argument("--world-size", type=_positive, default=8, help="ranks for the per-rank byte figures (default 8)")
    plan.add_argument("--layer-classes", default=None, help="comma-separated layer class names (default: "
                      "the model's _no_split_modules)")
    plan.add_argument("--all-evidence", action="store_true", help="also list reads that cost no sharding")
    plan.add_argument("--all-rows", action="store_true", help="one row per group (default: repeated layers folded)")
    plan.set_defaults(func=_cmd_plan)

    smoke = sub.add_parser("smoke", help="GLM4V FSDP2: the legacy crash, then the fix with exact parity")
    smoke.add_argument("--framework", default="core", choices=["core", "verl", "skyrl", "all"],
                       help="core (default): fsdp-compat's own API, no framework needed; verl / skyrl: through the "
                       "installed framework's own apply_fsdp2; all: each that is installed")
    smoke.add_argument("--world-size", type=_positive, default=None,
                       help="ranks (default: 2 on cpu, one rank per GPU on cuda)")
    smoke.add_argument("--steps", type=_positive, default=3, help="AdamW steps per case (default 3)")
    smoke.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="cpu (default): gloo ranks on the CPU; cuda: NCCL, one rank per visible GPU")
    smoke.set_defaults(func=_cmd_smoke)

    doctor = sub.add_parser("doctor", help="installed frameworks, what is patched, whether activation is on; exits 1 "
                            "on a switch value the run would refuse")
    doctor.add_argument("--json", action="store_true", help="print the same facts as one JSON object (stable keys, "
                        "for scripts) instead of text")
    doctor.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from fsdp_compat.errors import FsdpCompatError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except FsdpCompatError as exc:
        print(f"fsdp-compat: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
