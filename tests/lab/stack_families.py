"""One family of every tower kind through a stack's own path (issue 30, item 5): which tiny model stands for a kind
in which stack, and where its vision tower and text model sit (for a stack whose groups come from a plan).

A tower kind is the dummy builder of the family's row (``VisionFamily.dummy`` in
:mod:`fsdp_compat.runtime.vlm_families`: one per kind, shared by the families of that kind; docs/families.md's tower
column names it). :data:`KINDS` lists, per kind, the tiny models (zoo names or ``lab.vlms:<model_type>``) of the
families whose image|text run is exact (0.0) in the families test, smallest first (parameters on transformers 5.25).
A stack runs the first of them that its transformers version has: :data:`STACKS` holds each stack's pick, written
here after building them in that stack's env (a pick that no longer builds fails the stack's test, never skips).

Kinds with no exact family are in :data:`HELD_KINDS` instead (their families are held to their all-image run, not
to 0.0, as in the families test): strided stages (Florence-2), one tile per token (Inkling 2), packed patches
(Inkling, exact after all where it runs), and two fixed-resolution towers (DeepSeek-VL-Hybrid, 0.0 through some
stacks' own groups: it is in :data:`KINDS` for those). The timm towers run in tests/stacks/timm (torchvision: only
the ``families524-timm`` env); the audio towers by name (Qwen2.5-Omni's thinker, tests/stacks/transformers).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HELD", "HELD_KINDS", "KINDS", "NATIVE_OWN_LAYOUT", "STACKS", "tower_layers", "tower_paths", "tower_plan"]

#: tower kind (the row's dummy builder) -> exact families' tiny models, smallest first (parameters, transformers 5.25)
KINDS: dict[str, tuple[str, ...]] = {
    "fixed_inputs": ("lab.vlms:deepseek_vl", "lab.vlms:step3p7", "llava"),  # 41,098
    "anyres_inputs": ("lab.vlms:llava_next", "lab.vlms:llava_onevision"),  # 41,610
    "sized_inputs": ("lab.vlms:mistral_large4", "mistral3", "lab.vlms:lighton_ocr"),  # 56,412
    "tile_inputs": ("idefics3", "smolvlm"),  # 114,346
    "masked_tile_inputs": ("lab.vlms:granite_docling",),  # 58,954
    "naflex_inputs": ("lab.vlms:lfm2_vl",),  # 61,215
    "positioned_inputs": ("lab.vlms:gemma4",),  # 49,040
    "position_patch_inputs": ("lab.vlms:gemma4_unified",),  # 220,144
    "packed_inputs": ("lab.vlms:minicpm_ocr", "lab.vlms:minicpmv4_6"),  # 88,190
    "pooled_inputs": ("lab.vlms:molmo2",),  # 45,066
    "sam_inputs": ("lab.vlms:unlimited_ocr", "lab.vlms:deepseek_ocr2"),  # 639,488
    "patch_grid_inputs": tuple(  # 50,784 .. 274,304
        f"lab.vlms:{t}"
        for t in ("cosmos3_edge", "muse_spark", "hy_v4_vl", "dots3_note", "muse_glimmer", "minimax_m3_vl", "hunyuan_vl")
    ),
    "conv_grid_inputs": ("lab.vlms:kimi_k25",),  # 64,714
    "merge_size_inputs": ("lab.vlms:video_llama_3",),  # 59,840
    "grid_hw_inputs": ("lab.vlms:nemotron_h_omni",),  # 126,208
    "grid_patches_inputs": ("lab.vlms:paddleocr_vl",),  # 840,960
    "flat_patch_inputs": ("lab.vlms:fuyu",),  # 108,330
    "vq_inputs": ("lab.vlms:emu3",),  # 691,287
    # not exact under fsdp-compat's own plan (1.5e-11: FSDP2 reorders the SAM patch-embed gradient's sum), but a
    # stack's own groups may put that conv where the sum keeps one process's order: run where measured 0.0
    "hybrid_inputs": ("lab.vlms:deepseek_vl_hybrid",),  # 73,979
}


def _picks(**picks: str | None) -> dict[str, str]:
    """Every kind's first tiny model, but for the kinds named (another model, or None: none of them loads there)."""
    firsts = {kind: models[0] for kind, models in KINDS.items()} | picks
    return {kind: model for kind, model in firsts.items() if model is not None}


