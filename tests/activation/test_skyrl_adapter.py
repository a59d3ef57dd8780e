"""SkyRL adapter, in one process without SkyRL: version table, config reading, and patch mechanics on stand-ins.

The stand-in modules take the real module names (``skyrl.backends.skyrl_train.distributed.fsdp_utils`` ...) only
for the duration of a test. They exercise what no release can yet: the upstream selector ``modules_to_wrap_fsdp2``
(open upstream PR, unreleased), whose replacement is checked here on a synthetic model, selection only.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
import warnings
from typing import Any, ClassVar

import pytest
from fsdp_compat.adapters import skyrl as skyrl_adapter
from fsdp_compat.adapters.skyrl import (
    ADAPTER,
    PACKAGES,
    SUPPORTED,
    configured_layer_classes,
    make_apply_fsdp2,
)
from fsdp_compat.adapters.skyrl import (
    RELEASES as SKYRL_TABLE,
)
from packaging.version import Version
from torch import nn

from fsdp_compat.activation import Adapter, FsdpCompatWarning
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.policies import Auto

RELEASES = {
    "skyrl-train": ["0.1.0", "0.2.0", "0.3.0", "0.3.1"],
    "skyrl": ["0.1.0", "0.2.0", "0.3.0", "0.4.0"],
}


# ------------------------------------------------------------------------------------------------ version table


@pytest.mark.parametrize(("distribution", "version"), [(d, v) for d, vs in RELEASES.items() for v in vs])
def test_every_release_is_supported(distribution: str, version: str) -> None:
    assert ADAPTER.is_supported(distribution, Version(version))
    assert ADAPTER.release_for(distribution, Version(version)) is not None  # and the table has its row


@pytest.mark.parametrize(
    ("distribution", "version"),
    [("skyrl", "0.0.1"), ("skyrl", "0.5.0"), ("skyrl", "1.0.0"), ("skyrl-train", "0.4.0"), ("other", "0.1.0")],
)
def test_placeholder_and_future_releases_are_not(distribution: str, version: str) -> None:
    assert not ADAPTER.is_supported(distribution, Version(version))


def test_trigger_modules_match_the_index() -> None:
    from fsdp_compat.adapters import ADAPTERS

    entry = ADAPTERS["skyrl"]
    assert entry.module == "fsdp_compat.adapters.skyrl"
    assert set(entry.triggers) == set(ADAPTER.trigger_modules) == {f"{p}.fsdp_utils" for p in PACKAGES.values()}
    assert set(SUPPORTED) == set(PACKAGES)


# ------------------------------------------------------------------------------------------------ config access


@dataclasses.dataclass
class _FSDPConfig:  # the shape of skyrl's FSDPConfig dataclass
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    wrap_policy: dict = dataclasses.field(default_factory=dict)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, None),
        ({}, None),
        ({"wrap_policy": {}}, None),
        ({"wrap_policy": {"transformer_layer_cls_to_wrap": None}}, None),
        ({"wrap_policy": {"transformer_layer_cls_to_wrap": []}}, None),
        ({"wrap_policy": {"transformer_layer_cls_to_wrap": "Block"}}, ["Block"]),
        ({"wrap_policy": {"transformer_layer_cls_to_wrap": ("A", "B")}}, ["A", "B"]),
        (_FSDPConfig(), None),
        (_FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["A"]}), ["A"]),
        (types.SimpleNamespace(wrap_policy=types.SimpleNamespace(transformer_layer_cls_to_wrap=["A"])), ["A"]),
    ],
)
def test_configured_layer_classes(config: Any, expected: list[str] | None) -> None:
    assert configured_layer_classes(config) == expected


def test_configured_layer_classes_on_dictconfig() -> None:
    import omegaconf

    plain = omegaconf.OmegaConf.create({"cpu_offload": False, "reshard_after_forward": True, "fsdp_size": -1})
    assert configured_layer_classes(plain) is None
    listed = omegaconf.OmegaConf.create({"wrap_policy": {"transformer_layer_cls_to_wrap": ["A", "B"]}})
    assert configured_layer_classes(listed) == ["A", "B"]
    structured = omegaconf.OmegaConf.structured(_FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["C"]}))
    assert configured_layer_classes(structured) == ["C"]


# ----------------------------------------------------------------------------------- stand-in SkyRL modules


class _DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.fc(x)


class _VisionEmbeddings(nn.Module):
    """Reads ``position_embedding.weight`` raw, as Glm4vVisionEmbeddings does."""

    def __init__(self) -> None:
        super().__init__()
        self.position_embedding = nn.Embedding(16, 4)

    def forward(self, x: Any) -> Any:
        return x + self.position_embedding.weight[: x.shape[0]]


class _TinyVLM(nn.Module):
    _no_split_modules: ClassVar[set[str]] = {"_DecoderLayer"}  # a set, as transformers 5 has it

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(tie_word_embeddings=False)
        self.embed_tokens = nn.Embedding(32, 4)
        self.vision = _VisionEmbeddings()
        self.layers = nn.ModuleList([_DecoderLayer(), _DecoderLayer()])
        self.lm_head = nn.Linear(4, 32, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: Any, pixels: Any) -> Any:
        h = self.embed_tokens(input_ids) + self.vision(pixels).sum()
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def _upstream_selector(model: nn.Module, cls_names: Any) -> list[nn.Module]:
    """What the open upstream PR's selector does: layers plus the input embedding when untied."""
    return [m for m in model.modules() if type(m).__name__ in cls_names] + [model.get_input_embeddings()]


