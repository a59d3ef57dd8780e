"""Families without the alignment's shape (no separate tower attribute, no text-model attribute, or no
``get_image_features``): cross-attention VLMs, VQ tokenizers, patches embedded by a linear, encoder-decoders.

Their images do not all reach the text model as placeholder features, so the generic batch's image layout (one
placeholder per ``get_image_features`` feature) is given per family here (:class:`ShapeVlm`'s ``tokens``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lab.vlms import TinyVlm, eager


@dataclass(frozen=True)
class ShapeVlm(TinyVlm):
    """A :class:`TinyVlm` whose placeholder tokens per image are given (``tokens``: a number, or a function of the
    config), for families whose images do not become placeholder features (cross-attention: 1 ``<|image|>`` token).

    ``unaligned``: where the family's forward cannot run a text-only micro-batch at all, the error a text rank
    raises by itself in an unaligned run (the families test asserts it instead of gloo's size mismatch).
    ``named``: False where fsdp-compat cannot name the model either (no ``pixel_values*`` argument or no tower it
    recognises): the aligned run fails with the same error of the text rank (status ``needs images``).
    ``rename``: keywords of the generic batch renamed for the forward (an encoder-decoder's text is the decoder's).
    """

    tokens: int | Callable[[Any], int] | None = None
    unaligned: str = ""
    named: bool = True
    rename: tuple[tuple[str, str], ...] = ()

    def placeholders_per_image(self) -> int:
        if self.tokens is None:
            return super().placeholders_per_image()
        import lab.vlms as vlms

        return self.tokens if isinstance(self.tokens, int) else self.tokens(vlms._config(self))

    def batch(self, g: torch.Generator, variant: str = "image") -> dict[str, torch.Tensor]:
        batch = super().batch(g, variant)
        for old, new in self.rename:
            if old in batch:
                batch[new] = batch.pop(old)
        return batch


_TEXT = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ mllama


def _mllama() -> nn.Module:
    """The tester's MllamaVisionText2TextModelTester sizes; cross-attention at text layer 1 of 2. Every tanh gate
    (the cross-attention layers' attention and MLP gates, the vision tower's tile, position and global-layer gates)
    drawn from U(-1, 1), not transformers' zero init: a trained checkpoint's gates are open, and a zero gate would
    hide what the cross-attention layers add (the text rank's dummy states included) from the first step."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    text = {**_TEXT, "model_type": "mllama_text_model", "cross_attention_layers": [1], "rope_scaling": None}
    text.pop("max_position_embeddings")
    vision = {"image_size": 30, "patch_size": 2, "num_channels": 3, "hidden_size": 16,
              "intermediate_layers_indices": [0], "vision_output_dim": 32, "num_hidden_layers": 2,
              "num_global_layers": 2, "attention_heads": 4,
              "intermediate_size": 37, "max_num_tiles": 1, "supported_aspect_ratios": [[1, 1]]}  # fmt: skip
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=10, tie_word_embeddings=False)
    model = MllamaForConditionalGeneration(eager(config))
    gates = ("cross_attn_attn_gate", "cross_attn_mlp_gate", "gate", "gate_attn", "gate_ffn")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.rpartition(".")[2] in gates:
                parameter.uniform_(-1.0, 1.0)
    return model


def _mllama_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """One tile per image, one image per row: ``(n, 1, 1, C, S, S)``, aspect ratio id 1 (1 x 1 tiles)."""
    vision = config.vision_config
    side = int(vision.image_size)
    return {
        "pixel_values": torch.randn(n, 1, 1, int(vision.num_channels), side, side, generator=g),
        "aspect_ratio_ids": torch.ones(n, 1, dtype=torch.long),
        "aspect_ratio_mask": torch.ones(n, 1, 1, dtype=torch.long),
    }


# -------------------------------------------------------------------------------------------------------- fuyu


def _fuyu() -> nn.Module:
    """The tester's FuyuModelTester sizes (persimmon text model, 30 x 30 patches)."""
    from transformers import FuyuConfig, FuyuForCausalLM

    text = {k: v for k, v in _TEXT.items() if k != "num_key_value_heads"}
    config = FuyuConfig(**text, patch_size=30, num_channels=3, image_token_id=10, tie_word_embeddings=False,
                        text_config={**text, "model_type": "persimmon"})  # fmt: skip
    return FuyuForCausalLM(eager(config))


def _fuyu_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """Four flattened 30 x 30 patches per image, one image per row: ``(n, 4, P * P * C)``, under the name the
    installed transformers' forward takes (``image_patches`` up to 5.18 at least, ``pixel_values`` in 5.24)."""
    import inspect

    from transformers.models.fuyu import modeling_fuyu

    dim = int(config.patch_size) ** 2 * int(config.num_channels)
    takes = inspect.signature(modeling_fuyu.FuyuModel.forward).parameters
    return {"pixel_values" if "pixel_values" in takes else "image_patches": torch.randn(n, 4, dim, generator=g)}


# --------------------------------------------------------------------------------------------------- chameleon


def _vq_vocab(codes: int, first: int) -> dict[str, int]:
    """Chameleon/Emu3's vocabulary map: ``<image>`` = 10 and one ``IMGIMG<code in letters>Z`` token per VQ code."""
    letters = {str(i): chr(ord("A") + i) for i in range(10)}
    names = {f"IMGIMG{''.join(letters[c] for c in str(code))}Z": first + code for code in range(codes)}
    return {"<image>": 10, **names}


def _chameleon() -> nn.Module:
    """Config defaults shrunk (text as the llama tester; a 2-level VQ-VAE of 32 channels, 16 codes, 8 x 8 images ->
    4 x 4 tokens; 16 image-code ids above the 128 text ids)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    vq = {"embed_dim": 8, "num_embeddings": 16, "latent_channels": 8, "resolution": 8, "base_channels": 32,
          "channel_multiplier": [1, 2], "num_res_blocks": 1, "attn_resolutions": []}  # fmt: skip
    text = {**_TEXT, "vocab_size": 144}  # ids 128-143: the image codes (their logits are masked: no text label)
    config = ChameleonConfig(**text, vq_config=vq, vocabulary_map=_vq_vocab(16, 128), tie_word_embeddings=False)
    return ChameleonForConditionalGeneration(eager(config))


def _chameleon_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    side = int(config.vq_config.resolution)
    return {"pixel_values": torch.randn(n, 3, side, side, generator=g)}


# ------------------------------------------------------------------------------------------------- instructblip

_BLIP_VISION = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
                "image_size": 30, "patch_size": 2}  # fmt: skip
_QFORMER = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 37, "encoder_hidden_size": 32, "cross_attention_frequency": 1,
            "max_position_embeddings": 512, "pad_token_id": 0}  # fmt: skip


def _instructblip() -> nn.Module:
    """Config defaults shrunk (2-layer ViT and Q-Former of 32, 4 query tokens, a llama text model)."""
    from transformers import InstructBlipConfig, InstructBlipForConditionalGeneration

    config = InstructBlipConfig(vision_config=_BLIP_VISION, qformer_config=_QFORMER,
                                text_config={**_TEXT, "model_type": "llama"}, num_query_tokens=4,
                                image_token_index=10, tie_word_embeddings=False)  # fmt: skip
    return InstructBlipForConditionalGeneration(eager(config))


def _instructblipvideo() -> nn.Module:
    """InstructBLIP's sizes under the video class (frames share the image ViT)."""
    from transformers import InstructBlipVideoConfig, InstructBlipVideoForConditionalGeneration

    config = InstructBlipVideoConfig(vision_config=_BLIP_VISION, qformer_config=_QFORMER,
                                     text_config={**_TEXT, "model_type": "llama"}, num_query_tokens=4,
                                     video_token_index=10, tie_word_embeddings=False)  # fmt: skip
    return InstructBlipVideoForConditionalGeneration(eager(config))


def _blip() -> nn.Module:
    """Config defaults shrunk (InstructBLIP's 2-layer ViT of 32 over 30 x 30 images; a 2-layer BERT-like text
    decoder of 32 cross-attending the image states)."""
    from transformers import BlipConfig, BlipForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "encoder_hidden_size": 32, "intermediate_size": 37,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 3, "tie_word_embeddings": False}  # fmt: skip
    config = BlipConfig(text_config=text, vision_config=_BLIP_VISION, tie_word_embeddings=False)
    return BlipForConditionalGeneration(eager(config))


