"""AReaL (``areal`` 1.0.4 from PyPI, installed ``--no-deps`` plus what its FSDP engine imports): GLM4V through
AReaL's own ``parallelize_model`` (the call its FSDPEngine makes), on 2 gloo ranks in fresh interpreters.

Crash first with fsdp-compat off (``FSDP_COMPAT=off``), then exact parity with the ``.pth`` hook patching
``areal.engine.fsdp_utils.apply_fsdp2``; a text model keeps exactly AReaL's groups. Rank code is
``tests/_areal_ranks.py``. Runs in the ``areal104`` tox env (``FSDP_COMPAT_REQUIRE=areal``: missing AReaL fails).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

REQUIRED = "areal" in os.environ.get("FSDP_COMPAT_REQUIRE", "").replace(",", " ").split()
try:
    importlib.import_module("areal.engine.fsdp_utils.parallel")
except ImportError as exc:
    if REQUIRED:
        pytest.fail(f"AReaL's FSDP engine does not import: {exc} (FSDP_COMPAT_REQUIRE=areal)", pytrace=False)
    pytest.skip(f"AReaL's FSDP engine does not import: {exc}", allow_module_level=True)

from fsdp_compat.testing.harness import PARITY_TOL, run_training  # noqa: E402

pytestmark = pytest.mark.timeout(400)

TESTS = Path(__file__).resolve().parent
WRAP = "_areal_ranks:wrap_parallelize_model"


def run(model: str, **env: str | None):
    return run_training(model, WRAP, steps=2, timeout_s=240, env={"PYTHONPATH": str(TESTS), **env})


def test_glm4v_crashes_through_areal_without_fsdp_compat():
    result = run("glm4v", FSDP_COMPAT="off")
    assert not result.ok
    assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in (result.exception or ""), result.error


def test_glm4v_exact_through_areal_with_fsdp_compat():
    result = run("glm4v", FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    result.raise_for_error()
    extra = result.ranks[0].extra
    assert extra["wrap"] is True  # parallelize_model called fsdp-compat's apply_fsdp2 (rebound by name)
    assert "model.visual.embeddings.position_embedding" not in extra["fsdp_groups"]
    assert {"model.language_model.embed_tokens", "model.visual.blocks.0"} <= set(extra["fsdp_groups"])
    assert result.max_rel_grad_diff <= PARITY_TOL and result.max_rel_param_diff <= PARITY_TOL


def test_text_model_keeps_areals_groups():
    off, on = run("qwen2", FSDP_COMPAT="off"), run("qwen2", FSDP_COMPAT=None, FSDP_COMPAT_POLICY=None)
    off.raise_for_error()
    on.raise_for_error()
    assert on.ranks[0].extra["wrap"] is True and off.ranks[0].extra["wrap"] is False
    assert sorted(on.ranks[0].extra["fsdp_groups"]) == sorted(off.ranks[0].extra["fsdp_groups"])
    assert on.max_rel_param_diff <= PARITY_TOL
