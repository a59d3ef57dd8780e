"""Every adapter's replacement survives a framework's signature growth: arguments it does not know reach the
framework's own code, and LLaMA-Factory's own ``prepare_model`` runs with only its unsafe ``fully_shard`` calls
left out.

Unit tests of our wrappers in one process, without the frameworks: each replacement factory gets a recording
original (what a newer release's function would receive), and the model is the zoo's tiny GLM4V, whose vision
``position_embedding`` is read raw (the static analysis is real). The stack envs drive the real releases
(``tests/stacks/<framework>``; LLaMA-Factory main's engine shape there too).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
from fsdp_compat.adapters import areal, llamafactory, skyrl, transformers, verl
from fsdp_compat.adapters._selection import DeferredShards, foreign_arguments, make_deferring_fully_shard
from torch import nn

from fsdp_compat.policies import Auto, resolve_policy
from fsdp_compat.testing.zoo import build_model

RAW_READ = "model.visual.embeddings.position_embedding"


@pytest.fixture(scope="module")
def glm4v() -> nn.Module:
    return build_model("glm4v", seed=0)


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``install_runtime`` recorded instead of installed (the models here are never sharded)."""
    import fsdp_compat.runtime

    calls: list[Any] = []
    monkeypatch.setattr(fsdp_compat.runtime, "install_runtime", calls.append)
    return calls


class Recorder:
    """A ``fully_shard`` that records (path, positional, keyword arguments) and shards nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((self.paths[id(module)], args, kwargs))
        return module

    @property
    def order(self) -> list[str]:
        return [path for path, _, _ in self.calls]


def _main_like_selection(model: nn.Module) -> list[str]:
    """What LLaMA-Factory main's ``prepare_model`` shards of GLM4V besides the root, in its (pre-)order: a *set* of
    layer classes (vision blocks too) and every untied ``nn.Embedding``; ``model.visual`` added, a parent listed
    before its children as a pre-order walk does."""
    classes = {type(model.model.visual.blocks[0]), type(model.model.language_model.layers[0])}
    return [
        path
        for path, m in model.named_modules()
        if type(m) in classes or isinstance(m, nn.Embedding) or path == "model.visual"
    ]


class _Engine:
    """A framework method with a signature newer than any replacement: LLaMA-Factory main's
    ``prepare_model(self, model, ignored_params=None)`` plus positional and keyword arguments nobody knows yet.
    Like the release it looks ``fully_shard`` up in its module (``ns``) at call time and runs its own steps."""

    def __init__(self, ns: Any) -> None:
        self.ns = ns
        self.received: list[Any] = []

    def prepare_model(self, model: nn.Module, ignored_params: Any = None, *extra: Any, **more: Any) -> nn.Module:
        self.received.append((model, ignored_params, extra, more))
        for path in _main_like_selection(model):
            self.ns.fully_shard(model.get_submodule(path), mesh="m", tag=path, ignored_params=ignored_params)
        model.framework_step_ran = True  # a step of the framework's own (main's norms step, say)
        self.ns.fully_shard(model, mesh="m", tag="root", ignored_params=ignored_params)
        return model


def _engine(glm4v: nn.Module, name: str) -> tuple[Any, Recorder, _Engine]:
    policy = resolve_policy(name)
    recorder = Recorder(glm4v)
    ns = types.SimpleNamespace(fully_shard=make_deferring_fully_shard(recorder, policy))
    engine = _Engine(ns)
    return llamafactory.make_prepare_model(_Engine.prepare_model, policy), recorder, engine


def _children_first(order: list[str]) -> bool:
    return all(not b.startswith(a + ".") for i, a in enumerate(order) for b in order[i + 1 :] if a)


# --------------------------------------------------------------------------------------------- LLaMA-Factory


def test_llamafactory_runs_the_engines_own_method_with_every_argument(glm4v: nn.Module) -> None:
    """main's ``FSDPTurboFSDP2Engine`` calls ``prepare_model(model, ignored_params=...)``: 0.9.5's signature would
    raise TypeError; every argument (known or not) reaches the engine's own method, whose steps all run."""
    prepare_model, recorder, engine = _engine(glm4v, "auto")
    ignored = {glm4v.model.visual.patch_embed.proj.weight}
    assert prepare_model(engine, glm4v, ignored_params=ignored) is glm4v  # FSDPTurboFSDP2Engine's call
    assert prepare_model(engine, glm4v, ignored, "future-positional", future=1) is glm4v
    assert engine.received == [(glm4v, ignored, (), {}), (glm4v, ignored, ("future-positional",), {"future": 1})]
    assert glm4v.framework_step_ran is True
    assert prepare_model(engine, model=glm4v) is glm4v  # the model by keyword
    assert engine.received[-1] == (glm4v, None, (), {})
    assert recorder.order.count("") == 3  # each call sharded the root through the engine's own fully_shard