def _blip_2() -> nn.Module:
    """InstructBLIP's sizes (2-layer ViT and Q-Former of 32, 4 query tokens, a llama text model)."""
    from transformers import Blip2Config, Blip2ForConditionalGeneration

    config = Blip2Config(vision_config=_BLIP_VISION, qformer_config=_QFORMER,
                         text_config={**_TEXT, "model_type": "llama"}, num_query_tokens=4, image_token_index=10,
                         tie_word_embeddings=False)  # fmt: skip
    return Blip2ForConditionalGeneration(eager(config))


def _blip_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    side = int(config.vision_config.image_size)
    return {"pixel_values": torch.randn(n, 3, side, side, generator=g)}


def _video_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """One video of one frame per row: ``(n, 1, C, S, S)``."""
    side = int(config.vision_config.image_size)
    return {"pixel_values": torch.randn(n, 1, 3, side, side, generator=g)}


def _qformer_ids(batch: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    """The Q-Former's instruction: the first 4 text tokens of each row (on both variants)."""
    ids = batch["input_ids"][:, :4]
    return {"qformer_input_ids": ids, "qformer_attention_mask": torch.ones_like(ids)}


# ---------------------------------------------------------------------------------------------------- kosmos-2


def _kosmos2() -> nn.Module:
    """The tester's Kosmos2ModelTester sizes (a 2-layer CLIP-like ViT of 32 over 32 x 32 images, patch 4; 2 text
    layers of 32; 3 latent queries), dropout 0, vocabulary 128 (tester: 99), vision initializer_range 0.02
    (tester: 1e-10)."""
    from transformers import Kosmos2Config, Kosmos2ForConditionalGeneration

    text = {"vocab_size": 128, "embed_dim": 32, "layers": 2, "attention_heads": 4, "ffn_dim": 37, "dropout": 0.0,
            "attention_dropout": 0.0, "activation_dropout": 0.0, "max_position_embeddings": 512, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    vision = {"image_size": 32, "patch_size": 4, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 37, "attention_dropout": 0.0, "initializer_range": 0.02}  # fmt: skip
    config = Kosmos2Config(text_config=text, vision_config=vision, latent_query_num=3, tie_word_embeddings=False)
    return Kosmos2ForConditionalGeneration(eager(config))


def _kosmos2_mask(batch: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    """Where the latent queries' image embeddings go: the placeholder tokens (none in a text row)."""
    return {"image_embeds_position_mask": (batch["input_ids"] == 10).long()}


# ----------------------------------------------------------------------------------------------------- idefics


def _idefics() -> nn.Module:
    """Config defaults shrunk (a 2-layer ViT of 32, gated cross-attention at every text layer, no perceiver), with
    nothing frozen (the defaults freeze the text and vision layers)."""
    from transformers import IdeficsConfig, IdeficsForVisionText2Text

    vision = {"embed_dim": 32, "image_size": 30, "patch_size": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 37}  # fmt: skip
    text = {k: v for k, v in _TEXT.items() if k != "num_key_value_heads"}
    config = IdeficsConfig(**text, vision_config=vision, cross_layer_interval=1, use_resampler=False,
                           freeze_text_layers=False, freeze_vision_layers=False)  # fmt: skip
    return IdeficsForVisionText2Text(eager(config))


def _idefics_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """One image per row, ``(n, 1, C, S, S)``, every text token attending to it."""
    side = int(config.vision_config.image_size)
    return {"pixel_values": torch.randn(n, 1, 3, side, side, generator=g)}


def _idefics_mask(batch: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    if variant != "image":
        return {}
    return {"image_attention_mask": torch.ones(*batch["input_ids"].shape, 1, dtype=torch.long)}


# --------------------------------------------------------------------------------------------------------- git


def _git() -> nn.Module:
    """Config defaults shrunk (a 2-layer CLIP-like ViT of 32, 2 BERT-like text layers of 32)."""
    from transformers import GitConfig, GitForCausalLM

    vision = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 30, "patch_size": 2}  # fmt: skip
    text = {k: v for k, v in _TEXT.items() if k != "num_key_value_heads"}
    config = GitConfig(vision_config=vision, **text, tie_word_embeddings=False)
    return GitForCausalLM(eager(config))


# -------------------------------------------------------------------------------------------------------- emu3


def _emu3() -> nn.Module:
    """Config defaults shrunk (a 2-level VQ-VAE of 32 channels, 16 codes; image codes above the 128 text ids,
    end-of-row 11)."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    vq = {"codebook_size": 16, "embed_dim": 4, "latent_channels": 4, "base_channels": 32, "channel_multiplier": [1, 2],
          "num_res_blocks": 1, "attn_resolutions": [], "hidden_size": 64, "num_attention_heads": 1,
          "temporal_downsample_factor": 2}  # fmt: skip
    text = {**_TEXT, "vocab_size": 144, "model_type": "emu3_text_model", "attention_dropout": 0.0}
    vocab = {"<image>": 10, "<|extra_200|>": 11, **{f"<|visual token{code:06d}|>": 128 + code for code in range(16)}}
    config = Emu3Config(vq_config=vq, text_config=text, vocabulary_map=vocab, tie_word_embeddings=False)
    return Emu3ForConditionalGeneration(eager(config))


def _emu3_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """8 x 8 images (4 x 4 codes each) with their ``image_sizes``."""
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g), "image_sizes": torch.tensor([[8, 8]] * n)}


# ---------------------------------------------------------------------------------------------- gemma4_unified


def _gemma4_unified() -> nn.Module:
    """Config defaults shrunk (encoder-free: a patch embedder of 32 over 4 x 4 merged patches, 2 text layers of 32,
    no audio)."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    text = {**_TEXT, "head_dim": 8, "num_key_value_heads": 2, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False}  # fmt: skip
    vision = {"patch_size": 2, "pooling_kernel_size": 2, "mm_embed_dim": 32, "mm_posemb_size": 16,
              "output_proj_dims": 32}  # fmt: skip
    config = Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=None, image_token_id=10,
                                 video_token_id=11, boi_token_id=12, eoi_token_id=13, audio_token_id=14,
                                 boa_token_id=15, eoa_token_index=3, tie_word_embeddings=False)  # fmt: skip
    return Gemma4UnifiedForConditionalGeneration(eager(config))


def _unified_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """Four merged patches (2 x 2) per image, one image per row, with their (x, y) positions."""
    vision = config.vision_config
    dim = int(vision.model_patch_size) ** 2 * 3
    positions = torch.tensor([[0, 0], [1, 0], [0, 1], [1, 1]]).expand(n, 4, 2)
    return {"pixel_values": torch.randn(n, 4, dim, generator=g), "image_position_ids": positions.clone()}


# ---------------------------------------------------------------------------------------------------- t5gemma2


def _t5gemma2() -> nn.Module:
    """Config defaults shrunk (a 2-layer SigLIP of 32 over 16 x 16 images, 4 tokens per image, 2 encoder and 2
    decoder layers of 32)."""
    from transformers import T5Gemma2Config, T5Gemma2ForConditionalGeneration

    text = {**_TEXT, "head_dim": 8, "num_key_value_heads": 2, "sliding_window": 8, "query_pre_attn_scalar": 8,
            "layer_types": ["sliding_attention", "full_attention"], "dropout_rate": 0.0}  # fmt: skip
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 37,
              "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 16, "patch_size": 4}  # fmt: skip
    encoder = {"text_config": text, "vision_config": vision, "mm_tokens_per_image": 4, "boi_token_index": 12,
               "eoi_token_index": 13, "image_token_index": 10}  # fmt: skip
    config = T5Gemma2Config(encoder=encoder, decoder=dict(text), image_token_index=10, eoi_token_index=13,
                            tie_word_embeddings=False, dropout_rate=0.0)  # fmt: skip
    return T5Gemma2ForConditionalGeneration(eager(config))


def _t5gemma2_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    side = int(config.encoder.vision_config.image_size)
    return {"pixel_values": torch.randn(n, 3, side, side, generator=g)}


# -------------------------------------------------------------------------------------------------- pix2struct


def _pix2struct() -> nn.Module:
    """Config defaults shrunk (2 encoder layers of 32 over 2 x 2 x 3 patches, 2 decoder layers of 32)."""
    from transformers import Pix2StructConfig, Pix2StructForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4,
            "dropout_rate": 0.0}  # fmt: skip
    vision = {"hidden_size": 32, "patch_embed_hidden_size": 12, "d_ff": 37, "d_kv": 8, "num_hidden_layers": 2,
              "num_attention_heads": 4, "seq_len": 16}  # fmt: skip
    config = Pix2StructConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return Pix2StructForConditionalGeneration(eager(config))


def _pix2struct_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """Four flattened patches per image (row, column, 2 x 2 x 3 values) and their mask (``attention_mask`` once
    renamed)."""
    dim = int(config.vision_config.patch_embed_hidden_size)
    patches = torch.randn(n, 4, 2 + dim, generator=g)
    patches[..., :2] = torch.tensor([[1, 1], [1, 2], [2, 1], [2, 2]], dtype=torch.float)
    return {"flattened_patches": patches, "patch_mask": torch.ones(n, 4)}


#: An encoder-decoder's text is the decoder's; the encoder's mask is the patches' (``patch_mask``).
_DECODER_TEXT = (
    ("input_ids", "decoder_input_ids"),
    ("attention_mask", "decoder_attention_mask"),
    ("patch_mask", "attention_mask"),
)


# ------------------------------------------------------------------------------------- vision-encoder-decoder


def _vision_encoder_decoder() -> nn.Module:
    """Config defaults shrunk: a 2-layer ViT of 32 over 16 x 16 images and a 2-layer BERT decoder of 32 with
    cross-attention (the pairing is the user's; these are the smallest of each)."""
    from transformers import BertConfig, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    encoder = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        image_size=16,
        patch_size=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    decoder = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=37, is_decoder=True, add_cross_attention=True, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, pad_token_id=0)  # fmt: skip
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return VisionEncoderDecoderModel(config=eager(config))


