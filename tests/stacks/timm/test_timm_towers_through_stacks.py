"""The timm tower kinds (``timm_inputs``: FastVLM, Gemma3n; ``timm_tile_inputs``: PerceptionLM) through two stacks'
own FSDP2 paths (issue 30, item 5), where tests/families runs them through the direct API only:

- transformers' native FSDP2: ``Model.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=2,
  fsdp_plan=...))`` (:func:`lab.transformers_smoke.run_native`), the user's plan giving the timm tower
  (``TimmWrapperModel``) one group and each text layer one;
- accelerate's ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)).prepare(model, optimizer)``
  (``lab.stacks.accelerate_ranks``, as tests/stacks/accelerate), whose ``_no_split_modules`` rule gives the tower
  (``TimmWrapperModel`` is in every timm family's list) one group.

Rank 0 trains an image micro-batch, rank 1 a text-only one, fp32, 2 gloo ranks, 2 AdamW steps. Unaligned (transformers:
``FSDP_COMPAT_MIXED_BATCHES=off``; accelerate: ``FSDP_COMPAT=off``) rank 0's all-gather of the tower group meets rank
1's of a text group and gloo aborts ("Received data size doesn't match expected size"); with fsdp-compat rank 1 runs
one zero dummy tower call per forward (the row's ``timm_inputs`` / ``timm_tile_inputs``) and both ranks equal one
process training on both micro-batches with the mean loss: gradients after each backward and parameters after each
step ``== 0.0``, each rank's loss the reference's on its own batch.

timm imports torchvision, which imports beside torch 2.14.1 only, so this folder runs in the ``families524-timm`` tox
env alone (transformers 5.24.0, timm 1.0.31, accelerate 1.16.0): a missing piece fails collection, never skips.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from lab.stack_families import tower_paths, tower_plan
from lab.support import OFF, ON, rank_output, rank_pythonpath, require_framework

from fsdp_compat.testing.crashes import GLOO_MISMATCH

require_framework("timm", lambda: importlib.import_module("timm"))
require_framework("transformers' native FSDP2", lambda: importlib.import_module("transformers.distributed.fsdp"))
require_framework("accelerate", lambda: importlib.import_module("accelerate.utils.fsdp_utils"))

from lab.transformers_smoke import aborts_then_exact, build_tiny, save_tiny  # noqa: E402

from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: timm tower kind (the row's dummy builder, ``fsdp_compat.runtime.vlm_families``) -> its families' tiny models,
#: smallest first (parameters on transformers 5.24): every one of them is exact through both stacks.
TIMM_KINDS: dict[str, tuple[str, ...]] = {
    "timm_inputs": ("lab.vlms:fast_vlm", "lab.vlms:gemma3n"),  # 36,218 (FastViT), 284,112 (PE ViT + audio)
    "timm_tile_inputs": ("lab.vlms:perception_lm",),  # 70,368 (PE ViT, one tile per image)
}
CASES = [pytest.param(m, id=f"{kind}-{m.rpartition(':')[2]}") for kind, models in TIMM_KINDS.items() for m in models]

VARIANTS = ["image", "text"]
TOWER = "model.vision_tower"


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", list(TIMM_KINDS))
def test_each_model_stands_for_its_kind_smallest_first(kind: str) -> None:
    """Each tiny model's row (found as the alignment finds it) has this kind's dummy builder and the tower at
    ``model.vision_tower``, a ``TimmWrapperModel``; the list is in order of size."""
    from fsdp_compat.runtime.vlm_families import FAMILIES

    sizes = []
    for name in TIMM_KINDS[kind]:
        model = build_tiny(name)
        row = next(  # the first module (in model order) whose class or a base a row names: tower_paths' rule
            f for m in model.modules() for f in FAMILIES if {c.__name__ for c in type(m).__mro__} & set(f.classes)
        )
        assert row.dummy.__name__ == kind, (name, row.dummy.__name__)
        assert tower_paths(model)[0] == TOWER, tower_paths(model)
        assert type(model.get_submodule(TOWER)).__name__ == "TimmWrapperModel"
        sizes.append(_count(model))
    assert sizes == sorted(sizes), sizes


# ------------------------------------------------------------------------------------ transformers' native FSDP2


def _tower_group_plan(model) -> dict[str, str]:
    """The user's plan: the whole timm tower one group, each text layer one."""
    _, text = tower_paths(model)
    return {TOWER: "free_full_weight", f"{text}.layers.*": "free_full_weight"}


def _native_crashes_then_exact(name: str, path: Path, plan: dict[str, str]) -> RunResult:
    """Unaligned, gloo aborts; aligned, 0.0 (:func:`lab.transformers_smoke.aborts_then_exact`), rank 1 running one
    dummy tower call per forward."""
    run = aborts_then_exact(name, path, plan, VARIANTS)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in run.ranks] == [2, 2]
    return run


