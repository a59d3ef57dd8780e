"""One family of each tower kind through verl 0.9.1's REAL engine, image|text ranks (issue 30 item 5): crash first,
then exact.

verl 0.9.1 has forwards of its own for the Qwen-VL, GLM4V and Kimi-VL families only; for every family here
``apply_monkey_patch`` leaves transformers' forward, which calls the vision tower only when the micro-batch has
images, and the engine's ``prepare_model_inputs`` hands it the rows' ``multi_modal_inputs`` concatenated along dim 0
(``extract_multi_modal_inputs``, ``verl/utils/model.py``). 2 gloo ranks, verl's ``TrainingWorker`` and
``train_batch``, fp32 policy, no remove padding (eager attention), rank 0 image rows, rank 1 text-only rows, 2 steps.
Rank routines: ``tests/lab/stacks/verl_families_ranks.py``.

Per kind, ``FSDP_COMPAT=off`` first, which fails in one of four ways (:data:`OFF`): verl's selector picks a module
of ``_no_split_modules`` and a module inside it (a vision embeddings class and its ``nn.Embedding`` child; Molmo2's
vision attention inside its encoder layer; Emu3's vector quantizer and its codebook), and ``fully_shard`` of the inner
one raises at setup on both ranks (``verl/utils/fsdp_utils.py`` ``apply_fsdp2``); the text rank skips the tower's
groups and gloo aborts on the collective mismatch; Gemma4 reads ``embed_tokens.weight`` outside its group on both
ranks; PaddleOCR-VL's tower (transformers 5.10.4) reads its position table's sharded weight on the image rank while
the text rank waits in an all-gather. Then the default: fsdp-compat's selector and alignment (a dummy tower call on
the text rank); losses, gradients and post-AdamW parameters equal one process training on both micro-batches with the
mean loss: 0.0.

The installed transformers picks the families (:data:`MODELS`): 5.10.4 (the verl091 envs) as lab.stack_families
``STACKS["verl"]``, less the kinds whose families it lacks (``_TRANSFORMERS_5_10``); 5.25 every kind's first family
(six kinds more: masked tiles, pooled, patch grid, conv grid, grid hw, VQ) less DeepSeek-VL-Hybrid (2.9e-11 there:
held, as through accelerate on 5.25). transformers 5.25 kernelizes every ``from_pretrained`` by default (the
``kernels`` package is one of its requirements), and verl's ranks other than 0 load on the meta device, where
``kernelize`` raises ("Unsupported device type 'meta'", kernels/_internals/layer/kernelize.py) before any step, with
or without fsdp-compat: the ranks run with ``USE_HUB_KERNELS=0`` (a no-op on 5.10.4, which kernelizes only when asked).
Molmo2 trains only with ``mm_token_type_ids``, which verl's own datasets drop: its rows keep it
(``KEEPS_MM_TOKEN_TYPES`` in the rank routines says why).

Not here: the packed kind (MiniCPM-V 4.6; lab.stack_families says why) and Fuyu (verl's monkey patch reads a
``num_key_value_heads`` its text config lacks).

Figures were measured with torch 2.13.0+cpu, verl 0.9.1, transformers 5.10.4 and 5.25.0, 2 gloo ranks on 2 cores.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
from lab.stack_families import STACKS
from lab.stacks.verl_engine_ranks import assert_reference_steps_exact
from lab.support import BREADTH, rank_pythonpath, require_framework
from packaging.version import Version

from fsdp_compat.testing.crashes import GLOO_MISMATCH

VERL = require_framework("verl", lambda: Version(metadata.version("verl")))

from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks  # noqa: E402

WORLD = 2
TIMEOUT_S = 180.0
#: the launch that hangs: gloo's collective timeout, and how long the crashed rank stays alive (as a Ray actor's
#: process does after its method raised) so that the other waits as it would on a cluster
COLLECTIVE_TIMEOUT_S, HOLD_S = 20.0, 25.0
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
#: no remove padding, fp32, the clip made a no-op: the comparison can be exact
CASE = {"name": "family", "kinds": ["image", "text"], "engine": {"mixed_precision": FP32},
        "optimizer": {"clip_grad": 1e9}}  # fmt: skip

NEWER_TRANSFORMERS = Version(metadata.version("transformers")) >= Version("5.25")
#: tower kind -> its tiny family here (lab.stack_families: transformers 5.10.4 as in verl091, less the packed kind and
#: Fuyu; on transformers >= 5.25 every kind's first family, less those and the held DeepSeek-VL-Hybrid)
MODELS = STACKS["verl-transformers-5.25" if NEWER_TRANSFORMERS else "verl"]
#: how each kind's family fails with FSDP_COMPAT=off: "setup" (both ranks, apply_fsdp2's fully_shard of an
#: nn.Embedding inside an already sharded vision embeddings module), "abort" (gloo's collective mismatch), "both"
#: (both ranks: a module reads a sharded weight outside its group), "image" (rank 0 crashes in the tower, rank 1 waits
#: in an all-gather until gloo's timeout)
OFF = {
    "fixed_inputs": "setup",  # SiglipVisionEmbeddings + its position_embedding
    "anyres_inputs": "setup",  # CLIPVisionEmbeddings + its position_embedding
    "sized_inputs": "abort",
    "tile_inputs": "abort",
    "naflex_inputs": "setup",  # Siglip2VisionEmbeddings + its position_embedding
    "positioned_inputs": "both",  # Gemma4Model.forward: self.language_model.embed_tokens.weight[pad_token_id]
    "position_patch_inputs": "abort",  # no vision group: the tower is in the root, whose gradients differ per rank
    "sam_inputs": "abort",
    "merge_size_inputs": "abort",
    "grid_patches_inputs": "image",  # interpolate_pos_encoding reads position_embedding.weight
    "hybrid_inputs": "setup",  # SiglipVisionEmbeddings + its position_embedding
    # transformers >= 5.25 only
    "masked_tile_inputs": "abort",
    "pooled_inputs": "setup",  # the adapter's _no_split_modules name Molmo2VisionAttention, inside the encoder layer
    "patch_grid_inputs": "abort",
    "conv_grid_inputs": "abort",
    "grid_hw_inputs": "abort",
    "vq_inputs": "setup",  # Emu3VQVAEVectorQuantizer + its codebook embedding
}
if NEWER_TRANSFORMERS:
    # PaddleOCR-VL's embeddings call position_embedding (its own group) instead of reading its weight: gloo aborts
    OFF["grid_patches_inputs"] = "abort"
SETUP_CRASH = "Cannot concatenate overlapping meshes"
#: the kinds whose FSDP_COMPAT=off launch takes over ~30 s (the hang: the hold plus gloo's timeout)
SLOW_OFF = frozenset(k for k, mode in OFF.items() if mode == "image")
#: the kinds whose tower gets no gradient on any rank, by construction: Emu3's VQ tokenizer (discrete codes; the
#: row's 0.0 term is the codes' text embeddings only, lab.vlms)
NO_TOWER_GRADIENT = frozenset({"vq_inputs"})

#: verl 0.9.1: the engine on CPU (platform registry, 0.9.0+). The verl091-sp env runs this folder; under an older
#: verl these tests fail (test_verl_engine.py asserts where older releases stop), never skip.


def _params(kinds: list[str], slow: frozenset[str] = frozenset()) -> list[Any]:
    return [pytest.param(k, id=k, marks=[BREADTH] if k in slow else []) for k in kinds]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny family of a kind, saved once per module (verl's engine loads it with ``from_pretrained``)."""
    from fsdp_compat.testing.zoo import build_model

    dirs: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in dirs:
            path = tmp_path_factory.mktemp(kind)
            build_model(MODELS[kind]).save_pretrained(path)
            dirs[kind] = str(path)
        return dirs[kind]

    return get