#: transformers 5.10.4 (accelerate 1.15/1.16) lacks these families' classes (``ImportError: cannot import name
#: '<Family>Config' from 'transformers'``): Step3p7, MistralLarge4, GraniteDocling, MiniCPM-OCR, Molmo2,
#: UnlimitedOcr, Kimi K2.5, Nemotron-H Omni and every patch-grid family of ``patch_grid_inputs`` (they run through
#: accelerate on transformers 5.25: ``accelerate-transformers-5.25``). Emu3 is left out there: its unpatched
#: image|text run through accelerate's groups trains at 0.0 (no crash to show; it crashes first on 5.25).
_TRANSFORMERS_5_10 = dict(
    sized_inputs="mistral3", masked_tile_inputs=None, packed_inputs="lab.vlms:minicpmv4_6", pooled_inputs=None,
    sam_inputs="lab.vlms:deepseek_ocr2", patch_grid_inputs=None, conv_grid_inputs=None, grid_hw_inputs=None,
    vq_inputs=None,
)  # fmt: skip

#: transformers 5.23 - 5.25's native FSDP2 loading (``from_pretrained(dir, distributed_config=DistributedConfig(
#: fsdp_size=2))``) slices each checkpoint tensor to the rank's shard before the family's conversion ops run
#: (huggingface/transformers#48519, open): where an op moves rows across the shard, a checkpoint in the original
#: layout (``save_pretrained``'s default) loads other weights than a plain ``from_pretrained``. Measured with
#: fsdp-compat off, before any step: Kimi K2.5's and Nemotron-H Omni's vision q/k/v 0.08 .. 0.13 apart (MistralLarge4
#: and UnlimitedOcr the same), Molmo2's load raises ("Split on tensors destined for
#: model.language_model.layers.1.self_attn.q_proj.weight", split_with_sizes [32, 16, 16] of 32), Inkling's too
#: ("Interleave on tensors destined for model.language_model.layers.0.mlp.gate_proj.weight"). fsdp-compat's
#: transformers adapter converts those weights whole, then shards them (every rank equals a plain load, 0.0:
#: tests/stacks/transformers/test_original_layout.py), so every family runs there from the original layout:
#: :data:`NATIVE_OWN_LAYOUT` (the families to run from transformers' own layout, ``save_pretrained(
#: save_original_format=False)``) is empty. MistralLarge4 and UnlimitedOcr's kinds still run Mistral3 and
#: DeepSeek-OCR 2, picked while those two loaded other weights.
_NATIVE_LOADS_OTHER_WEIGHTS = dict(sized_inputs="mistral3", sam_inputs="lab.vlms:deepseek_ocr2")
NATIVE_OWN_LAYOUT: frozenset[str] = frozenset()

#: transformers 5.18.0 (NeMo Automodel 0.7.0) lacks MistralLarge4, GraniteDocling, MiniCPM-OCR, Molmo2 and
#: UnlimitedOcr (``ImportError: cannot import name '<Family>Config' from 'transformers'``), so MiniCPM-V 4.6 stands
#: for the packed kind there. NeMo gives its merger's ``mlp.0`` (outside the vision tower) a group of its own, and the
#: merger runs it once per image: the image rank's two images all-gather and reduce-scatter that group twice in
#: backward (FSDP2 reshards it after the first call's gradient), so the text rank's dummy packs as many images as the
#: image rank's call (the row's ``per_image``, exchanged with the tower calls; one image hung in the first backward).
#: Its Fuyu takes ``image_patches`` (5.24's ``pixel_values``): the row names both, the tiny batch the one it takes.
_TRANSFORMERS_5_18 = dict(
    sized_inputs="mistral3", masked_tile_inputs=None, pooled_inputs=None, packed_inputs="lab.vlms:minicpmv4_6",
    sam_inputs="lab.vlms:deepseek_ocr2",
)  # fmt: skip