@pytest.mark.parametrize("name", CASES)
def test_timm_tower_rank_without_images_crashes_then_trains_exactly_through_transformers(name, tmp_path) -> None:
    """The tower one group of the user's plan (``DistributedConfig.fsdp_plan``): unaligned, gloo aborts; aligned,
    the tower group is kept and both ranks equal one process (0.0). The checkpoint is ``save_pretrained``'s default
    layout: transformers 5.24's distributed load gives these families the plain load's weights (the runs are 0.0
    from a plainly loaded reference)."""
    model = build_tiny(name)
    path = save_tiny(name, tmp_path)
    run = _native_crashes_then_exact(name, path, _tower_group_plan(model))
    groups = run.ranks[0].extra["fsdp_groups"]
    assert [TOWER] in groups, groups
    assert not [g for g in groups if any(p.startswith(f"{TOWER}.") for p in g)], groups  # nothing split below it


def test_eva_block_plan_keeps_its_block_groups_and_trains_exactly(tmp_path) -> None:
    """The plan the other kinds' stack tests give (:func:`lab.stack_families.tower_plan`: each block of the tower's
    layer list one group, here the timm Eva's ``timm_model.blocks.*``). ``Eva.forward`` hands each block to timm's
    ``checkpoint`` -> ``torch.utils.checkpoint.checkpoint`` when gradient checkpointing is on; fsdp-compat's analysis
    follows that as a call of the block (through its hooks), so the plan check keeps the block groups (it dropped
    them into the root before). Unaligned, rank 0's block all-gathers meet rank 1's text-layer ones: gloo aborts;
    aligned, 0.0."""
    import transformers
    from fsdp_compat.adapters import transformers as adapter
    from transformers.distributed import fsdp as fsdp_module

    name = "lab.vlms:perception_lm"
    model = build_tiny(name)
    plan = tower_plan(model)
    assert plan == {f"{TOWER}.timm_model.blocks.*": "free_full_weight",
                    "model.language_model.layers.*": "free_full_weight"}  # fmt: skip
    blocks = [f"{TOWER}.timm_model.blocks.{i}" for i in range(2)]
    _, _, resolved = model._resolve_parallel_plans(transformers.DistributedConfig(fsdp_size=2, fsdp_plan=plan))
    _, changes = adapter.fix_fsdp_plan(model, resolved, fsdp_module.is_norm_and_head_pair)
    assert not [c for c in changes if any(path.startswith(TOWER) for path in c.paths)], changes

    run = _native_crashes_then_exact(name, save_tiny(name, tmp_path), plan)
    groups = run.ranks[0].extra["fsdp_groups"]
    assert all([block] in groups for block in blocks), groups
    assert ["model.language_model.layers.0"] in groups, groups


# ------------------------------------------------------------------------------------------ accelerate 1.16 FSDP2

#: the modules that bind ``fsdp2_prepare_model`` by name (as tests/stacks/accelerate)
BINDINGS = ["accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator"]
#: accelerate's own selection for these families: every ``_no_split_modules`` block (the whole timm tower, each text
#: decoder layer), the untied input embedding, lm_head (no final norm directly under ``model``), the root
ACCELERATE_GROUPS = [
    [""],
    [TOWER],
    ["model.language_model.embed_tokens"],
    ["model.language_model.layers.0"],
    ["model.language_model.layers.1"],
    ["lm_head"],
]


def _accelerate(model: str, env: dict[str, str | None]) -> RunResult:
    return run_ranks(
        "lab.stacks.accelerate_ranks:accelerate_rank",
        {"model": model, "steps": 2, "variants": VARIANTS, "bindings": BINDINGS},
        world_size=2,
        timeout_s=240,
        env={"PYTHONPATH": rank_pythonpath(), **env},
    )


@pytest.mark.parametrize("name", CASES)
def test_timm_tower_rank_without_images_crashes_then_trains_exactly_through_accelerate(name: str) -> None:
    """accelerate's own groups (the timm tower one of them). Unpatched (``FSDP_COMPAT=off``): gloo aborts. Patched
    by the ``.pth`` hook: the groups kept, rank 1 runs one dummy tower call per forward, both ranks exact (0.0)."""
    off = _accelerate(name, OFF)
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert GLOO_MISMATCH in current_wording(rank_output(off)), rank_output(off)[-4000:]
    assert all(r.extra["patched"] == [False, False, False] for r in off.ranks if "patched" in r.extra)

    on = _accelerate(name, ON)
    on.raise_for_error()
    for rank in on.ranks:
        extra = rank.extra
        assert extra["patched"] == [True, True, True]  # every by-name binding is fsdp-compat's
        assert extra["grad_diff"] == 0.0, extra["worst_grad_param"]  # NaN fails too
        assert extra["param_diff"] == 0.0, extra["worst_param"]
        assert extra["losses"] == extra["reference_losses"]
        assert extra["groups"] == ACCELERATE_GROUPS, extra["groups"]
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [2, 2]
    assert [r.extra["guard_unshards"] for r in on.ranks] == [0, 0]
    assert on.ranks[0].extra["losses"] != on.ranks[1].extra["losses"]  # each rank its own batch