def _upstream_apply(model: Any, fsdp_kwargs: Any, config: Any) -> None:
    raise AssertionError("the original apply_fsdp2 must not be replaced when the release ships the selector")


class _StandIn:
    """Installs ``fsdp_utils`` / ``fsdp_strategy`` stand-ins under one distribution's real module names."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, distribution: str, *, selector: bool, mpp: bool = True):
        package = PACKAGES[distribution]
        self.utils = types.ModuleType(f"{package}.fsdp_utils")
        self.utils.apply_fsdp2 = _upstream_apply
        if selector:
            self.utils.modules_to_wrap_fsdp2 = _upstream_selector
        if mpp:
            self.utils.MixedPrecisionPolicy = object
        self.strategy = types.ModuleType(f"{package}.fsdp_strategy")
        monkeypatch.setitem(sys.modules, self.utils.__name__, self.utils)
        self.monkeypatch = monkeypatch

    def import_strategy(self) -> types.ModuleType:
        """``from fsdp_utils import apply_fsdp2`` (and the selector) as SkyRL's fsdp_strategy does."""
        self.strategy.apply_fsdp2 = self.utils.apply_fsdp2
        if hasattr(self.utils, "modules_to_wrap_fsdp2"):
            self.strategy.modules_to_wrap_fsdp2 = self.utils.modules_to_wrap_fsdp2
        self.monkeypatch.setitem(sys.modules, self.strategy.__name__, self.strategy)
        return self.strategy


def _adapter(distribution: str, version: str) -> Adapter:
    class Pinned(Adapter):
        def version_of(self, name: str) -> Version | None:
            return Version(version) if name == distribution else None

    return Pinned("skyrl", SKYRL_TABLE)


