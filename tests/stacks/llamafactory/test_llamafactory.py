"""LLaMA-Factory (``llamafactory`` 0.9.5 from PyPI, ``--no-deps`` plus what its v1 FSDP2 engine imports): tiny
GLM4V through LLaMA-Factory's own ``fsdp2`` plugin (``DistributedPlugin("fsdp2")``, the call its v1 trainer makes,
which builds an ``FSDP2Engine`` and runs ``shard_model`` -> ``prepare_model``) on 2 gloo ranks in fresh interpreters.

No test-side engine: LLaMA-Factory's ``DistributedInterface`` builds the process group and its 2-D model mesh itself
from the torchrun variables the rank code sets (gloo and a CPU mesh on a machine without an accelerator).

Crash first with fsdp-compat off (``FSDP_COMPAT=off``), then parity with the ``.pth`` hook patching the class
attribute ``FSDP2Engine.prepare_model``: each rank trains a different batch; the reference, in every rank, does
``(ref(**batch_r).loss / 2).backward()`` for both ranks' batches, then one AdamW step; gradients and post-step
parameters are asserted ``== 0.0`` (fp32, 2 steps). A text model keeps exactly LLaMA-Factory's groups. Rank code is
``tests/lab/stacks/llamafactory_ranks.py``. Runs in the ``llamafactory095`` tox env (the only one that collects
this folder: a missing LLaMA-Factory fails).

LLaMA-Factory main (unreleased, 0.9.6.dev0) grew the engine: ``prepare_model(self, model, ignored_params=None)``,
called with ``ignored_params=`` by ``FSDPTurboFSDP2Engine``, a *set* of layer classes with the vision blocks, and
a bf16 norms step. ``lab.stacks.llamafactory_main`` is that engine's shape (read at ff6d4d1; see its docstring), run
with 0.9.5's real ``DistributedInterface`` under the real module's name and patched by the adapter's own table:
the same crash first, then the same exactness.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
from lab.support import rank_pythonpath, require_framework

from fsdp_compat.testing.core_smoke import GRID_SAMPLER_CRASH
from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RunResult, current_wording, run_ranks

require_framework(
    "LLaMA-Factory's v1 FSDP2 plugin",
    lambda: importlib.import_module("llamafactory.v1.plugins.trainer_plugins.distributed.hub"),
)

pytestmark = pytest.mark.timeout(400)



def run(model: str, variants: list[str] | None = None, *, body: str = "engine_rank", cfg: dict[str, Any] | None = None,
        **env: str | None) -> RunResult:
    return run_ranks(
        f"lab.stacks.llamafactory_ranks:{body}", {"model": model, "steps": 2, "variants": variants, **(cfg or {})},
        world_size=2, timeout_s=240,
        env={"PYTHONPATH": rank_pythonpath(), **env},
    )  # fmt: skip


def run_main(model: str, engine: str, variants: list[str] | None = None, **cfg_env: Any) -> RunResult:
    """Through main's engine shape: ``engine`` "fsdp2" or "fsdpturbo"; ``ignored`` / ``bf16`` go to the rank code,
    the rest to the environment."""
    cfg = {"engine": engine, **{k: cfg_env.pop(k) for k in ("ignored", "bf16") if k in cfg_env}}
    return run(model, variants, body="main_engine_rank", cfg=cfg, **cfg_env)


ON = {"FSDP_COMPAT": None, "FSDP_COMPAT_POLICY": None}


def test_glm4v_crashes_through_llamafactory_without_fsdp_compat() -> None:
    result = run("glm4v", FSDP_COMPAT="off")
    assert not result.ok
    assert GRID_SAMPLER_CRASH in (result.exception or ""), result.error


def test_glm4v_exact_through_llamafactory_with_fsdp_compat() -> None:
    result = run("glm4v", FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    result.raise_for_error()
    for rank in result.ranks:
        extra = rank.extra
        print(f"rank {rank.rank}: groups {extra['groups']}; Δgrad {extra['grad_diff']} Δparam {extra['param_diff']}")
        assert extra["patched"] is True  # the .pth hook replaced FSDP2Engine.prepare_model
        groups = {path for group in extra["groups"] for path in group}
        assert "model.visual.embeddings.position_embedding" not in groups  # read raw by its parent: in the root
        assert "model.language_model.embed_tokens" in groups  # the rest of LLaMA-Factory's selection stays
        assert extra["grad_diff"] == 0.0 and extra["param_diff"] == 0.0  # NaN fails too


def test_text_model_keeps_llamafactorys_groups() -> None:
    off, on = run("qwen2", FSDP_COMPAT="off"), run("qwen2", FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    off.raise_for_error()
    on.raise_for_error()
    assert on.ranks[0].extra["patched"] is True and off.ranks[0].extra["patched"] is False
    assert sorted(on.ranks[0].extra["groups"]) == sorted(off.ranks[0].extra["groups"])
    assert any(".layers." in group[0] for group in on.ranks[0].extra["groups"])  # its layer class was sharded
    assert on.ranks[0].extra["grad_diff"] == 0.0 and on.ranks[0].extra["param_diff"] == 0.0


def test_the_class_attribute_is_patched_and_restored_exactly() -> None:
    """The .pth hook patched ``FSDP2Engine.prepare_model`` and the module's ``fully_shard`` on import; unpatch puts
    the very original objects back (so every engine, however the class was imported, calls LLaMA-Factory's own
    method again); patch replaces them again."""
    from fsdp_compat.adapters import llamafactory as adapter
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    patched = vars(fsdp2.FSDP2Engine)["prepare_model"]
    assert getattr(patched, "__fsdp_compat__", False) and adapter.is_patched("llamafactory")
    assert adapter.ADAPTER.describe() == [
        f"{fsdp2.__name__}.{name} -> fsdp-compat (policy auto)" for name in ("fully_shard", "FSDP2Engine.prepare_model")
    ]
    original, fully_shard = patched.__wrapped__, fsdp2.fully_shard.__wrapped__
    adapter.unpatch()
    try:
        assert vars(fsdp2.FSDP2Engine)["prepare_model"] is original and not adapter.is_patched()
        assert fsdp2.fully_shard is fully_shard and not hasattr(original, "__fsdp_compat__")
        from torch.distributed.fsdp import fully_shard as torchs

        assert fully_shard is torchs
    finally:
        assert adapter.patch() is True
    assert getattr(vars(fsdp2.FSDP2Engine)["prepare_model"], "__fsdp_compat__", False)
    assert getattr(fsdp2.fully_shard, "__fsdp_compat__", False)


def test_rank_without_images_falls_out_of_step_then_trains_exactly() -> None:
    """Mixed micro-batches (rank 0 images, rank 1 text only). LLaMA-Factory 0.9.5 reads ``_no_split_modules`` only
    when it is a list, and transformers 5 makes it a set, so no vision block gets a group of its own; the tower
    sits in the root group, which in backward reduce-scatters only the parameters that got a gradient: the
    image-less rank's reduce-scatter is smaller and gloo aborts. With fsdp-compat's alignment it trains exactly."""
    off = run("glm4v", ["image", "text"], FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None, FSDP_COMPAT_MIXED_BATCHES="off")
    assert not off.ok
    text = "\n".join(f"{r.error}{r.extra.get('log_tail', '')}" for r in off.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-2000:]
    result = run("glm4v", ["image", "text"], FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    result.raise_for_error()
    groups = {path for group in result.ranks[0].extra["groups"] for path in group}
    assert not any(path.startswith("model.visual.") for path in groups), groups
    for rank in result.ranks:
        assert rank.extra["grad_diff"] == 0.0 and rank.extra["param_diff"] == 0.0


# ------------------------------------------------------------------------- LLaMA-Factory main's engine shape


@pytest.mark.parametrize("engine", ["fsdp2", "fsdpturbo"])
def test_glm4v_crashes_through_mains_engine_without_fsdp_compat(engine: str) -> None:
    result = run_main("glm4v", engine, FSDP_COMPAT="off")
    assert not result.ok
    assert GRID_SAMPLER_CRASH in (result.exception or ""), result.error


def test_glm4v_exact_through_mains_turbo_engine_with_its_ignored_params() -> None:
    """``FSDPTurboFSDP2Engine.prepare_model`` -> ``super().prepare_model(model, ignored_params=...)`` (0.9.5's
    signature: TypeError). The engine's set of classes is sharded (vision blocks and text layers), its ignored
    parameters stay plain tensors in every group, the raw-read table stays in the root; exact."""
    result = run_main("glm4v", "fsdpturbo", ignored=["model.visual.patch_embed"], **ON)
    result.raise_for_error()
    for rank in result.ranks:
        extra = rank.extra
        print(f"rank {rank.rank}: groups {extra['groups']}; Δgrad {extra['grad_diff']} Δparam {extra['param_diff']}")
        assert extra["patched"] is True
        groups = {path for group in extra["groups"] for path in group}
        assert {"model.visual.blocks.0", "model.language_model.layers.0", "model.language_model.embed_tokens"} <= groups
        assert "model.visual.embeddings.position_embedding" not in groups
        assert extra["ignored_kinds"] == ["Parameter"]  # not DTensor: the keyword reached every fully_shard
        assert extra["grad_diff"] == 0.0 and extra["param_diff"] == 0.0  # NaN fails too


def test_text_model_keeps_mains_groups() -> None:
    off, on = run_main("qwen2", "fsdp2", FSDP_COMPAT="off"), run_main("qwen2", "fsdp2", **ON)
    off.raise_for_error()
    on.raise_for_error()
    assert on.ranks[0].extra["patched"] is True and off.ranks[0].extra["patched"] is False
    assert sorted(on.ranks[0].extra["groups"]) == sorted(off.ranks[0].extra["groups"])
    assert any(".layers." in group[0] for group in on.ranks[0].extra["groups"])  # its set of classes was sharded
    assert on.ranks[0].extra["grad_diff"] == 0.0 and on.ranks[0].extra["param_diff"] == 0.0


def test_rank_without_images_through_mains_vision_block_groups() -> None:
    """main gives every vision block a group: rank 1 (text only) never all-gathers them and gloo aborts unless the
    vision tower still runs there (fsdp-compat's alignment); then exact."""
    off = run_main("glm4v", "fsdp2", ["image", "text"], **ON, FSDP_COMPAT_MIXED_BATCHES="off")
    assert not off.ok
    text = "\n".join(f"{r.error}{r.extra.get('log_tail', '')}" for r in off.ranks)
    assert GLOO_MISMATCH in current_wording(text), text[-2000:]
    result = run_main("glm4v", "fsdp2", ["image", "text"], **ON)
    result.raise_for_error()
    groups = {path for group in result.ranks[0].extra["groups"] for path in group}
    assert "model.visual.blocks.0" in groups and "model.visual.embeddings.position_embedding" not in groups
    for rank in result.ranks:
        assert rank.extra["grad_diff"] == 0.0 and rank.extra["param_diff"] == 0.0


def test_mains_bf16_norms_step_runs_inside_its_own_prepare_model() -> None:
    """Gradient checkpointing under bf16: main's ``prepare_model`` hooks every ``nn.LayerNorm`` (GLM4V's merger
    norm); with fsdp-compat that step is the engine's own and still runs; training steps stay finite."""
    result = run_main("glm4v", "fsdp2", bf16=True, **ON)
    result.raise_for_error()
    for rank in result.ranks:
        assert rank.extra["patched"] is True
        assert rank.extra["hooked_norms"] == ["model.visual.merger.post_projection_norm"]
        assert len(rank.extra["losses"]) == 2 and all(math.isfinite(x) for x in rank.extra["losses"])
