"""GLM4V through verl's REAL training engine: ``TrainingWorker(TrainingWorkerConfig(...)).reset()`` and
``train_batch`` (``forward_backward_batch`` + ``optimizer_step``), then ``engine.get_per_tensor_param()``.

Ranks are fresh interpreters (``tests/lab/stacks/verl_engine_ranks.py``) that never import fsdp_compat's adapter: the
installed wheel's ``.pth`` hook / ``verl.plugins`` entry point activate it, exactly as for a user. On CPU the
test-side pieces are a platform registered through verl's public ``PlatformRegistry`` (``lab.stacks.verl_cpu_platform``,
verl >= 0.9.0) and, for the remove-padding recipe only, a pure-torch stand-in for flash-attn's varlen kernel
(flash-attn needs CUDA; where verl stops without it is asserted). The tiny GLM4V is saved with ``save_pretrained``
and loaded by verl itself (meta-device init on rank 1, ``apply_monkey_patch``, FSDP2, ``fsdp2_load_full_state_dict``).
Cases are grouped into four rank launches (the verl import dominates): ``FSDP_COMPAT=off`` and the default, each for
the zoo GLM4V and for the patch-14 GLM4V (a different micro-batch per rank, mixed image/text ranks, verl's
remove-padding recipe). Each guarded failure is shown first.

Figures asserted below were measured with torch 2.13.0+cpu, transformers 5.10.4, verl 0.9.1, 2 gloo ranks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib import metadata
from typing import Any

import pytest
from lab.stacks.verl_engine_ranks import assert_reference_steps_exact
from lab.support import rank_pythonpath, require_framework
from packaging.specifiers import SpecifierSet
from packaging.version import Version

VERL = require_framework("verl", lambda: Version(metadata.version("verl")))

from fsdp_compat.testing.launch import RunResult, run_ranks  # noqa: E402
from fsdp_compat.testing.verl_smoke import GRID_SAMPLER_CRASH  # noqa: E402

DEVICE = os.environ.get("FSDP_COMPAT_TEST_DEVICE", "cpu")
TRANSFORMERS_5 = Version(metadata.version("transformers")).major >= 5
SHAPE_CRASH = "AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'shape'"
#: verl 0.9.1's Qwen2-VL text-only dummy on transformers 5 (``.mean()`` of the tower's output)
MEAN_CRASH = "AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'mean'"
ROPE_CRASH_TF4 = (
    "RuntimeError: The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 0"
)
#: pin_memory() without an accelerator: a CPU build of torch, or a CUDA build (verl's torch 2.11.0 pin) on a host
#: without a GPU driver
PIN_CRASHES = (
    "RuntimeError: Cannot access accelerator device when none is available.",
    "RuntimeError: Found no NVIDIA driver on your system.",
)
#: step-1 loss of the fp32 run = the unsharded run of verl's forward on the same weights (CPU, figures above)
FP32_STEP1_LOSS_CPU = 4.9012651443481445
TIMEOUT_S = 300.0
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}

CASES: list[dict[str, Any]] = [
    # fp32 MixedPrecisionPolicy: the step-1 loss must equal the unsharded single-process verl forward
    {"name": "fp32", "reference": True, "engine": {"mixed_precision": FP32}},
    # verl's defaults: bf16 mixed precision, gradient checkpointing, meta-device init on rank 1
    {"name": "defaults"},
    # LoRA through verl's own builder (_build_lora_module: get_peft_model, all-linear)
    {"name": "lora", "model": {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}},
    # verl's fused kernels, torch backend: its forward reads lm_head.weight raw
    {"name": "fused", "model": {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": "torch"}}},
]
#: the two paths that use CPUOffloadPolicy(pin_memory=True): the ref model (forward_only) and offload_policy
OFFLOAD = [
    {"name": "ref", "engine": {"forward_only": True}},
    {"name": "offload_policy", "engine": {"offload_policy": True}},
]

#: verl.plugin.platform (the public platform registry) and VERL_ENGINE_DEVICE arrived in 0.9.0
ENGINE_ON_CPU = SpecifierSet(">=0.9.0").contains(VERL, prereleases=True)
#: verl/models/transformers/glm4v.py (verl's own GLM4V forward) arrived in 0.6.0
has_glm4v_forward = pytest.mark.skipif(
    not SpecifierSet(">=0.6.0").contains(VERL, prereleases=True),
    reason=f"verl {VERL} has no GLM4V forward of its own (verl/models/transformers/glm4v.py: 0.6.0+)",
)
needs_engine = pytest.mark.skipif(
    not SpecifierSet(">=0.8.0").contains(VERL, prereleases=True) or (DEVICE == "cpu" and not ENGINE_ON_CPU),
    reason=f"verl {VERL}: the TrainingWorker engine path is 0.8.0+ (older releases train through fsdp_workers, "
    "test_verl.py); on CPU it needs verl.plugin.platform and VERL_ENGINE_DEVICE (0.9.0+): verl 0.8.0's "
    "EngineRegistry asserts 'Unknown device: cpu' (its FSDP engine registers cuda/npu only); runs in the -gpu factor",
)


@pytest.fixture(autouse=True, scope="module")
def _device() -> None:
    if DEVICE.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.fail("FSDP_COMPAT_TEST_DEVICE=cuda but CUDA is not available", pytrace=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_compat.testing.zoo import build_model

    path = tmp_path_factory.mktemp("glm4v")
    build_model("glm4v").save_pretrained(path)
    return str(path)


def _world_size() -> int:
    if DEVICE != "cuda":
        return 2
    import torch

    return max(1, torch.cuda.device_count())


def _launch(
    model_dir: str, cases: list[dict[str, Any]], env: dict[str, str], **dirs: str
) -> list[dict[str, Any]]:
    clean = {k: "" for k in ("FSDP_COMPAT", "FSDP_COMPAT_POLICY", "VERL_USE_EXTERNAL_MODULES")}
    result: RunResult = run_ranks(
        "lab.stacks.verl_engine_ranks:engine_ranks",
        {"model_dir": model_dir, "device": DEVICE, "cases": cases, **dirs},
        world_size=_world_size(),
        timeout_s=TIMEOUT_S,
        env={**clean, "PYTHONPATH": rank_pythonpath(), **env},
    )
    result.raise_for_error()
    first = result.ranks[0].extra["cases"]
    timing = ", ".join(f"{c['name']} {first[c['name']]['case_s']:.1f}s" for c in cases if c["name"] in first)
    print(f"verl {VERL} engine launch: {result.seconds:.1f}s (rank 0, per case: {timing})")
    return [rank.extra for rank in result.ranks]


@pytest.fixture(scope="module")
def off(model_dir: str) -> list[dict[str, Any]]:
    return _launch(model_dir, [{"name": "off", "expect_failure": True, "reference": True}], {"FSDP_COMPAT": "off"})


@pytest.fixture(scope="module")
def on(model_dir: str) -> list[dict[str, Any]]:
    if DEVICE == "cuda":
        cases = CASES + OFFLOAD
    else:  # the blocker is at wrap time on both ranks, before any collective: the launch goes on after it
        cases = CASES + [{**c, "expect_failure": True, "at_setup": True} for c in OFFLOAD]
    return _launch(model_dir, cases, {})


@pytest.fixture(scope="module")
def p14_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny GLM4V with a patch-14 vision tower: verl's text-only dummy (16 x 1176 patches) fits it."""
    import lab.stacks.verl_engine_ranks as verl_engine_ranks

    path = tmp_path_factory.mktemp("glm4v-p14")
    verl_engine_ranks.build_glm4v_p14().save_pretrained(path)
    return str(path)


