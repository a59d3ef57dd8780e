"""Reliability: checkpoints survive a wrap-policy change, and bad input gets a clear error or a safe plan.

Checkpoints: two runs of 2 real gloo ranks share one folder. Run 1 trains qwen2 under ``legacy`` and glm4v under
``input-only`` (legacy crashes on glm4v) for 4 steps, with an unsharded reference, saving DCP checkpoints (model +
AdamW) at steps 2 and 4. Run 2 (fresh processes) loads the step-2 checkpoints into models built from another seed
and sharded under ``auto``, resumes to step 4, saves, and loads those into ``legacy``/``layers-only`` (qwen2) and
``input-only`` (glm4v). Everything is compared exactly: loaded tensors, state-dict keys, the full state dict that
verl/SkyRL gather, the loss trajectory. Each rank trains on its own micro-batch; the unsharded reference trains on
all the ranks' micro-batches with the mean loss, and every rank's losses and post-AdamW parameters equal it (0.0).

Patching is covered by tests/activation/test_patching.py; a rank that raises or hangs under the launcher
(``fsdp_compat.testing.launch.run_ranks``) by ``test_failing_rank_reported_fast`` and
``test_hanging_rank_times_out_and_leaves_no_process``.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from lab.checkpoints import Phase, load_full, run_phases
from lab.support import DEVICE, WORLD_SIZE
from torch import nn

from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.plan import plan_wrap, select_wrap_targets, unsafe_reads
from fsdp_compat.policies import POLICY_NAMES
from fsdp_compat.testing.parity import run_training

STEPS, SAVE_STEP = 4, 2

# ------------------------------------------------------------------------------------------------------------
# Checkpoints across policies (2 ranks, two runs)

RUN1 = [
    Phase("q_legacy", "legacy", model="qwen2", seed=0, steps=STEPS, save_at=[SAVE_STEP, STEPS], reference=True,
          rewrap=True),
    Phase("g_input", "input-only", model="glm4v", seed=0, steps=STEPS, save_at=[SAVE_STEP, STEPS], reference=True),
    Phase("t_legacy", "legacy", model="glm4v-tied", seed=0, steps=STEPS, save_at=[SAVE_STEP, STEPS],
          reference=True),
]
RUN2 = [
    Phase("q_auto", "auto", model="qwen2", seed=1, steps=STEPS, load=f"q_legacy_s{SAVE_STEP}", save_at=[STEPS]),
    Phase("q_back", "legacy", model="qwen2", seed=2, load=f"q_auto_s{STEPS}"),
    Phase("q_layers", "layers-only", model="qwen2", seed=3, load=f"q_auto_s{STEPS}"),
    Phase("q_skyrl", "legacy-skyrl", model="qwen2", seed=4, load=f"q_auto_s{STEPS}"),
    Phase("g_auto", "auto", model="glm4v", seed=1, steps=STEPS, load=f"g_input_s{SAVE_STEP}", save_at=[STEPS]),
    Phase("g_back", "input-only", model="glm4v", seed=2, load=f"g_auto_s{STEPS}"),
    Phase("t_auto", "auto", model="glm4v-tied", seed=1, steps=STEPS, load=f"t_legacy_s{SAVE_STEP}",
          save_at=[STEPS]),
    Phase("t_back", "legacy", model="glm4v-tied", seed=2, load=f"t_auto_s{STEPS}"),
]
# model -> (phase that saved at step 2 and ran uninterrupted, phase that resumed under auto)
MODELS = {"qwen2": ("q_legacy", "q_auto"), "glm4v": ("g_input", "g_auto"), "glm4v-tied": ("t_legacy", "t_auto")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    """Run both runs once; returns the folder and rank 0's per-phase records (rank 1's must agree)."""
    folder = tmp_path_factory.mktemp("dcp")
    phases: dict[str, dict[str, Any]] = {}
    for specs in (RUN1, RUN2):
        run = run_phases("qwen2", specs, folder, world_size=WORLD_SIZE, device=DEVICE, timeout_s=240)
        run.raise_for_error()
        print(f"checkpoint run {[p.tag for p in specs]}: {run.seconds:.1f}s")
        # each rank trains its own micro-batch: a phase with a reference equals one process on all of them with the
        # mean loss on every rank (losses, and parameters after every AdamW step: 0.0)
        for rank in run.ranks:
            for tag, p in rank.extra["phases"].items():
                if p["reference_losses"]:
                    assert p["losses"] == p["reference_losses"], (rank.rank, tag)
                    assert p["max_abs_param_diff"] == 0.0, (rank.rank, tag, p["worst_param"])
        for tag, p in run.ranks[0].extra["phases"].items():
            if p["losses"]:
                assert p["losses"] != run.ranks[1].extra["phases"][tag]["losses"], tag  # different data per rank
        phases.update(run.ranks[0].extra["phases"])
    return folder, phases


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Exact equality of nested state dicts (tensors bit for bit, same keys, same dtypes)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), f"keys differ at {where}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max |Δ| {float((a.float() - b.float()).abs().max())}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "loaded, saved",
    [
        ("q_auto", f"q_legacy_s{SAVE_STEP}"),  # legacy -> auto
        ("q_back", f"q_auto_s{STEPS}"),  # auto -> legacy
        ("q_layers", f"q_auto_s{STEPS}"),  # auto -> layers-only (embeddings and lm_head move to the root)
        ("q_skyrl", f"q_auto_s{STEPS}"),  # auto -> legacy-skyrl (lm_head moves to the root)
        ("g_auto", f"g_input_s{SAVE_STEP}"),  # input-only -> auto
        ("g_back", f"g_auto_s{STEPS}"),  # auto -> input-only
        ("t_auto", f"t_legacy_s{SAVE_STEP}"),  # tied: legacy (layers only) -> auto (embed_tokens + lm_head group)
        ("t_back", f"t_auto_s{STEPS}"),  # tied: auto -> legacy
    ],
)
def test_dcp_checkpoint_loads_across_policies_with_identical_tensors(
    ckpt: tuple[Path, dict[str, dict[str, Any]]], loaded: str, saved: str
) -> None:
    folder, phases = ckpt
    before = phases[loaded]["differs_before_load"]
    assert before == sorted(phases[loaded]["plain_keys"]), "the fresh model must differ before the load"
    _assert_same(load_full(folder, f"{loaded}_loaded"), load_full(folder, saved), loaded)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_state_dict_keys_identical_across_policies(ckpt: tuple[Path, dict[str, dict[str, Any]]], model: str) -> None:
    _, phases = ckpt
    prefix = MODELS[model][0].split("_")[0] + "_"
    mine = {tag: p for tag, p in phases.items() if tag.startswith(prefix)}
    assert len({str(p["groups"]) for p in mine.values()}) >= 2  # the policies shard differently
    first = next(iter(mine.values()))
    for tag, p in mine.items():
        assert p["sharded_keys"] == first["sharded_keys"], tag
        assert sorted(p["sharded_keys"]) == sorted(p["plain_keys"]), f"{tag}: FSDP2 changed the names"
        assert p["optim_keys"] == first["optim_keys"], tag
        assert {v[1] for v in p["sharded_keys"].values()} == {"DTensor"}, tag


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_full_state_dict_identical_across_policies(ckpt: tuple[Path, dict[str, dict[str, Any]]], model: str) -> None:
    """What verl/SkyRL gather for saving and weight sync: uninterrupted (saved-by policy) == resumed under auto."""
    folder, _ = ckpt
    first, resumed = MODELS[model]
    _assert_same(load_full(folder, f"{resumed}_s{STEPS}"), load_full(folder, f"{first}_s{STEPS}"), model)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_resume_under_auto_follows_the_uninterrupted_trajectory(
    ckpt: tuple[Path, dict[str, dict[str, Any]]], model: str
) -> None:
    _, phases = ckpt
    first, resumed = (phases[t] for t in MODELS[model])
    print(f"{model}: uninterrupted {first['losses']} resumed {resumed['losses']}")
    assert first["losses"] == first["reference_losses"]  # the sharded run is the unsharded one, exactly
    assert len(first["losses"]) == STEPS and resumed["loaded_step"] == SAVE_STEP
    assert resumed["losses"] == {k: v for k, v in first["losses"].items() if int(k) > SAVE_STEP}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_already_wrapped_model_is_refused_and_left_unchanged(ckpt: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    _, phases = ckpt
    record = phases["q_legacy"]
    message = record["rewrap_error"]
    assert message and message.startswith("FsdpCompatError:")
    assert "already wrapped by FSDP2" in message and "unwrapped model, once" in message
    assert record["rewrap_groups_unchanged"]
    layer = record["partial_layer"]  # fully_shard applied to one layer by the user, then apply_fsdp2
    assert record["partial_error"].startswith("FsdpCompatError: Qwen2ForCausalLM is already wrapped by FSDP2")
    assert repr(layer) in record["partial_error"] and record["partial_groups_after"] == [layer]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_precision_and_cpu_offload_pass_through_apply_fsdp2() -> None:
    """glm4v, 2 ranks, auto plan with MixedPrecisionPolicy(bf16) + CPUOffloadPolicy: trains, close to fp32."""
    w = "lab.checkpoints:"
    run = run_training(
        "glm4v", w + "auto_bf16_cpu_offload", steps=2, probe=w + "dtype_probe", world_size=WORLD_SIZE,
        device=DEVICE, timeout_s=240,
    )
    run.raise_for_error()
    for rank in run.ranks:
        assert rank.extra["probe"]["param_dtype_in_forward"] == "torch.bfloat16"
        assert rank.extra["probe"]["sharded_param_device"] == "cpu"
        rel = [abs(a - b) / abs(b) for a, b in zip(rank.losses, rank.extra["reference_losses"], strict=True)]
        assert len(rel) == 2 and max(rel) <= 1e-2, rel
    print(f"bf16+offload: loss rel. to fp32 {rel}, max rel Δparam {run.max_rel_param_diff:.3g} ({run.seconds:.1f}s)")
    assert run.max_rel_param_diff < 1e-2


def test_checkpoint_runner_rejects_bad_phases_before_spawning(tmp_path: Path) -> None:
    with pytest.raises(FsdpCompatError, match="unknown wrap policy 'no-such-policy'"):
        run_phases("qwen2", [Phase("bad", "no-such-policy")], tmp_path)
    with pytest.raises(FsdpCompatError, match="unknown zoo model 'no-such-model'"):
        run_phases("qwen2", [Phase("bad", "auto", model="no-such-model")], tmp_path)
    with pytest.raises(FsdpCompatError, match="phase 'b' loads 'a_s1', which no earlier phase saves"):
        run_phases("qwen2", [Phase("a", "auto", steps=1), Phase("b", "auto", load="a_s1")], tmp_path)


# ------------------------------------------------------------------------------------------------------------
# Bad input (single process: plans only)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Toy(nn.Module):
    """No ``config``, no ``get_input_embeddings``, no ``_no_split_modules``; ``pos`` is read raw (like GLM4V)."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.pos = nn.Embedding(4, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos.weight[: ids.shape[-1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _no_fsdp_state(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return not any(isinstance(m, FSDPModule) for m in model.modules())


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_layer_names_matching_no_module(policy: str) -> None:
    model = Toy()
    for call in (plan_wrap, select_wrap_targets):
        with pytest.raises(FsdpCompatError) as err:
            call(model, ["DecoderLayer", "NoSuchBlock"], policy=policy)
        text = str(err.value)
        assert "none of the layer classes ['DecoderLayer', 'NoSuchBlock'] matches a module of Toy" in text
        assert "fix layer_classes" in text and "Block, Embedding, Linear, ModuleList, Toy" in text
    from fsdp_compat.apply import apply_fsdp2

    with pytest.raises(FsdpCompatError, match="none of the layer classes"):
        apply_fsdp2(model, {}, ["NoSuchBlock"], policy=policy)  # raises before any fully_shard call
    assert _no_fsdp_state(model)
    assert plan_wrap(model, ["Block", "NoSuchBlock"], policy=policy).layer_classes == ("Block", "NoSuchBlock")