def test_llamafactory_keeps_the_engines_calls_minus_the_unsafe_children_first(glm4v: nn.Module) -> None:
    """The engine's own selection (a set of classes: vision blocks and text layers, the embeddings) is what gets
    sharded, each call with the keywords the engine gave it, minus the raw-read table, children first, root last."""
    prepare_model, recorder, engine = _engine(glm4v, "auto")
    prepare_model(engine, glm4v, ignored_params="ignored")
    selected = _main_like_selection(glm4v)
    assert RAW_READ in selected and "model.visual.blocks.0" in selected  # the engine did select both
    assert recorder.order[-1] == ""  # the root, last, as the engine made it
    kept = recorder.order[:-1]
    assert sorted(kept) == sorted(p for p in selected if p != RAW_READ)
    assert kept.index("model.visual.blocks.0") < kept.index("model.visual")  # the engine listed visual first
    assert _children_first(kept)
    for path, args, kwargs in recorder.calls:
        assert args == () and kwargs == {"mesh": "m", "tag": path or "root", "ignored_params": "ignored"}


def test_llamafactory_legacy_runs_the_engines_calls_as_made(glm4v: nn.Module) -> None:
    prepare_model, recorder, engine = _engine(glm4v, "legacy")
    prepare_model(engine, glm4v, ignored_params=None)
    assert recorder.order == [*_main_like_selection(glm4v), ""]


def test_fully_shard_outside_a_prepare_model_goes_straight_through(glm4v: nn.Module) -> None:
    recorder = Recorder(glm4v)
    fully_shard = make_deferring_fully_shard(recorder, Auto())
    assert fully_shard(glm4v.model.visual.embeddings.position_embedding, mesh="m") is not None
    assert recorder.calls == [(RAW_READ, (), {"mesh": "m"})]


def test_deferred_calls_without_a_root_call_are_applied_when_the_scope_closes(glm4v: nn.Module) -> None:
    recorder = Recorder(glm4v)
    fully_shard = make_deferring_fully_shard(recorder, Auto())
    with DeferredShards("fw", glm4v) as calls:
        fully_shard(glm4v.model.visual, 1)
        fully_shard(glm4v.model.visual.blocks[0], 2)
        fully_shard(glm4v.model.visual.blocks[0], 3)  # selected twice: sharded once, with the first call's args
        assert recorder.calls == []
    assert calls.calls == 3
    assert recorder.calls == [("model.visual.blocks.0", (2,), {}), ("model.visual", (1,), {})]


def test_a_group_call_keeps_every_call_as_made(glm4v: nn.Module) -> None:
    """``fully_shard([a, b])`` (no release read does it) cannot be judged per module: nothing is changed."""
    shard: list[Any] = []
    fully_shard = make_deferring_fully_shard(lambda module, *a, **k: shard.append(module), Auto())
    table = glm4v.model.visual.embeddings.position_embedding
    with DeferredShards("fw", glm4v):
        fully_shard(table)
        fully_shard([glm4v.model.visual.blocks[0], glm4v.model.visual.blocks[1]])
    assert shard[0] is table and isinstance(shard[1], list)


def test_an_exception_in_the_framework_applies_nothing(glm4v: nn.Module) -> None:
    recorder = Recorder(glm4v)
    fully_shard = make_deferring_fully_shard(recorder, Auto())
    with pytest.raises(RuntimeError, match="framework failed"), DeferredShards("fw", glm4v):
        fully_shard(glm4v.model.visual.blocks[0])
        raise RuntimeError("framework failed")
    assert recorder.calls == []
    fully_shard(glm4v.model.visual.blocks[0])  # the scope is closed: straight through again
    assert recorder.order == ["model.visual.blocks.0"]


# ------------------------------------------------------------------ replacements that re-implement a function


