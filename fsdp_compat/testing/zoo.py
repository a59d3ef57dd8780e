"""Tiny real transformers models, built from their config classes, for plan and FSDP2 parity tests.

Each entry is a real architecture (or a documented minimal subclass of one) shrunk until one training step
takes well under a second on CPU, so the bug classes fsdp-compat guards against can be reproduced on real
code: GLM4V's raw read of the vision position table, tied and shared Parameters, a large auxiliary embedding
used through its forward, and a fused-kernel style raw read of ``lm_head.weight`` in the root forward.

Models are fp32, in train mode with dropout off, and depend only on ``seed``. Every entry builds and trains
with transformers 5.x and 4.57 (in 4.57 T5's encoder/decoder ``embed_tokens`` are the ``shared`` module itself;
in 5.x they are separate modules holding the same Parameter).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FAMILY_VLMS",
    "VISION_ZOO",
    "VLM_VARIANTS",
    "ZOO",
    "ZooModel",
    "build_model",
    "builder",
    "is_vlm",
    "make_batch",
    "zoo_names",
]


@dataclass(frozen=True)
class ZooModel:
    """What a zoo entry is and what a test may assume about it."""

    name: str
    description: str
    only_input_embedding: bool  # True when the model's only nn.Embedding is get_input_embeddings()


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            "glm4v",
            "Glm4vForConditionalGeneration, untied; the vision embeddings read position_embedding.weight raw "
            "and feed it to F.grid_sample (the verl/SkyRL FSDP2 crash).",
            only_input_embedding=False,
        ),
        ZooModel(
            "glm4v-tied",
            "glm4v with top-level tie_word_embeddings=True: lm_head.weight is embed_tokens.weight (one Parameter).",
            only_input_embedding=False,
        ),
        ZooModel(
            "glm4v-moe",
            "Glm4vMoeForConditionalGeneration, untied, 4 routed experts; same raw vision position read as glm4v.",
            only_input_embedding=False,
        ),
        ZooModel(
            "qwen2",
            "Qwen2ForCausalLM, untied control: its only nn.Embedding is the input embedding.",
            only_input_embedding=True,
        ),
        ZooModel(
            "gemma3n",
            "Gemma3nForCausalLM (text), untied, with the large per-layer embedding embed_tokens_per_layer "
            "used through its own forward (must stay shardable).",
            only_input_embedding=False,
        ),
        ZooModel(
            "qwen2-fused-lmhead",
            "Qwen2ForCausalLM subclass whose forward computes logits as F.linear(hidden, "
            "self.lm_head.weight): a raw read of lm_head.weight in the root forward, like verl's fused "
            "kernels.",
            only_input_embedding=True,
        ),
        ZooModel(
            "qwen2-zloss",
            "Qwen2ForCausalLM subclass that calls lm_head and then reads lm_head.weight again in the root "
            "forward (a weight-norm penalty): a read after the module's own forward.",
            only_input_embedding=True,
        ),
        ZooModel(
            "t5-shared",
            "T5ForConditionalGeneration in the transformers-4 / flan-t5 state: shared, encoder.embed_tokens "
            "and decoder.embed_tokens are one Parameter, lm_head untied, config.tie_word_embeddings False; "
            "the relative_attention_bias tables are further embeddings, used through their forward.",
            only_input_embedding=False,
        ),
    )
}

#: More vision-language models, for the mixed micro-batch tests (one rank with images, another without). They build
#: and batch like the zoo's (``build_model``, ``make_batch``) but stay out of the zoo-wide parametrized tests.
VISION_ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            "qwen2-vl",
            "Qwen2VLForConditionalGeneration, untied: a vision tower of repeated blocks fed pixel_values + "
            "image_grid_thw (mixed image/text micro-batches).",
            only_input_embedding=True,
        ),
        ZooModel(
            "qwen2.5-vl",
            "Qwen2_5_VLForConditionalGeneration, untied: windowed vision blocks, pixel_values + image_grid_thw.",
            only_input_embedding=True,
        ),
        ZooModel(
            "qwen3-vl",
            "Qwen3VLForConditionalGeneration, untied: vision blocks with deepstack features injected into the "
            "first text layers, pixel_values + image_grid_thw.",
            only_input_embedding=False,
        ),
        ZooModel(
            "llava",
            "LlavaForConditionalGeneration (CLIP vision tower, Qwen2 text), untied: a fixed-resolution tower, "
            "pixel_values (N, C, S, S) only.",
            only_input_embedding=False,
        ),
        ZooModel(
            "gemma3",
            "Gemma3ForConditionalGeneration (SigLIP tower, pooled to 4 tokens, Gemma3 text), untied: fixed resolution.",
            only_input_embedding=False,
        ),
        ZooModel(
            "paligemma",
            "PaliGemmaForConditionalGeneration (SigLIP tower, Gemma text), untied: fixed resolution.",
            only_input_embedding=False,
        ),
        ZooModel(
            "mistral3",
            "Mistral3ForConditionalGeneration (Pixtral tower, Mistral text), untied: any image size, pixel_values "
            "plus image_sizes, patches merged 2 x 2.",
            only_input_embedding=False,
        ),
        ZooModel(
            "idefics3",
            "Idefics3ForConditionalGeneration (SigLIP-style tower over tiles, Llama text as text_model), untied: "
            "pixel_values (N, tiles, C, S, S), all-zero tiles dropped as padding.",
            only_input_embedding=False,
        ),
        ZooModel(
            "smolvlm",
            "SmolVLMForConditionalGeneration (Idefics3's tiles, Llama text as text_model), untied.",
            only_input_embedding=False,
        ),
        ZooModel(
            "vipllava",
            "VipLlavaForConditionalGeneration (CLIP tower read at two layers, Qwen2 text), untied: a row held to "
            "FSDP2's own all-image distance (its all-image run is not bit-exact either).",
            only_input_embedding=False,
        ),
    )
}

#: The zoo's vision-language models whose batches have one image per row or none (variants "image", "text").
FAMILY_VLMS = ("llava", "gemma3", "paligemma", "mistral3", "idefics3", "smolvlm", "vipllava")

#: Batch variants of the vision-language models (``make_batch(..., variant=...)``): every rank of a data-parallel
#: test may get another kind of micro-batch.
VLM_VARIANTS = ("image", "text", "three-images", "video", "image+video")
# GLM4V and Qwen3-VL lay videos out as frames of image tokens with timestamps; the zoo builds videos for these two
_VIDEO_MODELS = ("qwen2-vl", "qwen2.5-vl")


def zoo_names() -> list[str]:
    """The zoo's model names, in a stable order."""
    return list(ZOO)


