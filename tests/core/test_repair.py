"""Repair of someone else's grouping (``fsdp_compat.repair.repair_groups``, what the transformers adapter runs on
``fsdp_plan``), on zoo models in the core env: safe groups untouched, a read after the group's own forward kept
unsharded, a read without it dropped to the root, sharers of one Parameter never split. The reads are the ones the
zoo's forwards make (see zoo.py); the adapter's cases on transformers' resolved plans: tests/stacks/transformers.
"""

from __future__ import annotations

from torch import nn

from fsdp_compat.repair import ForeignGroup, repair_groups
from fsdp_compat.testing.zoo import build_model


def _qwen2_groups(model: nn.Module) -> list[ForeignGroup]:
    """verl's shape of selection on a Qwen2: the input table, every decoder layer, the head."""
    layers = [ForeignGroup((f"model.layers.{i}",)) for i in range(len(model.model.layers))]
    return [ForeignGroup(("model.embed_tokens",)), *layers, ForeignGroup(("lm_head",))]


def test_a_safe_grouping_comes_back_unchanged() -> None:
    """Qwen2 (untied) uses every weight inside its owner's forward."""
    model = build_model("qwen2")
    groups = _qwen2_groups(model)
    kept, changes = repair_groups(model, groups)
    assert kept == groups and changes == []


def test_read_after_the_groups_forward_keeps_it_unsharded() -> None:
    """qwen2-zloss calls lm_head, then reads lm_head.weight: keeping that group unsharded until backward covers it."""
    model = build_model("qwen2-zloss")
    groups = _qwen2_groups(model)
    kept, changes = repair_groups(model, groups)
    assert kept == [*groups[:-1], ForeignGroup(("lm_head",), reshard_after_forward=False)]
    assert [(c.paths, c.action) for c in changes] == [(("lm_head",), "keep-full-weight")]
    assert "lm_head.weight read raw by <root>" in changes[0].why


def test_read_without_the_groups_forward_drops_it_into_the_root() -> None:
    """qwen2-fused-lmhead reads lm_head.weight in the root and never calls lm_head: only the root covers it."""
    model = build_model("qwen2-fused-lmhead")
    groups = _qwen2_groups(model)
    kept, changes = repair_groups(model, groups)
    assert kept == groups[:-1]
    assert [(c.paths, c.action, c.now_in) for c in changes] == [(("lm_head",), "dropped", "<root>")]
    assert changes[0].describe().startswith("lm_head: no group of its own; its parameters now live in <root>")


def test_evidence_passed_in_replaces_the_analysis() -> None:
    """With no evidence the fused read is unknown, and nothing is changed: the evidence alone decides."""
    model = build_model("qwen2-fused-lmhead")
    groups = _qwen2_groups(model)
    assert repair_groups(model, groups, evidence=[]) == (groups, [])


def test_sharers_of_one_parameter_are_never_split() -> None:
    """T5: ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens`` hold one weight. One group each would split
    it; one group holding all three is left as it is."""
    model = build_model("t5-shared")
    sharers = ("shared", "encoder.embed_tokens", "decoder.embed_tokens")
    separate = [ForeignGroup((path,)) for path in sharers]
    kept, changes = repair_groups(model, separate)
    assert all(set(g.paths) in ({*sharers}, set()) or not set(g.paths) & set(sharers) for g in kept), kept
    assert changes and all("hold one Parameter" in c.why for c in changes)
    together = [ForeignGroup(sharers)]
    assert repair_groups(model, together) == (together, [])


def test_groups_naming_no_module_of_the_model_are_left_out() -> None:
    model = build_model("qwen2")
    groups = _qwen2_groups(model)
    kept, changes = repair_groups(model, [*groups, ForeignGroup(("model.visual.blocks.0",))])
    assert kept == groups and changes == []