def test_no_layer_classes_declared() -> None:
    """auto plans with the repeated block classes (tests/core/test_auto_blocks.py); the other policies still raise."""
    assert plan_wrap(Toy()).layer_classes == ("Block",)
    with pytest.raises(FsdpCompatError, match=r"Toy declares no layer classes .*pass layer_classes=\[\.\.\.\]"):
        plan_wrap(Toy(), policy="legacy")


def test_model_without_config_plans_under_every_policy() -> None:
    """No config: the tie flag is absent, treated as untied; identity, not the flag, decides sharing."""
    model = Toy()
    plans = {p: plan_wrap(model, ["Block"], policy=p) for p in POLICY_NAMES}
    assert plans["auto"].group_paths() == [("embed",), ("layers.0",), ("layers.1",)]
    assert "pos" in {e.path for e in plans["auto"].root}  # read raw by the root: never its own group
    assert unsafe_reads(model, plans["auto"]) == []
    assert plans["legacy"].group_paths() == [("embed",), ("pos",), ("layers.0",), ("layers.1",)]
    assert any("pos.weight read raw by <root>" in p for p in unsafe_reads(model, plans["legacy"]))
    model.config = types.SimpleNamespace()  # a config without tie_word_embeddings
    assert plan_wrap(model, ["Block"]).group_paths() == plans["auto"].group_paths()


