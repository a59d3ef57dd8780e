"""Tiled, any-resolution and masked families (tiles of whole images, ``image_sizes``, pixel masks): InternVL, the
LLaVA-Next line, Idefics2, Pixtral kin and the others of ``TILED_FAMILIES``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lab.vlms import TinyVlm, eager, fixed_pixels
from lab.vlms.grid import AUDIO_NOTE, OmniVlm

IMAGE = 10  # the image placeholder token of every model here (special ids < 16)


def _qwen2_text(**extra: Any) -> dict[str, Any]:
    """A 2-layer Qwen2 text config (vocab 128, untied, pad 0)."""
    text = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    text.update(extra)
    return text


# ---------------------------------------------------------------------------------------------------- InternVL


def _internvl() -> nn.Module:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  image_size=32, patch_size=4, num_channels=3, hidden_act="quick_gelu",
                  use_absolute_position_embeddings=True)  # fmt: skip
    config = InternVLConfig(text_config=_qwen2_text(hidden_size=128), vision_config=vision, image_token_id=IMAGE,
                            image_seq_length=16, vision_feature_layer=-1, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    return InternVLForConditionalGeneration(eager(config))


MODELS = [
    TinyVlm(
        ("internvl",),
        _internvl,
        fixed_pixels,
        IMAGE,
        source="tester (text hidden 128, vision hidden 32 patch 4), image_size 32 instead of 64: 16 tokens",
    ),
]


# ------------------------------------------------------------------------ LLaVA-Next line (anyres, image_sizes)

_CLIP = dict(model_type="clip_vision_model", image_size=16, patch_size=4, num_channels=3, hidden_size=32,
             projection_dim=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)  # fmt: skip
_LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=37, hidden_act="gelu", max_position_embeddings=580, pad_token_id=0,
              tie_word_embeddings=False)  # fmt: skip
_PINPOINTS = [[32, 32]]


def _llava_next(prefix: str, **extra: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, f"{prefix}Config")(
            text_config=dict(_LLAMA), vision_config=dict(_CLIP), image_token_index=IMAGE, projector_hidden_act="gelu",
            vision_feature_select_strategy="default", vision_feature_layer=-2, image_grid_pinpoints=_PINPOINTS,
            tie_word_embeddings=False, **extra,
        )  # fmt: skip
        return getattr(transformers, f"{prefix}ForConditionalGeneration")(eager(config))

    return build


def anyres_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random 30 x 30 images (the tester's size) as the base tile plus the 32 x 32 pinpoint's tiles."""
    vision = config.vision_config
    side = int(vision.image_size)
    height, width = config.image_grid_pinpoints[0]
    tiles = 1 + (height // side) * (width // side)
    return {"pixel_values": torch.randn(n, tiles, int(vision.num_channels), side, side, generator=g),
            "image_sizes": torch.tensor([[30, 30]] * n)}  # fmt: skip


_ANYRES = (
    "tester (CLIP 16 px tiles, pinpoints [[32, 32]], Llama text hidden 32), patch 4 instead of 2, and the "
    "config's and checkpoints' vision_feature_layer -2 instead of the tester's -1 (the last CLIP layer unused)"
)

MODELS += [
    TinyVlm(("llava_next",), _llava_next("LlavaNext"), anyres_pixels, IMAGE, source=_ANYRES),
    TinyVlm(("llava_onevision",), _llava_next("LlavaOnevision"), anyres_pixels, IMAGE, source=_ANYRES),
    TinyVlm(("llava_next_video",), _llava_next("LlavaNextVideo"), anyres_pixels, IMAGE, source=_ANYRES),
]


# ----------------------------------------------------------------------------------- Idefics2 (tiles, a mask)


def tile_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of one tile each at the tower's ``image_size``: ``(n, 1, C, S, S)``."""
    vision = config.vision_config
    side = int(vision.image_size)
    return {"pixel_values": torch.randn(n, 1, int(vision.num_channels), side, side, generator=g)}


def _idefics2() -> nn.Module:
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration

    vision = dict(image_size=12, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=32)  # fmt: skip
    perceiver = dict(hidden_act="silu", resampler_n_latents=2, resampler_depth=2, resampler_n_heads=2,
                     num_key_value_heads=1, resampler_head_dim=12)  # fmt: skip
    text = dict(
        model_type="mistral",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=32,
        tie_word_embeddings=False,
    )
    config = Idefics2Config(vision_config=vision, perceiver_config=perceiver, text_config=text, image_token_id=IMAGE,
                            tie_word_embeddings=False)  # fmt: skip
    return Idefics2ForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("idefics2",),
        _idefics2,
        tile_pixels,
        IMAGE,
        source="tester (image 12, perceiver 2 latents, Mistral text hidden 64), patch 4 instead of 12",
        parity="reordered",
        note="within 1e-6 relative, not 0.0: an all-image run, which needs no dummy, is already 1.9e-08 off on "
        "text_model.embed_tokens against the single-process reference (FSDP2 reorders a sum)",
    ),
]


