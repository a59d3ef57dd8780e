"""Llama4 (``Llama4ForConditionalGeneration``: the outer model holds the tower and the text model itself).

Why a wrapper: transformers 5.24's forward raises ``AttributeError: 'MoeCausalLMOutputWithPast' object has no
attribute 'image_outputs'`` whenever it builds its dict output, and ``return_dict=False`` alone raises too
(``capture_outputs`` pops the keyword, the forward returns a tuple from ``config.return_dict``, and the decorator
then calls ``to_tuple()`` on that tuple when the popped value was False). The one path that trains: ``config.return_dict
= False`` with ``return_dict=True`` passed, so the forward returns its tuple ``(loss, logits, ...)`` and the
decorator passes it through. :func:`tuple_outputs` takes that path and gives the harness ``.loss``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from lab.vlms import TinyVlm, eager, fixed_pixels
from lab.vlms.shapes import ShapeVlm


def _ask_for_the_tuple(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Pre-hook: ``return_dict=True`` beside ``config.return_dict = False`` (the module doc's one working path)."""
    return args, {**kwargs, "return_dict": True}


def _loss_of_the_tuple(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Post-hook: the forward's ``(loss, logits, ...)`` as an output with ``.loss`` (what the harness reads)."""
    return CausalLMOutput(loss=output[0], logits=output[1]) if isinstance(output, tuple) else output


def _complex_rotary(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Pre-hook of the vision rotary embedding: the zoo's ``.to(dtype=float32)`` casts its complex ``freqs_ci``
    buffer to the real part (with a warning); recompute it, as the model built it, so the tower rotates as it
    would in a user's job."""
    if not module.freqs_ci.is_complex():
        module.freqs_ci = module._compute_freqs_ci(module.config).to(module.freqs_ci.device)


def tuple_outputs(model: nn.Module) -> nn.Module:
    """``model`` (the real Llama4ForConditionalGeneration, still the root: fsdp-compat sees transformers' own
    forward) called through the path transformers 5.24 can run: instance hooks, no subclass, no wrapper."""
    model.config.return_dict = False
    model.register_forward_pre_hook(_ask_for_the_tuple, with_kwargs=True)
    model.register_forward_hook(_loss_of_the_tuple)
    for module in model.modules():
        if hasattr(module, "freqs_ci") and hasattr(module, "_compute_freqs_ci"):
            module.register_forward_pre_hook(_complex_rotary)
    return model


def _llama4() -> nn.Module:
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 37, "intermediate_size_mlp": 37,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_local_experts": 2, "num_experts_per_tok": 1, "max_position_embeddings": 512,
            "attention_chunk_size": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "vision_output_dim": 32, "image_size": 16, "patch_size": 4, "pixel_shuffle_ratio": 0.5,
              "projector_input_dim": 32, "projector_output_dim": 32}  # fmt: skip
    config = Llama4Config(text_config=text, vision_config=vision, image_token_index=10, boi_token_index=11,
                          eoi_token_index=12, tie_word_embeddings=False)  # fmt: skip
    return tuple_outputs(Llama4ForConditionalGeneration(eager(config)))


def _tokens(config: Any) -> int:
    """Features per image: (S / p)^2 patches, pixel-shuffled by r per side (Llama4's vision adapter)."""
    vision = config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2)


MODELS: list[TinyVlm] = [
    ShapeVlm(
        ("llama4",),
        _llama4,
        fixed_pixels,
        tokens=_tokens,
        source="config defaults shrunk (vision 32 wide, 16 x 16 images of 4 x 4 patches; text MoE of 2 experts)",
        note="run through config.return_dict=False with return_dict=True passed (the dict output and "
        "return_dict=False alone raise in transformers 5.24: tests/lab/vlms/tuple_outputs.py); the forward "
        "projects get_image_features' last_hidden_state with multi_modal_projector itself, so the row names that "
        "projector and the dummy's features pass through it (without it the aligned run aborts in backward, gloo "
        "8448 vs 7424 bytes in the root group's reduce-scatter: multi_modal_projector.linear_1.weight has a "
        "gradient on the image rank only)",
    ),
]