def _vit_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    side = int(config.encoder.image_size)
    return {"pixel_values": torch.randn(n, 3, side, side, generator=g)}


# -------------------------------------------------------------------------------------------------------- udop


def _udop() -> nn.Module:
    """Config defaults shrunk (2 encoder and 2 decoder T5 layers of 32; 16 x 16 page images of 4 x 4 patches)."""
    from transformers import UdopConfig, UdopForConditionalGeneration

    config = UdopConfig(vocab_size=128, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
                        dropout_rate=0.0, image_size=16, patch_size=4, tie_word_embeddings=False,
                        decoder_start_token_id=0)  # fmt: skip
    return UdopForConditionalGeneration(eager(config))


def _udop_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    side = int(config.image_size)
    return {"pixel_values": torch.randn(n, 3, side, side, generator=g)}


def _udop_boxes(batch: dict[str, torch.Tensor], variant: str) -> dict[str, torch.Tensor]:
    """Each token's layout box: the whole page (both variants)."""
    return {"bbox": torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(*batch["input_ids"].shape, 4).clone()}


# ----------------------------------------------------------------------------------------------- pp_formulanet


def _pp_formulanet() -> nn.Module:
    """Config defaults shrunk (a 2-layer SAM-style ViT of 32 over 32 x 32 images, 2 decoder layers of 32)."""
    from transformers import PPFormulaNetConfig, PPFormulaNetForConditionalGeneration

    vision = {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 8, "window_size": 2, "global_attn_indexes": [1], "mlp_dim": 37,
              "post_conv_in_channels": 16, "post_conv_mid_channels": 16, "post_conv_out_channels": 32,
              "decoder_hidden_size": 32}  # fmt: skip
    text = {"vocab_size": 128, "d_model": 32, "decoder_layers": 2, "decoder_attention_heads": 4,
            "decoder_ffn_dim": 37, "encoder_layers": 2, "encoder_attention_heads": 4, "max_position_embeddings": 64,
            "dropout": 0.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "decoder_start_token_id": 2}  # fmt: skip
    config = PPFormulaNetConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return PPFormulaNetForConditionalGeneration(eager(config))