# ------------------------------------------------------------------- Gemma4 (patch rows + image_position_ids)


def positioned_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of 2k x 2k patches (k = pooling kernel: 4 tokens each) as patch rows with their (x, y)
    ``image_position_ids``."""
    vision = config.vision_config
    side = 2 * int(vision.pooling_kernel_size)
    dim = 3 * int(vision.patch_size) ** 2
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(-1, 2)
    return {"pixel_values": torch.randn(n, side * side, dim, generator=g),
            "image_position_ids": grid.unsqueeze(0).repeat(n, 1, 1)}  # fmt: skip


def _gemma4() -> nn.Module:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=8, layer_types=["sliding_attention",
                "full_attention"], sliding_window=16, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
                num_kv_shared_layers=0, use_bidirectional_attention="vision", pad_token_id=0, eos_token_id=1,
                bos_token_id=2, tie_word_embeddings=False, max_position_embeddings=512)  # fmt: skip
    vision = dict(
        hidden_size=32,
        num_key_value_heads=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        head_dim=8,
        patch_size=5,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    # the USM conformer shrunk: 2 layers of 32, 8 mel bins (the first conv's channels), chunks of 4
    audio = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[8, 4],
                 conv_kernel_size=3, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
                 output_proj_dims=32)  # fmt: skip
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, image_token_id=IMAGE,
                          video_token_id=7, audio_token_id=8, boi_token_id=5, eoi_token_id=6, mm_tokens_per_image=4,
                          tie_word_embeddings=False)  # fmt: skip
    return Gemma4ForConditionalGeneration(eager(config))


def _gemma4_clips(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random clips of 8 mel frames with their all-valid ``input_features_mask``: two tokens each."""
    mels = int(config.audio_config.subsampling_conv_channels[0])
    return {"input_features": torch.randn(n, 8, mels, generator=g),
            "input_features_mask": torch.ones(n, 8, dtype=torch.bool)}  # fmt: skip


MODELS += [
    OmniVlm(
        ("gemma4",),
        _gemma4,
        positioned_pixels,
        IMAGE,
        source="tester (vision hidden 32 patch 5 pooling 2; text hidden 32, per-layer input 16), 2 text layers "
        "without kv sharing or MoE; a USM audio encoder shrunk to 2 layers of 32",
        note=AUDIO_NOTE,
        audio_token_id=8,
        clips=_gemma4_clips,
    ),
]


# ----------------------------------------------------------- LFM2-VL (SigLIP2 naflex: spatial_shapes + a mask)


