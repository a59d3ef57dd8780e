"""NeMo Automodel (``nemo-automodel`` from PyPI, 0.7.0): tiny GLM4V and Qwen2.5-VL through NeMo's own FSDP2 entry
point ``parallelize_model(model, MeshContext.build(FSDP2Config(...)))`` (its ``ModelParallelizer._apply`` ->
``apply_fsdp2_sharding_recursively``, the embeddings, the root;
``lab.stacks.nemo_automodel_ranks`` says what runs), on 2 gloo ranks in fresh interpreters, fp32, 2 AdamW steps.

Rank 0 trains an image batch, rank 1 a text-only one. With ``FSDP_COMPAT=off`` the vision blocks' groups (NeMo
gives every ``nn.ModuleList`` child one) are all-gathered on rank 0 only and gloo aborts ("Received data size doesn't
match expected size"); with fsdp-compat installed (the ``.pth`` hook patches ``apply_fsdp2_sharding_recursively``
when NeMo's parallelizer is imported) both ranks equal one process training on both batches with the mean loss:
gradients after each backward and parameters after each step ``== 0.0``, with NeMo's own groups; a control
reference (rank 0's batch in both places) differs, so the comparator sees a wrong reference. Runs in the
``nemoautomodel070`` tox env (the only one that collects this folder: a missing NeMo Automodel fails).
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
from fsdp_compat.testing.crashes import GLOO_MISMATCH

PARALLELIZER = "nemo_automodel.components.distributed.parallelizer"

require_framework("nemo_automodel", lambda: importlib.import_module(PARALLELIZER))

from fsdp_compat.testing.launch import RunResult, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(400)

NEMO = metadata.version("nemo-automodel")
#: the modules that hold ``apply_fsdp2_sharding_recursively`` (oracle: grep of the 0.7.0 wheel)
BINDINGS = [PARALLELIZER, "nemo_automodel._diffusers.parallelization"]
RAW_READ_CRASH = "aten.index.Tensor got mixed torch.Tensor and DTensor"
ACTIVATED = f"fsdp-compat: patched nemo-automodel {NEMO} (policy auto, activated by pth-hook)"
PASSED = "NeMo Automodel's 4 FSDP2 groups below the root pass fsdp-compat's safety check (kept as they are)"
#: NeMo 0.7.0's selection for the zoo's VLMs (its rule, written here again): every ``nn.ModuleList`` child (the
#: vision blocks, the text layers), then the untied input and output embeddings, then the root. The vision position
#: table (read raw by its parent) is no ModuleList child and stays in the root: no wrap crash.
VLM_GROUPS = [
    [""],
    ["model.visual.blocks.0"],
    ["model.visual.blocks.1"],
    ["model.language_model.embed_tokens"],
    ["model.language_model.layers.0"],
    ["model.language_model.layers.1"],
    ["lm_head"],
]


def run(body: str, env: dict[str, str | None], **cfg: Any) -> RunResult:
    return run_ranks(
        f"lab.stacks.nemo_automodel_ranks:{body}",
        {"steps": 2, **cfg},
        world_size=2,
        timeout_s=240,
        env={"PYTHONPATH": rank_pythonpath(), **env},
    )


def _assert_exact(result: RunResult, patched: bool = True) -> None:
    """Ran on every rank (else every failing rank's traceback), exact against one process, and not against the
    control reference."""
    result.raise_for_error()
    for rank in result.ranks:
        extra = rank.extra
        print(
            f"rank {rank.rank}: Δgrad {extra['grad_diff']} Δparam {extra['param_diff']} control Δgrad "
            f"{extra['control_grad_diff']} losses {extra['losses']} mixed batches {extra['mixed_batches']} "
            f"guard unshards {extra['guard_unshards']}"
        )
        assert extra["patched"] is patched
        assert extra["groups"] == VLM_GROUPS  # NeMo's selection, kept
        assert extra["grad_diff"] == 0.0, extra["worst_grad_param"]  # NaN fails too
        assert extra["param_diff"] == 0.0, extra["worst_param"]
        assert extra["control_grad_diff"] > 1e-3  # the comparator sees a reference that ignores rank 1's batch
        assert extra["losses"] == extra["reference_losses"]  # each rank's loss is the reference's on its batch
    assert result.ranks[0].extra["losses"] != result.ranks[1].extra["losses"]  # each rank its own batch


@pytest.mark.parametrize("model", ["glm4v", "qwen2.5-vl"])
def test_rank_without_images_crashes_then_trains_exactly_through_nemo(model: str) -> None:
    """Rank 0 images, rank 1 text only. Unpatched: gloo aborts on the collective mismatch. Patched: NeMo's own
    groups, rank 1 runs the vision tower on a zero dummy once per forward, and both ranks are exact (0.0)."""
    off = run("nemo_rank", OFF, model=model, variants=["image", "text"])
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert GLOO_MISMATCH in rank_output(off), rank_output(off)[-4000:]
    assert all(r.extra["patched"] is False for r in off.ranks if "patched" in r.extra)
    assert all(r.extra["log"] == [] for r in off.ranks if "log" in r.extra)

    on = run("nemo_rank", ON, model=model, variants=["image", "text"])
    _assert_exact(on)
    assert all(any(line.startswith(ACTIVATED) for line in r.extra["log"]) for r in on.ranks), on.ranks[0].extra
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [2, 2]
    assert [r.extra["guard_unshards"] for r in on.ranks] == [0, 0]  # NeMo's grouping is safe: guard idle
    assert any(PASSED in line for line in on.ranks[0].extra["log"]), on.ranks[0].extra["log"]
    assert not any(PASSED in line for line in on.ranks[1].extra["log"])  # rank 0 only


#: One family of every other tower kind that transformers 5.18.0 has (lab.stack_families), the patch grid being
#: GLM4V's and Qwen2.5-VL's above.
KIND_FAMILIES = STACKS["nemo_automodel"]
#: Where the unpatched run fails otherwise than by gloo's size mismatch: Gemma4's per-layer-input read of a sharded
#: weight crashes first (as in transformers' own Gemma4 plan); Emu3's ranks fall out of step (the VQ encoder's blocks
#: get no gradient, so the text rank runs out of collectives first, finishes, and the image rank's next all-gather
#: finds the peer gone).
UNPATCHED = {
    "lab.vlms:gemma4": "aten.where.self got mixed torch.Tensor and DTensor",
    "lab.vlms:emu3": "Connection closed by peer",
}


@pytest.mark.parametrize("model", [pytest.param(m, id=kind) for kind, m in KIND_FAMILIES.items()])
def test_every_tower_kind_rank_without_images_crashes_then_trains_exactly_through_nemo(model: str) -> None:
    """As above, for one family of each tower kind, with NeMo's own groups (every ``nn.ModuleList`` child: the
    family's vision blocks among them): unpatched, gloo aborts (or, :data:`UNPATCHED`, another crash first, or the
    ranks fall out of step); patched, rank 1 runs one dummy tower call per forward and both ranks are exact (0.0)."""
    off = run("nemo_rank", OFF, model=model, variants=["image", "text"])
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert UNPATCHED.get(model, GLOO_MISMATCH) in rank_output(off), rank_output(off)[-4000:]

    on = run("nemo_rank", ON, model=model, variants=["image", "text"])
    on.raise_for_error()
    for rank in on.ranks:
        extra = rank.extra
        print(f"{model} rank {rank.rank}: Δgrad {extra['grad_diff']} Δparam {extra['param_diff']} ({on.seconds:.1f}s)")
        assert extra["patched"] is True
        assert extra["grad_diff"] == 0.0, extra["worst_grad_param"]  # NaN fails too
        assert extra["param_diff"] == 0.0, extra["worst_param"]
        assert extra["losses"] == extra["reference_losses"]
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [2, 2]
    assert on.ranks[0].extra["losses"] != on.ranks[1].extra["losses"]  # each rank its own batch


@pytest.mark.parametrize("model", [pytest.param(m, id=kind) for kind, m in HELD["nemo_automodel"].items()])
def test_inexact_tower_kind_crashes_then_stays_within_fsdp2s_own_distance_through_nemo(model: str) -> None:
    """For a kind whose all-image FSDP2 run is not exact (lab.stack_families.HELD): unpatched, image|text aborts;
    patched, the all-image run (no dummy: FSDP2's own arithmetic) is measured first, and the image|text run, one dummy
    tower call per forward on rank 1, is held to it (:func:`~lab.families.assert_held`)."""
    off = run("nemo_rank", OFF, model=model, variants=["image", "text"])
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert GLOO_MISMATCH in rank_output(off), rank_output(off)[-4000:]

    alone = run("nemo_rank", ON, model=model, variants=["image", "image"])
    on = run("nemo_rank", ON, model=model, variants=["image", "text"])
    for result, dummies in ((alone, [0, 0]), (on, [0, 2])):
        result.raise_for_error()
        assert [r.extra["mixed_batches"]["dummy_calls"] for r in result.ranks] == dummies
        assert all(r.extra["patched"] is True for r in result.ranks)
    diffs = [tuple(max(r.extra[w] for r in res.ranks) for w in ("grad_diff", "param_diff")) for res in (alone, on)]
    assert_held(model, *diffs)


#: fsdp-compat's error where per-image modules (MiniCPM-V's merger MLPs) are FSDP2 groups and the ranks' images differ
PER_IMAGE_ERROR = "runs model.merger.mlp once per image of each vision tower call"


def test_per_image_groups_with_unequal_image_counts_fail_on_every_rank_instead_of_hanging() -> None:
    """MiniCPM-V runs its merger's ``mlp.0`` once per image, and NeMo gives it an FSDP2 group of its own: rank 0 with
    two images, rank 1 with one makes that group's backward collectives differ, which no dummy can pair. Patched,
    every rank raises fsdp-compat's error at the first forward (naming the group and each rank's images per call);
    with the same images on both ranks (two each), the same run trains exactly."""
    model = "lab.vlms:minicpmv4_6"
    on = run("nemo_rank", ON, model=model, variants=["image", "image"], one_image_ranks=[1])
    assert not on.ok
    for rank in on.ranks:
        assert rank.error is not None and "FsdpCompatError" in rank.error and PER_IMAGE_ERROR in rank.error, rank.error
        assert "(model.merger.mlp.0)" in rank.error and "rank 0: [2]; rank 1: [1]" in rank.error, rank.error
    same = run("nemo_rank", ON, model=model, variants=["image", "image"])
    same.raise_for_error()
    for rank in same.ranks:
        assert rank.extra["grad_diff"] == 0.0 and rank.extra["param_diff"] == 0.0, rank.extra["worst_grad_param"]
        assert rank.extra["losses"] == rank.extra["reference_losses"]
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in same.ranks] == [0, 0]


def test_image_ranks_train_exactly_with_and_without_fsdp_compat() -> None:
    """Both ranks with images (distinct batches): NeMo's grouping is safe on GLM4V, so it trains exactly without
    fsdp-compat too, and with it (same groups, no dummy, guard idle)."""
    off = run("nemo_rank", OFF, model="glm4v", variants=["image", "image"])
    _assert_exact(off, patched=False)
    on = run("nemo_rank", ON, model="glm4v", variants=["image", "image"])
    _assert_exact(on)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 0]
    assert [r.extra["guard_unshards"] for r in on.ranks] == [0, 0]
    assert [r.extra["losses"] for r in on.ranks] == [r.extra["losses"] for r in off.ranks]


def test_unsafe_modulelist_group_is_kept_with_a_warning_and_the_guard_rescues_it() -> None:
    """A ModuleList child whose weight its parent reads raw: NeMo's own function gives it a group. Unpatched, the
    read crashes; patched, NeMo's grouping is kept, one warning on rank 0 names the group and the read, and the
    run-time guard unshards it there: exact (0.0)."""
    off = run("raw_read_rank", OFF)
    assert not off.ok and RAW_READ_CRASH in (off.exception or ""), off.error
    on = run("raw_read_rank", ON)
    on.raise_for_error()
    for rank in on.ranks:
        assert rank.extra["patched"] and rank.extra["groups"] == [[""], ["tables.0"], ["tables.1"]]
        assert rank.extra["grad_diff"] == 0.0 and rank.extra["param_diff"] == 0.0
        assert rank.extra["guard_unshards"] == 2  # one per forward
    warning = [line for line in on.ranks[0].extra["log"] if "safety check cannot show" in line]
    assert len(warning) == 1 and "tables.1 (tables.1.weight read raw by <root>" in warning[0], warning
    assert not any("safety check" in line for line in on.ranks[1].extra["log"])


def test_every_binding_is_patched_and_restored_exactly() -> None:
    """In this process the ``.pth`` hook patched NeMo when its parallelizer was imported: the definer and the
    by-name importer hold fsdp-compat's function; unpatch puts the very original back; patch replaces it again."""
    for name in BINDINGS:
        importlib.import_module(name)
    from fsdp_compat.adapters import nemo_automodel as adapter

    modules = [sys.modules[name] for name in BINDINGS]
    patched = modules[0].apply_fsdp2_sharding_recursively
    assert getattr(patched, "__fsdp_compat__", False) and adapter.is_patched("nemo-automodel")
    assert all(m.apply_fsdp2_sharding_recursively is patched for m in modules)
    assert adapter.ADAPTER.activated_by == "pth-hook"
    assert sorted(adapter.ADAPTER.describe()) == sorted(
        f"{name}.apply_fsdp2_sharding_recursively -> fsdp-compat (policy auto)" for name in BINDINGS
    )
    original = patched.__wrapped__
    adapter.unpatch()
    try:
        assert all(m.apply_fsdp2_sharding_recursively is original for m in modules) and not adapter.is_patched()
        assert not hasattr(original, "__fsdp_compat__") and original.__module__ == PARALLELIZER
    finally:
        assert adapter.patch() is True
    again = modules[0].apply_fsdp2_sharding_recursively
    assert getattr(again, "__fsdp_compat__", False)
    assert all(m.apply_fsdp2_sharding_recursively is again for m in modules)


