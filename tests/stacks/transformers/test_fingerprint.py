"""Forward compatibility by fingerprint on transformers' real code (``fsdp_compat.fingerprints``).

The installed release's fingerprint is the one recorded in ``fsdp_compat/fingerprints.json`` (the file cannot go
stale). A release newer than the tested range is simulated by a ``transformers-5.99.0.dist-info`` placed first on the
ranks' ``PYTHONPATH`` (``importlib.metadata`` reports 5.99.0 over the installed code): unpatched (``FSDP_COMPAT=off``)
the GLM4V user plan crashes in ``grid_sampler_2d``; with fsdp-compat installed the ``.pth`` hook patches it by
fingerprint, logs so, and the run trains at exact parity. A changed recorded fingerprint leaves transformers exactly as
it is, with one warning naming the change. Runs in the ``hf524`` / ``hf525`` / ``newest-transformers`` tox envs.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from importlib import metadata
from pathlib import Path

import pytest
from lab.support import require_framework

fsdp_module = require_framework(
    "transformers' native FSDP2", lambda: importlib.import_module("transformers.distributed.fsdp")
)

from fsdp_compat.adapters import ADAPTERS  # noqa: E402
from fsdp_compat.adapters import transformers as adapter  # noqa: E402
from lab.transformers_smoke import GLM4V_USER_PLAN, run_native, save_tiny  # noqa: E402
from packaging.version import Version  # noqa: E402

from fsdp_compat import fingerprints  # noqa: E402
from fsdp_compat.activation import Adapter, FsdpCompatWarning  # noqa: E402

pytestmark = pytest.mark.timeout(300)

NEWER = "5.99.0"
INSTALLED = metadata.version("transformers")


def test_installed_release_has_its_recorded_fingerprint():
    """Recorded by ``python -m fsdp_compat.fingerprints record transformers`` in this env; equal to what its code
    gives now. A newer-than-tested release (the ``newest-transformers`` canary) has no record of its own: its verdict
    against the newest tested release is printed instead, and must be "patched by fingerprint" for the tests below."""
    spec = ADAPTERS["transformers"].supported["transformers"]
    recorded = fingerprints.recorded("transformers")
    if INSTALLED not in recorded:
        verdict = fingerprints.judge("transformers", Version(INSTALLED), spec)
        assert verdict is not None and verdict.unchanged, verdict
        return
    before = recorded[INSTALLED]
    watched = [(k.partition(":")[0], k.partition(":")[2], v["watched"]) for k, v in before.items()]
    assert fingerprints.compute(watched) == before
    assert "transformers.distributed.fsdp:apply_fully_sharded_data_parallelism" in before
    assert before["transformers.distributed.fsdp:apply_fully_sharded_data_parallelism"]["importers"] == [
        "transformers.distributed.mixin"
    ]


@pytest.fixture(scope="module")
def newer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The ranks' environment for a transformers that reports 5.99.0 (its dist-info first on PYTHONPATH)."""
    root = tmp_path_factory.mktemp("newer")
    info = root / f"transformers-{NEWER}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {NEWER}\n")
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([str(root), *inherited])}


@pytest.fixture(scope="module")
def glm4v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("glm4v", tmp_path_factory.mktemp("tiny"))


def test_newer_version_over_unchanged_code_crashes_unpatched_then_trains_exactly(newer, glm4v):
    off = run_native("glm4v", glm4v, fsdp_plan=GLM4V_USER_PLAN, env={**newer, "FSDP_COMPAT": "off"})
    assert not off.ok
    assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in (off.exception or ""), off.error
    run = run_native(
        "glm4v", glm4v, fsdp_plan=GLM4V_USER_PLAN, env={**newer, "FSDP_COMPAT": None, "FSDP_COMPAT_POLICY": None}
    )
    run.raise_for_error()
    assert run.max_abs_grad_diff == 0.0 and run.max_abs_param_diff == 0.0
    for rank in run.ranks:
        assert rank.losses == rank.extra["reference_losses"]
    assert ["model.visual.embeddings.position_embedding"] not in run.ranks[0].extra["fsdp_groups"]
    log = run.ranks[0].extra.get("log_tail", "")
    newest = fingerprints.newest_tested("transformers", ADAPTERS["transformers"].supported["transformers"])
    assert (
        f"fsdp-compat: transformers {NEWER} is newer than the tested range (transformers "
        f"{ADAPTERS['transformers'].supported['transformers']}); what fsdp-compat replaces is unchanged from "
        f"{newest} (fingerprint), patched"
    ) in log, log[-3000:]


def test_newer_version_with_a_changed_signature_is_left_alone(tmp_path, monkeypatch):
    """The recorded signature of the newest tested release differs from the installed code's: an adapter for 5.99.0
    replaces nothing (transformers' own objects stay in the definer and the mixin), with one warning naming it."""
    from transformers.distributed import mixin

    data = fingerprints.load()
    newest = str(fingerprints.newest_tested("transformers", ADAPTERS["transformers"].supported["transformers"]))
    changed = json.loads(json.dumps(data))
    target = changed["transformers"][newest]["transformers.distributed.fsdp:apply_fully_sharded_data_parallelism"]
    target["signature"] = target["code"] = "0" * 16
    path = tmp_path / "fingerprints.json"
    path.write_text(json.dumps(changed))
    shipped = fingerprints.DATA
    monkeypatch.setattr(fingerprints, "DATA", path)
    fingerprints.clear_cache()

    class Newer(Adapter):
        def version_of(self, distribution):
            return Version(NEWER)

    before = (fsdp_module.apply_fully_sharded_data_parallelism, mixin.apply_fully_sharded_data_parallelism)
    fresh = Newer("transformers", adapter.RELEASES)
    try:
        with pytest.warns(FsdpCompatWarning) as caught:
            assert not fresh.patch(distribution="transformers")
        (warning,) = [w for w in caught if issubclass(w.category, FsdpCompatWarning)]
        assert (
            f"transformers {NEWER} is newer than the tested range" in str(warning.message)
            and f"changed since {newest}: transformers.distributed.fsdp.apply_fully_sharded_data_parallelism: "
            "signature changed" in str(warning.message)
        ), str(warning.message)
        assert (fsdp_module.apply_fully_sharded_data_parallelism, mixin.apply_fully_sharded_data_parallelism) == before
        assert not fresh.is_patched()
        monkeypatch.setattr(fingerprints, "DATA", shipped)  # the shipped record: the same release is unchanged
        fingerprints.clear_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error", FsdpCompatWarning)
            assert Newer("transformers", adapter.RELEASES).fingerprint_verdict("transformers", Version(NEWER)).unchanged
    finally:
        fresh.unpatch()
        fingerprints.clear_cache()