def naflex_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of 2f x 2f patches (f = downsample factor: 4 tokens each) as patch rows, with their
    ``spatial_shapes`` and an all-valid ``pixel_attention_mask`` (the tester's layout)."""
    vision = config.vision_config
    side = 2 * int(config.downsample_factor)
    dim = int(vision.num_channels) * int(vision.patch_size) ** 2
    return {"pixel_values": torch.randn(n, side * side, dim, generator=g),
            "spatial_shapes": torch.tensor([[side, side]] * n),
            "pixel_attention_mask": torch.ones(n, side * side, dtype=torch.long)}  # fmt: skip


def _lfm2_vl() -> nn.Module:
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2, num_channels=3,
                  num_patches=16, patch_size=4, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)  # fmt: skip
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=100, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False, conv_bias=False, conv_L_cache=3, block_multiple_of=2,
                full_attn_idxs=[0])  # fmt: skip
    config = Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, downsample_factor=4,
                          projector_hidden_size=32, tie_word_embeddings=False)  # fmt: skip
    return Lfm2VlForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(("lfm2_vl",), _lfm2_vl, naflex_pixels, IMAGE, source="tester"),
]


# ------------------------------------------------------------------ Pixtral towers with image_sizes (Mistral3 kin)


def sized_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images at the Pixtral tower's ``image_size`` with their ``image_sizes``: ``(n, C, S, S)``."""
    vision = config.vision_config
    side = int(vision.image_size)
    return {"pixel_values": torch.randn(n, int(vision.num_channels), side, side, generator=g),
            "image_sizes": torch.tensor([[side, side]] * n)}  # fmt: skip


def _lighton_ocr() -> nn.Module:
    from transformers import LightOnOcrConfig, LightOnOcrForConditionalGeneration

    from fsdp_compat.testing.zoo import _PIXTRAL, _text

    config = LightOnOcrConfig(vision_config=dict(_PIXTRAL), text_config=_text("qwen3"), spatial_merge_size=2,
                              image_token_id=IMAGE, tie_word_embeddings=False)  # fmt: skip
    return LightOnOcrForConditionalGeneration(eager(config))


def _mistral_large4() -> nn.Module:
    from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration

    from fsdp_compat.testing.zoo import _PIXTRAL

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=37, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                head_dim=8, index_topk=16, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1,
                max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    config = MistralLarge4Config(
        vision_config=dict(_PIXTRAL),
        text_config=text,
        spatial_merge_size=2,
        image_token_index=IMAGE,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    return MistralLarge4ForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("lighton_ocr",),
        _lighton_ocr,
        sized_pixels,
        IMAGE,
        source="no tester stored: the zoo Mistral3's Pixtral sizes and zoo text sizes (Qwen3)",
    ),
    TinyVlm(
        ("mistral_large4",),
        _mistral_large4,
        sized_pixels,
        IMAGE,
        source="no tester stored: the zoo Mistral3's Pixtral sizes; text config defaults shrunk (hidden 32, "
        "4 experts, MLA ranks 8-16)",
    ),
]


# ----------------------------------------------------------------- Granite 4 Vision (anyres + deepstack layers)


