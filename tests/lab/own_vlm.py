"""A vision-language model of the user's own (no transformers class, in no table of fsdp-compat), for the tests of
``fsdp_compat.register_family``: a patch encoder of two blocks whose features replace the image placeholder tokens
of ``inputs_embeds`` when ``pixel_values`` is given, and a decoder of two blocks. Named ``"lab.own_vlm:TINY"`` where
the zoo takes a name (``build()``, ``batch(generator, variant)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IMAGE_TOKEN", "TINY", "OwnVlm", "dummy_inputs", "row"]

IMAGE_TOKEN = 1
PATCHES = 4  # patches (and placeholder tokens) per image
PATCH = 12  # values per patch
HIDDEN = 16
VOCAB = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(PATCH, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.patch(pixel_values)  # (images, PATCHES, PATCH) -> (images, PATCHES, HIDDEN)
        for block in self.blocks:
            h = block(h)
        return h.flatten(0, 1)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        h = inputs_embeds
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class OwnVlm(nn.Module):
    """The user's own class: ``get_image_features``, ``encoder`` and ``decoder`` attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.encoder(pixel_values)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, pixel_values: torch.Tensor | None = None) -> Any:
        embeds = self.embed(input_ids)
        if pixel_values is not None:
            features = self.get_image_features(pixel_values).to(embeds.dtype)
            mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, features)
        logits = self.head(self.decoder(inputs_embeds=embeds))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return Output(loss, logits)


def dummy_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The smallest valid input of the encoder: one zero image."""
    return {"pixel_values": torch.zeros(1, PATCHES, PATCH, device=device, dtype=dtype)}


def row() -> Any:
    """The row a user registers for :class:`OwnVlm`."""
    from fsdp_compat import VisionFamily

    return VisionFamily("own-vlm", ("OwnVlm",), ("pixel_values",), dummy_inputs, tower="encoder", text="decoder")


class _Tiny:
    is_vlm = True

    @staticmethod
    def build() -> nn.Module:
        return OwnVlm()

    @staticmethod
    def batch(g: torch.Generator, variant: str = "image") -> dict[str, torch.Tensor]:
        rows = []
        for _ in range(2):
            text = torch.randint(2, VOCAB, (10,), generator=g).tolist()
            rows.append(text[:3] + ([IMAGE_TOKEN] * PATCHES if variant == "image" else text[3:7]) + text[7:])
        input_ids = torch.tensor(rows)
        batch = {"input_ids": input_ids, "labels": input_ids.masked_fill(input_ids == IMAGE_TOKEN, -100)}
        if variant == "image":
            batch["pixel_values"] = torch.randn(2, PATCHES, PATCH, generator=g)
        return batch


TINY = _Tiny()
