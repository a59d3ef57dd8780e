"""axolotl (``axolotl`` from PyPI, installed ``--no-deps`` next to the accelerate it pins): tiny GLM4V prepared by
axolotl's own ``fsdp2_prepare_model``, installed over accelerate's the way axolotl's model loader installs it
(``PatchManager._apply_fsdp_patches`` -> ``patch_accelerate_fsdp2``), reached through accelerate's own
``Accelerator.prepare`` on 2 gloo ranks in fresh interpreters. Rank code, and where it stops in axolotl's loader and
why: ``tests/lab/stacks/axolotl_ranks.py``.

Rank 0 trains an image batch, rank 1 a text-only one. With ``FSDP_COMPAT=off`` the vision blocks' groups (axolotl
gives every ``_no_split_modules`` block one) are all-gathered on rank 0 only and gloo aborts ("Received data size
doesn't match expected size"); with fsdp-compat installed (the ``.pth`` hook wraps axolotl's function when its
module loads) ranks with distinct image batches and image|text ranks equal one process training on both batches
with the mean loss: gradients after each backward and parameters after each AdamW step ``== 0.0`` (fp32, 2 steps),
with axolotl's own groups. Runs in the ``axolotl019`` / ``axolotl021`` tox envs (the only ones that collect this
folder: a missing axolotl fails).
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
from lab.support import OFF, ON, rank_output, rank_pythonpath, require_framework
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_compat.policies import Auto
from fsdp_compat.testing.crashes import GLOO_MISMATCH

require_framework("axolotl", lambda: importlib.import_module("axolotl.monkeypatch.accelerate.fsdp2"))

from fsdp_compat.testing.launch import RunResult, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(400)

AXOLOTL = metadata.version("axolotl")
AXOLOTL_FN = "axolotl.monkeypatch.accelerate.fsdp2.fsdp2_prepare_model"
ACTIVATED = f"fsdp-compat: patched axolotl {AXOLOTL} (policy auto, activated by pth-hook): {AXOLOTL_FN}"
PASSED = "axolotl's 4 FSDP2 groups below the root pass fsdp-compat's safety check (kept as they are)"
#: accelerate's binding and axolotl's module global: both fsdp-compat's wrapper of axolotl's function
BINDINGS = ["accelerate.accelerator", "axolotl.monkeypatch.accelerate.fsdp2"]
#: axolotl's selection for tiny GLM4V (its rule, written here again): every ``_no_split_modules`` block
#: (accelerate's auto-wrap policy), no embedding and no output-embedding group (unlike accelerate's own function),
#: the root. The vision position table (read raw by its parent) stays in the root.
GROUPS = [
    [""],
    ["model.visual.blocks.0"],
    ["model.visual.blocks.1"],
    ["model.language_model.layers.0"],
    ["model.language_model.layers.1"],
]


def run(variants: list[str], env: dict[str, str | None]) -> RunResult:
    return run_ranks(
        "lab.stacks.axolotl_ranks:axolotl_rank",
        {"model": "glm4v", "steps": 2, "variants": variants, "bindings": BINDINGS},
        world_size=2,
        timeout_s=240,
        env={"PYTHONPATH": rank_pythonpath(), **env},
    )


def _assert_exact(result: RunResult) -> None:
    """Ran on every rank (else every failing rank's traceback), through fsdp-compat's wrapper of axolotl's function,
    exact against one process, axolotl's groups kept and checked."""
    result.raise_for_error()
    for rank in result.ranks:
        extra = rank.extra
        print(
            f"rank {rank.rank}: Δgrad {extra['grad_diff']} Δparam {extra['param_diff']} losses {extra['losses']} "
            f"mixed batches {extra['mixed_batches']} guard unshards {extra['guard_unshards']}"
        )
        assert (extra["binding"], extra["wrapped"], extra["patched"]) == (AXOLOTL_FN, True, [True, True])
        assert any(line.startswith(ACTIVATED) for line in extra["all_log"]), extra["all_log"]
        assert extra["groups"] == GROUPS  # axolotl's selection, kept
        assert extra["grad_diff"] == 0.0, extra["worst_grad_param"]  # NaN fails too
        assert extra["param_diff"] == 0.0, extra["worst_param"]
        assert extra["losses"] == extra["reference_losses"]  # each rank's loss is the reference's on its batch
        assert extra["guard_unshards"] == 0  # axolotl's grouping is safe: the guard stays idle
    assert any(f"axolotl: Glm4vForConditionalGeneration: {PASSED}" in line for line in result.ranks[0].extra["log"])
    assert not any("safety check" in line for line in result.ranks[1].extra["log"])  # rank 0 only
    assert result.ranks[0].extra["losses"] != result.ranks[1].extra["losses"]  # each rank its own batch


def test_rank_without_images_crashes_then_trains_exactly_through_axolotl() -> None:
    """Rank 0 images, rank 1 text only. Unpatched: accelerate calls axolotl's own function and gloo aborts on the
    collective mismatch. Patched: axolotl's groups, rank 1 runs the vision tower on a zero dummy once per forward,
    and both ranks are exact (0.0)."""
    variants = ["image", "text"]
    off = run(variants, OFF)
    assert not off.ok, "expected the collective mismatch, but it ran"
    assert GLOO_MISMATCH in rank_output(off), rank_output(off)[-4000:]
    for rank in off.ranks:
        if "binding" in rank.extra:  # recorded before the abort
            assert (rank.extra["binding"], rank.extra["wrapped"]) == (AXOLOTL_FN, False)

    on = run(variants, ON)
    _assert_exact(on)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 2]  # one per forward, 2 steps
    assert [r.extra["mixed_batches"]["exchanges"] for r in on.ranks] == [2, 2]


