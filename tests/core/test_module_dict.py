"""Decoder loops over an ``nn.ModuleDict`` (``for layer in self.layers.values()``, torchtitan's shape): the layers
keep their groups; a raw read through the loop is still seen. Before, ``ModuleDict.values()`` (its body reads
``self._modules``) counted as reflecting on every layer, which put every layer in the root and made the generic
layer's group check warn on every layer group. The dynamic audit (``audit_raw_reads``, one real forward) is the
independent evidence: it sees no raw read where the plan keeps the groups, and sees the read where it withholds them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_compat


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x))


class Base(nn.Module):
    _no_split_modules = ("Block",)

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(3)})
        self.head = nn.Linear(8, 16)


class Values(Base):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h)


class Items(Base):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for _name, layer in self.layers.items():
            h = layer(h)
        return self.head(h)


class RawThroughValues(Base):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers.values():
            h = layer(h) + layer.lin.weight.sum()
        return self.head(h)


class RawThroughItems(Base):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for _name, layer in self.layers.items():
            h = layer(h) + layer.lin.weight.sum()
        return self.head(h)


LAYERS = [("layers.0",), ("layers.1",), ("layers.2",)]


def _audited(model: nn.Module) -> set[str]:
    ids = torch.randint(0, 16, (2, 5))
    return {r.owner for r in fsdp_compat.audit_raw_reads(model, ids)}


@pytest.mark.parametrize("cls", [Values, Items], ids=lambda c: c.__name__)
def test_a_loop_over_module_dict_values_keeps_the_layers_grouped(cls: type[nn.Module]) -> None:
    model = cls()
    groups = [g.paths for g in fsdp_compat.plan_wrap(model).groups]
    assert [g for g in groups if g[0].startswith("layers.")] == LAYERS, groups
    assert not any(owner.startswith("layers.") for owner in _audited(model))


@pytest.mark.parametrize("cls", [RawThroughValues, RawThroughItems], ids=lambda c: c.__name__)
def test_a_raw_read_through_module_dict_values_is_still_seen(cls: type[nn.Module]) -> None:
    model = cls()
    groups = [g.paths for g in fsdp_compat.plan_wrap(model).groups]
    assert not any(g[0].startswith("layers.") and g[0].count(".") == 1 for g in groups), groups
    assert {"layers.0.lin", "layers.1.lin", "layers.2.lin"} <= _audited(model)
