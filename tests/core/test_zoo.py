"""The zoo builds real, tiny, deterministic models with the structure tests rely on; skeletons are meta."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.testing.skeleton import REFERENCE_NAMES, build_skeleton, reference_skeleton
from fsdp_compat.testing.zoo import VISION_ZOO, ZOO, build_model, builder, make_batch

pytestmark = pytest.mark.timeout(120)


def _embeddings(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Embedding)]


@pytest.mark.parametrize("name", list(ZOO))
def test_trains_one_step(name: str) -> None:
    model = build_model(name)
    assert model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    batch = make_batch(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    times = []
    for _ in range(2):
        t = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        assert torch.isfinite(loss)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "no parameter changed after two AdamW steps"
    print(f"{name}: step {times[-1]:.3f}s (first {times[0]:.3f}s), {sum(p.numel() for p in model.parameters())} params")
    assert times[-1] < 5.0  # ~0.01-0.15 s measured; generous for a loaded CI machine


@pytest.mark.parametrize("name", list(ZOO))
def test_deterministic_by_seed(name: str) -> None:
    a, b, c = build_model(name, seed=3), build_model(name, seed=3), build_model(name, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    ba, bb = make_batch(name, seed=3), make_batch(name, seed=3)
    assert all(torch.equal(ba[k], bb[k]) for k in ba)
    assert "labels" in ba


@pytest.mark.parametrize("name", list(ZOO))
def test_only_input_embedding_flag(name: str) -> None:
    model = build_model(name)
    only = _embeddings(model) == [model.get_input_embeddings()]
    assert only == ZOO[name].only_input_embedding


def test_glm4v_untied_with_raw_position_read() -> None:
    model = build_model("glm4v")
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    assert model.get_input_embeddings() is model.model.language_model.embed_tokens
    emb = model.model.visual.embeddings
    assert isinstance(emb.position_embedding, nn.Embedding)
    calls = []
    emb.position_embedding.register_forward_hook(lambda *a: calls.append(1))
    model(**make_batch("glm4v")).loss.backward()
    assert calls == []  # the table is read raw, never through its forward
    assert emb.position_embedding.weight.grad is not None


def test_glm4v_tied_shares_parameter() -> None:
    model = build_model("glm4v-tied")
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_glm4v_moe_has_experts_and_raw_read() -> None:
    model = build_model("glm4v-moe")
    assert any(path.endswith(".experts") for path, _ in model.named_modules())
    assert type(model.model.visual.embeddings).__name__ == "Glm4vMoeVisionEmbeddings"


def test_qwen2_control() -> None:
    model = build_model("qwen2")
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_gemma3n_per_layer_embedding_used_through_forward() -> None:
    model = build_model("gemma3n")
    per_layer = model.model.embed_tokens_per_layer
    assert isinstance(per_layer, nn.Embedding)
    assert per_layer.weight.numel() > model.get_input_embeddings().weight.numel()
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    calls = []
    per_layer.register_forward_hook(lambda *a: calls.append(1))
    model(**make_batch("gemma3n")).loss.backward()
    assert calls and per_layer.weight.grad is not None


def test_fused_lmhead_reads_weight_raw() -> None:
    model = build_model("qwen2-fused-lmhead")
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    out = model(**make_batch("qwen2-fused-lmhead"))
    out.loss.backward()
    assert calls == []
    assert model.lm_head.weight.grad is not None
    # same weights and loss as the plain Qwen2 control: only the way lm_head is applied differs
    plain = build_model("qwen2")
    assert torch.allclose(plain(**make_batch("qwen2")).loss, out.loss, rtol=0, atol=1e-6)


def test_t5_shared_parameter_and_untied_head() -> None:
    model = build_model("t5-shared")
    shared = model.shared.weight
    assert model.encoder.embed_tokens.weight is shared
    assert model.decoder.embed_tokens.weight is shared
    assert model.lm_head.weight is not shared
    assert model.config.tie_word_embeddings is False
    assert model.get_input_embeddings() is model.shared


def test_unknown_name() -> None:
    with pytest.raises(FsdpCompatError, match="glm4v"):
        build_model("nope")
    with pytest.raises(FsdpCompatError, match="glm4v"):
        builder("nope")


def test_builder_is_the_unseeded_constructor_of_every_zoo_model() -> None:
    """The public accessor ``fsdp-compat plan NAME`` uses (through ``build_skeleton``): on meta, no weights."""
    for name in [*ZOO, *VISION_ZOO]:
        assert callable(builder(name)), name
    with torch.device("meta"):
        model = builder("glm4v")()
    assert type(model).__name__ == "Glm4vForConditionalGeneration" and all(p.is_meta for p in model.parameters())


# --- skeletons ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ZOO))
def test_skeleton_of_zoo_model_matches(name: str) -> None:
    skel = build_skeleton(name)
    real = build_model(name)
    assert all(p.is_meta for p in skel.parameters())
    assert {n: p.shape for n, p in skel.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}
    assert type(skel) is type(real)


def test_skeleton_from_config_file_and_folder(tmp_path) -> None:
    build_model("qwen2").config.save_pretrained(tmp_path)
    by_folder = build_skeleton(str(tmp_path))
    by_file = build_skeleton(tmp_path / "config.json")
    assert type(by_folder).__name__ == type(by_file).__name__ == "Qwen2ForCausalLM"
    assert all(p.is_meta for p in by_folder.parameters())
    data = json.loads((tmp_path / "config.json").read_text())
    data["architectures"] = ["Qwen2Model"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert type(build_skeleton(other)).__name__ == "Qwen2Model"


def test_skeleton_glm4v_from_folder(tmp_path) -> None:
    build_model("glm4v").config.save_pretrained(tmp_path)
    skel = build_skeleton(tmp_path)
    assert type(skel).__name__ == "Glm4vForConditionalGeneration"


@pytest.mark.parametrize(
    ("spec", "match"),
    [("not-a-model", "not a zoo model"), ("qwen2-7b", "reference_skeleton")],
)
def test_skeleton_bad_spec(spec: str, match: str) -> None:
    with pytest.raises(FsdpCompatError, match=match):
        build_skeleton(spec)


def test_skeleton_bad_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(FsdpCompatError, match="model_type"):
        build_skeleton(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_type_xyz"}))
    with pytest.raises(FsdpCompatError, match="cannot build a config"):
        build_skeleton(tmp_path)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_reference_skeleton(name: str) -> None:
    t = time.perf_counter()
    model = reference_skeleton(name)
    elapsed = time.perf_counter() - t
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {type(model).__name__} {n / 1e9:.2f}B params on meta in {elapsed:.2f}s")
    assert all(p.is_meta for p in model.parameters())
    assert n > 1e9


def test_reference_sizes() -> None:
    glm = reference_skeleton("glm4v")
    assert tuple(glm.model.visual.embeddings.position_embedding.weight.shape) == (576, 1536)
    gemma = reference_skeleton("gemma3n")
    assert gemma.model.embed_tokens_per_layer.weight.numel() == 262144 * 35 * 256  # 2.35B
    with pytest.raises(FsdpCompatError, match="qwen2-7b"):
        reference_skeleton("nope")


def test_the_guard_report_sees_a_rescue() -> None:
    """Control for the zoo parity runs' ``unshards == 0`` (test_core.py, probe ``guard_models:guard_report``):
    the same probe on a plan that needs the guard (GLM4V under ``legacy``) reports the run-time unshards, so a
    planner regression that the guard silently rescues fails those runs."""
    from lab.support import DEVICE, WORLD_SIZE

    from fsdp_compat.testing.parity import run_training

    result = run_training(
        "glm4v", "fsdp_compat.testing.wraps:core_legacy", steps=2, timeout_s=120, device=DEVICE,
        world_size=WORLD_SIZE, probe="lab.guard_models:guard_report",
    )
    result.raise_for_error()
    for rank in result.ranks:
        report = rank.extra["probe"]
        assert report["guards"] == 1 and report["unshards"] == 2 and len(report["events"]) == 1, report
