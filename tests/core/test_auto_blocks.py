"""Models that declare no layer classes (Marian, Pegasus: ``_no_split_modules`` empty): ``auto`` plans them with
their repeated block classes instead of raising, says so in the groups' reasons, and trains them at
data-parallel parity on 2 gloo ranks; explicit ``layer_classes`` still win and the other policies still raise.

Parity (fp32, 2 AdamW steps): each rank trains a different batch through ``fsdp_compat.apply_fsdp2`` (auto); the
reference, in every rank, does ``(ref(**batch_r).loss / 2).backward()`` for both ranks' batches, then one AdamW step.
Asserted: every gradient and parameter within 1e-6 relative of the reference after each step, and at step 1 the
decoder's own gradients and post-step parameters ``== 0.0``. Not 0.0 everywhere because the encoder output feeds
every decoder layer's cross-attention and the embedding table is tied: FSDP2's hooks change the order in which
autograd sums those several consumers' gradients (a reordered sum, as with T5: within the 1e-6 relative this test
asserts, not 0.0), which AdamW's first step magnifies on near-zero gradients. The rank routine lives here
(the ranks import this file with ``tests/core/`` first on ``PYTHONPATH``, then the inherited ``tests/``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_compat import FsdpCompatError, plan_wrap
from fsdp_compat.testing.launch import run_ranks
from fsdp_compat.testing.parity import Diff, full_tensor, reference_backward

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parent
MODELS = {
    "marian": ("MarianConfig", "MarianMTModel", {"decoder_start_token_id": 0}),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", {}),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 seq2seq model from its config class (dropout off), depending only on ``seed``."""
    import transformers

    config_cls, model_cls, overrides = MODELS[name]
    base = dict(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    config = getattr(transformers, config_cls)(**{**base, **overrides})
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
    return model.train()


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, 10), generator=g)
    labels = torch.randint(3, 128, (2, 7), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def dp_rank(cfg: dict[str, Any], rank: int, extra: dict[str, Any]) -> None:
    """One rank: shard with ``apply_fsdp2`` (auto), train this rank's batch; the reference trains every rank's
    batch with the mean loss. ``extra`` gets the groups, their reasons and the worst differences: ``exact`` (absolute,
    step 1, the decoder's own gradients and parameters) and ``rel`` (relative, everything, both steps)."""
    import copy

    from lab.transformers_smoke import init_gloo
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compat import apply_fsdp2

    init_gloo(cfg, rank)
    world = cfg["world_size"]
    model = build(cfg["model"])
    holders: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        holders[id(p)] = holders.get(id(p), 0) + 1
    tied = {n for n, p in model.named_parameters() if holders[id(p)] > 1}
    reference = copy.deepcopy(model)
    plan = apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (world,))})
    extra["groups"] = [list(g.paths) for g in plan.groups]
    extra["reasons"] = [g.reason for g in plan.groups]
    extra["tied"] = sorted(tied)
    batches = [make_batch(1000 + r) for r in range(world)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_params = dict(reference.named_parameters())
    every, decoder = Diff(), Diff()  # every parameter (relative); step 1, the decoder's own (absolute); NaN fails
    for step in range(cfg["steps"]):
        model(**batches[rank]).loss.backward()
        reference_backward(reference, batches)  # one process on every rank's batch, mean loss
        named = list(model.named_parameters())
        with torch.no_grad():
            for name, p in named:
                grad = full_tensor(p.grad)
                every.add(name, grad, ref_params[name].grad)
                if step == 0 and name.startswith("model.decoder.") and name not in tied:
                    decoder.add(name, grad, ref_params[name].grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in named:
                every.add(name, full_tensor(p), ref_params[name])
                if step == 0 and name.startswith("model.decoder.") and name not in tied:
                    decoder.add(name, full_tensor(p), ref_params[name])
    extra["exact"], extra["rel"] = decoder.abs, every.rel


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_plans_with_the_repeated_blocks(name: str) -> None:
    model = build(name)
    assert not model._no_split_modules  # the premise: the model declares no layer classes
    plan = plan_wrap(model)
    stem = type(model).__name__.removesuffix("MTModel").removesuffix("ForConditionalGeneration")
    assert plan.layer_classes == (f"{stem}DecoderLayer", f"{stem}EncoderLayer")
    layers = [g for g in plan.groups if g.kind == "layer"]
    assert [g.paths for g in layers] == [(f"model.{s}.layers.{i}",) for s in ("encoder", "decoder") for i in (0, 1)]
    assert all("(the model declares no _no_split_modules)" in g.reason for g in layers)
    explicit = plan_wrap(model, [f"{stem}EncoderLayer"])  # explicit layer classes win
    assert explicit.layer_classes == (f"{stem}EncoderLayer",)
    assert [g.paths for g in explicit.groups if g.kind == "layer"] == [(f"model.encoder.layers.{i}",) for i in (0, 1)]
    assert all(g.reason == f"layer class {stem}EncoderLayer" for g in explicit.groups if g.kind == "layer")
    for policy in ("legacy", "input-only", "layers-only"):
        with pytest.raises(FsdpCompatError, match="declares no layer classes"):
            plan_wrap(model, policy=policy)


def test_a_model_without_repeated_blocks_still_raises() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    with pytest.raises(FsdpCompatError, match="declares no layer classes"):
        plan_wrap(model)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_trains_at_exact_data_parallel_parity(name: str) -> None:
    result = run_ranks(
        "test_auto_blocks:dp_rank", {"model": name, "steps": 2}, world_size=2, timeout_s=240,
        env={"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ["PYTHONPATH"]])},
    )  # fmt: skip
    result.raise_for_error()
    for rank in result.ranks:
        extra = rank.extra
        print(f"{name} rank {rank.rank}: step-1 decoder Δ {extra['exact']}, all Δrel {extra['rel']}")
        assert sum(1 for paths in extra["groups"] if ".layers." in paths[0]) == 4, extra["groups"]
        assert extra["tied"] == ["model.shared.weight"]
        assert extra["exact"] == 0.0  # NaN fails too
        assert extra["rel"] <= 1e-6