def _tf_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _rope(theta: float, *, partial: float | None = None, mrope: list[int] | None = None) -> dict[str, Any]:
    """Rope config kwargs: ``rope_parameters`` in transformers 5, ``rope_theta``/``rope_scaling`` in 4."""
    if _tf_major() >= 5:
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        if partial is not None:
            params["partial_rotary_factor"] = partial
        if mrope is not None:
            params["mrope_section"] = mrope
        return {"rope_parameters": params}
    kwargs: dict[str, Any] = {"rope_theta": theta}
    if partial is not None:
        kwargs["partial_rotary_factor"] = partial
    if mrope is not None:
        kwargs["rope_scaling"] = {"rope_type": "default", "type": "default", "mrope_section": mrope}
    return kwargs


# ------------------------------------------------------------------------------------------------------------
# GLM4V family

_GLM_TOKENS = dict(
    image_token_id=10,
    video_token_id=11,
    image_start_token_id=12,
    image_end_token_id=13,
    video_start_token_id=14,
    video_end_token_id=15,
)
_GLM_VISION = dict(
    depth=2,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=64,
    in_channels=3,
    image_size=32,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
)
_GLM_TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    pad_token_id=0,
)


def glm4v_config(*, tied: bool = False, vision: dict[str, Any] | None = None) -> Any:
    """The tiny GLM4V's config (eager attention): the zoo's vision tower unless ``vision`` replaces it (the verl
    engine tests use a patch-14 tower, the size verl's own dummy image has)."""
    from transformers import Glm4vConfig

    # transformers 5 ties on the top-level flag; 4.57 on text_config's: set both so "tied" ties in either.
    text = dict(_GLM_TEXT, tie_word_embeddings=tied, **_rope(10000.0, partial=0.5, mrope=[2, 3, 3]))
    vision_config = dict(vision or _GLM_VISION)
    config = Glm4vConfig(text_config=text, vision_config=vision_config, tie_word_embeddings=tied, **_GLM_TOKENS)
    config._attn_implementation = "eager"
    return config