#: fp32 compute, and verl's clip made a no-op (clip_grad 1e9: the factor is exactly 1.0): a sharded gradient norm
#: sums its squares in another order than one process does, so a clip that bites differs in the last bits
PARITY = {"model_dir": "p14_dir", "engine": {"mixed_precision": FP32}, "optimizer": {"clip_grad": 1e9}}
#: verl's VLM recipe: use_remove_padding=True (model config and batch meta), verl's default mixed precision (no
#: mixed_precision key: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) + bf16 autocast), gradient
#: checkpointing (verl's default), 2 rows per micro-batch (micro_batch_size_per_gpu 2), rank 0 image rows, rank 1
#: text-only rows, 2 steps. The clip is made a no-op as in PARITY so that the comparison can be exact.
RECIPE = {"model_dir": "p14_dir", "kinds": ["image", "text"], "remove_padding": True, "optimizer": {"clip_grad": 1e9}}
#: verl 0.9.0's remove-padding GLM4V attention (glm4v_attn_forward) imports apply_multimodal_rotary_pos_emb, which
#: transformers 5 (what verl 0.9.x requires) no longer has: it cannot run anywhere; 0.9.1 uses apply_rotary_pos_emb
RECIPE_RUNS = SpecifierSet(">=0.9.1").contains(VERL, prereleases=True)
ROPE_IMPORT = "ImportError: cannot import name 'apply_multimodal_rotary_pos_emb' from 'transformers.models.glm4v"
#: remove-padding attention needs flash-attn's varlen kernel (CUDA): on CPU the recipe runs with a pure-torch stand-in
#: for it (``cpu_varlen_attention`` in tests/lab/stacks/verl_engine_ranks.py), and without it records where verl stops
RECIPE_CASES = [
    # no flash-attn and no stand-in: verl's own remove-padding attention cannot run (the stop is asserted)
    {"name": "recipe_no_flash", **RECIPE, "expect_failure": True, "same_stop": True},
    # fp32 compute with remove padding: verl's attention hands flash-attn's bf16 output to the fp32 o_proj
    {"name": "recipe_fp32", **RECIPE, "flash_stand_in": True, "engine": {"mixed_precision": FP32},
     "expect_failure": True, "same_stop": True},
    {"name": "recipe", **RECIPE, "flash_stand_in": True, "expect_failure": not RECIPE_RUNS, "same_stop": True},
]
#: rank 0 micro-batches of one image per row, rank 1 of other image sizes (another token count) / of text only
PARITY_CASES = [
    {"name": "parity", "kinds": ["image", "image2"], **PARITY},
    {"name": "mixed", "kinds": ["image", "text"], **PARITY},
]