def test_upstream_selector_is_replaced_when_a_release_ships_it(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.delenv("FSDP_COMPAT_POLICY", raising=False)
    stand_in = _StandIn(monkeypatch, "skyrl", selector=True)
    strategy = stand_in.import_strategy()
    adapter = _adapter("skyrl", "0.4.0")
    assert adapter.patch() is True
    try:
        selector = stand_in.utils.modules_to_wrap_fsdp2
        assert selector.__fsdp_compat__ and selector.__wrapped__ is _upstream_selector
        assert strategy.modules_to_wrap_fsdp2 is selector  # rebound in the by-name importer
        assert stand_in.utils.apply_fsdp2 is _upstream_apply  # the release's own apply_fsdp2 stays
        model = _TinyVLM()
        chosen = selector(model, {"_DecoderLayer"})
        assert model.vision.position_embedding not in chosen  # read raw by its parent: the GLM4V crash case
        assert model.layers[0] in chosen and model.layers[1] in chosen and model.embed_tokens in chosen
        assert model not in chosen
        paths = [next(p for p, m in model.named_modules() if m is c) for c in chosen]
        for i, path in enumerate(paths):  # bottom-up: every descendant of a target comes before it
            assert not any(p.startswith(path + ".") for p in paths[i + 1 :])
        again = _TinyVLM()  # a fresh model per call, as SkyRL does (the guard is installed on the one it shards)
        paths_again = [next(p for p, m in again.named_modules() if m is c) for c in selector(again, "_DecoderLayer")]
        assert paths_again == paths  # a single name, as a string
        # an outdated wrap list: SkyRL's embeddings rule minus the raw-read table, with one warning, no exception
        with caplog.at_level(logging.WARNING, logger="fsdp_compat"):
            outdated = _TinyVLM()
            assert selector(outdated, ["NoSuchLayer"]) == [outdated.embed_tokens]
        assert "['NoSuchLayer'] match no module of _TinyVLM" in caplog.text and "_DecoderLayer" in caplog.text
    finally:
        adapter.unpatch()
    assert stand_in.utils.modules_to_wrap_fsdp2 is _upstream_selector
    assert strategy.modules_to_wrap_fsdp2 is _upstream_selector


@pytest.mark.parametrize("strategy_first", [True, False])
def test_apply_fsdp2_replaced_and_restored_in_both_modules(
    monkeypatch: pytest.MonkeyPatch, strategy_first: bool
) -> None:
    stand_in = _StandIn(monkeypatch, "skyrl-train", selector=False)
    adapter = _adapter("skyrl-train", "0.3.0")
    if strategy_first:
        strategy = stand_in.import_strategy()
        adapter.patch()
    else:
        adapter.patch()
        strategy = stand_in.import_strategy()  # a late importer receives the replacement by name
    replacement = stand_in.utils.apply_fsdp2
    assert replacement.__fsdp_compat__ and replacement.__wrapped__ is _upstream_apply
    assert strategy.apply_fsdp2 is replacement
    adapter.unpatch()
    assert stand_in.utils.apply_fsdp2 is _upstream_apply
    assert strategy.apply_fsdp2 is _upstream_apply
    assert not adapter.is_patched()


def test_future_release_warns_and_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSDP_COMPAT_FORCE", raising=False)
    stand_in = _StandIn(monkeypatch, "skyrl", selector=False)
    adapter = _adapter("skyrl", "0.5.0")
    # skyrl 0.4.0 has a recorded fingerprint: a newer release is judged by it (the stand-in's code differs)
    newer = r"skyrl 0\.5\.0 is newer than the tested range.*skyrl >=0\.1\.0,<0\.5.*nothing was patched"
    with pytest.warns(FsdpCompatWarning, match=newer):
        assert adapter.patch() is False
    assert stand_in.utils.apply_fsdp2 is _upstream_apply and not adapter.is_patched()


def test_forced_future_release_uses_the_selector_it_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMPAT_FORCE", "1")
    stand_in = _StandIn(monkeypatch, "skyrl", selector=True)
    adapter = _adapter("skyrl", "0.5.0")
    with pytest.warns(FsdpCompatWarning, match="patching anyway"):
        assert adapter.patch() is True
    try:
        assert stand_in.utils.modules_to_wrap_fsdp2.__fsdp_compat__
    finally:
        adapter.unpatch()


def test_release_without_apply_fsdp2_is_not_partially_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = _StandIn(monkeypatch, "skyrl", selector=False)
    del stand_in.utils.apply_fsdp2
    adapter = _adapter("skyrl", "0.4.0")
    with pytest.raises(FsdpCompatError, match="does not exist in this release"):
        adapter.patch()
    assert not adapter.is_patched()


def test_bad_policy_name_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_COMPAT_POLICY", "no-such-policy")
    _StandIn(monkeypatch, "skyrl", selector=False)
    with pytest.raises(FsdpCompatError, match="FSDP_COMPAT_POLICY"):
        _adapter("skyrl", "0.4.0").patch()


@pytest.mark.parametrize(("version", "repaired"), [("0.3.1", True), ("0.3.0", False)])
def test_skyrl_train_031_missing_reexport_is_repaired_and_undone(
    monkeypatch: pytest.MonkeyPatch, version: str, repaired: bool
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    stand_in = _StandIn(monkeypatch, "skyrl-train", selector=False, mpp=False)
    adapter = _adapter("skyrl-train", version)
    adapter.patch()
    assert (getattr(stand_in.utils, "MixedPrecisionPolicy", None) is MixedPrecisionPolicy) is repaired
    assert any("MixedPrecisionPolicy" in line for line in adapter.describe()) is repaired
    adapter.unpatch()
    assert not hasattr(stand_in.utils, "MixedPrecisionPolicy")


def test_replacement_keeps_skyrl_signature_and_passes_config_override(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_core(model: Any, fsdp_kwargs: Any, layer_classes: Any, *, policy: str) -> str:
        calls.append((model, fsdp_kwargs, layer_classes, policy))
        return "plan"

    import fsdp_compat.apply

    monkeypatch.setattr(fsdp_compat.apply, "apply_fsdp2", fake_core)
    replacement = make_apply_fsdp2(_upstream_apply, Auto())
    kwargs = {"mesh": "m", "mp_policy": "mp", "offload_policy": None, "reshard_after_forward": True}
    config = _FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["_DecoderLayer"]})
    model = _TinyVLM()
    assert replacement(model, kwargs, config) is None  # SkyRL's apply_fsdp2 returns nothing
    assert replacement(model, kwargs, {"wrap_policy": {}}) is None
    named = [(*call[:3], call[3].name) for call in calls]  # the adapter hands the resolved Policy on
    assert named == [(model, kwargs, ["_DecoderLayer"], "auto"), (model, kwargs, None, "auto")]


def test_module_api() -> None:
    assert skyrl_adapter.patch == skyrl_adapter.ADAPTER.patch
    assert skyrl_adapter.unpatch == skyrl_adapter.ADAPTER.unpatch
    assert skyrl_adapter.is_patched == skyrl_adapter.ADAPTER.is_patched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(skyrl_adapter.ADAPTER.describe(), list)


def test_plan_is_the_same_on_the_meta_device() -> None:
    """skyrl 0.3.0+ move the model to the meta device right before apply_fsdp2: the plan must not change."""
    import copy

    from fsdp_compat.plan import plan_wrap
    from fsdp_compat.testing.zoo import build_model

    model = build_model("glm4v")
    meta = copy.deepcopy(model).to("meta")
    real_plan, meta_plan = plan_wrap(model, None), plan_wrap(meta, None)
    assert real_plan.group_paths() == meta_plan.group_paths()
    assert ("model.visual.embeddings.position_embedding",) not in real_plan.group_paths()