class Original:
    """A framework function of a newer release: records what it got, returns ``result``."""

    def __init__(self, result: Any = None) -> None:
        self.result = result
        self.received: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.received.append((args, kwargs))
        return self.result


def test_skyrl_apply_fsdp2_hands_unknown_arguments_to_skyrls_own(glm4v: nn.Module, installed: list[Any]) -> None:
    """``apply_fsdp2(model, fsdp_kwargs, config, *extra)``: the replacement used to drop ``extra``."""
    original = Original()
    replacement = skyrl.make_apply_fsdp2(original, Auto())
    assert replacement(glm4v, {"mesh": "m"}, None, "extra", future=True) is None
    assert original.received == [((glm4v, {"mesh": "m"}, None, "extra"), {"future": True})]
    assert installed == [glm4v]


def test_skyrl_selector_keeps_skyrls_own_candidates_with_unknown_arguments(
    glm4v: nn.Module, installed: list[Any]
) -> None:
    table, block = glm4v.model.visual.embeddings.position_embedding, glm4v.model.visual.blocks[0]
    original = Original([table, block])
    replacement = skyrl.make_modules_to_wrap_fsdp2(original, Auto())
    assert replacement(glm4v, ["Glm4vVisionBlock"], future=1) == [block]  # the raw-read table stays in the root
    assert original.received == [((glm4v, ["Glm4vVisionBlock"]), {"future": 1})]
    assert installed == [glm4v]


@pytest.mark.parametrize("policy", ["auto", "legacy"])
def test_areal_apply_fsdp2_hands_unknown_arguments_to_areals_own(
    glm4v: nn.Module, installed: list[Any], policy: str
) -> None:
    """``apply_fsdp2(model, fsdp_kwargs, wrap_policy)`` used to raise TypeError on anything more."""
    original = Original()
    replacement = areal.make_apply_fsdp2(original, resolve_policy(policy))
    assert replacement(glm4v, {"mesh": "m"}, None, "extra", future=True) is None
    assert original.received == [((glm4v, {"mesh": "m"}, None, "extra"), {"future": True})]


# ------------------------------------------------------------------------- replacements that call the original


def test_transformers_replacements_pass_unknown_arguments_on(glm4v: nn.Module, installed: list[Any]) -> None:
    apply = Original("applied")
    replacement = transformers.make_apply_fully_sharded_data_parallelism(apply, Auto())
    assert replacement(glm4v, "mesh-manager", {}, "ep-plan", future=1) == "applied"
    assert apply.received == [((glm4v, "mesh-manager", {}, "ep-plan"), {"future": 1})]
    expand = Original(([], []))
    replacement = transformers.make_expand_fsdp_plan(expand, Auto())
    assert replacement(glm4v, {}, "extra", future=1) == ([], [])
    assert expand.received == [((glm4v, {}, "extra"), {"future": 1})]


def test_verl_selector_passes_use_fused_kernels_and_positionals_on(glm4v: nn.Module, installed: list[Any]) -> None:
    """verl's ``_select_fsdp2_wrap_targets`` with the keyword an upstream change adds: it reaches verl's own
    selector (which takes it), and a keyword verl's selector does not take is not forced on it."""
    table, layer = glm4v.model.visual.embeddings.position_embedding, glm4v.model.language_model.layers[0]
    received: list[Any] = []

    def selector(model: Any, names: Any, extra: Any = None, use_fused_kernels: bool = False) -> list[Any]:
        received.append((names, extra, use_fused_kernels))
        return [table, layer]

    replacement = verl.make_select_fsdp2_wrap_targets(selector, Auto())
    assert replacement(glm4v, ["Glm4vTextDecoderLayer"], "extra", use_fused_kernels=False, unknown=1) == [layer]
    assert received == [(["Glm4vTextDecoderLayer"], "extra", False)]


def test_unknown_arguments_warn_once_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fsdp_compat"):
        assert not foreign_arguments("fw", "fn", (), {})
        assert foreign_arguments("fw", "fn", ("x",), {"b": 1, "a": 2})
        assert foreign_arguments("fw", "fn", ("y",), {"a": 0, "b": 0})  # the same shape: no second warning
    lines = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(lines) == 1 and "extra #0, a, b" in lines[0] and "fw's own fn" in lines[0], lines