def _granite4_vision() -> nn.Module:
    from transformers import Granite4VisionConfig, Granite4VisionForConditionalGeneration

    vision = dict(_CLIP, hidden_size=64, projection_dim=64)
    text = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    qformer = dict(num_hidden_layers=1, intermediate_size=37, cross_attention_frequency=1,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
                   use_qformer_text_input=False)  # fmt: skip
    config = Granite4VisionConfig(
        vision_config=vision, text_config=text, qformer_config=qformer, image_token_index=IMAGE,
        image_grid_pinpoints=_PINPOINTS, vision_feature_layer=-1, downsample_rate="1/2",
        deepstack_layer_map=[[-2, 0]], spatial_vision_layer=-1, spatial_target_layers=[1, 2, 3, 4],
        projector_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return Granite4VisionForConditionalGeneration(eager(config))


class _DeepstackVlm(TinyVlm):
    """A tiny model whose ``get_image_features`` has no ``pooler_output`` but ``deepstack_features``, pairs of (text
    layer, per-image features) all of one length: its placeholder count is that length, counted on the built model
    (``lab.vlms.features_per_image`` reads ``pooler_output`` only)."""

    def placeholders_per_image(self) -> int:
        import lab.vlms as vlms

        if self.name not in _DEEPSTACK_FEATURES:
            model = vlms._built(self)
            with torch.no_grad():
                out = vlms.inner_model(model).get_image_features(**self.pixels(model.config, torch.Generator(), 1))
            _DEEPSTACK_FEATURES[self.name] = int(out.deepstack_features[0][1][0].shape[0])
        return _DEEPSTACK_FEATURES[self.name]


_DEEPSTACK_FEATURES: dict[str, int] = {}


MODELS += [
    _DeepstackVlm(
        ("granite4_vision",),
        _granite4_vision,
        anyres_pixels,
        IMAGE,
        source="no tester stored: LLaVA-Next's tester sizes (vision hidden 64: the Q-Former takes hidden // 64 "
        "heads), Granite text shrunk to 5 layers, not 2: the deepstack projector and the 4 spatial ones each need "
        "a text layer of their own (the forward keeps one feature set per layer, so a shared layer leaves a "
        "projector out of the image rank's graph while the dummy's zero reaches it)",
        parity="measured",
        note="FSDP2 alone is not exact here: its all-image run (no dummy) is 3.0e-08 off in gradients (lm_head), "
        "1.3e-06 in parameters after 2 AdamW steps (a vision v_proj); the aligned image|text run 1.5e-08 and "
        "7.8e-07: FSDP2 reorders sums, the alignment adds no error of its own",
    ),
]


# ------------------------------------------------------------------- Granite Docling (tiles + a tile mask)


def masked_tile_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """:func:`tile_pixels` with the ``pixel_attention_mask`` that marks each row's one tile real."""
    return {**tile_pixels(config, g, n), "pixel_attention_mask": torch.ones(n, 1, dtype=torch.bool)}


def _granite_docling() -> nn.Module:
    from transformers import GraniteDoclingConfig, GraniteDoclingForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=4, out_hidden_size=32, scale_factor=2, use_fine_route=False)  # fmt: skip
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                tie_word_embeddings=False)  # fmt: skip
    config = GraniteDoclingConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, pad_token_id=0,
                                  tie_word_embeddings=False)  # fmt: skip
    return GraniteDoclingForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("granite_docling",),
        _granite_docling,
        masked_tile_pixels,
        IMAGE,
        source="no tester stored: config defaults shrunk (vision hidden 32, 16 px tiles of 4 px patches, scale "
        "factor 2; text hidden 32), no fine route",
    ),
]


# ------------------------------------------------------------------------ Aria (fixed size, an optional pixel_mask)


def _aria() -> nn.Module:
    from transformers import AriaConfig, AriaForConditionalGeneration

    vision = dict(model_type="idefics3_vision", image_size=20, patch_size=5, num_channels=3, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=10)  # fmt: skip
    text = dict(model_type="aria_text", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=60, moe_intermediate_size=4,
                moe_num_experts=4, moe_topk=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)  # fmt: skip
    config = AriaConfig(vision_config=vision, text_config=text, projector_patch_to_query_dict={16: 4},
                        image_token_index=IMAGE, vision_feature_layer=-1, tie_word_embeddings=False)  # fmt: skip
    return AriaForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("aria",),
        _aria,
        fixed_pixels,
        IMAGE,
        source="tester (vision hidden 32, MoE text hidden 32 with 4 experts of 4), 4 heads instead of 20 and a "
        "20 px image of 16 patches -> 4 queries instead of 358 px -> 128",
    ),
]