def test_tied_by_identity_without_config_keeps_sharers_together() -> None:
    model = Toy(tie=True)
    plan = plan_wrap(model, ["Block"])
    assert ("embed", "head") in plan.group_paths() and unsafe_reads(model, plan) == []
    legacy = plan_wrap(model, ["Block"], policy="legacy")
    assert any("is split across groups" in p for p in unsafe_reads(model, legacy))


def test_no_get_input_embeddings() -> None:
    """input-only finds no input embedding: it falls back to the layers (safe); auto still shards the table."""
    for model in (Toy(), _RaisingGetter()):
        plan = plan_wrap(model, ["Block"], policy="input-only")
        assert plan.group_paths() == [("layers.0",), ("layers.1",)]
        assert any("get_input_embeddings() is missing or failed" in w for w in plan.warnings), plan.warnings
        assert ("embed",) in plan_wrap(model, ["Block"]).group_paths()


class _RaisingGetter(Toy):
    def get_input_embeddings(self) -> nn.Module:
        raise NotImplementedError  # what transformers' PreTrainedModel does without a base model


@pytest.mark.parametrize("name", ["qwen2", "glm4v"])
def test_meta_device_plans_match_the_real_model(name: str) -> None:
    from fsdp_compat.testing.skeleton import build_skeleton
    from fsdp_compat.testing.zoo import build_model

    meta, real = build_skeleton(name), build_model(name)
    for policy in POLICY_NAMES:
        assert plan_wrap(meta, policy=policy).group_paths() == plan_wrap(real, policy=policy).group_paths()
    assert all(p.is_meta for p in meta.parameters())  # planning materialises nothing


