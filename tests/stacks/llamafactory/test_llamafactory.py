"""LLaMA-Factory (``llamafactory`` 0.9.5 from PyPI, ``--no-deps`` plus what its v1 FSDP2 engine imports): tiny
GLM4V through LLaMA-Factory's own ``fsdp2`` plugin (``DistributedPlugin("fsdp2")``, the call its v1 trainer makes,
which builds an ``FSDP2Engine`` and runs ``shard_model`` -> ``prepare_model``) on 2 gloo ranks in fresh interpreters.

No test-side engine: LLaMA-Factory's ``DistributedInterface`` builds the process group and its 2-D model mesh itself
from the torchrun variables the rank code sets (gloo and a CPU mesh on a machine without an accelerator).

Crash first with fsdp-compat off (``FSDP_COMPAT=off``), then parity with the ``.pth`` hook patching the class
attribute ``FSDP2Engine.prepare_model``: each rank trains a different batch; the reference, in every rank, does
``(ref(**batch_r).loss / 2).backward()`` for both ranks' batches, then one AdamW step; gradients and post-step
parameters are asserted ``== 0.0`` (fp32, 2 steps). A text model keeps exactly LLaMA-Factory's groups. Rank code is
``_llamafactory_ranks.py`` (this folder). Runs in the ``llamafactory095`` tox env (the only one that collects
this folder: a missing LLaMA-Factory fails).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
from _support import require_framework

from fsdp_compat.testing.core_smoke import GRID_SAMPLER_CRASH
from fsdp_compat.testing.launch import RunResult, run_ranks

require_framework(
    "LLaMA-Factory's v1 FSDP2 plugin",
    lambda: importlib.import_module("llamafactory.v1.plugins.trainer_plugins.distributed.hub"),
)

pytestmark = pytest.mark.timeout(400)

TESTS = Path(__file__).resolve().parent


def run(model: str, variants: list[str] | None = None, **env: str | None) -> RunResult:
    return run_ranks(
        "_llamafactory_ranks:engine_rank", {"model": model, "steps": 2, "variants": variants}, world_size=2,
        timeout_s=240,
        env={"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p), **env},
    )  # fmt: skip


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
    """The .pth hook patched ``FSDP2Engine.prepare_model`` on import; unpatch puts the very original function back
    on the class (so every engine, however the class was imported, calls it again); patch replaces it again."""
    from fsdp_compat.adapters import llamafactory as adapter
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    patched = vars(fsdp2.FSDP2Engine)["prepare_model"]
    assert getattr(patched, "__fsdp_compat__", False) and adapter.is_patched("llamafactory")
    assert adapter.ADAPTER.describe() == [f"{fsdp2.__name__}.FSDP2Engine.prepare_model -> fsdp-compat (policy auto)"]
    original = patched.__wrapped__
    adapter.unpatch()
    try:
        assert vars(fsdp2.FSDP2Engine)["prepare_model"] is original and not adapter.is_patched()
        assert not hasattr(original, "__fsdp_compat__")
    finally:
        assert adapter.patch() is True
    assert getattr(vars(fsdp2.FSDP2Engine)["prepare_model"], "__fsdp_compat__", False)


def test_rank_without_images_falls_out_of_step_then_trains_exactly() -> None:
    """Mixed micro-batches (rank 0 images, rank 1 text only). LLaMA-Factory 0.9.5 reads ``_no_split_modules`` only
    when it is a list, and transformers 5 makes it a set, so no vision block gets a group of its own; the tower
    sits in the root group, which in backward reduce-scatters only the parameters that got a gradient: the
    image-less rank's reduce-scatter is smaller and gloo aborts. With fsdp-compat's alignment it trains exactly."""
    off = run("glm4v", ["image", "text"], FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None, FSDP_COMPAT_MIXED_BATCHES="off")
    assert not off.ok
    text = "\n".join(f"{r.error}{r.extra.get('log_tail', '')}" for r in off.ranks)
    assert "Received data size doesn't match expected size" in text, text[-2000:]
    result = run("glm4v", ["image", "text"], FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    result.raise_for_error()
    groups = {path for group in result.ranks[0].extra["groups"] for path in group}
    assert not any(path.startswith("model.visual.") for path in groups), groups
    for rank in result.ranks:
        assert rank.extra["grad_diff"] == 0.0 and rank.extra["param_diff"] == 0.0
