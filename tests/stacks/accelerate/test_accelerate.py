"""accelerate (``accelerate`` from PyPI, 1.15.x / 1.16.x): tiny GLM4V and Qwen2.5-VL through accelerate's own
``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)).prepare(model, optimizer)`` (its
``_prepare_fsdp2`` -> ``fsdp2_prepare_model``, the HF Trainer's and TRL's FSDP2 path), ``accelerator.backward`` and
the prepared optimizer, on 2 gloo ranks in fresh interpreters.

accelerate takes FSDP only on a GPU-type distributed state; the rank code
(``lab.stacks.accelerate_ranks``, its docstring) builds accelerate's ``PartialState`` as a CPU job (gloo, CPU
device) and sets its shared ``distributed_type`` to
``MULTI_GPU`` before the ``Accelerator`` exists: nothing of accelerate is replaced or mocked.

Rank 0 trains an image batch, rank 1 a text-only one. With ``FSDP_COMPAT=off`` the vision blocks' groups (accelerate
gives every ``_no_split_modules`` block one) are all-gathered on rank 0 only and gloo aborts ("Received data size
doesn't match expected size"); with fsdp-compat installed (the ``.pth`` hook patches ``fsdp2_prepare_model`` when
accelerate is imported) both ranks equal one process training on both batches with the mean loss: gradients after
each backward and parameters after each AdamW step ``== 0.0`` (fp32, 2 steps), with accelerate's own groups. Runs in
the ``accelerate115`` / ``accelerate116`` tox envs (the only ones that collect this folder: a missing accelerate
fails).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from typing import Any

import pytest
from lab.families import assert_held
from lab.stack_families import HELD, STACKS
from lab.support import OFF, ON, rank_output, rank_pythonpath, require_framework
from packaging.version import Version

from fsdp_compat.policies import Auto
from fsdp_compat.testing.crashes import GLOO_MISMATCH, GRID_SAMPLER_CRASH

require_framework("accelerate", lambda: importlib.import_module("accelerate.utils.fsdp_utils"))

from fsdp_compat.testing.launch import RunResult, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(400)

ACCELERATE = metadata.version("accelerate")
#: the modules that bind ``fsdp2_prepare_model`` by name (oracle: grep of accelerate 1.15.0 and 1.16.0)
BINDINGS = ["accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator"]
ACTIVATED = f"fsdp-compat: patched accelerate {ACCELERATE} (policy auto, activated by pth-hook)"
PASSED = "FSDP2 groups below the root pass fsdp-compat's safety check (kept as they are)"
#: accelerate's own selection for the zoo's VLMs (its rule, written here again): every ``_no_split_modules`` block,
#: the untied input embedding, the tail ``[final norm, lm_head]`` (no final norm directly under ``model``: lm_head
#: alone), the root. The vision position table (read raw by its parent) stays in the root.
VLM_GROUPS = [
    [""],
    ["model.visual.blocks.0"],
    ["model.visual.blocks.1"],
    ["model.language_model.embed_tokens"],
    ["model.language_model.layers.0"],
    ["model.language_model.layers.1"],
    ["lm_head"],
]


def run(model: str, variants: list[str], env: dict[str, str | None], **cfg: Any) -> RunResult:
    return run_ranks(
        "lab.stacks.accelerate_ranks:accelerate_rank",
        {"model": model, "steps": 2, "variants": variants, "bindings": BINDINGS, **cfg},
        world_size=2,
        timeout_s=240,
        env={"PYTHONPATH": rank_pythonpath(), **env},
    )


def _assert_exact(result: RunResult) -> None:
    """Ran on every rank (else every failing rank's traceback), patched, exact against one process."""
    result.raise_for_error()
    for rank in result.ranks:
        extra = rank.extra
        print(
            f"rank {rank.rank}: Δgrad {extra['grad_diff']} Δparam {extra['param_diff']} losses {extra['losses']} "
            f"mixed batches {extra['mixed_batches']} guard unshards {extra['guard_unshards']}"
        )
        assert extra["patched"] == [True, True, True]  # every by-name binding is fsdp-compat's
        assert extra["log"][0].startswith(ACTIVATED), extra["log"]
        assert extra["grad_diff"] == 0.0, extra["worst_grad_param"]  # NaN fails too
        assert extra["param_diff"] == 0.0, extra["worst_param"]
        assert extra["losses"] == extra["reference_losses"]  # each rank's loss is the reference's on its batch


@pytest.mark.parametrize("model", ["glm4v", "qwen2.5-vl"])
def test_rank_without_images_crashes_then_trains_exactly_through_accelerate(model: str) -> None:
    """Rank 0 images, rank 1 text only. Unpatched: gloo aborts on the collective mismatch. Patched: accelerate's own
    groups, rank 1 runs the vision tower on a zero dummy once per forward, and both ranks are exact (0.0)."""
    variants = ["image", "text"]
    off = run(model, variants, OFF)
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert GLOO_MISMATCH in rank_output(off), rank_output(off)[-4000:]
    assert all(r.extra["patched"] == [False, False, False] for r in off.ranks if "patched" in r.extra)

    on = run(model, variants, ON)
    _assert_exact(on)
    for rank in on.ranks:
        assert rank.extra["groups"] == VLM_GROUPS  # accelerate's selection, kept
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [2, 2]
    assert [r.extra["guard_unshards"] for r in on.ranks] == [0, 0]  # accelerate's grouping is safe: guard idle
    assert any(PASSED in line for line in on.ranks[0].extra["log"]), on.ranks[0].extra["log"]
    assert on.ranks[0].extra["losses"] != on.ranks[1].extra["losses"]  # each rank its own batch


#: One family of every other tower kind that the installed transformers has (lab.stack_families: 5.10.4 in the
#: accelerate envs, 5.25 in ``accelerate116-families``), the patch grid being GLM4V's and Qwen2.5-VL's above.
NEWER_TRANSFORMERS = Version(metadata.version("transformers")) >= Version("5.25")
STACK = "accelerate-transformers-5.25" if NEWER_TRANSFORMERS else "accelerate"
KIND_FAMILIES = STACKS[STACK]
#: Where the unpatched run crashes before any mismatch: Gemma4's per-layer-input read of a sharded weight (as in
#: transformers' own Gemma4 plan, tests/stacks/transformers).
UNPATCHED_CRASH = {"lab.vlms:gemma4": "aten.where.self got mixed torch.Tensor and DTensor"}


@pytest.mark.parametrize("model", [pytest.param(m, id=kind) for kind, m in KIND_FAMILIES.items()])
def test_every_tower_kind_rank_without_images_crashes_then_trains_exactly_through_accelerate(model: str) -> None:
    """As above, for one family of each tower kind, with accelerate's own groups (its ``_no_split_modules`` rule
    gives the family's vision blocks groups of their own): unpatched, gloo aborts (Gemma4: its own wrap crash
    first); patched, rank 1 runs one dummy tower call per forward and both ranks are exact (0.0)."""
    variants = ["image", "text"]
    off = run(model, variants, OFF)
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert UNPATCHED_CRASH.get(model, GLOO_MISMATCH) in rank_output(off), rank_output(off)[-4000:]

    on = run(model, variants, ON)
    _assert_exact(on)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [2, 2]
    assert on.ranks[0].extra["losses"] != on.ranks[1].extra["losses"]  # each rank its own batch


#: The kinds FSDP2 alone does not train at 0.0 (lab.stack_families.HELD), on the installed transformers (5.10.4 has
#: none that accelerate can shard: the accelerate115/116 envs deselect this test).
HELD_FAMILIES = HELD.get(STACK, {})


@pytest.mark.parametrize("model", [pytest.param(m, id=kind) for kind, m in HELD_FAMILIES.items()])
def test_inexact_tower_kind_crashes_then_stays_within_fsdp2s_own_distance_through_accelerate(model: str) -> None:
    """For a kind whose all-image FSDP2 run is not exact: unpatched, image|text aborts; patched, the all-image run
    (both ranks images: no dummy, FSDP2's own arithmetic) is measured first, and the image|text run, with one dummy
    tower call per forward on rank 1, is held to the all-image run (:func:`~lab.families.assert_held`)."""
    off = run(model, ["image", "text"], OFF)
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert GLOO_MISMATCH in rank_output(off), rank_output(off)[-4000:]

    alone, on = run(model, ["image", "image"], ON), run(model, ["image", "text"], ON)
    for result, dummies in ((alone, [0, 0]), (on, [0, 2])):
        result.raise_for_error()
        assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == dummies
        assert all(r.extra["patched"] == [True, True, True] for r in result.ranks)
    diffs = [tuple(max(r.extra[w] for r in res.ranks) for w in ("grad_diff", "param_diff")) for res in (alone, on)]
    assert_held(model, *diffs)


def test_text_model_keeps_accelerates_groups() -> None:
    """Qwen2: accelerate's layers, input embedding and ``[model.norm, lm_head]`` tail group, the same with and
    without fsdp-compat, both exact; the adapter's check passes (the tail keeps its ``reshard_after_forward=False``)."""
    off, on = run("qwen2", ["text", "text"], OFF), run("qwen2", ["text", "text"], ON)
    off.raise_for_error()
    _assert_exact(on)
    assert off.ranks[0].extra["patched"] == [False, False, False] and off.ranks[0].extra["log"] == []
    assert on.ranks[0].extra["groups"] == off.ranks[0].extra["groups"]
    assert ["model.norm", "lm_head"] in on.ranks[0].extra["groups"]
    assert off.ranks[0].extra["grad_diff"] == 0.0 and off.ranks[0].extra["param_diff"] == 0.0
    assert any(PASSED in line for line in on.ranks[0].extra["log"]), on.ranks[0].extra["log"]


def test_unsafe_wrap_list_is_kept_with_a_warning_and_the_guard_rescues_it() -> None:
    """A user's ``transformer_cls_names_to_wrap`` that names ``Embedding`` makes accelerate give GLM4V's vision
    position table a group of its own: unpatched, the grid_sampler crash. Patched, accelerate's grouping is kept as
    it is (nothing is taken from a working job), one warning on rank 0 names the group and the raw read, and the
    run-time guard unshards the table where it is read: exact, image|text ranks included."""
    plugin = {"transformer_cls_names_to_wrap": ["Glm4vVisionBlock", "Glm4vTextDecoderLayer", "Embedding"]}
    off = run("glm4v", ["image", "image"], OFF, plugin=plugin)
    assert not off.ok and GRID_SAMPLER_CRASH in (off.exception or ""), off.error

    on = run("glm4v", ["image", "text"], ON, plugin=plugin)
    _assert_exact(on)
    table = "model.visual.embeddings.position_embedding"
    assert [table] in on.ranks[0].extra["groups"]  # accelerate's group, kept
    warning = [line for line in on.ranks[0].extra["log"] if "safety check cannot show" in line]
    assert len(warning) == 1 and f"{table} ({table}.weight read raw by model.visual.embeddings" in warning[0]
    assert not any("safety check" in line for line in on.ranks[1].extra["log"])  # rank 0 only
    assert all(r.extra["guard_unshards"] == 2 for r in on.ranks)  # one per forward (rank 1: in its dummy)


def test_every_binding_is_patched_and_restored_exactly() -> None:
    """In this process the ``.pth`` hook patched accelerate when it was imported: the definer and both by-name
    importers hold fsdp-compat's function; unpatch puts the very original back everywhere; patch replaces it
    again."""
    import accelerate.accelerator  # noqa: F401  (loads the definer and both importers)
    from fsdp_compat.adapters import accelerate as adapter

    modules = [sys.modules[name] for name in BINDINGS]
    patched = modules[0].fsdp2_prepare_model
    assert getattr(patched, "__fsdp_compat__", False) and adapter.is_patched("accelerate")
    assert all(m.fsdp2_prepare_model is patched for m in modules)
    assert adapter.ADAPTER.activated_by == "pth-hook"
    assert sorted(adapter.ADAPTER.describe()) == sorted(
        f"{name}.fsdp2_prepare_model -> fsdp-compat (policy auto)" for name in BINDINGS
    )
    original = patched.__wrapped__
    adapter.unpatch()
    try:
        assert all(m.fsdp2_prepare_model is original for m in modules) and not adapter.is_patched()
        assert not hasattr(original, "__fsdp_compat__") and original.__module__ == "accelerate.utils.fsdp_utils"
    finally:
        assert adapter.patch() is True
    again = modules[0].fsdp2_prepare_model
    assert getattr(again, "__fsdp_compat__", False) and all(m.fsdp2_prepare_model is again for m in modules)


def test_adapter_imported_after_accelerate_rebinds_the_importers() -> None:
    """Without the ``.pth`` hook (``FSDP_COMPAT_AUTOLOAD=0``) accelerate loads unpatched; ``import
    fsdp_compat.adapters.accelerate`` afterwards (a custom entry point) rebinds the definer and both importers."""
    code = textwrap.dedent(
        f"""
        import logging, sys
        logging.getLogger("fsdp_compat").setLevel(logging.DEBUG)  # patch time logs at DEBUG (INFO: at first call)
        import accelerate
        names = {BINDINGS!r}
        assert not any(getattr(sys.modules[n].fsdp2_prepare_model, "__fsdp_compat__", False) for n in names)
        import fsdp_compat.adapters.accelerate as adapter
        assert all(getattr(sys.modules[n].fsdp2_prepare_model, "__fsdp_compat__", False) for n in names)
        print(adapter.ADAPTER.activated_by)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COMPAT")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**env, "FSDP_COMPAT_AUTOLOAD": "0"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "import"
    # what was patched, logged at DEBUG now; its INFO line waits for the first call of fsdp2_prepare_model
    logged = [line for line in done.stderr.splitlines() if "fsdp-compat: patched accelerate" in line]
    assert len(logged) == 1, done.stderr
    assert f"fsdp-compat: patched accelerate {ACCELERATE} (policy auto, activated by import)" in logged[0]
    assert "(logged at INFO when first used)" in logged[0], logged


def test_replacement_passes_every_argument_and_the_result_through() -> None:
    """A grown signature (a new positional or keyword argument) reaches accelerate's own function unchanged, and its
    result comes back; on an unsharded model the run-time layer is installed all the same (it finds the groups at
    the first forward)."""
    import torch
    from fsdp_compat.adapters.accelerate import make_fsdp2_prepare_model

    from fsdp_compat.runtime.guard import guard_of

    calls = []

    def fsdp2_prepare_model(accelerator: Any, model: Any, extra: Any = None, *, new_keyword: Any = None) -> Any:
        calls.append((accelerator, model, extra, new_keyword))
        return model

    replacement = make_fsdp2_prepare_model(fsdp2_prepare_model, Auto())
    model, accelerator = torch.nn.Linear(2, 2), object()
    assert replacement(accelerator, model, "x", new_keyword=3) is model
    assert replacement(accelerator, model=model) is model
    assert calls == [(accelerator, model, "x", 3), (accelerator, model, None, None)]
    assert guard_of(model) is not None


def test_supported_range_is_the_releases_run_here() -> None:
    """The index row (``>=1.15.0,<1.17``) covers the releases these tests ran on (1.15.0 and 1.16.0, tox envs
    ``accelerate115`` / ``accelerate116``) and each has its table row; 1.14 (another tied-embedding tail group) and
    1.17 (not released at the time of writing) are outside; the installed release is inside."""
    from fsdp_compat.adapters import ADAPTERS
    from fsdp_compat.adapters import accelerate as adapter

    assert ADAPTERS["accelerate"].triggers == {"accelerate.utils.fsdp_utils": "accelerate"}
    for raw in ("1.15.0", "1.16.0"):
        assert adapter.ADAPTER.is_supported("accelerate", Version(raw))
        row = adapter.ADAPTER.release_for("accelerate", Version(raw))
        assert row is not None and row.importers == ("accelerate.utils", "accelerate.accelerator")
    for raw in ("1.14.0", "1.17.0"):
        assert not adapter.ADAPTER.is_supported("accelerate", Version(raw))
    assert adapter.ADAPTER.is_supported("accelerate", Version(ACCELERATE))