# Forwards whose source cannot be read.

_NS: dict[str, Any] = {}
exec("def generated_forward(self, x):\n    return self.inner(x) + self.table.weight.sum()\n", _NS)


def _fwd(self: Any, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return self.inner(x) * scale + self.table.weight.sum()


class Reader(nn.Module):
    """Reads ``table.weight`` raw in its forward: ``table`` must never get a group of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 8)
        self.inner = Block()

    forward = _fwd


class Generated(Reader):
    forward = _NS["generated_forward"]


class Lambda(Reader):
    forward = lambda self, x: self.inner(x) + self.table.weight.sum()  # noqa: E731


class Builtin(Reader):
    forward = torch.relu  # type: ignore[assignment]


class PartialMethod(Reader):
    forward = functools.partialmethod(_fwd, scale=2.0)  # type: ignore[assignment]


def _plain_wrapper(f: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # no functools.wraps: no __wrapped__ to follow
        return f(*args, **kwargs)

    return wrapper


class Decorated(Reader):
    forward = _plain_wrapper(_fwd)


class Helper(Reader):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fwd(self, x)  # the raw read happens in a module-level helper that gets ``self``


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.gen = inner
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.gen(self.embed(ids))
        for layer in self.layers:
            h = layer(h)
        return h


def _instance_partial() -> nn.Module:
    module = Reader()
    module.forward = functools.partial(_fwd, module, scale=2.0)
    return module


OPAQUE = {
    "exec": Generated,
    "builtin": Builtin,
    "instance-partial": _instance_partial,
    "torch.jit.script": lambda: torch.jit.script(Block()),
}


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("case", sorted(OPAQUE))
def test_unreadable_forward_warns_and_plans_conservatively(case: str) -> None:
    model = Outer(OPAQUE[case]())
    plan = plan_wrap(model, ["Block"])
    if case == "torch.jit.script":
        # Nothing below the scripted Block could own a group, so the unreadable code changes nothing: no warning
        # (warnings are kept for opaque code that costs sharding, else every transformers attention would warn).
        assert plan.warnings == ()
    else:
        assert any(w.startswith("cannot read the source of gen (") for w in plan.warnings), plan.warnings
        assert "warning: cannot read the source of gen" in str(plan)
    assert not any(p.startswith("gen.") for key in plan.group_paths() for p in key)
    assert plan.group_paths() == [("embed",), ("layers.0",), ("layers.1",)]
    assert unsafe_reads(model, plan) == []
    assert [m for m in select_wrap_targets(model, ["Block"]) if m is model.gen or m in set(model.gen.modules())] == []
    if case != "torch.jit.script":  # the upstream rule ignores it and would shard what the opaque forward reads
        assert any("forward source unreadable" in p for p in unsafe_reads(model, plan_wrap(model, ["Block"],
                                                                                       policy="legacy")))


def test_unreadable_root_forward_gives_no_groups() -> None:
    class GeneratedRoot(Outer):
        forward = _NS["generated_forward"]

    model = GeneratedRoot(Reader())
    model.inner, model.table = Block(), nn.Embedding(4, 8)
    plan = plan_wrap(model, ["Block"])
    assert plan.group_paths() == [] and any("<root>" in w for w in plan.warnings)


@pytest.mark.parametrize(
    "cls",
    [PartialMethod, Decorated, Helper, Lambda],
    ids=["partialmethod", "decorator-without-wraps", "helper-function", "lambda"],
)
def test_wrapped_forward_is_analysed_or_opaque(cls: type[nn.Module]) -> None:
    """The code that reads gen.table.weight is followed (a helper called with self) or the module is opaque."""
    model = Outer(cls())
    plan = plan_wrap(model, ["Block"])
    assert ("gen.table",) not in plan.group_paths()
    assert unsafe_reads(model, plan) == []


# ------------------------------------------------------------------------------------------------------------
# peft (a dependency of the core env)


def test_peft_lora_with_modules_to_save() -> None:
    from peft import LoraConfig, get_peft_model

    from fsdp_compat.testing.zoo import build_model

    model = get_peft_model(
        build_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    )
    wrapper = "base_model.model.lm_head"
    assert type(dict(model.named_modules())[wrapper]).__name__ == "ModulesToSaveWrapper"
    layers = [("base_model.model.model.layers.0",), ("base_model.model.model.layers.1",)]
    for policy in POLICY_NAMES:
        plan = plan_wrap(model, policy=policy)
        assert all(key in plan.group_paths() for key in layers), policy
        assert unsafe_reads(model, plan) == [], policy
        # the frozen original and the trainable copy are never split into different groups
        assert not any(p.startswith(wrapper + ".") for key in plan.group_paths() for p in key), policy
    assert (wrapper,) in plan_wrap(model, policy="legacy").group_paths()  # upstream's by-name rule
    auto = plan_wrap(model)
    assert (wrapper,) not in auto.group_paths() and not auto.warnings  # no own params: stays in the root