def _glm4v(tied: bool) -> nn.Module:
    from transformers import Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration(glm4v_config(tied=tied))


def _glm4v_moe() -> nn.Module:
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    text = dict(
        _GLM_TEXT,
        tie_word_embeddings=False,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        **_rope(10000.0, partial=0.5, mrope=[2, 3, 3]),
    )
    config = Glm4vMoeConfig(text_config=text, vision_config=dict(_GLM_VISION), tie_word_embeddings=False, **_GLM_TOKENS)
    config._attn_implementation = "eager"
    if _torch_release() < (2, 9):
        # transformers' grouped-mm experts call torch._grouped_mm, which torch 2.8 has for CUDA only: the loop
        config._experts_implementation = "eager"
    return Glm4vMoeForConditionalGeneration(config)


def _torch_release() -> tuple[int, int]:
    import torch

    from fsdp_compat.runtime.torch_versions import release

    return release(torch.__version__) or (0, 0)


def _vlm_batch(
    model_name: str, g: torch.Generator, variant: str, *, patch: int, vocab: int
) -> dict[str, torch.Tensor]:
    """Right-padded rows of text around images and/or videos (start, t*h*w/4 placeholder tokens, end).

    ``variant``: "image" (two images, one per row), "three-images" (another image count), "video", "image+video"
    (a row with an image and a row with a video), or "text" (no vision input at all: the rank whose micro-batch
    has no image).
    """
    if variant not in VLM_VARIANTS:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"unknown batch variant {variant!r}; choose one of: {', '.join(VLM_VARIANTS)}")
    if "video" in variant and model_name not in _VIDEO_MODELS:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"the zoo builds video batches for {', '.join(_VIDEO_MODELS)} only, not {model_name!r}")
    merge = _GLM_VISION["spatial_merge_size"] ** 2
    patch_dim = _GLM_VISION["in_channels"] * _GLM_VISION["temporal_patch_size"] * patch**2
    media: list[tuple[str, list[int]]] = {
        "image": [("image", [1, 4, 6]), ("image", [1, 6, 4])],
        "three-images": [("image", [1, 4, 4]), ("image", [1, 4, 6]), ("image", [1, 2, 4])],
        "video": [("video", [2, 4, 4]), ("video", [2, 4, 2])],
        "image+video": [("image", [1, 4, 6]), ("video", [2, 4, 4])],
        "text": [("text", [0, 0, 0]), ("text", [0, 0, 0])],
    }[variant]
    token = {"image": (10, 1), "video": (11, 2)}
    rows: list[list[int]] = []
    kinds: list[list[int]] = []
    for kind, (t, h, w) in media:
        before = torch.randint(16, vocab, (5,), generator=g).tolist()
        after = torch.randint(16, vocab, (4,), generator=g).tolist()
        if kind == "text":
            middle = torch.randint(16, vocab, (3,), generator=g).tolist()
            rows.append([*before, *middle, *after])
            kinds.append([0] * len(rows[-1]))
            continue
        tok, mm_kind = token[kind]
        n = t * h * w // merge
        rows.append([*before, 12, *([tok] * n), 13, *after])  # vision start, placeholders, vision end
        kinds.append([0] * 6 + [mm_kind] * n + [0] * 5)
    length = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    mm = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (r, k) in enumerate(zip(rows, kinds, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        mm[i, : len(k)] = torch.tensor(k)
    labels = input_ids.clone()
    labels[(mask == 0) | (mm != 0)] = -100
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    for kind, pixels, grids in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        thw = [x for k, x in media if k == kind]
        if thw:
            n_patches = sum(t * h * w for t, h, w in thw)
            batch[pixels] = torch.randn(n_patches, patch_dim, generator=g)
            batch[grids] = torch.tensor(thw, dtype=torch.long)
    if _accepts_mm_token_type_ids(model_name):
        batch["mm_token_type_ids"] = mm
    return batch


def _accepts_mm_token_type_ids(model_name: str) -> bool:
    """transformers 5.x requires ``mm_token_type_ids`` with images; 4.x has no such argument."""
    import transformers

    cls = getattr(transformers, _VLM_INNER[model_name])
    return "mm_token_type_ids" in inspect.signature(cls.get_rope_index).parameters


#: zoo name -> the inner VLM model class (the one holding ``visual`` and ``language_model``)
_VLM_INNER = {
    "glm4v": "Glm4vModel",
    "glm4v-tied": "Glm4vModel",
    "glm4v-moe": "Glm4vMoeModel",
    "qwen2-vl": "Qwen2VLModel",
    "qwen2.5-vl": "Qwen2_5_VLModel",
    "qwen3-vl": "Qwen3VLModel",
}

# ------------------------------------------------------------------------------------------------------------
# Qwen-VL families: the same text and vision sizes as the tiny GLM4V (patch size 4, merge 2)

_QWEN_VL_TOKENS = dict(image_token_id=10, video_token_id=11, vision_start_token_id=12, vision_end_token_id=13)
_QWEN_VL_PATCH = dict(in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)


def _qwen_vl(name: str) -> nn.Module:
    import transformers

    text = dict(_GLM_TEXT, tie_word_embeddings=False, **_rope(10000.0, mrope=[4, 6, 6]))
    if name == "qwen2-vl":
        vision: dict[str, Any] = dict(_QWEN_VL_PATCH, depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        config_cls, model_cls = "Qwen2VLConfig", "Qwen2VLForConditionalGeneration"
    elif name == "qwen2.5-vl":
        vision = dict(_QWEN_VL_PATCH, depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                      window_size=16, fullatt_block_indexes=[1])  # fmt: skip
        config_cls, model_cls = "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"
    else:
        vision = dict(_QWEN_VL_PATCH, depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip
        text["head_dim"] = 32
        config_cls, model_cls = "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"
    config = getattr(transformers, config_cls)(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **_QWEN_VL_TOKENS
    )
    config._attn_implementation = "eager"
    return getattr(transformers, model_cls)(config)


_LLAVA_IMAGE = 16  # pixels per side; CLIP patch 8 -> 4 patch tokens per image ("default" drops the CLS token)


def _llava() -> nn.Module:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=_LLAVA_IMAGE, patch_size=8, projection_dim=32)  # fmt: skip
    text = dict(_QWEN2, model_type="qwen2", **_rope(10000.0))
    # vision_feature_layer -2, LLaVA's default: the features skip the tower's last layer, which then has no gradient
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=10, image_seq_length=4,
                         vision_feature_layer=-2, tie_word_embeddings=False)  # fmt: skip
    config._attn_implementation = "eager"
    return LlavaForConditionalGeneration(config)


def _llava_batch(g: torch.Generator, variant: str) -> dict[str, torch.Tensor]:
    """Two rows of text around one image each ("image"), or plain text ("text")."""
    if variant not in ("image", "text"):
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"the llava zoo model takes variant 'image' or 'text', not {variant!r}")
    image = variant == "image"
    rows = []
    for _ in range(2):
        before = torch.randint(16, 128, (5,), generator=g).tolist()
        after = torch.randint(16, 128, (4,), generator=g).tolist()
        rows.append([*before, *([10] * 4 if image else torch.randint(16, 128, (4,), generator=g).tolist()), *after])
    input_ids = torch.tensor(rows)
    labels = input_ids.masked_fill(input_ids == 10, -100)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if image:
        batch["pixel_values"] = torch.randn(2, 3, _LLAVA_IMAGE, _LLAVA_IMAGE, generator=g)
    return batch


# ------------------------------------------------------------------------------------------------------------
# Vision-language families of the other tower kinds (fixed resolution, Pixtral image_sizes, Idefics3 tiles). Sizes
# follow each family's tester in transformers' tests/models/<name>/test_modeling_<name>.py (2 layers, hidden 32),
# with the zoo's text sizes. Every row has one image (rows of text around its placeholder tokens) or none.

_FAMILY_IMAGE_TOKEN = 10
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=37, num_hidden_layers=2,
               num_attention_heads=4, image_size=20, patch_size=5, num_channels=3)  # fmt: skip
_PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, image_size=24, patch_size=6, num_channels=3, head_dim=8)  # fmt: skip
_IDEFICS3_VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                        image_size=16, patch_size=4, num_channels=3)  # fmt: skip


def _text(model_type: str, **extra: Any) -> dict[str, Any]:
    return dict(_QWEN2, model_type=model_type, head_dim=32, **_rope(10000.0), **extra)


def _eager(config: Any) -> Any:
    config._attn_implementation = "eager"
    return config


def _gemma3() -> nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = _text("gemma3_text", sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    text.update(rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                 for t in ("sliding_attention", "full_attention")})  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=dict(_SIGLIP), mm_tokens_per_image=4,
                          image_token_index=_FAMILY_IMAGE_TOKEN, boi_token_index=11, eoi_token_index=12,
                          tie_word_embeddings=False)  # fmt: skip
    return Gemma3ForConditionalGeneration(_eager(config))


def _paligemma() -> nn.Module:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    config = PaliGemmaConfig(text_config=_text("gemma"), vision_config=dict(_SIGLIP, projection_dim=64),
                             image_token_index=_FAMILY_IMAGE_TOKEN, projection_dim=64, hidden_size=64,
                             tie_word_embeddings=False)  # fmt: skip
    return PaliGemmaForConditionalGeneration(_eager(config))


