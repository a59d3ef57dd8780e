"""``WrapPlan.to_transformers_fsdp_plan`` (``fsdp_compat.export``): pure planning on the zoo, no transformers FSDP2
run, so it runs in the core env (transformers 5.10.4). That transformers trains the exported plan exactly is in
tests/stacks/transformers (hf524: transformers' native FSDP2).
"""

from __future__ import annotations

import warnings

import pytest

from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.export import wildcard
from fsdp_compat.plan import plan_wrap
from fsdp_compat.testing.zoo import build_model


def test_export_leaves_out_multi_module_groups_with_a_warning():
    model = build_model("t5-shared")
    plan = plan_wrap(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = plan.to_transformers_fsdp_plan(model)
    assert exported["encoder.block.*"] == "free_full_weight"
    assert not any("embed_tokens" in key or key == "shared" for key in exported)
    assert any("cannot express" in str(w.message) and "shared" in str(w.message) for w in caught)
    with pytest.raises(FsdpCompatError, match="cannot express"):
        plan.to_transformers_fsdp_plan(model, strict=True)


def test_export_keeps_no_reshard_groups_and_wildcards_layers():
    model = build_model("qwen2-zloss")
    exported = plan_wrap(model).to_transformers_fsdp_plan(model)
    assert exported == {
        "model.embed_tokens": "free_full_weight",
        "model.layers.*": "free_full_weight",
        "lm_head": "keep_full_weight",
    }


def test_wildcard_replaces_every_layer_index_and_nothing_else():
    """transformers' fsdp_plan key: a ``.<digits>`` path segment (a ModuleList index) is ``.*``; digits inside a
    name are not an index."""
    assert wildcard("model.layers.12.mlp.experts.3") == "model.layers.*.mlp.experts.*"
    assert wildcard("model.visual.blocks.0") == "model.visual.blocks.*"
    assert wildcard("model.layers10.conv1d") == "model.layers10.conv1d"
    assert wildcard("lm_head") == "lm_head"