def _run(model_dir: str, kind: str, case: dict[str, Any], env: dict[str, str], **cfg: Any) -> RunResult:
    clean = {k: "" for k in ("FSDP_COMPAT", "FSDP_COMPAT_POLICY", "FSDP_COMPAT_MIXED_BATCHES",
                             "VERL_USE_EXTERNAL_MODULES")}  # fmt: skip
    clean["USE_HUB_KERNELS"] = "0"  # transformers 5.25's default kernelize fails on verl's meta-device ranks
    result = run_ranks(
        "lab.stacks.verl_families_ranks:families_ranks",
        {"model_dir": model_dir, "model": MODELS[kind], "device": "cpu", "cases": [case], **cfg},
        world_size=WORLD,
        timeout_s=TIMEOUT_S,
        env={**clean, "PYTHONPATH": rank_pythonpath(), **env},
    )
    print(f"verl {VERL} {kind} ({MODELS[kind]}) launch {env or 'default'}: {result.seconds:.1f}s, ok {result.ok}")
    return result


@pytest.mark.parametrize("kind", _params(list(MODELS), SLOW_OFF))
def test_off_switch_fails(model_dirs: Any, kind: str) -> None:
    """FSDP_COMPAT=off: verl's own selector and no alignment; the family's launch fails as :data:`OFF` says."""
    mode = OFF[kind]
    off = {"FSDP_COMPAT": "off"}
    if mode == "abort":
        result = _run(model_dirs(kind), kind, CASE, off)
        assert not result.ok, "expected the collective mismatch, but it trained"
        assert result.seconds < TIMEOUT_S, result.seconds  # an abort, not a hang
        text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in result.ranks)
        assert GLOO_MISMATCH in current_wording(text), text[-3000:]
        return
    hang = mode == "image"
    case = {**CASE, "expect_failure": True, **({"hold_s": HOLD_S} if hang else {})}
    result = _run(model_dirs(kind), kind, case, off, **({"collective_timeout_s": COLLECTIVE_TIMEOUT_S} if hang else {}))
    result.raise_for_error()
    image, text = (r.extra["cases"]["family"] for r in result.ranks)
    for rank in result.ranks:
        assert not rank.extra["state"]["patched"], rank.extra["state"]
    if mode == "setup":  # both ranks, in verl's apply_fsdp2 loop over the selected modules
        for out in (image, text):
            assert SETUP_CRASH in out["error"], out
            assert any(f.startswith("verl/utils/fsdp_utils.py:") and f.endswith(" apply_fsdp2") for f in out["frames"])
            assert "steps" not in out, out  # before any step
    elif mode == "both":
        for out in (image, text):
            assert "got mixed torch.Tensor and DTensor" in out["error"], out
            assert any(f.startswith("transformers/models/gemma4/modeling_gemma4.py:") for f in out["frames"]), out
            assert out["steps"] == [], out
    else:  # the image rank crashes in the tower; the text rank waits in FSDP2's all-gather of the next group
        assert "Sharding propagation failed" in image["error"], image
        assert any("interpolate_pos_encoding" in f for f in image["frames"]), image["frames"]
        assert "Timed out waiting" in text["error"] and "foreach_all_gather" in text["traceback"], text
        assert text["vision_calls"] == [] and text["steps"] == [], text
        assert text["case_s"] > image["case_s"], (text["case_s"], image["case_s"])  # blocked while rank 0 lived
    print(f"verl {VERL} {kind} off: rank 0 {image['error'][:80]} at {image['where']}; rank 1 {text['error'][:80]}")