def _pp_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    side = int(config.vision_config.image_size)
    return {"pixel_values": torch.randn(n, 3, side, side, generator=g)}


_IMAGE_ALWAYS = ("its forward runs the tower on every call ({}): a micro-batch without pixel_values fails in the "
                 "model itself, so no text-only micro-batch, and no mixed batch, exists to align")  # fmt: skip
_NAMED_FIRST = "; with fsdp-compat every rank raises the named error first"

MODELS: list[TinyVlm] = [
    ShapeVlm(
        ("mllama",),
        _mllama,
        _mllama_pixels,
        tokens=1,
        parity="reordered",
        note="cross-attention VLM: the vision states reach the text model's cross-attention layers as "
        "cross_attention_states, which a text-only micro-batch skips; the row's join point (CrossAttention) hands "
        "the text rank's text model zero states of one vision token per row carrying the dummy tower call's 0.0 "
        "term, a zero mask and an all-zero full_text_row_masked_out_mask, so those layers (FSDP2 groups) run on "
        "every rank and return their input exactly (one process, the text batch: loss and every gradient "
        "bitwise equal to the skipped layers', the tower's, projector's and cross-attention layers' gradients "
        "exactly 0); generate on image|text ranks gives the text rank's tokens and scores torch.equal (its decode "
        "steps from the zero states get the zero row mask again: without it 4.3e-03 off); within 1e-6 relative, "
        "not 0.0: the aligned image/text run is 7.5e-09 off in gradients (embed_tokens), 6.4e-08 in parameters "
        "after 2 AdamW steps, its all-image run, which needs no dummy, 1.5e-08 and 3.7e-08: FSDP2 reorders sums "
        "(the tiny model's tanh gates open, U(-1, 1))",
    ),
    ShapeVlm(
        ("fuyu",),
        _fuyu,
        _fuyu_pixels,
        tokens=4,
        note="the tower is one linear layer over flattened patches (vision_embed_tokens); the dummy is one zero patch",
    ),
    TinyVlm(
        ("chameleon",),
        _chameleon,
        _chameleon_pixels,
        source="config defaults shrunk",
        note="VQ tokenizer (vqmodel, its blocks FSDP2 groups of their own) whose codes are embedded and placed "
        "inside ChameleonModel itself: there is no text-model module whose inputs_embeds a 0.0 term could join "
        "after the dummy's tower call, so no row; every rank raises the named error (the tokenizer counts as "
        "a tower)",
    ),
    ShapeVlm(
        ("instructblip",),
        _instructblip,
        _blip_pixels,
        tokens=4,
        extra=_qformer_ids,
        source="config defaults shrunk",
        unaligned="missing 1 required positional argument: 'pixel_values'",
        note="every micro-batch needs an image: the forward takes pixel_values as a required argument (its "
        "Q-Former output is the only route of the image into the text model), so a text-only micro-batch "
        "fails by itself and no dummy can make it an image-and-text step; with fsdp-compat every rank raises the "
        "named error first",
    ),
    ShapeVlm(
        ("instructblipvideo",),
        _instructblipvideo,
        _video_pixels,
        tokens=4,
        extra=_qformer_ids,
        source="config defaults shrunk",
        unaligned="missing 1 required positional argument: 'pixel_values'",
        note="as InstructBLIP: pixel_values (the video frames) is a required argument of the forward, so a "
        "text-only micro-batch fails by itself; with fsdp-compat every rank raises the named error first",
    ),
    ShapeVlm(
        ("blip",),
        _blip,
        _blip_pixels,
        tokens=0,
        source="config defaults shrunk",
        unaligned="missing 1 required positional argument: 'pixel_values'",
        note=_IMAGE_ALWAYS.format("the text decoder cross-attends the image embeddings") + _NAMED_FIRST,
    ),
    ShapeVlm(
        ("blip-2",),
        _blip_2,
        _blip_pixels,
        tokens=4,
        source="config defaults shrunk",
        unaligned="missing 1 required positional argument: 'pixel_values'",
        note=_IMAGE_ALWAYS.format("get_image_features unconditionally, pixel_values is required") + _NAMED_FIRST,
    ),
    ShapeVlm(
        ("kosmos-2",),
        _kosmos2,
        _blip_pixels,
        tokens=3,
        extra=_kosmos2_mask,
        unaligned="You have to specify either `pixel_values` or `image_embeds`.",
        note=_IMAGE_ALWAYS.format("ValueError without pixel_values or image_embeds") + _NAMED_FIRST,
    ),
    ShapeVlm(
        ("idefics",),
        _idefics,
        _idefics_pixels,
        tokens=1,
        extra=_idefics_mask,
        source="config defaults shrunk",
        unaligned="Exactly 1 of pixel_values, image_encoder_embeddings or perceiver_embeddings",
        note="every micro-batch needs an image: IdeficsModel.forward raises unless exactly one of pixel_values, "
        "image_encoder_embeddings or perceiver_embeddings is given (the gated cross-attention layers always "
        "attend to image states), so a text-only micro-batch fails by itself; with fsdp-compat every rank "
        "raises the named error first",
    ),
    ShapeVlm(
        ("git",),
        _git,
        _blip_pixels,
        tokens=0,
        source="config defaults shrunk",
        note="the image states are prepended to the text inside GitModel's own encoder (no text-model module "
        "whose inputs_embeds a 0.0 term could join), so no row; besides, GitForCausalLM's loss skips a fixed "
        "count of image positions, so a text-only micro-batch with labels fails by itself (batch size 0 vs "
        "labels) even on one process",
    ),
    TinyVlm(
        ("emu3",),
        _emu3,
        _emu3_pixels,
        source="config defaults shrunk",
        note="VQ tokenizer: the row's tower is vqmodel.encoder (get_image_features calls vqmodel.encode, "
        "not the module) and its 0.0 term is the codes' text embeddings only (pooler_output): the encoder "
        "gets no gradient on any rank; the dummy moves the encoder's BatchNorm running statistics in training "
        "mode, as a real image does",
    ),
    TinyVlm(
        ("gemma4_unified",),
        _gemma4_unified,
        _unified_pixels,
        source="config defaults shrunk",
        note="encoder-free: the tower is the patch embedder (embed_vision: norms, a linear, position table); the "
        "dummy is one zero patch at (0, 0)",
    ),
    ShapeVlm(
        ("pix2struct",),
        _pix2struct,
        _pix2struct_pixels,
        tokens=0,
        source="config defaults shrunk",
        unaligned="You have to specify flattened_patches",
        named=False,
        rename=_DECODER_TEXT,
        note="every micro-batch needs an image: the encoder's only input is flattened_patches and it raises "
        "without them; the forward takes no pixel_values argument, so fsdp-compat cannot name the model and the text "
        "rank's own error ends the step, aligned or not",
    ),
    ShapeVlm(
        ("vision-encoder-decoder",),
        _vision_encoder_decoder,
        _vit_pixels,
        tokens=0,
        source="config defaults shrunk (ViT encoder, BERT decoder)",
        unaligned="You have to specify pixel_values",
        named=False,
        rename=_DECODER_TEXT,
        note="every micro-batch needs an image: the forward raises without pixel_values (the encoder's output is "
        "the decoder's only context); its encoder sits under no tower name fsdp-compat recognises, so the text "
        "rank's own error ends the step, aligned or not",
    ),
    ShapeVlm(
        ("udop",),
        _udop,
        _udop_pixels,
        tokens=0,
        extra=_udop_boxes,
        source="config defaults shrunk",
        note="the page image is patch-embedded (patch_embed) and merged with the OCR tokens inside the encoder's "
        "own forward (no get_image_features, no text-model module taking the features as inputs_embeds), so no "
        "row; a text-only micro-batch leaves patch_embed without a gradient (the root group's reduce-scatter "
        "shrinks); every rank raises the named error (patch_embed counts as a tower)",
    ),
    ShapeVlm(
        ("pp_formulanet",),
        _pp_formulanet,
        _pp_pixels,
        tokens=0,
        source="config defaults shrunk",
        unaligned="You must specify exactly one of encoder_outputs or pixel_values",
        rename=_DECODER_TEXT,
        note="every micro-batch needs an image: an image-to-formula OCR encoder-decoder whose forward raises "
        "without pixel_values or encoder_outputs (the image is the decoder's only context); with fsdp-compat "
        "every rank raises the named error first (the error names model.encoder.patch_embed as the tower)",
    ),
    ShapeVlm(
        ("t5gemma2",),
        _t5gemma2,
        _t5gemma2_pixels,
        tokens=4,
        source="config defaults shrunk",
        parity="measured",
        note="the row is T5Gemma2Encoder's (it holds the SigLIP tower and the text encoder); FSDP2 alone is not "
        "exact here: the all-image run (no dummy) is 4.5e-05 off relative (1.5e-04 absolute, 2.5 fp32 ulps) on "
        "encoder.multi_modal_projector.mm_input_projection_weight's gradient, 8.2e-06 in parameters after 2 "
        "AdamW steps; the aligned image|text run 6.6e-05 and 2.2e-06 (1.5x in gradients: other batches, other "
        "roundings). Why: that gradient is a sum of terms up to 720 that cancel to a few units, and FSDP2 with "
        "the decoder layers in groups of their own sums it in another order: in fp64 every grouping is 0.0 off, "
        "in fp32 one group (the root) is 0.0 and the decoder layers' groups alone give the 4.5e-05, and the fp32 "
        "run and the fp32 reference are both 5.5e-04 from the fp64 value; no parameter is shared or tied",
    ),
]

__all__ = ["MODELS", "ShapeVlm"]
