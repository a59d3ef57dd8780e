"""Every vision-language family of the installed transformers (found from its registries, not a typed list) against
fsdp-compat's mixed micro-batch table and the published family table (docs/families.md).

Two kinds of case, both parametrised over the discovered families, so a family a newer transformers adds is a
failing case until it is classified:

- classification: the family's path and status in docs/families.md are the ones the code gives it (a tiny zoo
  model and a ``FAMILIES`` row: ``row``, ``trains``; a tiny model, no row, not refused by name: ``mechanism``,
  ``trains``; a row without a zoo model: ``row``, ``row, not run``; a zoo model refused by name
  (``fsdp_compat.runtime.vlm_families.refused``): ``named error``; neither: ``not covered``). An undocumented family
  fails here. The doc is written for transformers ``DOC_TRANSFORMERS`` (5.25.0, ``tox -e families525``): on another
  release these cases are deselected (tests/conftest.py), naming it (``families524`` runs the 5.24 families' run cases).
- run (families with a tiny zoo model): image rank 0, text rank 1. With ``FSDP_COMPAT_MIXED_BATCHES=off`` gloo
  aborts ("Received data size doesn't match expected size"; a family whose forward cannot take a text-only
  micro-batch fails on the text rank with its own error, its tiny model's ``unaligned``); with the alignment a family
  that trains (by its row, or by the generic mechanism, which replays the image rank's media call on the text rank)
  does so at exact parity (0.0 gradients and parameters after each of 2 AdamW steps, one dummy tower call or replay
  per forward on the text rank), or, where FSDP2 alone is not exact for the family (``parity="measured"``), no further
  from one process than the family's all-image run measured in the same test (``MEASURED_FACTOR``); a family refused
  by name raises the named FsdpCompatError on both ranks, and a family that needs an image in every micro-batch and
  that fsdp-compat cannot name (``needs images``) fails on the text rank with its own error again.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from lab.families import (
    DOC_TRANSFORMERS,
    MEASURED_FACTOR,
    DiscoveredVlm,
    counts_sentence,
    discover_vlms,
    family_path,
    family_status,
    parity_of,
    row_of,
    table_markdown,
    tiny_of,
    zoo_model,
)
from lab.support import DEVICE

from fsdp_compat.runtime.mixed_batches import FAMILIES
from fsdp_compat.testing.crashes import GLOO_MISMATCH
from fsdp_compat.testing.launch import RankResult, RunResult, current_wording
from fsdp_compat.testing.parity import PARITY_TOL, run_training

pytestmark = [pytest.mark.timeout(300)]

AUTO = "fsdp_compat.testing.wraps:core_auto"
DOC = Path(__file__).resolve().parents[2] / "docs" / "families.md"
DISCOVERED = discover_vlms()


def _documented() -> dict[str, tuple[str, str]]:
    """docs/families.md's table: first cell (the model types, the first one in backticks) -> path, and status with
    note."""
    table = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # a note's \| is no border
        match = re.match(r"`([^`]+)`", cells[0]) if len(cells) > 5 else None
        if match:
            table[match.group(1)] = (cells[3], " | ".join(cells[4:]))
    return table


DOCUMENTED = _documented()


def _doc_release() -> Any:
    import transformers

    installed = transformers.__version__
    reason = f"docs/families.md is transformers {DOC_TRANSFORMERS}'s, this is {installed}: tox -e families525"
    return pytest.mark.skipif(installed != DOC_TRANSFORMERS, reason=reason)


doc_release = _doc_release()


def _ids(found: DiscoveredVlm) -> str:
    return found.name


@doc_release
@pytest.mark.parametrize("found", DISCOVERED, ids=_ids)
def test_family_is_documented_with_the_status_the_code_gives_it(found: DiscoveredVlm) -> None:
    assert found.name in DOCUMENTED, f"{found.name} ({found.outer}) is not in docs/families.md: classify it"
    path, said = DOCUMENTED[found.name]
    status = family_status(found)
    assert (path, said.startswith(status)) == (family_path(found), True), (found.name, path, said, status)
    if not found.has_tower_and_text:  # not covered, or run with a tiny model: the gap is said either way
        assert found.shape_gap() in said


def test_the_refused_classes_are_the_named_error_families() -> None:
    """Every class refused by name (its one-line reason in refused.py, the runtime's error) is a discovered family
    the families test runs to that named error, and every named-error family is refused there: one home per reason.
    A refused class the installed transformers lacks is left out (none on 5.24 or 5.25)."""
    import transformers

    from fsdp_compat.runtime.vlm_families.refused import REFUSED

    named = {f.inner for f in DISCOVERED if family_status(f) == "named error"}
    installed = {c for c in REFUSED if hasattr(transformers, c)}
    assert named == installed, {"refused, not named": installed - named, "named, not refused": named - installed}
    assert all(zoo_model(f) for f in DISCOVERED if f.inner in named)  # each is run to its named error


@pytest.mark.parametrize("found", [f for f in DISCOVERED if family_status(f) == "named error"], ids=_ids)
def test_the_runtime_refuses_each_named_error_family(found: DiscoveredVlm) -> None:
    """The runtime refuses by the classes of the model's modules (``refusal``): the family's tiny model (its outer
    class, which need not hold the inner one: BlipForConditionalGeneration has no BlipModel) must hold a refused
    class, or the run goes the generic mechanism's way instead of the named error the doc says."""
    from fsdp_compat.runtime.vlm_families.refused import refusal

    model = tiny_of(found).build()
    names = {type(m).__name__ for m in model.modules()}
    assert refusal(names) is not None, f"{found.name}: none of {type(model).__name__}'s module classes is refused"


@doc_release
def test_the_table_and_its_counts_are_the_ones_the_code_writes() -> None:
    text = DOC.read_text()
    fix = "regenerate it: cd tests && python -m lab.families ../docs/families.md"
    assert table_markdown(DISCOVERED) in text, fix
    assert counts_sentence(DISCOVERED) in text.replace("\n", " "), fix


@doc_release
def test_the_table_has_no_family_transformers_does_not_have() -> None:
    assert set(DOCUMENTED) == {f.name for f in DISCOVERED}


def test_every_row_matches_a_discovered_family() -> None:
    """By inner class, or by the submodule class that holds the tower (``row_of``: T5Gemma2's encoder). A row of a
    family the installed transformers does not have (none of its classes in ``transformers``: a 5.25 family on 5.24)
    matches nothing here; its family's own env runs it (``families525``)."""
    import transformers

    matched = {id(row_of(f)) for f in DISCOVERED}
    installed = [f for f in FAMILIES if any(hasattr(transformers, c) for c in f.classes)]
    assert [f.name for f in installed if id(f) not in matched] == []


def _run(model: str, mode: str, variants: tuple[str, str] = ("image", "text"), steps: int = 2) -> RunResult:
    return run_training(model, AUTO, world_size=2, steps=steps, device=DEVICE, timeout_s=90.0,
                        variants=list(variants), env={"FSDP_COMPAT_MIXED_BATCHES": mode})  # fmt: skip


def _assert_mismatch(run: RunResult, own: str = "") -> None:
    """The unaligned run fails: gloo's size mismatch (an NCCL timeout), or, where the family's forward cannot run a
    text-only micro-batch at all (``own``: the ``unaligned`` text of its tiny model), that error of the text rank."""
    assert not run.ok
    text = "\n".join((r.error or "") + str(r.extra.get("log_tail", "")) for r in run.ranks)
    if own:
        assert own in (run.ranks[1].error or ""), text[-3000:]
        return
    assert (GLOO_MISMATCH in current_wording(text)) if DEVICE == "cpu" else ("timed out" in text), text[-3000:]


def _assert_exact(run: RunResult) -> None:
    run.raise_for_error()
    assert run.max_abs_grad_diff == 0.0, run.ranks[0].extra.get("worst_grad_param")
    assert run.max_abs_param_diff == 0.0, run.ranks[0].extra.get("worst_param")
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == [0, 2]
    for r in run.ranks:
        assert r.losses == r.extra["reference_losses"]


def _assert_reordered(run: RunResult, dummies: list[int]) -> None:
    """Within PARITY_TOL relative (FSDP2 reorders a sum), not 0.0; every loss within it too."""
    run.raise_for_error()
    assert run.max_rel_grad_diff <= PARITY_TOL, run.ranks[0].extra.get("worst_grad_param")
    assert run.max_rel_param_diff <= PARITY_TOL, run.ranks[0].extra.get("worst_param")
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == dummies
    for r in run.ranks:
        assert r.losses == pytest.approx(r.extra["reference_losses"], rel=PARITY_TOL, abs=0.0)


def _assert_no_further_than_all_image(model: str, eps_param: str = "") -> None:
    """The aligned image|text run is no further from one process than the same family's all-image run (no dummy:
    FSDP2's own arithmetic), within :data:`MEASURED_FACTOR`; both distances finite, every loss within it.
    ``eps_param`` (the tiny model's ``adamw_eps_param``): both runs make one step, and where the worst parameter is
    that one, its distance is held to AdamW's largest step (lr 1e-3) instead: one of its elements has moved by its
    rounding times lr / eps, so a second step would compare another trajectory; its gradients are held as all."""
    steps = 1 if eps_param else 2
    alone = _run(model, "sync", ("image", "image"), steps)
    alone.raise_for_error()
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in alone.ranks] == [0, 0]
    run = _run(model, "sync", steps=steps)
    run.raise_for_error()
    assert [r.extra["mixed_batches"]["dummy_calls"] for r in run.ranks] == [0, steps]
    bounds = {"grad": alone.max_rel_grad_diff, "param": alone.max_rel_param_diff,
              "loss": max(_loss_distance(r) for r in alone.ranks)}  # fmt: skip
    got = {"grad": run.max_rel_grad_diff, "param": run.max_rel_param_diff,
           "loss": max(_loss_distance(r) for r in run.ranks)}  # fmt: skip
    assert all(math.isfinite(v) for v in (*bounds.values(), *got.values())), (bounds, got)  # NaN fails
    where = run.ranks[0].extra.get("worst_grad_param"), run.ranks[0].extra.get("worst_param")
    if eps_param and where[1] == eps_param:
        assert got.pop("param") <= 1e-3, where  # one AdamW step of lr 1e-3
    for what, value in got.items():
        assert value <= MEASURED_FACTOR * bounds[what], (what, value, bounds[what], where)