@pytest.mark.parametrize(("switches", "expected"), [({"FSDP_COMPAT_AUTOLOAD": "0"}, "import"), ({}, "pth-hook")])
def test_activation_without_and_with_the_pth_hook(switches: dict[str, str], expected: str) -> None:
    """Without the ``.pth`` hook NeMo loads unpatched and ``import fsdp_compat.adapters.nemo_automodel`` afterwards
    rebinds the definer and the importer; with it, importing NeMo's parallelizer patches."""
    code = textwrap.dedent(
        f"""
        import logging, sys
        logging.getLogger("fsdp_compat").setLevel(logging.DEBUG)  # patch time logs at DEBUG (INFO: at first call)
        import nemo_automodel.components.distributed.parallelizer
        import nemo_automodel._diffusers.parallelization
        names = {BINDINGS!r}
        before = [getattr(sys.modules[n].apply_fsdp2_sharding_recursively, "__fsdp_compat__", False) for n in names]
        import fsdp_compat.adapters.nemo_automodel as adapter
        assert all(getattr(sys.modules[n].apply_fsdp2_sharding_recursively, "__fsdp_compat__", False) for n in names)
        print(before, adapter.ADAPTER.activated_by)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COMPAT")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**env, **switches}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    patched_first = expected == "pth-hook"
    assert done.stdout.strip() == f"{[patched_first] * 2} {expected}"
    # what was patched, logged at DEBUG now; its INFO line waits for the replacement's first call
    logged = [line for line in done.stderr.splitlines() if "fsdp-compat: patched nemo-automodel" in line]
    assert len(logged) == 1, done.stderr
    assert f"fsdp-compat: patched nemo-automodel {NEMO} (policy auto, activated by {expected})" in logged[0]
    assert "(logged at INFO when first used)" in logged[0], logged


def test_replacement_passes_every_argument_and_the_result_through() -> None:
    """A grown signature reaches NeMo's own function unchanged and its result comes back; the run-time layer goes
    on the model of the outermost call only (NeMo's recursion and a ModuleList pass straight through)."""
    import torch
    from fsdp_compat.adapters.nemo_automodel import make_apply_fsdp2_sharding_recursively

    from fsdp_compat.runtime.guard import guard_of

    calls = []

    def apply_fsdp2_sharding_recursively(module: Any, mesh: Any, *rest: Any, new_keyword: Any = None) -> Any:
        calls.append((module, mesh, rest, new_keyword))
        for child in module.children():  # NeMo's recursion, through the (replaced) module global
            replacement(child, mesh, *rest, new_keyword=new_keyword)
        return "result"

    replacement = make_apply_fsdp2_sharding_recursively(apply_fsdp2_sharding_recursively, Auto())
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    mesh = object()
    assert replacement(model, mesh, "mp", "offload", new_keyword=3) == "result"
    assert [c[0] for c in calls] == [model, model[0], model[0][0]]
    assert all(c[1:] == (mesh, ("mp", "offload"), 3) for c in calls)
    assert guard_of(model) is not None
    assert guard_of(model[0]) is None and guard_of(model[0][0]) is None
    lonely = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    assert replacement(module=lonely, mesh=mesh) == "result" and guard_of(lonely) is None


def test_supported_range_is_the_release_run_here() -> None:
    """The index row (``>=0.7.0,<0.8``) covers the release these tests ran on (0.7.0, tox env ``nemoautomodel070``)
    with its table row; 0.6.x (not run) and 0.8.0 (announced to remove ``FSDP2Manager``) are outside."""
    from fsdp_compat.adapters import ADAPTERS
    from fsdp_compat.adapters import nemo_automodel as adapter

    assert ADAPTERS["nemo_automodel"].triggers == {PARALLELIZER: "nemo-automodel"}
    row = adapter.ADAPTER.release_for("nemo-automodel", Version("0.7.0"))
    assert row is not None and row.importers == ("nemo_automodel._diffusers.parallelization",)
    for raw in ("0.6.0", "0.8.0"):
        assert not adapter.ADAPTER.is_supported("nemo-automodel", Version(raw))
    assert adapter.ADAPTER.is_supported("nemo-automodel", Version(NEMO))