#: SkyRL 0.4.0's ``HFModelWrapper.forward`` hands the model ``pixel_values`` and ``image_grid_thw`` only (the
#: experience carries no other image field), so only the kinds whose images are those two run through it; the others
#: need ``image_sizes`` (anyres, sized, vq), ``pixel_attention_mask``/``spatial_shapes`` (NaFlex),
#: ``image_position_ids`` (both Gemma4 kinds), ``target_sizes`` (packed) or ``image_merge_sizes`` (merge sizes).
#: Of those, transformers 5.16.1 (its env) lacks UnlimitedOcr (DeepSeek-OCR 2 stands for the SAM kind).
#: Fuyu is out too: FuyuConfig has no ``vision_config``, so HFModelWrapper loads it as a text model and passes no
#: image at all (and transformers 5.16.1's Fuyu takes ``image_patches``): the unpatched image|text run trains.
#: Of the held kinds (:data:`HELD_KINDS`), measured through the same path with images on both ranks: DeepSeek-VL-Hybrid
#: needs ``high_res_pixel_values`` ("Both pixel_values and high_res_pixel_values should be specified at the same
#: time"); Florence-2's encoder-decoder logits do not fit SkyRL's log-prob gather ("Size does not match at dimension
#: 1 expected index [2, 14, 1] to be no larger than self [2, 1, 128]"); Inkling and Inkling 2 are not in 5.16.1.
_SKYRL_KINDS = ("fixed_inputs", "tile_inputs", "sam_inputs", "patch_grid_inputs", "conv_grid_inputs",
                "grid_patches_inputs")  # fmt: skip

#: verl 0.9.1's engine (transformers 5.10.4, as accelerate's env) joins each row's ``multi_modal_inputs`` along dim 0
#: (``extract_multi_modal_inputs``, verl/utils/model.py): MiniCPM-V 4.6's processor packs every image of a call
#: into one ``(1, C, p, columns)`` strip, two rows' strips become ``(2, C, p, 64p)`` and the tower's position
#: embeddings no longer match ("The size of tensor a (64) must match the size of tensor b (128)",
#: modeling_minicpmv4_6.py, with or without FSDP): the packed kind cannot go through verl's engine. Nor can Fuyu:
#: verl's ``apply_monkey_patch`` reads ``text_config.num_key_value_heads``
#: (verl/models/transformers/monkey_patch.py:340) and its Persimmon text config has none (``AttributeError``, with
#: or without fsdp-compat, before any step). Molmo2 (transformers 5.25) trains only with ``mm_token_type_ids``, which
#: verl's own SFT dataset and agent loop drop: its rows keep it (the rank routines' ``KEEPS_MM_TOKEN_TYPES``), as a
#: user's own dataset would.
_VERL_KINDS_LEFT_OUT = ("packed_inputs", "flat_patch_inputs")

#: stack -> the tiny model each kind runs there (``grid_inputs``, the patch grid, is every stack's GLM4V/Qwen2.5-VL).
STACKS: dict[str, dict[str, str]] = {
    "transformers": _picks(**_NATIVE_LOADS_OTHER_WEIGHTS, hybrid_inputs=None),  # 2.9e-11: held there (HELD)
    "accelerate": _picks(**_TRANSFORMERS_5_10),
    # accelerate builds the model itself (no checkpoint layout to load); DeepSeek-VL-Hybrid is 2.9e-11 off on
    # transformers 5.25 (0.0 on 5.10.4): held there (:data:`HELD`)
    "accelerate-transformers-5.25": _picks(hybrid_inputs=None),
    "nemo_automodel": _picks(**_TRANSFORMERS_5_18, hybrid_inputs=None),  # 2.9e-11 there too (SAM's patch embed): HELD
    "skyrl": {k: m for k, m in _picks(sam_inputs="lab.vlms:deepseek_ocr2").items() if k in _SKYRL_KINDS},
    "verl": {k: m for k, m in _picks(**_TRANSFORMERS_5_10).items() if k not in _VERL_KINDS_LEFT_OUT},
    # verl loads with a plain from_pretrained (no checkpoint layout issue); DeepSeek-VL-Hybrid is 2.9e-11 off on
    # transformers 5.25 (SAM's patch-embed gradient, step 1), as through accelerate there
    "verl-transformers-5.25": {k: m for k, m in _picks(hybrid_inputs=None).items() if k not in _VERL_KINDS_LEFT_OUT},
}