def _loss_distance(rank: RankResult) -> float:
    """A rank's worst loss difference from one process, relative as the comparator's (``|Δ| / max(1, |ref|)``)."""
    losses, ref = rank.losses, rank.extra["reference_losses"]
    return max((abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref, strict=True)), default=0.0)


def _assert_named_error(run: RunResult, found: DiscoveredVlm) -> None:
    assert not run.ok
    for r in run.ranks:
        assert r.extra.get("exception", "").startswith("fsdp_compat.errors.FsdpCompatError: fsdp-compat: mixed")
        assert found.outer in (r.error or "") and "Fix:" in (r.error or ""), r.error


def _runnable(found: DiscoveredVlm) -> Any:
    """The family as a case; one whose tiny model needs a package this env lacks (timm) is not applicable here:
    deselected at collection (tests/conftest.py), and run by the env its tiny model names."""
    import importlib.util

    tiny = tiny_of(found)
    missing = [m for m in getattr(tiny, "requires", ()) if importlib.util.find_spec(m) is None]
    reason = f"{found.name} needs {', '.join(missing)}: tox -e {getattr(tiny, 'env', '')}"
    return pytest.param(found, marks=pytest.mark.skipif(bool(missing), reason=reason))


RUNNABLE = [_runnable(f) for f in DISCOVERED if zoo_model(f)]


