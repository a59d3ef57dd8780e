"""Models and rank routines of tests/runtime/test_mechanism.py: vision-language classes of the user's own, in no
family table, aligned (or refused by name) by the generic mechanism alone.

``lab.own_vlm``'s :class:`~lab.own_vlm.OwnVlm` is the plain case. Here, the inputs that must not break it:

* :class:`DirectVlm` calls its encoder module directly (no features method): with the encoder one FSDP2 group, the
  media call is a group itself;
* :class:`SelfDummyVlm` runs its encoder on a zero image itself when a micro-batch has none (as verl's and VeOmni's
  own VLM forwards do): the mechanism must not add a second call;
* :class:`LoopedVlm` runs its encoder's blocks one by one in its own forward (no module call holds the whole
  medium): nothing can be replayed, every rank must raise the named error;
* :class:`TaggedVlm` hands its encoder an object of its own beside the pixels: its call cannot be rebuilt on
  another rank, every rank must raise the named error;
* :class:`PartialVlm` reads features from its encoder's first block and ignores the last block's output: the
  replay must give the last block no gradient either.

``cfg["shard"]``: ``blocks`` (every block, then the root: a trainer's own rule), ``embed`` (the embedding too, which
runs before the encoder), ``unit`` (the encoder one group, as torchtitan shards its vision encoder: the media call is
a group itself), ``decoder`` (the decoder's blocks only: the encoder lives in the root's group) or ``root`` (one
``fully_shard(model)``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_compat.testing.parity import init_group
from lab.contract import _mesh, _train
from lab.own_vlm import IMAGE_TOKEN, PATCH, PATCHES, TINY, Output, OwnVlm

__all__ = ["DIRECT", "LOOPED", "PARTIAL", "SELF_DUMMY", "TAGGED", "mechanism_rank"]


class SelfDummyVlm(OwnVlm):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, pixel_values: torch.Tensor | None = None) -> Any:
        embeds = self.embed(input_ids)
        if pixel_values is not None:
            features = self.encoder(pixel_values)
            mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, features)
        else:  # the model's own dummy: one zero image, joined with 0.0
            embeds = embeds + 0.0 * self.encoder(torch.zeros(1, PATCHES, PATCH)).mean()
        return self._finish(embeds, labels)

    def _finish(self, embeds: torch.Tensor, labels: torch.Tensor) -> Output:
        import torch.nn.functional as F

        logits = self.head(self.decoder(inputs_embeds=embeds))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return Output(loss, logits)


class DirectVlm(SelfDummyVlm):
    """Calls its encoder module directly (no features method), as torchtitan's Qwen3.5 does."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, pixel_values: torch.Tensor | None = None) -> Any:
        embeds = self.embed(input_ids)
        if pixel_values is not None:
            mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, self.encoder(pixel_values))
        return self._finish(embeds, labels)


class LoopedVlm(SelfDummyVlm):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, pixel_values: torch.Tensor | None = None) -> Any:
        embeds = self.embed(input_ids)
        if pixel_values is not None:
            h = self.encoder.patch(pixel_values)
            for block in self.encoder.blocks:  # the blocks one by one, in the model's own forward
                h = block(h)
            mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, h.flatten(0, 1))
        return self._finish(embeds, labels)


@dataclass
class Tag:
    """An object of the user's own that the encoder takes beside the pixels."""

    source: str


class TaggedEncoder(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.inner = encoder

    def forward(self, pixel_values: torch.Tensor, tag: Tag) -> torch.Tensor:
        assert isinstance(tag, Tag)
        return self.inner(pixel_values)


class TaggedVlm(SelfDummyVlm):
    def __init__(self) -> None:
        super().__init__()
        self.tagged = TaggedEncoder(self.encoder)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, pixel_values: torch.Tensor | None = None) -> Any:
        embeds = self.embed(input_ids)
        if pixel_values is not None:
            features = self.tagged(pixel_values, Tag("camera"))
            mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, features)
        return self._finish(embeds, labels)


class PartialVlm(SelfDummyVlm):
    """Features from the encoder's first block (as LLaVA's ``vision_feature_layer=-2`` takes an inner layer's): the
    encoder returns both blocks' states, the forward reads the first, so its second block gets no gradient."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, pixel_values: torch.Tensor | None = None) -> Any:
        embeds = self.embed(input_ids)
        if pixel_values is not None:
            inner, _last = self.layered(pixel_values)
            mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, inner.flatten(0, 1))
        return self._finish(embeds, labels)

    def __init__(self) -> None:
        super().__init__()
        self.layered = LayeredEncoder(self.encoder)


class LayeredEncoder(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.inner = encoder

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inner.patch(pixel_values)
        states = []
        for block in self.inner.blocks:
            h = block(h)
            states.append(h)
        return states[0], states[-1]


class _Zoo:
    is_vlm = True

    def __init__(self, cls: type[nn.Module]) -> None:
        self.cls = cls

    def build(self) -> nn.Module:
        return self.cls()

    @staticmethod
    def batch(g: torch.Generator, variant: str = "image") -> dict[str, torch.Tensor]:
        return TINY.batch(g, variant)


SELF_DUMMY = _Zoo(SelfDummyVlm)
DIRECT = _Zoo(DirectVlm)
LOOPED = _Zoo(LoopedVlm)
TAGGED = _Zoo(TaggedVlm)
PARTIAL = _Zoo(PartialVlm)


def _shard(model: nn.Module, how: str, mesh: Any) -> None:
    encoder = model.encoder.blocks if how in ("blocks", "embed") else [model.encoder] if how == "unit" else []
    if how == "embed":
        fully_shard(model.embed, mesh=mesh)
    if how in ("blocks", "embed", "decoder", "unit"):
        for module in [*encoder, *model.decoder.blocks]:
            fully_shard(module, mesh=mesh)
    elif how != "root":
        raise ValueError(how)
    fully_shard(model, mesh=mesh)


def mechanism_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """Train ``cfg["model"]`` sharded as ``cfg["shard"]`` says against one process (:func:`lab.contract._train`)."""
    from fsdp_compat.testing.zoo import build_model

    init_group(cfg, rank)
    model = build_model(cfg["model"], seed=0)
    reference = copy.deepcopy(model)
    mesh = _mesh(cfg)
    _shard(model, cfg["shard"], mesh)
    _train(cfg, rank, extra, model, reference, mesh)
    _log_probs(cfg, rank, extra, model, reference)


def _log_probs(cfg: dict[str, Any], rank: int, extra: dict[str, Any], model: nn.Module, reference: nn.Module) -> None:
    """A log-prob pass after training (``no_grad``, every group sharded again: the ranks' media still differ): each
    rank's log-probabilities against the reference's on the same micro-batch, and the replays it made."""
    from fsdp_compat.runtime.mixed_batches import mixed_batches_of
    from fsdp_compat.testing.zoo import make_batch

    batch = make_batch(cfg["model"], seed=100 + rank, variant=cfg["variants"][rank])
    before = sum(m.dummy_calls for m in mixed_batches_of(model))
    with torch.no_grad():
        mine = torch.log_softmax(model(**batch).logits, -1)
        theirs = torch.log_softmax(reference(**batch).logits, -1)
    extra["log_prob_diff"] = float((mine - theirs).abs().max())
    extra["log_prob_replays"] = sum(m.dummy_calls for m in mixed_batches_of(model)) - before