#: Tower kinds none of whose families FSDP2 alone trains at 0.0 (the families test's ``parity="measured"``: even the
#: all-image run, no dummy, is off one process by FSDP2's reordered sums): through a stack each is held to that
#: all-image run's distance, measured in the same test (:data:`lab.families.MEASURED_FACTOR`), not to 0.0. Inkling's
#: tower imports scipy.
HELD_KINDS: dict[str, str] = {
    "hybrid_inputs": "lab.vlms:deepseek_vl_hybrid",
    "strided_inputs": "lab.vlms:florence2",
    "token_tile_inputs": "lab.vlms:inkling2",
    "packed_patch_inputs": "lab.vlms:inkling_mm_model",
}

#: stack -> the held kinds that run there (:data:`HELD_KINDS`; where one is left out, the comment says why).
HELD: dict[str, dict[str, str]] = {
    # Florence-2: accelerate's tail group [shared, lm_head] leaves BART's encoder and decoder embed_tokens (the same
    # Parameter) in the root, and torch 2.13's lazy init raises "Parameter 'model.language_model.shared.weight' is
    # shared with a parameter already managed by another FSDP group" on the first forward, all-image too, with or
    # without fsdp-compat (which names that group in its warning; accelerate applies fully_shard itself)
    "accelerate-transformers-5.25": {k: m for k, m in HELD_KINDS.items() if k != "strided_inputs"},
    "transformers": dict(HELD_KINDS),
    "nemo_automodel": {k: m for k, m in HELD_KINDS.items() if k != "token_tile_inputs"},  # 5.18: no Inkling 2
}


def _row_names(module: Any) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def tower_paths(model: Any) -> tuple[str, str]:
    """``(tower, text model)``: the dotted paths in ``model`` of the vision tower and the text model that the
    family's row names (the row found as the alignment finds it: the first module whose class or base it names)."""
    from fsdp_compat.runtime.vlm_families import FAMILIES

    for path, module in model.named_modules():
        names = _row_names(module)
        row = next((f for f in FAMILIES if names & set(f.classes)), None)
        if row is not None:
            prefix = f"{path}." if path else ""
            return prefix + row.tower, prefix + row.text
    raise LookupError(f"{type(model).__name__}: no row of fsdp_compat.runtime.vlm_families matches a submodule")


def tower_layers(model: Any) -> str:
    """The path of the vision tower's layer list (the ``nn.ModuleList`` under the tower named ``layers``, ``layer`` or
    ``blocks`` holding the most parameters, e.g. ``model.visual.blocks``), or the tower's own path where it has none
    (Fuyu's one linear layer; Emu3's VQ encoder, whose ``down_block.down`` stages fsdp-compat's plan check folds back
    into the root)."""
    import torch

    tower, _ = tower_paths(model)
    lists = [
        (sum(p.numel() for p in module.parameters()), f"{tower}.{path}")
        for path, module in model.get_submodule(tower).named_modules()
        if path.rpartition(".")[2] in ("layers", "layer", "blocks") and isinstance(module, torch.nn.ModuleList)
    ]
    return max(lists)[1] if lists else tower


def tower_plan(model: Any) -> dict[str, str]:
    """A user's FSDP2 plan (transformers' ``DistributedConfig.fsdp_plan`` spelling) that gives each block of the
    vision tower's layer list a group of its own (:func:`tower_layers`: as GLM4V's user plan ``model.visual.blocks.*``
    does; a built-in plan may leave the tower in the root, where no mismatch arises), and each text layer one where
    the text model has a ``layers`` list."""
    _, text = tower_paths(model)
    layers = tower_layers(model)
    plan = {layers if layers == tower_paths(model)[0] else f"{layers}.*": "free_full_weight"}
    names = {name for name, _ in model.named_modules()}
    if f"{text}.layers" in names:
        plan[f"{text}.layers.*"] = "free_full_weight"
    return plan
