"""Models on the meta device: module tree and parameter shapes of real (even full-size) models, no weights.

A wrap plan depends only on the module tree, the classes' code and Parameter identity, so ``fsdp-compat plan``
can explain a 9B-parameter model on a laptop in a second without downloading anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_compat.errors import FsdpCompatError

__all__ = ["REFERENCE_NAMES", "build_skeleton", "reference_skeleton"]

_AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel")


def build_skeleton(spec: str | Path) -> nn.Module:
    """A zoo name, a ``config.json`` path, or a folder holding one → that model on the meta device."""
    from fsdp_compat.testing.zoo import ZOO, builder

    text = str(spec)
    if text in ZOO:
        with torch.device("meta"):
            return builder(text)()
    path = Path(text).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        hint = " (it is a reference name: use reference_skeleton)" if text in _REFERENCES else ""
        raise FsdpCompatError(
            f"{text!r} is not a zoo model ({', '.join(ZOO)}), a config.json file, or a folder containing "
            f"config.json{hint}; pass one of those"
        )
    return _from_config(_load_config(config_file), source=str(config_file))


def _load_config(config_file: Path) -> Any:
    from transformers import AutoConfig

    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise FsdpCompatError(f"cannot read {config_file} as JSON ({exc}); pass a model's config.json") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise FsdpCompatError(
            f"{config_file} has no 'model_type'; pass a transformers config.json (from save_pretrained)"
        )
    try:
        if config_file.name == "config.json":
            return AutoConfig.from_pretrained(str(config_file.parent), local_files_only=True)
        model_type = data.pop("model_type")
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise FsdpCompatError(
            f"transformers cannot build a config from {config_file}: {str(exc).splitlines()[0]} Upgrade "
            "transformers or pass a config whose model_type this version knows"
        ) from exc


def _from_config(config: Any, *, source: str) -> nn.Module:
    """On meta: the class in ``config.architectures`` when transformers has it, else an Auto class."""
    import transformers

    config._attn_implementation = "eager"
    errors: list[str] = []
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is None:
            errors.append(f"{arch}: not in transformers {transformers.__version__}")
            continue
        try:
            with torch.device("meta"):
                return cls(config)
        except Exception as exc:  # a mismatched architecture/config pair: try the next way
            errors.append(f"{arch}: {type(exc).__name__}: {exc}")
    for name in _AUTO_CLASSES:
        auto = getattr(transformers, name, None)
        if auto is None:
            continue
        try:
            with torch.device("meta"):
                return auto.from_config(config)
        except (ValueError, KeyError) as exc:
            errors.append(f"{name}: {str(exc).splitlines()[0]}")
    raise FsdpCompatError(
        f"cannot build a model from {source} (model_type {getattr(config, 'model_type', '?')!r}); tried: "
        + "; ".join(errors)
        + ". Set 'architectures' in the config to a transformers model class name"
    )


# ------------------------------------------------------------------------------------------------------------
# Full-size reference models from the config classes' defaults (GLM4V's defaults are GLM-4.1V-9B).


def _glm4v() -> nn.Module:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration(Glm4vConfig())


def _glm4v_moe() -> nn.Module:
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    return Glm4vMoeForConditionalGeneration(Glm4vMoeConfig())


def _gemma3n() -> nn.Module:
    from transformers import Gemma3nConfig, Gemma3nForCausalLM

    return Gemma3nForCausalLM(Gemma3nConfig().text_config)


def _qwen2_7b() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_compat.testing.zoo import _rope

    config = Qwen2Config(  # Qwen/Qwen2-7B config.json
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        **_rope(1_000_000.0),
    )
    return Qwen2ForCausalLM(config)


_REFERENCES: dict[str, Callable[[], nn.Module]] = {
    "glm4v": _glm4v,
    "glm4v-moe": _glm4v_moe,
    "gemma3n": _gemma3n,
    "qwen2-7b": _qwen2_7b,
}
REFERENCE_NAMES = tuple(_REFERENCES)


def reference_skeleton(name: str) -> nn.Module:
    """Full-size ``name`` on the meta device, from its config class defaults (for plans and memory sums)."""
    builder = _REFERENCES.get(name)
    if builder is None:
        raise FsdpCompatError(f"unknown reference model {name!r}; choose one of: {', '.join(_REFERENCES)}")
    with torch.device("meta"):
        model = builder()
    model.config._attn_implementation = "eager"
    return model
