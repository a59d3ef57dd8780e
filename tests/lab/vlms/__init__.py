"""Tiny models of the vision-language families beyond the zoo's, for the families test (test support, not shipped).

Why here and not in :mod:`fsdp_compat.testing.zoo`: the zoo is the documented kit (a handful of models every test
and user can name); these are one per transformers family, as many as transformers has, and only the families test
runs them. Each module of this package holds the families of one tower kind as ``MODELS``, a list of
:class:`TinyVlm`. A model is named ``"lab.vlms:<model_type>"`` wherever the zoo takes a name (``run_training``,
``build_model``, ``make_batch``): ``fsdp_compat.testing.zoo`` builds external names through ``build()`` and
``batch(generator, variant)``.

Every tiny model is its family's ``*ForConditionalGeneration`` in fp32 with eager attention, built from the sizes of
the family's tester in transformers' ``tests/models/<type>/test_modeling_<type>.py`` where the tester exists (else
the config class's defaults, shrunk: say which in ``source``), with 2 text and 2 vision layers, special token ids
below 16 (text tokens are drawn from ``[16, vocab_size)``) and untied embeddings.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["TinyVlm", "eager", "features_per_image", "fixed_pixels", "grid_pixels", "inner_model", "tiny_models"]

Pixels = Callable[[Any, torch.Generator, int], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class TinyVlm:
    """One family's tiny model: how to build it and how to lay out its images.

    ``model_types``: the transformers model types it stands for (the first is its name); ``build``: the seeded-free
    constructor of the outer model; ``pixels(config, generator, n)``: the forward's vision keywords for ``n`` random
    images, one per row; ``extra(batch, variant)``: keywords the family's forward needs beside ``input_ids`` (e.g.
    ``token_type_ids``); ``source``: where the sizes come from (the tester, or the config defaults shrunk); ``note``:
    docs/families.md's note (required where the family has no row: why no dummy exists); ``parity``: ``"exact"``
    (0.0), ``"reordered"`` (within ``PARITY_TOL`` relative, where FSDP2 reorders a sum: the test then holds the
    all-image run, which needs no dummy, to the same bound, and says so) or ``"measured"`` (no further off than the
    family's all-image run, measured in the same test: where that run is not exact either); ``adamw_eps_param``: under
    ``"measured"``, the one parameter whose parameter distance is not held to the all-image run's, because one of its
    gradient elements is below AdamW's eps on the image|text batches (its first step, lr * g / (|g| + eps), then
    turns that element's rounding into up to lr); its gradients are held all the same.
    """

    model_types: tuple[str, ...]
    build: Callable[[], nn.Module]
    pixels: Pixels
    image_token_id: int = 10
    vocab_size: int = 128
    source: str = "tester"
    note: str = ""
    parity: str = "exact"
    adamw_eps_param: str = ""
    extra: Callable[[dict[str, torch.Tensor], str], dict[str, torch.Tensor]] | None = None
    is_vlm: bool = field(default=True, init=False)

    @property
    def name(self) -> str:
        return self.model_types[0]

    def batch(self, g: torch.Generator, variant: str = "image") -> dict[str, torch.Tensor]:
        """Two rows of text around one image each (``"image"``), or plain text of the same shape (``"text"``)."""
        if variant not in ("image", "text"):
            raise ValueError(f"{self.name}: variant 'image' or 'text', not {variant!r}")
        n = self.placeholders_per_image()
        rows = []
        for _ in range(2):
            before = torch.randint(16, self.vocab_size, (5,), generator=g).tolist()
            after = torch.randint(16, self.vocab_size, (4,), generator=g).tolist()
            text = torch.randint(16, self.vocab_size, (n,), generator=g).tolist()
            rows.append([*before, *([self.image_token_id] * n if variant == "image" else text), *after])
        input_ids = torch.tensor(rows)
        labels = input_ids.masked_fill(input_ids == self.image_token_id, -100)
        batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
        if variant == "image":
            batch.update(self.pixels(_config(self), g, 2))
        if _accepts(self, "mm_token_type_ids"):
            batch["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        if self.extra is not None:
            batch.update(self.extra(batch, variant))
        return batch

    def placeholders_per_image(self) -> int:
        """Placeholder tokens one image takes in :meth:`batch`: :func:`features_per_image` (subclasses whose
        images do not become ``pooler_output`` features override this)."""
        return features_per_image(self)


_CONFIGS: dict[str, Any] = {}
_FEATURES: dict[str, int] = {}
_FORWARD_ARGS: dict[str, set[str]] = {}


def _built(tiny: TinyVlm) -> nn.Module:
    """A throw-away instance (the global RNG is left as it was: batches must not move the caller's seed)."""
    with torch.random.fork_rng():
        return tiny.build().float().eval()


def _config(tiny: TinyVlm) -> Any:
    if tiny.name not in _CONFIGS:
        model = _built(tiny)
        _CONFIGS[tiny.name] = model.config
        _FORWARD_ARGS[tiny.name] = set(inspect.signature(model.forward).parameters)
    return _CONFIGS[tiny.name]


def _accepts(tiny: TinyVlm, name: str) -> bool:
    _config(tiny)
    return name in _FORWARD_ARGS[tiny.name]


def eager(config: Any) -> Any:
    """``config`` with eager attention, on itself and every sub-config that has an attention setting (the tiny
    models compare against one process bit for bit: no fused kernels that may reorder sums)."""
    config._attn_implementation = "eager"
    for name in ("text_config", "vision_config", "qformer_config", "perceiver_config", "vq_config"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = "eager"
    return config


def inner_model(model: nn.Module) -> nn.Module:
    """The module holding the tower and the text model (``model.model``; Llama4's outer model is its own)."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "get_image_features") else model


def features_per_image(tiny: TinyVlm) -> int:
    """Placeholder tokens one image takes: the features ``get_image_features`` returns for one image, counted on
    the built model (the family's own merge, pooling, CLS or newline rule decides, not a formula copied here)."""
    if tiny.name not in _FEATURES:
        model = _built(tiny)
        pixels = tiny.pixels(model.config, torch.Generator().manual_seed(0), 1)
        with torch.no_grad():
            out = inner_model(model).get_image_features(**pixels)
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        tensors = list(pooled) if isinstance(pooled, (list, tuple)) else [pooled]
        _FEATURES[tiny.name] = sum(t.numel() // t.shape[-1] for t in tensors)
    return _FEATURES[tiny.name]


# ----------------------------------------------------------------------------- images of the known tower kinds


def grid_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images as patch rows with their ``image_grid_thw`` (Qwen-VL / GLM4V layout): 2m x 3m and
    3m x 2m patches alternating (m = spatial merge size), so no image is the dummy's 2m x 2m square."""
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    channels = int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3)
    dim = channels * int(getattr(vision, "temporal_patch_size", 1) or 1) * int(vision.patch_size) ** 2
    grids = [[1, 2 * merge, 3 * merge] if i % 2 == 0 else [1, 3 * merge, 2 * merge] for i in range(n)]
    patches = sum(t * h * w for t, h, w in grids)
    return {"pixel_values": torch.randn(patches, dim, generator=g), "image_grid_thw": torch.tensor(grids)}


def fixed_pixels(config: Any, g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """``n`` random images at the tower's fixed ``image_size``: ``(n, C, S, S)``."""
    vision = config.vision_config
    size = vision.image_size
    side = int(size[0] if isinstance(size, (list, tuple)) else size)
    channels = int(getattr(vision, "num_channels", None) or 3)
    return {"pixel_values": torch.randn(n, channels, side, side, generator=g)}


# ------------------------------------------------------------------------------------------------------ registry

_REGISTRY: dict[str, TinyVlm] | None = None


def tiny_models() -> dict[str, TinyVlm]:
    """Every tiny model of this package's modules, by each of its model types."""
    global _REGISTRY
    if _REGISTRY is None:
        registry: dict[str, TinyVlm] = {}
        for info in pkgutil.iter_modules(__path__):
            module = importlib.import_module(f"{__name__}.{info.name}")
            for tiny in getattr(module, "MODELS", ()):
                for model_type in tiny.model_types:
                    if model_type in registry:
                        raise ValueError(f"two tiny models for {model_type}: {info.name} and another module")
                    registry[model_type] = tiny
        _REGISTRY = registry
    return _REGISTRY


def __getattr__(name: str) -> TinyVlm:
    """``lab.vlms:<model_type>``, the zoo's external-model name."""
    models = tiny_models()
    if name in models:
        return models[name]
    raise AttributeError(f"no tiny model for {name!r} in lab.vlms")