def _qianfan_ocr() -> nn.Module:
    from transformers import QianfanOCRConfig, QianfanOCRForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  image_size=32, patch_size=4, num_channels=3, drop_path_rate=0.0)  # fmt: skip
    config = QianfanOCRConfig(text_config=_qwen2_text(model_type="qwen3", hidden_size=128, head_dim=32),
                              vision_config=vision, image_token_id=IMAGE, image_seq_length=16,
                              vision_feature_layer=-1, tie_word_embeddings=False)  # fmt: skip
    return QianfanOCRForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("qianfan_ocr",),
        _qianfan_ocr,
        fixed_pixels,
        IMAGE,
        source="no tester stored: InternVL's (its lineage) tiny sizes, Qwen3 text, drop path 0",
    ),
]


# -------------------------------------------------------- MiniCPM-V 4.6 / 4.7 / OCR (NaViT-packed + target_sizes)


def packed_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of 8 x 8 patches, NaViT-packed into one ``(1, C, p, n * 64 * p)`` strip, with their
    ``target_sizes`` (patch grid per image): 4 tokens each after the two 2 x 2 merges."""
    vision = config.vision_config
    patch, side = int(vision.patch_size), 8
    pixels = torch.randn(1, int(vision.num_channels), patch, n * side * side * patch, generator=g)
    return {"pixel_values": pixels, "target_sizes": torch.tensor([[side, side]] * n, dtype=torch.int32)}


_QWEN3_5_TEXT = dict(
    model_type="qwen3_5_text",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _minicpm(prefix: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        text = (
            dict(_QWEN3_5_TEXT)
            if prefix == "MiniCPMV4_7"
            else _qwen2_text(model_type="qwen3", hidden_size=32, head_dim=8)
        )

        vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                      image_size=32, patch_size=4, insert_layer_id=0)  # fmt: skip
        config = getattr(transformers, f"{prefix}Config")(
            text_config=text, vision_config=vision,
            insert_layer_id=0, image_size=32, image_token_id=IMAGE, video_token_id=11, tie_word_embeddings=False,
        )  # fmt: skip
        return getattr(transformers, f"{prefix}ForConditionalGeneration")(eager(config))

    return build


_MINICPM = "no tester stored: config defaults shrunk (vision hidden 32, 4 px patches, merger after layer 0; Qwen3 text)"

MODELS += [
    TinyVlm(("minicpmv4_6",), _minicpm("MiniCPMV4_6"), packed_pixels, IMAGE, source=_MINICPM),
    TinyVlm(("minicpm_ocr",), _minicpm("MiniCPMOcr"), packed_pixels, IMAGE, source=_MINICPM),
    TinyVlm(
        ("minicpmv4_7",),
        _minicpm("MiniCPMV4_7"),
        packed_pixels,
        IMAGE,
        source=_MINICPM.replace("Qwen3 text", "Qwen3.5 text: one linear, one full attention layer"),
    ),
]


# ---------------------------------------------------------- Molmo2 (crops + image_token_pooling + image_grids)


def pooled_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of one crop each (the tower's fixed patch count, 4 x 4 patches) as ``(n, P, C * p * p)``,
    with ``image_token_pooling`` pooling each 2 x 2 block of a crop into one token (4 tokens an image) and the
    ``image_grids`` (rows x columns of pooled tokens; no low-resolution part) that count them."""
    vision = config.vision_config
    side, dim = 4, int(vision.num_channels) * int(vision.patch_size) ** 2
    local = _molmo2_counts_crops()  # transformers >= 5.25: indices within each image, shifted by image_num_crops
    blocks = [[(0 if local else i * side * side) + (2 * r + dr) * side + 2 * c + dc for dr in (0, 1) for dc in (0, 1)]
              for i in range(n) for r in range(side // 2) for c in range(side // 2)]  # fmt: skip
    crops = {"image_num_crops": torch.ones(n, dtype=torch.long)} if local else {}
    grids = torch.tensor([[2, 2, 0, 0]] * n)
    return {"pixel_values": torch.randn(n, side * side, dim, generator=g),
            "image_token_pooling": torch.tensor(blocks), "image_grids": grids} | crops  # fmt: skip


def _molmo2_counts_crops() -> bool:
    """Whether Molmo2's ``get_image_features`` takes ``image_num_crops`` (transformers 5.25: each image's pooling
    indices count from that image's first patch, and more than one image needs the crop counts; 5.24 indexes the
    batch's patches as one list and ignores it)."""
    import inspect

    from transformers.models.molmo2 import modeling_molmo2

    return "image_num_crops" in inspect.signature(modeling_molmo2.Molmo2Model.get_image_features).parameters


def _molmo2() -> nn.Module:
    from transformers import Molmo2Config, Molmo2ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, image_size=[16, 16], patch_size=4,
                  num_position_embeddings=16)  # fmt: skip
    adapter = dict(vision_feature_layer=[-2], hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                   intermediate_size=37, text_hidden_size=32)  # fmt: skip
    text = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                additional_vocab_size=0, num_hidden_layers=2, intermediate_size=37, max_position_embeddings=512,
                tie_word_embeddings=False)  # fmt: skip
    config = Molmo2Config(vision_config=vision, adapter_config=adapter, text_config=text, image_patch_id=IMAGE,
                          image_start_token_id=11, low_res_image_start_token_id=12, image_end_token_id=13,
                          frame_start_token_id=14, frame_end_token_id=15, tie_word_embeddings=False)  # fmt: skip
    return Molmo2ForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("molmo2",),
        _molmo2,
        pooled_pixels,
        IMAGE,
        source="no tester stored: config defaults shrunk (vision hidden 32, 16 patches of 4 px; features from "
        "the next-to-last vision layer, as the checkpoints read inner layers; text hidden 32)",
    ),
]