def _mistral3() -> nn.Module:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(text_config=_text("mistral"), vision_config=dict(_PIXTRAL), spatial_merge_size=2,
                            image_token_index=_FAMILY_IMAGE_TOKEN, vision_feature_layer=-1,
                            tie_word_embeddings=False)  # fmt: skip
    return Mistral3ForConditionalGeneration(_eager(config))


def _idefics3(name: str) -> nn.Module:
    import transformers

    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[name]
    config = getattr(transformers, f"{prefix}Config")(
        text_config=_text("llama"), vision_config=dict(_IDEFICS3_VISION), scale_factor=2,
        image_token_id=_FAMILY_IMAGE_TOKEN, tie_word_embeddings=False,
    )  # fmt: skip
    return getattr(transformers, f"{prefix}ForConditionalGeneration")(_eager(config))


def _vipllava() -> nn.Module:
    from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=_LLAVA_IMAGE, patch_size=8, projection_dim=32)  # fmt: skip
    config = VipLlavaConfig(vision_config=vision, text_config=dict(_QWEN2, model_type="qwen2", **_rope(10000.0)),
                            image_token_index=_FAMILY_IMAGE_TOKEN, vision_feature_layers=[-2, -1],
                            tie_word_embeddings=False)  # fmt: skip
    return VipLlavaForConditionalGeneration(_eager(config))


def _family_pixels(name: str, g: torch.Generator, images: int) -> dict[str, torch.Tensor]:
    """``images`` random images in the layout of ``name``'s tower kind (one per row)."""
    if name in ("idefics3", "smolvlm"):
        side = _IDEFICS3_VISION["image_size"]
        return {"pixel_values": torch.randn(images, 1, 3, side, side, generator=g)}
    if name == "mistral3":
        side = _PIXTRAL["image_size"]
        return {"pixel_values": torch.randn(images, 3, side, side, generator=g),
                "image_sizes": torch.tensor([[side, side]] * images)}  # fmt: skip
    side = _LLAVA_IMAGE if name in ("llava", "vipllava") else _SIGLIP["image_size"]
    return {"pixel_values": torch.randn(images, 3, side, side, generator=g)}


_TOKENS: dict[str, int] = {}


def _tokens_per_image(name: str) -> int:
    """Placeholder tokens one image takes: the features ``get_image_features`` returns for one image, counted on
    the built model (so a family's own merge, pooling or CLS rule decides, not a formula copied here)."""
    if name not in _TOKENS:
        model = build_model(name)
        with torch.no_grad():
            out = model.model.get_image_features(**_family_pixels(name, torch.Generator().manual_seed(0), 1))
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        tensors = list(pooled) if isinstance(pooled, (list, tuple)) else [pooled]
        _TOKENS[name] = sum(t.numel() // t.shape[-1] for t in tensors)
    return _TOKENS[name]


def _family_batch(name: str, g: torch.Generator, variant: str) -> dict[str, torch.Tensor]:
    """Two rows of text around one image each ("image"), or plain text of the same shape ("text")."""
    if variant not in ("image", "text"):
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"the {name} zoo model takes variant 'image' or 'text', not {variant!r}")
    n = _tokens_per_image(name)
    rows = []
    for _ in range(2):
        before = torch.randint(16, 128, (5,), generator=g).tolist()
        after = torch.randint(16, 128, (4,), generator=g).tolist()
        middle = [_FAMILY_IMAGE_TOKEN] * n if variant == "image" else torch.randint(16, 128, (n,), generator=g).tolist()
        rows.append([*before, *middle, *after])
    input_ids = torch.tensor(rows)
    labels = input_ids.masked_fill(input_ids == _FAMILY_IMAGE_TOKEN, -100)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if variant == "image":
        batch.update(_family_pixels(name, g, 2))
    return batch