@pytest.fixture(scope="module")
def parity(model_dir: str, p14_dir: str) -> list[dict[str, Any]]:
    return _launch(model_dir, PARITY_CASES + RECIPE_CASES, {}, p14_dir=p14_dir)


@pytest.fixture(scope="module")
def mixed_off(model_dir: str, p14_dir: str) -> list[dict[str, Any]]:
    # both ranks stop in the vision tower's position embedding, after the same collectives: the launch goes on
    mixed = {"name": "mixed", "kinds": ["image", "text"], "expect_failure": True, "same_stop": True, **PARITY}
    recipe = {"name": "recipe", **RECIPE, "flash_stand_in": True, "expect_failure": True}
    return _launch(model_dir, [mixed, recipe], {"FSDP_COMPAT": "off"}, p14_dir=p14_dir)


def _case(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [rank["cases"][name] for rank in ranks]


def _trained(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Both ranks trained two steps with finite, identical losses that moved; plans agreed across ranks."""
    per_rank = _case(ranks, name)
    for case in per_rank:
        assert len(case["losses"]) == 2 and all(math.isfinite(x) for x in case["losses"]), case["losses"]
        assert case["losses"][1] != case["losses"][0], f"{name}: the loss did not move: {case['losses']}"
        assert case["plans_agree"], f"{name}: ranks planned different FSDP2 groups"
        assert "model.visual.embeddings.position_embedding" not in case["groups"], case["groups"]
    assert all(c["losses"] == per_rank[0]["losses"] for c in per_rank), [c["losses"] for c in per_rank]
    print(f"verl {VERL} {name}: losses {per_rank[0]['losses']} groups {per_rank[0]['groups']}")
    return per_rank


# -------------------------------------------------------------------------------------- the guarded failures


@needs_engine
def test_off_switch_reproduces_the_grid_sampler_crash(off: list[dict[str, Any]]) -> None:
    """FSDP_COMPAT=off: verl's own selector gives position_embedding a group; the first forward crashes. The
    unsharded run of verl's GLM4V forward (rank 0, before training) fails too, in verl's own code."""
    for rank in off:
        assert not rank["state"]["patched"] and not rank["state"]["glm4v_repaired"], rank["state"]
        case = rank["cases"]["off"]
        assert GRID_SAMPLER_CRASH in case["error"], case
        assert "model.visual.embeddings.position_embedding" in case["groups"], case["groups"]
    reference = off[0]["cases"]["off"]["reference"]
    if TRANSFORMERS_5:
        assert reference["error"] == SHAPE_CRASH, reference


# ---------------------------------------------------------------------------------------------- it trains


@needs_engine
def test_fp32_step1_loss_equals_unsharded_verl_forward(on: list[dict[str, Any]]) -> None:
    """fp32 MixedPrecisionPolicy: verl's engine on 2 ranks vs. the same checkpoint, unsharded, one process,
    through the engine's own forward_step; verl's unrepaired _get_input_embeds crashes on that same model."""
    fp32 = _trained(on, "fp32")
    reference = fp32[0]["reference"]
    assert reference.get("error") is None, reference
    assert fp32[0]["losses"][0] == reference["loss"], (fp32[0]["losses"], reference)
    if DEVICE == "cpu":
        assert reference["loss"] == FP32_STEP1_LOSS_CPU, reference
    if TRANSFORMERS_5:
        assert reference["unrepaired"] == SHAPE_CRASH, reference
        for rank in on:
            assert rank["state"]["glm4v_repaired"], rank["state"]
    for rank in on:
        assert rank["state"]["patched"] and rank["state"]["activated_by"] in ("pth-hook", "verl.plugins entry point")


@needs_engine
def test_verl_defaults_bf16_checkpointing_meta_rank(on: list[dict[str, Any]]) -> None:
    """verl's defaults: bf16 compute, HF gradient checkpointing, and rank 1 built on meta (init_empty_weights):
    the patched selector saw a meta model there and a real one on rank 0, and both chose the same groups."""
    per_rank = _trained(on, "defaults")
    for case in per_rank:
        assert case["compute_dtype"] == "torch.bfloat16" and case["gradient_checkpointing"], case
        (call,) = case["selector_calls"]
        assert call["patched_selector"], call
    calls = [case["selector_calls"][0] for case in per_rank]
    assert calls[0]["meta_params"] == 0
    if len(calls) > 1:
        assert calls[1]["meta_params"] == calls[1]["params"] > 0, calls[1]
    assert all(c["targets"] == calls[0]["targets"] for c in calls), calls


@needs_engine
def test_lora_through_verls_builder(on: list[dict[str, Any]]) -> None:
    per_rank = _trained(on, "lora")
    for case in per_rank:
        assert case["peft"], case
        assert case["trainable"] and all("lora_" in name for name in case["trainable"]), case["trainable"]


@needs_engine
def test_fused_kernels_torch_backend(on: list[dict[str, Any]]) -> None:
    """verl's fused forward reads lm_head.weight raw: lm_head must not be a group of its own."""
    for case in _trained(on, "fused"):
        assert "lm_head" not in case["groups"], case["groups"]


@needs_engine
def test_weight_sync_returns_every_parameter(on: list[dict[str, Any]]) -> None:
    """engine.get_per_tensor_param(): every parameter of the model, full (unsharded) size, on every rank."""
    from fsdp_compat.testing.zoo import build_model

    model = build_model("glm4v")
    names = sorted(n for n, _ in model.named_parameters())
    total = sum(p.numel() for p in model.parameters())
    for name in ("fp32", "defaults", "fused"):
        for case in _case(on, name):
            assert case["synced"] == names and case["synced_numel"] == total, (name, len(case["synced"]))
    for case in _case(on, "lora"):  # verl sends the base weights under their base names (+ the adapter config)
        assert case["synced_numel"] == total, case["synced_numel"]


@needs_engine
def test_ref_model_and_offload_policy(on: list[dict[str, Any]]) -> None:
    """Both use CPUOffloadPolicy(pin_memory=True). On CPU that is the blocker (pin_memory needs an accelerator:
    asserted here); with FSDP_COMPAT_TEST_DEVICE=cuda both run: the ref model infers, offload_policy trains."""
    if DEVICE == "cpu":
        for name in ("ref", "offload_policy"):
            for case in _case(on, name):
                assert case["error"].startswith(PIN_CRASHES) and "pin_memory()" in case["traceback"], case
        return
    ref = _case(on, "ref")
    assert all(len(c["losses"]) == 2 and c["losses"][0] == c["losses"][1] for c in ref), ref  # no step: same loss
    _trained(on, "offload_policy")


# ------------------------------------------------------- a different batch on every rank; mixed image/text ranks

DUMMY = [16, 1176]  #: verl's text-only dummy: zeros(16, 1176), grid [[1, 4, 4]] (verl/models/transformers/glm4v.py)
PATCHES = {"image": [48, 1176], "image2": [96, 1176], "text": DUMMY}  #: the vision tower's input per micro-batch kind


def _assert_exact_parity(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Every step: each rank's own loss, the full gradients and the post-AdamW parameters equal one process that
    ran verl's forward on all ranks' micro-batches, ``(loss_r / 2).backward()`` each, one AdamW step: 0.0."""
    cases = _case(ranks, name)
    reference = cases[0]["reference"]
    assert_reference_steps_exact(reference, 2, name)
    first, second = (s["loss"] for s in cases[0]["steps"])
    assert first != second, f"{name}: the loss did not move"
    losses = "; ".join(f"step {i + 1} losses {r['losses']}" for i, r in enumerate(reference["steps"]))
    print(f"verl {VERL} {name}: {losses}")
    return reference


@needs_engine
def test_different_batch_per_rank_step2_parity(parity: list[dict[str, Any]]) -> None:
    """Rank 0 and rank 1 train on different image micro-batches (other sizes, other token counts) for 2 steps:
    step-1 and step-2 losses, gradients and post-AdamW parameters equal one process exactly (0.0, fp32)."""
    reference = _assert_exact_parity(parity, "parity")
    kinds = PARITY_CASES[0]["kinds"]
    for rank, case in enumerate(_case(parity, "parity")):
        assert [s["vision_calls"] for s in case["steps"]] == [[PATCHES[kinds[rank]]]] * 2, case["steps"]
    assert all(s["vision_calls"] == [PATCHES[k] for k in kinds] for s in reference["steps"]), reference


def _grid_sampler_crash(ranks: list[dict[str, Any]], name: str) -> None:
    """Every rank ran the vision tower (rank 1 on verl's dummy) and crashed in verl's position_embedding group."""
    for rank, state in enumerate(ranks):
        assert not state["state"]["patched"], state["state"]
        case = state["cases"][name]
        assert GRID_SAMPLER_CRASH in case["error"], (name, case)
        assert "model.visual.embeddings.position_embedding" in case["groups"], (name, case["groups"])
        assert case["vision_calls"] == [PATCHES[["image", "text"][rank % 2]]], (name, case["vision_calls"])


@needs_engine
def test_mixed_batches_off_switch_crashes(mixed_off: list[dict[str, Any]]) -> None:
    """FSDP_COMPAT=off, rank 0 with images and rank 1 text only: both ranks reach the vision tower (rank 1 through
    verl's own dummy), both crash in verl's position_embedding group with the grid_sampler error. That crash, not a
    collective mismatch, is what a verl user meets: verl's GLM4V forward runs the tower on a zero dummy for a
    text-only micro-batch, so the ranks' collectives already pair up; in verl the alignment's job is to add no second
    dummy (the next test counts the tower calls)."""
    _grid_sampler_crash(mixed_off, "mixed")


@needs_engine
def test_mixed_image_and_text_ranks_train_with_exact_parity(parity: list[dict[str, Any]]) -> None:
    """Rank 0 has images, rank 1 none. verl's forward runs the tower on its own zero dummy on rank 1, so the FSDP2
    collectives pair up; with fsdp-compat installed that dummy runs exactly once per step (a second dummy of ours
    would show as a second call) and training equals one process on both micro-batches, 0.0 (fp32)."""
    reference = _assert_exact_parity(parity, "mixed")
    image, text = _case(parity, "mixed")
    assert [s["vision_calls"] for s in image["steps"]] == [[PATCHES["image"]]] * 2, image["steps"]
    assert [s["vision_calls"] for s in text["steps"]] == [[DUMMY]] * 2, text["steps"]
    for step in reference["steps"]:
        assert step["vision_calls"] == [PATCHES["image"], DUMMY], step
        assert step["grad_norm_vision"] > 0.0, step  # the image rank trains the tower


# ------------------------------------------------------------------ verl's GLM4V forward, every release, 1 process


def _probe(env: dict[str, str], probe: str = "forward_probe") -> dict[str, Any]:
    code = f"import json, lab.stacks.verl_engine_ranks as r; print(json.dumps(r.{probe}()))"
    full = {**os.environ, "PYTHONPATH": rank_pythonpath(), "VERL_USE_EXTERNAL_PLUGINS": "none", **env}
    full.pop("VERL_USE_EXTERNAL_MODULES", None)
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@has_glm4v_forward
def test_glm4v_forward_matches_transformers() -> None:
    """transformers 5 (verl 0.7.1+): verl's GLM4V forward, repaired, gives transformers' own logits bit for bit;
    verl's own function crashes on the first image (asserted); the repair is deferred, logged, undone by unpatch.
    transformers 4.57 (what verl 0.6.0-0.7.x run on):
    nothing is repaired, and verl's forward cannot run there at all, fsdp-compat or not: it insists on 4-row
    position ids (text + 3 mrope rows) that 4.57's Glm4vTextModel hands to its 3-row rotary embedding."""
    out = _probe({"FSDP_COMPAT": ""})
    assert out["has_glm4v_forward"], out
    print(f"verl {VERL} GLM4V forward: {out}")
    assert out["state"]["patched"] and out["state"]["glm4v_repaired"] == TRANSFORMERS_5, out["state"]
    if TRANSFORMERS_5:
        assert out.get("error") is None and out["max_abs_logit_diff"] == 0.0, out
        assert out["unrepaired"] == SHAPE_CRASH, out
        # deferred (text-only jobs never import verl's glm4v module), logged, and undone by unpatch()
        assert not out["glm4v_loaded_early"] and out["repair_logged"], out
        assert out["unpatch_restores_verls_function"], out
    else:
        assert out["error"] == ROPE_CRASH_TF4, out


@has_glm4v_forward
def test_glm4v_forward_unrepaired_when_off() -> None:
    """FSDP_COMPAT=off installs nothing: on transformers 5 verl's own forward then fails on the first image."""
    out = _probe({"FSDP_COMPAT": "off"})
    assert out["has_glm4v_forward"], out
    assert not out["state"]["patched"] and not out["state"]["glm4v_repaired"], out
    assert out["error"] == (SHAPE_CRASH if TRANSFORMERS_5 else ROPE_CRASH_TF4), out


@has_glm4v_forward
@pytest.mark.skipif(
    not TRANSFORMERS_5, reason="transformers 4: verl's GLM4V forward needs no repair (and cannot run, see above)"
)
@pytest.mark.parametrize(
    "path",
    [
        pytest.param({}, id="pth-hook"),
        pytest.param(
            {"FSDP_COMPAT_AUTOLOAD": "0", "VERL_USE_EXTERNAL_PLUGINS": "auto"},
            id="verl.plugins",
            marks=pytest.mark.skipif(not ENGINE_ON_CPU, reason=f"verl {VERL} has no verl.plugins entry points (0.9+)"),
        ),
    ],
)
def test_glm4v_forward_first_order_is_repaired(path: dict[str, str]) -> None:
    """A reference or evaluation pass before any engine: ``apply_monkey_patch`` then an image forward, nothing has
    imported ``verl.utils.fsdp_utils``. Importing verl's glm4v module activates the adapter (a registry trigger),
    through the .pth hook or verl's plugin entry point alike; transformers' logits bit for bit. FSDP_COMPAT=off:
    verl's own function fails (asserted), so the order is the one that used to fail."""
    out = _probe({"FSDP_COMPAT": "", **path}, "forward_first_probe")
    assert not out["utils_loaded_first"], out
    assert out["state"]["patched"] and out["state"]["glm4v_repaired"], out["state"]
    assert out["state"]["activated_by"] == ("pth-hook" if not path else "verl.plugins entry point"), out["state"]
    assert out.get("error") is None and out["max_abs_logit_diff"] == 0.0, out
    off = _probe({"FSDP_COMPAT": "off", **path}, "forward_first_probe")
    assert not off["state"]["patched"] and off["error"] == SHAPE_CRASH, off


# ------------------------------------------- verl's recipe: remove padding, bf16, checkpointing, mixed ranks

NO_FLASH = "NameError: name '_flash_use_top_left_mask' is not defined"
#: fp32 q/k/v cast to bf16 for flash-attn (verl/models/transformers/glm4v.py:226), the bf16 output into the fp32 o_proj
FP32_O_PROJ = "to have the same dtype, but got: c10::BFloat16 != float"


def _packed(case: dict[str, Any], rows: int = 2) -> None:
    """verl's remove-padding input: the micro-batch's rows packed into one row, 4-row position ids, no mask."""
    for step in case["steps"]:
        (inputs,) = step["model_inputs"]
        total = inputs["input_ids"][1]
        assert inputs["input_ids"] == [1, total] and inputs["position_ids"] == [4, 1, total], inputs
        assert inputs["attention_mask"] is None, inputs
        if case["flash_stand_in"]:  # every attention call cut the packed row into the micro-batch's rows
            assert step["attention_calls"] and set(step["attention_calls"]) == {rows}, step["attention_calls"]


@needs_engine
def test_recipe_off_switch_crashes_first_in_the_wrap(mixed_off: list[dict[str, Any]]) -> None:
    """FSDP_COMPAT=off, verl's recipe (remove padding, bf16, checkpointing, 2 rows per micro-batch, rank 0 images,
    rank 1 text only): the grid_sampler crash from verl's own wrap rule on both ranks, before any remove-padding
    code (the flash-attn stand-in is in place, so only the wrap can stop it)."""
    _grid_sampler_crash(mixed_off, "recipe")


def _stops_in_verls_rope_import(ranks: list[dict[str, Any]], name: str) -> None:
    """verl 0.9.0: both ranks pack the rows, run the vision tower (rank 1 on verl's dummy), then stop in verl's
    GLM4V remove-padding attention on an import from transformers that transformers 5 does not have."""
    for rank, state in enumerate(ranks):
        case = state["cases"][name]
        assert case["error"].startswith(ROPE_IMPORT), case
        assert case["where"].startswith("verl/models/transformers/glm4v.py:"), case["where"]
        assert "in glm4v_attn_forward" in case["traceback"], case["traceback"]
        assert case["vision_calls"] == [PATCHES[RECIPE["kinds"][rank]]], case["vision_calls"]
        (inputs,) = case["model_inputs"]
        assert inputs["input_ids"][0] == 1 and inputs["position_ids"][:2] == [4, 1], inputs


@needs_engine
def test_recipe_remove_padding_stops_without_flash_attn(parity: list[dict[str, Any]]) -> None:
    """verl's remove-padding path without flash-attn (a CPU host): the engine packs the rows (asserted), the vision
    tower runs on both ranks (rank 1 on verl's dummy, so fsdp-compat got the job past the wrap), then verl's GLM4V
    text attention (glm4v_attn_forward) reads flash-attn settings that glm4v.py defines only when flash-attn is
    importable: NameError on both ranks. Where flash-attn is installed the case trains instead."""
    if not RECIPE_RUNS:
        return _stops_in_verls_rope_import(parity, "recipe_no_flash")
    for rank, state in enumerate(parity):
        case = state["cases"]["recipe_no_flash"]
        if case["flash_attn"]:
            assert case["error"] is None and len(case["steps"]) == 2, case
            continue
        assert case["error"] == NO_FLASH, case
        assert case["where"].startswith("verl/models/transformers/glm4v.py:"), case["where"]
        assert "in glm4v_attn_forward" in case["traceback"], case["traceback"]
        if str(VERL) == "0.9.1":
            assert case["where"] == "verl/models/transformers/glm4v.py:327", case["where"]
        assert case["vision_calls"] == [PATCHES[RECIPE["kinds"][rank]]], case["vision_calls"]
        (inputs,) = case["model_inputs"]
        assert inputs["input_ids"][0] == 1 and inputs["position_ids"][:2] == [4, 1], inputs


@needs_engine
def test_recipe_remove_padding_fp32_fails_in_verls_attention(parity: list[dict[str, Any]]) -> None:
    """With an fp32 MixedPrecisionPolicy, verl's remove-padding attention casts q/k/v to bf16 for flash-attn and
    feeds flash-attn's bf16 output to the fp32 o_proj: a dtype error in verl's code on both ranks (no autocast in
    fp32). So the recipe's exact comparison is made in bf16, the precision verl's recipe trains in."""
    if not RECIPE_RUNS:
        return _stops_in_verls_rope_import(parity, "recipe_fp32")
    for state in parity:
        case = state["cases"]["recipe_fp32"]
        assert FP32_O_PROJ in (case["error"] or ""), case
        assert "glm4v_attn_forward" in case["traceback"] and "o_proj" in case["traceback"], case["traceback"]


@needs_engine
def test_recipe_remove_padding_bf16_mixed_ranks_trains_with_exact_parity(parity: list[dict[str, Any]]) -> None:
    """verl's recipe, rank 0 image rows and rank 1 text-only rows: both ranks train 2 steps (no hang, no abort),
    verl's dummy runs the tower once per step on rank 1, and each step's losses, fp32 gradients and post-AdamW
    parameters equal one process doing by hand what FSDP2's bf16 policy does (bf16 copies of fp32 master weights,
    inputs of each engine group cast to bf16, bf16 gradients per rank batch cast to fp32 and summed): 0.0.
    verl 0.9.0: its remove-padding attention stops on both ranks in verl's own code (asserted)."""
    if not RECIPE_RUNS:
        return _stops_in_verls_rope_import(parity, "recipe")
    reference = _assert_exact_parity(parity, "recipe")
    assert reference["mixed_precision"], reference
    image, text = _case(parity, "recipe")
    for case in (image, text):
        assert case["compute_dtype"] == "torch.bfloat16" and case["gradient_checkpointing"], case
        assert case["rows"] == [2, 2], case["rows"]
        assert case["flash_stand_in"] != case["flash_attn"], case
        _packed(case)
        assert all(math.isfinite(s["loss"]) for s in case["steps"]), case["steps"]
    assert [s["vision_calls"] for s in image["steps"]] == [[PATCHES["image"]]] * 2, image["steps"]
    assert [s["vision_calls"] for s in text["steps"]] == [[DUMMY]] * 2, text["steps"]
    for step in reference["steps"]:
        assert step["vision_calls"] == [PATCHES["image"], DUMMY], step
        assert step["grad_norm_vision"] > 0.0, step


# ------------------------------------------------------------------- verl's Qwen2-VL forward, one process, no FSDP


def _qwen_probe(env: dict[str, str]) -> dict[str, Any]:
    code = "import json, lab.stacks.verl_ulysses_ranks as r; print(json.dumps(r.qwen_forward_probe()))"
    full = {**os.environ, "PYTHONPATH": rank_pythonpath(), "VERL_USE_EXTERNAL_PLUGINS": "none", **env}
    full.pop("VERL_USE_EXTERNAL_MODULES", None)
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not (TRANSFORMERS_5 and SpecifierSet(">=0.9.1").contains(VERL, prereleases=True)),
    reason=f"verl {VERL}: the Qwen2-VL forward with the text-only dummy is 0.9.1's, on transformers 5",
)
def test_qwen_forward_text_only_is_repaired() -> None:
    """What verl's engine runs for Qwen2.5-VL (tests/stacks/verl_sp/test_verl_ulysses.py), in one process without FSDP:
    verl's Qwen2.5-VL forward on a text-only micro-batch fails in verl's own dummy on transformers 5
    (FSDP_COMPAT=off); with fsdp-compat installed it gives transformers' own logits bit for bit, on the image
    micro-batch too (the repair changes nothing else)."""
    off = _qwen_probe({"FSDP_COMPAT": "off"})
    assert not off["state"]["patched"] and not off["state"]["qwen2_vl_repaired"], off["state"]
    assert off["text"] == {"error": MEAN_CRASH}, off
    assert off["image"] == {"max_abs_logit_diff": 0.0}, off  # verl's image path unpacks the output itself
    on = _qwen_probe({"FSDP_COMPAT": ""})
    assert on["state"]["patched"] and on["state"]["qwen2_vl_repaired"], on["state"]
    assert on["text"] == {"max_abs_logit_diff": 0.0} and on["image"] == {"max_abs_logit_diff": 0.0}, on
