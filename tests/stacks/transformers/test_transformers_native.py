"""transformers' native FSDP2: ``from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=2))``.

Each distributed case first reproduces the real crash with fsdp-compat switched off (``FSDP_COMPAT=off``: the
``.pth`` hook stays out), then trains the same checkpoint with fsdp-compat installed (the hook patches
``transformers.distributed.fsdp`` the moment ``from_pretrained`` imports it) at exact parity with one process: fp32,
2 gloo ranks, each on its own micro-batch, 2 AdamW steps, against one process training on both ranks' micro-batches
with the mean loss; gradients after each backward and parameters after each AdamW step are asserted ``== 0.0``, and
each rank's loss equals the reference's loss of its own micro-batch. The mixed case (rank 0 images, rank 1 text only,
vision blocks sharded by the user's plan) shows gloo's collective mismatch with fsdp-compat's mixed-batch alignment
off (``FSDP_COMPAT_MIXED_BATCHES=off``), then the same exact parity with it on. Checkpoints are tiny real models
written by ``save_pretrained``. Runs in the ``hf524`` tox env (the only one that collects
this folder: a missing piece fails, never skips).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from lab.families import assert_held
from lab.stack_families import HELD, NATIVE_OWN_LAYOUT, STACKS, tower_layers, tower_plan
from lab.support import BREADTH, OFF, ON, require_framework

from fsdp_compat.policies import Auto, Legacy

transformers = importlib.import_module("transformers")
# transformers < 5.16 (the core env) has no native FSDP2
fsdp_module = require_framework(
    "transformers' native FSDP2", lambda: importlib.import_module("transformers.distributed.fsdp")
)

from fsdp_compat.adapters import transformers as adapter  # noqa: E402
from lab.transformers_smoke import (  # noqa: E402
    GLM4V_USER_PLAN,
    aborts_then_exact,
    assert_native_exact,
    assert_unaligned_aborts,
    build_tiny,
    load_differences,
    run_native,
    save_tiny,
)

from fsdp_compat.plan import plan_wrap  # noqa: E402
from fsdp_compat.testing.zoo import build_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: A user plan that shards GLM4V's vision blocks on their own (a large tower's usual choice).
MIXED_PLAN = {"model.visual.blocks.*": "free_full_weight"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: save_tiny(name, root) for name in ("gemma4", "glm4v")}


def resolved_plan(model, override=None) -> dict[str, str]:
    """The concrete plan transformers hands to apply_fully_sharded_data_parallelism (no process group needed)."""
    _, _, plan = model._resolve_parallel_plans(transformers.DistributedConfig(fsdp_size=2, fsdp_plan=override))
    return plan


def fsdp_compat_lines(run) -> list[str]:
    return [line for line in run.ranks[0].extra.get("log_tail", "").splitlines() if "fsdp_plan:" in line]


# ------------------------------------------------------------------------------------ through from_pretrained


def test_gemma4_builtin_plan_crashes_without_fsdp_compat(checkpoints):
    run = run_native("gemma4", checkpoints["gemma4"], env=OFF)
    assert not run.ok
    assert "aten.where.self got mixed torch.Tensor and DTensor" in (run.exception or ""), run.error


def test_gemma4_builtin_plan_exact_with_fsdp_compat(checkpoints):
    run = run_native("gemma4", checkpoints["gemma4"], env=ON)
    assert_native_exact(run)
    groups = run.ranks[0].extra["fsdp_groups"]
    assert ["model.language_model.embed_tokens"] not in groups
    assert ["model.language_model.layers.0"] in groups and ["model.language_model.norm"] in groups
    (line,) = fsdp_compat_lines(run)
    assert line.startswith("fsdp-compat: Gemma4ForConditionalGeneration fsdp_plan: model.language_model.embed_tokens")


def test_glm4v_user_plan_crashes_without_fsdp_compat(checkpoints):
    run = run_native("glm4v", checkpoints["glm4v"], fsdp_plan=GLM4V_USER_PLAN, env=OFF)
    assert not run.ok
    assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in (run.exception or ""), run.error


def test_glm4v_user_plan_exact_with_fsdp_compat(checkpoints):
    run = run_native("glm4v", checkpoints["glm4v"], fsdp_plan=GLM4V_USER_PLAN, env=ON)
    assert_native_exact(run)
    groups = run.ranks[0].extra["fsdp_groups"]
    assert ["model.visual.embeddings.position_embedding"] not in groups
    assert ["model.language_model.embed_tokens"] in groups  # the safe rest of the plan is kept
    (line,) = fsdp_compat_lines(run)
    assert "model.visual.embeddings.position_embedding: no group of its own" in line


def test_glm4v_rank_without_images_crashes_then_trains_exactly(checkpoints):
    """Rank 0 an image micro-batch, rank 1 text only; the user's plan gives the vision blocks groups of their own
    (transformers' built-in GLM4V plan leaves them in the root, where no mismatch can arise). transformers' forward
    calls the tower only with pixel_values, so with the alignment off rank 1's text-layer all-gathers meet rank 0's
    vision-block ones (gloo aborts); with fsdp-compat (installed by the adapter after transformers' plan) rank 1 runs
    one zero dummy tower call per forward and both ranks equal one process on both micro-batches (0.0)."""
    variants = ["image", "text"]
    glm4v = checkpoints["glm4v"]
    run = aborts_then_exact("glm4v", glm4v, MIXED_PLAN, variants)
    assert ["model.visual.blocks.0"] in run.ranks[0].extra["fsdp_groups"]
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in run.ranks] == [2, 2]


#: One family of every other tower kind (lab.stack_families: the smallest exact one transformers 5.25 has), the
#: patch grid being GLM4V's above.
KIND_FAMILIES = STACKS["transformers"]


@pytest.mark.parametrize("name", [pytest.param(name, id=kind, marks=BREADTH) for kind, name in KIND_FAMILIES.items()])
def test_every_tower_kind_rank_without_images_crashes_then_trains_exactly(name, tmp_path):
    """As the GLM4V case, for one family of each tower kind: the user's plan gives each block of the family's vision
    tower (the module its row names) one group, and each text layer one. With the alignment off rank 0's vision-block
    all-gathers meet rank 1's text-layer ones (gloo aborts); with fsdp-compat rank 1 runs one dummy tower call per
    forward and both ranks equal one process on both micro-batches (0.0)."""
    model = build_tiny(name)
    plan = tower_plan(model)
    layers = tower_layers(model)
    first = layers if plan.get(layers) else f"{layers}.0"
    path = save_tiny(name, tmp_path, original_format=name not in NATIVE_OWN_LAYOUT)
    variants = ["image", "text"]
    run = aborts_then_exact(name, path, plan, variants)
    assert [first] in run.ranks[0].extra["fsdp_groups"], run.ranks[0].extra["fsdp_groups"]
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in run.ranks] == [2, 2]


@pytest.mark.parametrize(
    "name", [pytest.param(name, id=kind, marks=BREADTH) for kind, name in HELD["transformers"].items()]
)
def test_inexact_tower_kind_aborts_then_stays_within_fsdp2s_own_distance(name, tmp_path):
    """For a kind whose all-image FSDP2 run is not exact (lab.stack_families.HELD): with the alignment off the
    image|text ranks abort; with it, the all-image run (no dummy: FSDP2's own arithmetic) is measured first, and the
    image|text run, one dummy tower call per forward on rank 1, is held to the all-image run
    (:func:`~lab.families.assert_held`)."""
    plan = tower_plan(build_tiny(name))
    path = save_tiny(name, tmp_path, original_format=name not in NATIVE_OWN_LAYOUT)
    assert_unaligned_aborts(name, path, plan, ["image", "text"])
    alone = run_native(name, path, fsdp_plan=plan, env=ON, variants=["image", "image"])
    run = run_native(name, path, fsdp_plan=plan, env=ON, variants=["image", "text"])
    for result, dummies in ((alone, [0, 0]), (run, [0, 2])):
        result.raise_for_error()
        assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == dummies
    diffs = [(result.max_abs_grad_diff, result.max_abs_param_diff) for result in (alone, run)]
    assert_held(name, *diffs)


@BREADTH
def test_original_layout_loads_other_vision_weights_upstream(tmp_path):
    """The canary of the loader fsdp-compat replaces (huggingface/transformers#48519; the repair:
    test_original_layout.py): fsdp-compat off, Kimi K2.5's checkpoint in its original layout loads other vision q/k/v
    weights sharded than plainly, the same checkpoint in transformers' layout loads equal. When the first assertion
    fails transformers has fixed its load: a release that changes ``convert_and_load_state_dict_in_model`` is left
    alone by fingerprint; give it a row without the loader replacement (docs/stacks.md)."""
    name = "lab.vlms:kimi_k25"
    original = load_differences(name, save_tiny(name, tmp_path / "original"), env=OFF)
    own = load_differences(name, save_tiny(name, tmp_path / "own", original_format=False), env=OFF)
    original.raise_for_error()
    own.raise_for_error()
    for rank in original.ranks:
        differing = rank.extra["differences"]
        assert {p.rpartition(".")[0].rpartition(".")[2] for p in differing} == {"q_proj", "k_proj", "v_proj"}, differing
        assert all(p.startswith("model.vision_tower.") for p in differing) and min(differing.values()) > 0.01, differing
    assert [rank.extra["differences"] for rank in own.ranks] == [{}, {}]


@BREADTH
def test_audio_rank_against_text_rank_crashes_then_trains_exactly(tmp_path):
    """The audio tower kind (Qwen2.5-Omni's thinker, ``lab.vlms``): rank 0 audio, rank 1 text only, the user's plan
    giving each audio encoder layer and each text layer a group. Unaligned, rank 0's audio-layer all-gathers meet
    rank 1's text-layer ones (gloo aborts); aligned, rank 1 runs one dummy clip per forward and both ranks equal one
    process (0.0)."""
    name = "lab.vlms:qwen2_5_omni_thinker"
    plan = {"model.audio_tower.layers.*": "free_full_weight", "model.language_model.layers.*": "free_full_weight"}
    path = save_tiny(name, tmp_path)
    variants = ["audio", "text"]
    run = aborts_then_exact(name, path, plan, variants)
    assert ["model.audio_tower.layers.0"] in run.ranks[0].extra["fsdp_groups"]
    assert [r.extra["mixed_batches"]["audio_dummy_calls"] for r in run.ranks] == [0, 2]  # one per forward
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == [0, 0]  # no image on either rank


def test_exported_plan_trains_exact_through_transformers_alone(checkpoints):
    """``plan_wrap(...).to_transformers_fsdp_plan()`` passed by the user, fsdp-compat's adapter switched off."""
    model = build_tiny("glm4v")
    exported = plan_wrap(model).to_transformers_fsdp_plan(model)
    assert exported["model.visual.blocks.*"] == "free_full_weight"
    assert not any("position_embedding" in key for key in exported)
    run = run_native("glm4v", checkpoints["glm4v"], fsdp_plan=exported, env=OFF)
    assert_native_exact(run)
    assert ["model.visual.blocks.0"] in run.ranks[0].extra["fsdp_groups"]


# --------------------------------------------------------------------------------------- the plan fixer alone


@pytest.mark.parametrize("name", ["qwen2", "glm4v", "glm4v-tied"])
def test_safe_builtin_plans_are_left_untouched(name):
    model = build_model(name)
    plan = resolved_plan(model)
    fixed, changes = adapter.fix_fsdp_plan(model, plan, fsdp_module.is_norm_and_head_pair)
    assert changes == []
    assert fixed == plan and list(fixed) == list(plan)


def test_read_after_forward_becomes_keep_full_weight():
    """qwen2-zloss reads lm_head.weight after calling lm_head: keeping it unsharded covers the read."""
    model = build_model("qwen2-zloss")
    plan = resolved_plan(model, {"lm_head": "free_full_weight"})
    fixed, changes = adapter.fix_fsdp_plan(model, plan, fsdp_module.is_norm_and_head_pair)
    assert fixed == {**plan, "lm_head": "keep_full_weight"}
    assert [(c.paths, c.action) for c in changes] == [(("lm_head",), "keep-full-weight")]


def test_raw_read_before_forward_is_dropped_not_kept():
    """A fused-kernel style read of lm_head.weight in the root, lm_head never called: only the root covers it."""
    model = build_model("qwen2-fused-lmhead")
    plan = resolved_plan(model)
    fixed, changes = adapter.fix_fsdp_plan(model, plan, fsdp_module.is_norm_and_head_pair)
    assert "lm_head" not in fixed and fixed["model.norm"] == "keep_full_weight"
    assert changes[0].action == "dropped" and changes[0].now_in == "<root>"


def test_shared_weight_stays_in_one_group():
    """T5: shared, encoder.embed_tokens and decoder.embed_tokens hold one weight (tied after sharding)."""
    model = build_model("t5-shared")
    plan = resolved_plan(model)
    assert {"encoder.embed_tokens", "decoder.embed_tokens"} <= set(plan)
    fixed, changes = adapter.fix_fsdp_plan(model, plan, fsdp_module.is_norm_and_head_pair)
    assert "encoder.embed_tokens" not in fixed and "decoder.embed_tokens" not in fixed
    assert all("hold one Parameter" in c.why for c in changes)


def test_legacy_policy_passes_the_plan_through():
    model = build_tiny("gemma4")
    plan = resolved_plan(model)
    seen: list[dict[str, str]] = []

    def original(model, mesh_manager, fsdp_plan, ep_plan):
        seen.append(fsdp_plan)
        return model

    original.__module__ = fsdp_module.__name__
    adapter.make_apply_fully_sharded_data_parallelism(original, Legacy())(model, None, plan, {})
    adapter.make_apply_fully_sharded_data_parallelism(original, Auto())(model, None, plan, {})
    assert seen[0] == plan
    assert "model.language_model.embed_tokens" not in seen[1]


def test_adapter_replaced_the_function_in_both_modules():
    """Importing transformers' FSDP module (the .pth hook) patched the definer and the mixin's by-name binding."""
    from transformers.distributed import mixin

    assert adapter.is_patched()
    assert getattr(fsdp_module.apply_fully_sharded_data_parallelism, "__fsdp_compat__", False)
    assert mixin.apply_fully_sharded_data_parallelism is fsdp_module.apply_fully_sharded_data_parallelism


def test_expand_fsdp_plan_row_filters_the_target_lists():
    """transformers 5.16-5.22 row: ``expand_fsdp_plan`` returns (reshard, no-reshard) target lists; the replacement
    returns them without the unsafe entry (the shape of 5.16.1's function, which 5.24 no longer ships)."""
    model = build_tiny("glm4v")
    plan = {
        **GLM4V_USER_PLAN,
        "model.language_model.layers.0": "free_full_weight",
        "model.language_model.norm": "keep_full_weight",
    }

    def expand_fsdp_plan(model, fsdp_plan):
        targets = [(name, model.get_submodule(name)) for name in fsdp_plan]
        return (
            [t for t in targets if fsdp_plan[t[0]] != "keep_full_weight"],
            [t for t in targets if fsdp_plan[t[0]] == "keep_full_weight"],
        )

    expand_fsdp_plan.__module__ = fsdp_module.__name__
    reshard, keep = adapter.make_expand_fsdp_plan(expand_fsdp_plan, Auto())(model, plan)
    assert [name for name, _ in reshard] == ["model.language_model.layers.0"]
    assert [name for name, _ in keep] == ["model.language_model.norm"]