# ------------------------------------------------------------------------------------------------------------
# Text models

_QWEN2 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
)


def _qwen2_config() -> Any:
    from transformers import Qwen2Config

    config = Qwen2Config(**_QWEN2, **_rope(10000.0))
    config._attn_implementation = "eager"
    return config


def _qwen2() -> nn.Module:
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM(_qwen2_config())


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """Causal-LM cross entropy (shifted by one, -100 ignored), as transformers computes it."""
    if labels is None:
        return None
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _logits_fused(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
    """verl's fused kernels: ``lm_head.weight`` read raw, ``lm_head``'s own forward never runs."""
    logits = F.linear(hidden, model.lm_head.weight)
    return _next_token_loss(logits, labels), logits


def _logits_weight_penalty(
    model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None
) -> tuple[Any, torch.Tensor]:
    """A z-loss-like penalty: ``lm_head.weight`` read *after* ``lm_head``'s forward (1e-3 * mean of its squares)."""
    logits = model.lm_head(hidden)
    loss = _next_token_loss(logits, labels)
    return (None if loss is None else loss + 1e-3 * model.lm_head.weight.pow(2).mean()), logits


#: Test models whose root forward reads ``lm_head.weight`` itself, by class name: how the head is applied.
_HEAD_READERS = {
    "Qwen2FusedLmHeadForCausalLM": _logits_fused,
    "Qwen2WeightPenaltyForCausalLM": _logits_weight_penalty,
}
_HEAD_READER_CLASSES: dict[str, type[nn.Module]] = {}


def _head_reader_class(name: str) -> type[nn.Module]:
    """A Qwen2ForCausalLM subclass named ``name`` (module-level, so it pickles by qualified name) whose forward
    applies the head the way :data:`_HEAD_READERS` says; built once, when first asked for."""
    if name not in _HEAD_READER_CLASSES:
        from transformers import Qwen2ForCausalLM
        from transformers.modeling_outputs import CausalLMOutputWithPast

        apply_head = _HEAD_READERS[name]

        def forward(
            self: nn.Module,
            input_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            labels: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> CausalLMOutputWithPast:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
            loss, logits = apply_head(self, hidden, labels)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

        namespace = {"forward": forward, "__module__": __name__, "__qualname__": name, "__doc__": apply_head.__doc__}
        cls = type(name, (Qwen2ForCausalLM,), namespace)
        _HEAD_READER_CLASSES[name] = cls
    return _HEAD_READER_CLASSES[name]


def __getattr__(name: str) -> Any:
    # the head-reader classes resolve lazily, so pickling by qualified name works without importing transformers
    # at module import
    if name in _HEAD_READERS:
        return _head_reader_class(name)
    raise AttributeError(name)


def _qwen2_fused() -> nn.Module:
    return _head_reader_class("Qwen2FusedLmHeadForCausalLM")(_qwen2_config())


def _qwen2_zloss() -> nn.Module:
    return _head_reader_class("Qwen2WeightPenaltyForCausalLM")(_qwen2_config())


def _gemma3n() -> nn.Module:
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size=64,
        hidden_size_per_layer_input=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0,
        laurel_rank=8,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0, 0.0],
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    return Gemma3nForCausalLM(config)


def _t5_shared() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    model = T5ForConditionalGeneration(config)
    # transformers 5 forces tie_word_embeddings=True and ties lm_head to shared; restore the flan-t5 state
    # (4.57 builds it untied already). A fresh lm_head either way, so both versions start alike.
    model.lm_head.weight = nn.Parameter(torch.empty_like(model.shared.weight))
    nn.init.normal_(model.lm_head.weight, std=config.d_model**-0.5)
    model.config.tie_word_embeddings = False
    shared = model.shared.weight
    model.encoder.embed_tokens.weight = shared
    model.decoder.embed_tokens.weight = shared
    return model


def _text_batch(g: torch.Generator, vocab: int = 128, rows: int = 2, length: int = 12) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(input_ids)
    input_ids[1, -3:] = 0
    mask[1, -3:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _t5_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    batch = _text_batch(g)
    labels = torch.randint(3, 128, (2, 7), generator=g)
    labels[1, -2:] = -100
    batch["labels"] = labels
    return batch


_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "glm4v": lambda: _glm4v(tied=False),
    "glm4v-tied": lambda: _glm4v(tied=True),
    "glm4v-moe": _glm4v_moe,
    "qwen2": _qwen2,
    "gemma3n": _gemma3n,
    "qwen2-fused-lmhead": _qwen2_fused,
    "qwen2-zloss": _qwen2_zloss,
    "t5-shared": _t5_shared,
    "qwen2-vl": lambda: _qwen_vl("qwen2-vl"),
    "qwen2.5-vl": lambda: _qwen_vl("qwen2.5-vl"),
    "qwen3-vl": lambda: _qwen_vl("qwen3-vl"),
    "llava": lambda: _llava(),
    "gemma3": _gemma3,
    "paligemma": _paligemma,
    "mistral3": _mistral3,
    "idefics3": lambda: _idefics3("idefics3"),
    "smolvlm": lambda: _idefics3("smolvlm"),
    "vipllava": _vipllava,
}


def _external(name: str) -> Any:
    """A test model outside the zoo, named "package.module:attr": attr has ``build()`` and ``batch(generator)``
    (``batch(generator, variant)`` where it has a true ``is_vlm``: a vision-language model)."""
    import importlib

    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_name(name: str) -> None:
    if name not in ZOO and name not in VISION_ZOO and ":" not in name:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"unknown zoo model {name!r}; choose one of: {', '.join([*ZOO, *VISION_ZOO])}")