def _assert_path(run: RunResult, path: str) -> None:
    """The path that aligned the run: the generic mechanism stops at FSDP2 groups (``rounds``) where ranks' media
    differ, a row never does."""
    rounds = [r.extra["mixed_batches"]["rounds"] for r in run.ranks]
    assert all(rounds) if path == "mechanism" else not any(rounds), (path, rounds)


@pytest.mark.parametrize("found", RUNNABLE, ids=_ids)
def test_image_and_text_ranks_crash_then_train_exactly_or_fail_by_name(found: DiscoveredVlm) -> None:
    model = zoo_model(found)
    assert model is not None
    tiny = tiny_of(found)
    status, path = family_status(found), family_path(found)
    _assert_mismatch(_run(model, "off"), getattr(tiny, "unaligned", ""))
    if status == "trains" and parity_of(found) == "measured":  # FSDP2 alone is inexact: measure it first
        _assert_no_further_than_all_image(model, getattr(tiny, "adamw_eps_param", ""))
        return
    run = _run(model, "sync")
    if status == "needs images":  # fsdp-compat cannot name it: the text rank's own error again
        _assert_mismatch(run, tiny.unaligned)
    elif status == "named error":
        _assert_named_error(run, found)
    elif parity_of(found) == "reordered":
        _assert_reordered(run, [0, 2])
        _assert_path(run, path)
        _assert_reordered(_run(model, "sync", ("image", "image")), [0, 0])  # no dummy: FSDP2's own order
    else:
        assert status == "trains", status
        _assert_exact(run)
        _assert_path(run, path)