def test_distinct_image_batches_train_exactly_through_axolotl() -> None:
    """Both ranks with images (different ones): exact, no dummy tower call."""
    on = run(["image", "image"], ON)
    _assert_exact(on)
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in on.ranks] == [0, 0]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter of this environment, fsdp-compat's switches cleared, then ``env`` set."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COMPAT")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env}, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_accelerate_calls_one_wrapper_whichever_patch_comes_first() -> None:
    """fsdp-compat first (the ``.pth`` hook: the accelerate adapter at ``import accelerate``, the axolotl adapter when
    axolotl's module loads), then axolotl's ``patch_accelerate_fsdp2``: accelerate's binding is the axolotl adapter's
    wrapper, one level deep. axolotl first (no ``.pth`` hook), then the adapters imported: the same, by the
    transaction's rebinding; the accelerate adapter leaves axolotl's binding alone. Unpatching puts axolotl's own
    function back in accelerate's binding."""
    check = """
        import sys
        import accelerate.accelerator as acc
        import axolotl.monkeypatch.accelerate.fsdp2 as ax
        {between}
        bound = acc.fsdp2_prepare_model
        assert bound.__fsdp_compat__ and bound is ax.fsdp2_prepare_model, bound
        inner = bound.__wrapped__
        assert not hasattr(inner, "__fsdp_compat__") and inner.__module__ == ax.__name__, inner
        import fsdp_compat.adapters.accelerate as acc_adapter
        import fsdp_compat.adapters.axolotl as adapter
        assert adapter.is_patched() and acc_adapter.is_patched() == {accelerate_supported}
        own = sys.modules["accelerate.utils"].fsdp2_prepare_model  # accelerate's, wrapped where supported
        assert getattr(own, "__wrapped__", own).__module__ == "accelerate.utils.fsdp_utils", own
        how = adapter.ADAPTER.activated_by
        adapter.unpatch()
        assert acc.fsdp2_prepare_model is inner and ax.fsdp2_prepare_model is inner
        print(how)
        """
    from fsdp_compat.adapters import ADAPTERS

    supported = Version(metadata.version("accelerate")) in SpecifierSet(ADAPTERS["accelerate"].supported["accelerate"])
    check = check.replace("{accelerate_supported}", str(supported))
    pth_first = _python(check.format(between="ax.patch_accelerate_fsdp2()"))
    assert pth_first.returncode == 0, pth_first.stderr
    assert pth_first.stdout.strip() == "pth-hook"

    between = "ax.patch_accelerate_fsdp2(); import fsdp_compat.adapters.accelerate, fsdp_compat.adapters.axolotl"
    axolotl_first = _python(check.format(between=between), FSDP_COMPAT_AUTOLOAD="0")
    assert axolotl_first.returncode == 0, axolotl_first.stderr
    assert axolotl_first.stdout.strip() == "import"


