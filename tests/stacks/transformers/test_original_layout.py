"""transformers' distributed loading from a checkpoint in its original layout (huggingface/transformers#48519).

``from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=2))`` on transformers 5.23 - 5.25 slices each
checkpoint tensor to the rank's shard before the family's conversion ops run. Each case saves a tiny real model with
``save_pretrained`` (the original layout, its default), loads it on 2 gloo ranks sharded and plainly, and compares
every parameter's gathered full tensor: with fsdp-compat off (``FSDP_COMPAT=off``) the sharded load first differs
from the plain one (silently: q/k/v 0.08 .. 0.13 apart) or raises (a conversion op cannot run on the slice); with
fsdp-compat installed (the loader replaced, :class:`fsdp_compat.adapters.transformers.WholeThenShard`) every
parameter equals the plain load's on every rank (difference 0.0). One family runs in ``hf525``'s default list; the
rest are ``breadth`` (``hf525-families``: Inkling's tower imports scipy).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
from lab.support import BREADTH, OFF, ON, require_framework

core = require_framework(
    "transformers' checkpoint loader with native FSDP2",
    lambda: (
        importlib.import_module("transformers.distributed.fsdp")
        and importlib.import_module("transformers.core_model_loading")
    ),
)

from fsdp_compat.adapters import transformers as adapter  # noqa: E402
from lab.transformers_smoke import load_differences, save_tiny  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: family -> what the upstream sharded load does with the original layout: ("differ", the prefix of every parameter
#: that differs, the op) or ("raise", the conversion error rank 0's loading report names).
UPSTREAM: dict[str, tuple[str, str]] = {
    # PermuteForRope and Chunk of the vision tower's fused wqkv
    "lab.vlms:kimi_k25": ("differ", "model.vision_tower."),
    # Chunk of the RADIO tower's fused qkv
    "lab.vlms:nemotron_h_omni": ("differ", "vision_model."),
    # PermuteForRope of the Pixtral tower's wq and wk
    "lab.vlms:mistral_large4": ("differ", "model.vision_tower."),
    # Chunk of the CLIP encoder's qkv_proj
    "lab.vlms:unlimited_ocr": ("differ", "model.vision_tower."),
    # Split of the text model's fused att_proj into q, k, v of different sizes
    "lab.vlms:molmo2": ("raise", "Split on tensors destined for model.language_model.layers."),
    # Interleave of the dense MLP's w13 into gate and up
    "lab.vlms:inkling_mm_model": ("raise", "Interleave on tensors destined for model.language_model.layers."),
}

DEFAULT = "lab.vlms:kimi_k25"  # the silent one: wrong vision weights, no error


CASES = [pytest.param(name, marks=() if name == DEFAULT else BREADTH, id=name.partition(":")[2]) for name in UPSTREAM]


@pytest.mark.parametrize("name", CASES)
def test_original_layout_loads_the_plain_weights_on_every_rank(name, tmp_path):
    path = save_tiny(name, tmp_path)
    off = load_differences(name, path, env=OFF)
    what, sign = UPSTREAM[name]
    if what == "raise":
        assert not off.ok
        assert "automatic conversion of the weights" in (off.exception or ""), off.error
        assert sign in off.ranks[0].extra.get("log_tail", ""), off.ranks[0].extra.get("log_tail", "")[-3000:]
    else:
        off.raise_for_error()
        for rank in off.ranks:
            differing = rank.extra["differences"]
            assert differing and all(path.startswith(sign) for path in differing), differing
            assert min(differing.values()) > 0.01, differing
    on = load_differences(name, path, env=ON)
    on.raise_for_error()
    assert [rank.extra["differences"] for rank in on.ranks] == [{}, {}]


def test_loader_is_replaced_where_transformers_binds_it():
    """The definer and ``modeling_utils`` (imported first; ``modeling_layers`` when it is imported) hold the
    replacement; it wraps transformers' own function."""
    from transformers import modeling_layers, modeling_utils

    assert adapter.is_patched()
    loader = core.convert_and_load_state_dict_in_model
    assert isinstance(loader, adapter.WholeThenShard)
    assert modeling_utils.convert_and_load_state_dict_in_model is loader
    assert modeling_layers.convert_and_load_state_dict_in_model is loader
    assert loader.__wrapped__.__module__ == core.__name__ and loader.__name__ == "convert_and_load_state_dict_in_model"


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (SimpleNamespace(device_map=None, hf_quantizer=SimpleNamespace()), "not with a quantizer (SimpleNamespace)"),
        (SimpleNamespace(device_map={"": "disk"}, hf_quantizer=None), "not with disk offload (model.x.q_proj.weight)"),
    ],
)
def test_what_cannot_be_converted_whole_raises_by_name(config, why):
    """A quantized or disk-offloaded sharded load of converted weights stops with ShardedConversionError (an
    FsdpCompatError) naming the way out, instead of loading other weights than a plain load."""
    with pytest.raises(adapter.ShardedConversionError, match="huggingface/transformers#48519") as caught:
        adapter.WholeThenShard.refuse(core, {"model.x.q_proj.weight": None}, config)
    assert why in str(caught.value) and "save_original_format=False" in str(caught.value)
