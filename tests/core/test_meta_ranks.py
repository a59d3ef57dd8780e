"""Same plan on every rank: rank 0 holds real weights, rank 1 a meta-device model (2 gloo ranks).

verl (``init_empty_weights`` on ranks != 0: meta parameters, real buffers) and skyrl-train / skyrl 0.4.0
(``module.to("meta")``: parameters and buffers on meta) plan FSDP2 groups on models without values. A plan that
differs between ranks makes FSDP2 issue different collectives on each rank: a hang, or a crash in the first
all-gather. Each rank plans with ``plan_wrap`` and ``select_wrap_targets`` (policy ``auto``), and the ranks compare
fingerprints with ``all_gather_object``. The guarded failure comes first in each launch: the comparison does see a
real difference between plans (rank 1 with one layer class fewer), so equality below is evidence, not a tautology.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fsdp_compat.testing.launch import run_ranks

TESTS = Path(__file__).resolve().parent
MODELS = ["glm4v", "glm4v-tied", "glm4v-moe", "t5-shared", "qwen2-fused-lmhead", "gemma3n"]


# ------------------------------------------------------------------------------------------------ rank side


def empty_weights(model: Any) -> Any:
    """What accelerate's ``init_empty_weights`` leaves: every Parameter on meta (shared ones stay one object),
    buffers real."""
    import torch
    from torch import nn

    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in memo:
                memo[id(param)] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = memo[id(param)]
    assert all(p.device == torch.device("meta") for p in model.parameters())
    return model


def fingerprint(model: Any, layers: list[str]) -> dict[str, Any]:
    """The plan as text (groups, kinds, reasons, sizes) and the flat list a framework selector gets."""
    from fsdp_compat.plan import plan_wrap, select_wrap_targets

    paths = {id(m): p for p, m in model.named_modules()}
    return {
        "plan": str(plan_wrap(model, layers, policy="auto")),
        "targets": [paths[id(m)] for m in select_wrap_targets(model, layers, policy="auto")],
    }


def plan_ranks(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Rank 0 plans on real weights; rank 1 on ``cfg["empty"]`` ("init_empty_weights" or "to_meta")."""
    import torch.distributed as dist

    from fsdp_compat.testing.parity import init_group
    from fsdp_compat.testing.zoo import build_model

    init_group(cfg, rank)  # gloo: no "device" in cfg
    extra["agree"], extra["meta"] = {}, {}
    # "control": the guarded failure first, rank 1 planning glm4v with one layer class fewer
    for name in ["control", *cfg["models"]]:
        model = build_model("glm4v" if name == "control" else name)
        layers = sorted(model._no_split_modules)
        if rank == 1:
            model = empty_weights(model) if cfg["empty"] == "init_empty_weights" else model.to("meta")
            layers = layers[:1] if name == "control" else layers
        extra["meta"][name] = sum(p.is_meta for p in model.parameters())
        slots = [p for m in model.modules() for p in m._parameters.values() if p is not None]
        extra.setdefault("shared_slots", {})[name] = len(slots) - len({id(p) for p in slots})
        mine = fingerprint(model, layers)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        extra["agree"][name] = all(x == everyone[0] for x in everyone)
        if rank == 0:
            extra.setdefault("plans", {})[name] = mine["targets"]
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ tests


def _run(**cfg: Any) -> list[dict[str, Any]]:
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    result = run_ranks(
        "test_meta_ranks:plan_ranks",
        cfg,
        world_size=2,
        timeout_s=240.0,
        env={"PYTHONPATH": os.pathsep.join([str(TESTS), *inherited])},
    )
    result.raise_for_error()
    return [rank.extra for rank in result.ranks]


@pytest.mark.parametrize("empty", ["init_empty_weights", "to_meta"])
def test_meta_rank_plans_the_same_groups(empty: str) -> None:
    """Planning reads structure and Parameter identity only, never values. One model differs under
    ``.to("meta")``, and not because of the planner: torch's ``Module.to`` across devices gives every module a
    new Parameter, so a tied ``lm_head``/``embed_tokens`` pair is no longer one Parameter on that rank (the
    planner keeps sharers together by identity). skyrl moves every rank, so its ranks still agree."""
    ranks = _run(models=MODELS, empty=empty)
    assert not ranks[0]["agree"]["control"], "the comparison must catch a rank that plans with other layers"
    for name in MODELS:
        assert ranks[0]["meta"][name] == 0 and ranks[1]["meta"][name] > 0, (name, ranks[1]["meta"])
        untied_by_to = ranks[1]["shared_slots"][name] < ranks[0]["shared_slots"][name]
        assert untied_by_to == (empty == "to_meta" and name in ("glm4v-tied", "t5-shared")), (name, empty)
        agree = ranks[0]["agree"][name] and ranks[1]["agree"][name]
        assert agree != untied_by_to, (name, empty, agree)
    print(f"{empty}: identical plans on a real and a meta rank for {', '.join(MODELS)} (except where to_meta untied)")
    assert not any("position_embedding" in p for p in ranks[0]["plans"]["glm4v"]), ranks[0]["plans"]["glm4v"]