def test_doctor_says_who_replaced_accelerates_binding() -> None:
    """``fsdp-compat doctor`` in a process where axolotl replaced ``accelerate.accelerator.fsdp2_prepare_model``:
    unpatched, it names axolotl's function and says the accelerate adapter does not run there; patched, it names
    the same function wrapped by fsdp-compat. Before accelerate is imported it says nothing and imports nothing."""
    code = """
        import sys
        from fsdp_compat.doctor import report
        before = report()
        assert "accelerate.accelerator" not in sys.modules and "replaced" not in before
        import accelerate
        assert "replaced" not in report()
        import axolotl.monkeypatch.accelerate.fsdp2 as ax
        ax.patch_accelerate_fsdp2()
        print(report())
        """
    replaced = "accelerate.accelerator.fsdp2_prepare_model was replaced by someone else: it holds " + AXOLOTL_FN
    off = _python(code, FSDP_COMPAT="off")
    assert off.returncode == 0, off.stderr
    assert f"{replaced}, not fsdp-compat's; the accelerate adapter does not run on that path" in off.stdout
    on = _python(code)
    assert on.returncode == 0, on.stderr
    assert f"{replaced}, wrapped by fsdp-compat" in on.stdout
    assert f"axolotl {AXOLOTL}: supported (supported: >=0.19.0,<0.22); patched in this process" in on.stdout


def test_supported_range_is_the_releases_run_here() -> None:
    """The index row covers the releases run here (0.19.0 on the accelerate it pins, 0.21.0 on accelerate 1.15.0)
    and 0.20.0 (read: the same function and the same patch); 0.18 and 0.22 are outside; the installed one is in."""
    from fsdp_compat.adapters import ADAPTERS
    from fsdp_compat.adapters import axolotl as adapter

    assert ADAPTERS["axolotl"].triggers == {"axolotl.monkeypatch.accelerate.fsdp2": "axolotl"}
    for raw in ("0.19.0", "0.20.0", "0.21.0"):
        row = adapter.ADAPTER.release_for("axolotl", Version(raw))
        assert adapter.ADAPTER.is_supported("axolotl", Version(raw)) and row is not None
        assert row.importers == ("accelerate.accelerator",)
    for raw in ("0.18.0", "0.22.0"):
        assert not adapter.ADAPTER.is_supported("axolotl", Version(raw))
    assert adapter.ADAPTER.is_supported("axolotl", Version(AXOLOTL))


def test_replacement_passes_every_argument_and_the_result_through(monkeypatch: Any) -> None:
    """The accelerate adapter's kind of wrapper under axolotl's name: every argument reaches axolotl's function, its
    result comes back, and the group check is told it is axolotl's."""
    import torch
    from fsdp_compat.adapters import _prepare
    from fsdp_compat.adapters.axolotl import make_fsdp2_prepare_model

    calls = []

    def fsdp2_prepare_model(accelerator: Any, model: Any, extra: Any = None) -> Any:
        calls.append((accelerator, model, extra))
        return model

    seen = []
    monkeypatch.setattr(_prepare, "evidence", lambda framework, model: seen.append(framework))
    replacement = make_fsdp2_prepare_model(fsdp2_prepare_model, Auto())
    model, accelerator = torch.nn.Linear(2, 2), object()
    assert replacement(accelerator, model, "x") is model and replacement(accelerator, model=model) is model
    assert calls == [(accelerator, model, "x"), (accelerator, model, None)] and seen == ["axolotl", "axolotl"]
    assert replacement.__wrapped__ is fsdp2_prepare_model and replacement.__fsdp_compat__