# ---------------------------------------------------------- Kosmos-2.5 (flattened_patches, features inside the text)


def flattened_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images of 4 x 4 patches as Pix2Struct ``flattened_patches``: (row, column) ids from 1, then the
    patch's pixels, ``(n, 16, 2 + C * p * p)``."""
    dim = int(config.vision_config.patch_embed_hidden_size)
    ids = torch.stack(torch.meshgrid(torch.arange(1, 5), torch.arange(1, 5), indexing="ij"), -1).reshape(16, 2)
    patches = torch.cat([ids.float().unsqueeze(0).repeat(n, 1, 1), torch.randn(n, 16, dim, generator=g)], -1)
    return {"flattened_patches": patches}


def _kosmos2_5_extra(batch: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    """Kosmos-2.5 places the image features where ``image_embeds_position_mask`` is 1 (no token id is read)."""
    if variant != "image":
        return {}
    return {"image_embeds_position_mask": (batch["input_ids"] == IMAGE).long()}


def _kosmos2_5() -> nn.Module:
    from transformers import Kosmos2_5Config, Kosmos2_5ForConditionalGeneration

    text = dict(vocab_size=128, max_position_embeddings=512, embed_dim=32, layers=2, ffn_dim=37, attention_heads=4,
                dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    vision = dict(hidden_size=32, patch_embed_hidden_size=48, intermediate_size=37, head_dim=8, num_hidden_layers=2,
                  num_attention_heads=4, max_num_patches=64)  # fmt: skip
    config = Kosmos2_5Config(text_config=text, vision_config=vision, latent_query_num=4, tie_word_embeddings=False)
    return Kosmos2_5ForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("kosmos-2.5",),
        _kosmos2_5,
        flattened_pixels,
        IMAGE,
        extra=_kosmos2_5_extra,
        source="no tester stored: config defaults shrunk (vision hidden 32, 4 x 4 patches of 4 px, 4 latent "
        "queries; text embed 32, dropout 0)",
        note="no row: the text model is called with input_ids and the features as image_embeds, which it "
        "places itself (image_embeds_position_mask); the alignment's 0.0 * features joins the text model's "
        "inputs_embeds, which this forward never passes; every rank raises the named FsdpCompatError "
        "(families524)",
    ),
]