def builder(name: str) -> Callable[[], nn.Module]:
    """The constructor of zoo model ``name`` (:data:`ZOO` or :data:`VISION_ZOO`) as it is: it builds on the default
    device (under ``torch.device("meta")``: a skeleton, no weights) and sets no seed, dtype or mode;
    :func:`build_model` is the seeded, fp32, dropout-free model."""
    if name not in _BUILDERS:
        from fsdp_compat.errors import FsdpCompatError

        raise FsdpCompatError(f"unknown zoo model {name!r}; choose one of: {', '.join([*ZOO, *VISION_ZOO])}")
    return _BUILDERS[name]


def build_model(name: str, *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Build zoo model ``name``: fp32, train mode, dropout-free, weights a function of ``seed`` only."""
    _check_name(name)
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = _BUILDERS[name]() if name in _BUILDERS else _external(name).build()
    model = model.to(device=device, dtype=torch.float32)
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if name == "glm4v-tied":
        assert model.lm_head.weight is model.get_input_embeddings().weight, "glm4v-tied did not tie"
    return model


def is_vlm(name: str) -> bool:
    """True for the zoo's vision-language models and external ones with a true ``is_vlm`` (they take
    ``make_batch(..., variant=...)``)."""
    if ":" in name:
        return bool(getattr(_external(name), "is_vlm", False))
    return name in _VLM_INNER or name in FAMILY_VLMS


def make_batch(
    name: str, *, seed: int = 0, device: str | torch.device = "cpu", variant: str = "image"
) -> dict[str, torch.Tensor]:
    """Valid inputs for ``build_model(name)(**batch)``, including labels so the output has ``.loss``.

    ``variant`` picks a vision-language model's kind of micro-batch (:data:`VLM_VARIANTS`); other models ignore it.
    """
    _check_name(name)
    g = torch.Generator().manual_seed(seed + 12345)
    if ":" in name:
        external = _external(name)
        batch = external.batch(g, variant) if getattr(external, "is_vlm", False) else external.batch(g)
    elif name == "llava":
        batch = _llava_batch(g, variant)
    elif name in FAMILY_VLMS:
        batch = _family_batch(name, g, variant)
    elif is_vlm(name):
        patch = _GLM_VISION["patch_size"]
        batch = _vlm_batch(name, g, variant, patch=patch, vocab=_GLM_TEXT["vocab_size"])
    elif name == "t5-shared":
        batch = _t5_batch(g)
    else:
        batch = _text_batch(g)
    return {k: v.to(device) for k, v in batch.items()}