@pytest.mark.parametrize("kind", _params(list(MODELS)))
def test_image_and_text_ranks_train_exactly(model_dirs: Any, kind: str) -> None:
    """The default: fsdp-compat's selector and alignment (one dummy tower call per step on rank 1); both ranks train
    2 steps and each step's losses, gradients and post-AdamW parameters equal one process training on both
    micro-batches with the mean loss (fp32): 0.0."""
    result = _run(model_dirs(kind), kind, CASE, {})
    result.raise_for_error()
    image, text = (r.extra["cases"]["family"] for r in result.ranks)
    for rank in result.ranks:
        assert rank.extra["state"]["patched"], rank.extra["state"]
    assert image["groups"] == text["groups"], (image["groups"], text["groups"])
    assert [len(s["vision_calls"]) for s in image["steps"]] == [1, 1], image["steps"]
    assert [len(s["vision_calls"]) for s in text["steps"]] == [1, 1], text["steps"]  # the dummy
    assert [s["alignment_dummies"] for s in image["steps"]] == [0, 0], image["steps"]
    assert [s["alignment_dummies"] for s in text["steps"]] == [1, 1], text["steps"]
    assert all("pixel_values" in s["model_inputs"][0] for s in image["steps"]), image["steps"]
    assert not any("pixel_values" in s["model_inputs"][0] for s in text["steps"]), text["steps"]
    reference = image["reference"]
    assert_reference_steps_exact(reference, 2, kind)
    for step, ref in enumerate(reference["steps"]):
        assert ref["vision_calls"] == image["steps"][step]["vision_calls"], ref  # one process: no dummy
        if kind in NO_TOWER_GRADIENT:
            assert ref["grad_norm_vision"] == 0.0, ref
        else:
            assert ref["grad_norm_vision"] > 0.0, ref
    assert image["steps"][0]["loss"] != image["steps"][1]["loss"], image["steps"]
    print(
        f"verl {VERL} {kind} image|text: losses {[r['losses'] for r in reference['steps']]}, 0.0 vs one process "
        f"({image['case_s']:.1f}s a rank)"
    )