# ------------------------------------------------------------- DeepSeek-OCR-2 (SAM + encoder, global + local views)


def sam_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random global views at the SAM encoder's ``image_size`` (no local patches): ``(n, C, S, S)``."""
    sam = config.vision_config.sam_config
    side = int(sam.image_size)
    return {"pixel_values": torch.randn(n, int(sam.num_channels), side, side, generator=g)}


# DeepSeek-OCR-2 and Unlimited-OCR: the same tester sizes (SAM tower, its encoder, a small MoE text model)
_OCR_SAM = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4, num_channels=3,
                image_size=16, patch_size=2, hidden_act="gelu", mlp_ratio=4.0, window_size=4, global_attn_indexes=[1],
                downsample_channels=[32, 64], initializer_range=0.02)  # fmt: skip
_OCR_ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, hidden_act="silu", max_position_embeddings=512,
                    rms_norm_eps=1.0)  # fmt: skip
_OCR_TEXT = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, hidden_act="silu", max_position_embeddings=512, tie_word_embeddings=False,
                 bos_token_id=2, eos_token_id=3, pad_token_id=4, n_routed_experts=8, n_shared_experts=1,
                 mlp_layer_types=["dense", "sparse"], moe_intermediate_size=64, num_experts_per_tok=2)  # fmt: skip


def _deepseek_ocr2() -> nn.Module:
    from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration

    sam, encoder, text = copy.deepcopy((_OCR_SAM, _OCR_ENCODER, _OCR_TEXT))
    config = DeepseekOcr2Config(vision_config=dict(sam_config=sam, encoder_config=encoder), text_config=text,
                                image_token_id=IMAGE, tie_word_embeddings=False)  # fmt: skip
    return DeepseekOcr2ForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("deepseek_ocr2",),
        _deepseek_ocr2,
        sam_pixels,
        IMAGE,
        source="tester (SAM hidden 32, encoder hidden 64, "
        "MoE text hidden 128: 145 tokens an image), global views only; SAM initializer_range 0.02, not its "
        "default 1e-10 (with it one SAM qkv bias gradient was 8.97e-43, a denormal, off the reference)",
    ),
]


def _unlimited_ocr() -> nn.Module:
    from transformers import UnlimitedOcrConfig, UnlimitedOcrForConditionalGeneration

    sam, encoder, text = copy.deepcopy((dict(_OCR_SAM, mlp_dim=128), _OCR_ENCODER, _OCR_TEXT))
    config = UnlimitedOcrConfig(vision_config=dict(sam_config=sam, encoder_config=encoder), text_config=text,
                                image_token_id=IMAGE, tie_word_embeddings=False)  # fmt: skip
    return UnlimitedOcrForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("unlimited_ocr",),
        _unlimited_ocr,
        sam_pixels,
        IMAGE,
        source="tester (SAM hidden 32, encoder hidden 64, "
        "MoE text hidden 128), global views only; SAM initializer_range 0.02 as for DeepSeek-OCR-2",
    ),
]


# ------------------------------------------------------------------ Step3p7 (fixed size, optional local patches)


def _step3p7() -> nn.Module:
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=4, max_position_embeddings=16)  # fmt: skip
    text = dict(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, share_expert_dim=8, layer_types=["full_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse"], max_position_embeddings=512, pad_token_id=0, sliding_window=16,
                tie_word_embeddings=False)  # fmt: skip
    config = Step3p7Config(vision_config=vision, text_config=text, image_token_id=IMAGE, tie_word_embeddings=False)
    return Step3p7ForConditionalGeneration(eager(config))


MODELS += [
    TinyVlm(
        ("step3p7",),
        _step3p7,
        fixed_pixels,
        IMAGE,
        source="tester's sizes (hidden 16, 16 px images of 4 px patches: one token; MoE text of 4 experts) on "
        "5.24's config classes (the stored tester is for another config layout), 2 vision layers",
    ),
]
