"""The vision-language families of the installed transformers, found from its own registries (test support).

Why: the mixed micro-batch table (:data:`fsdp_compat.runtime.mixed_batches.FAMILIES`) must cover every VLM whose vision
tower is trained next to its text model; a list typed by hand would miss the families a new transformers adds.
Every ``image-text-to-text`` model type (``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``) is read with its inner
model class (``MODEL_MAPPING_NAMES``, else the outer class itself); the attributes its ``__init__`` assigns say
whether it holds a vision tower and a text model, the shape the mixed-batch alignment needs. Model types that share
an outer class (aliases such as ``glmga`` / ``glm46v``) are one family.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DOC_TRANSFORMERS",
    "MEASURED_FACTOR",
    "PATHS",
    "STATUSES",
    "DiscoveredVlm",
    "assert_held",
    "counts_sentence",
    "discover_vlms",
    "family_note",
    "family_path",
    "family_status",
    "held_param_bound",
    "parity_of",
    "refused_of",
    "row_of",
    "table_markdown",
    "write_doc",
    "zoo_model",
]

#: The transformers release docs/families.md is written for: the newest the package supports (the README installs
#: it). :func:`write_doc` refuses another; the families test compares the doc only on it (``tox -e families525``).
DOC_TRANSFORMERS = "5.25.0"

#: How far an aligned image|text run may be from one process, as a multiple of the family's all-image run's distance
#: (measured in the same test). Not 1: the two runs train on different micro-batches on rank 1, so FSDP2's reordered
#: sums round differently and AdamW's first step (about lr * g / (|g| + eps)) amplifies near-zero gradients
#: differently (Florence-2's parameters: 1.3x). A dummy that adds error of its own (a gradient on one side only,
#: a wrong zero, a NaN) is inf, NaN or orders of magnitude off, not a factor of a few.
MEASURED_FACTOR = 4.0


def held_param_bound(all_image_param: float, all_image_grad: float, steps: int, lr: float = 1e-3) -> float:
    """How far a held run's parameters may be from one process after ``steps`` AdamW steps (lr ``lr``, eps 1e-8):
    :data:`MEASURED_FACTOR` times the all-image run's parameter distance, or times what AdamW can make of its
    gradient distance, whichever is larger. AdamW moves an element by ``lr * g / (|g| + eps)``, which changes by up to
    ``lr * delta / eps`` when ``g`` changes by ``delta``: a gradient near zero, reordered by FSDP2 as in the all-image
    run, moves its element by that much whichever run happens to hold it (DeepSeek-VL-Hybrid's SAM patch embed:
    2.9e-11 apart in gradients in both runs, 1.2e-10 and 3.7e-9 in parameters)."""
    return MEASURED_FACTOR * max(all_image_param, steps * lr * all_image_grad / 1e-8)


def assert_held(name: str, all_image: tuple[float, float], aligned: tuple[float, float], *, steps: int = 2) -> None:
    """A stack's aligned image|text run of a family FSDP2 alone does not train at 0.0, held to the same stack's
    all-image run: ``(gradient, parameter)`` distances from one process, each finite (a NaN fails); the gradients
    within :data:`MEASURED_FACTOR` of the all-image run's, the parameters within :func:`held_param_bound`."""
    import math

    (grad_bound, param_bound), (grad, param) = all_image, aligned
    print(f"{name}: all-image Δgrad {grad_bound:.3g} Δparam {param_bound:.3g}; image|text {grad:.3g} {param:.3g}")
    assert all(math.isfinite(v) for v in (*all_image, *aligned)), (name, all_image, aligned)
    assert grad <= MEASURED_FACTOR * grad_bound, (name, "gradients", all_image, aligned)
    assert param <= held_param_bound(param_bound, grad_bound, steps), (name, "parameters", all_image, aligned)


TOWER_ATTRS = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder", "image_tower", "vision")
TEXT_ATTRS = ("language_model", "text_model")


@dataclass(frozen=True)
class DiscoveredVlm:
    """One family: its model types, classes, and where its tower and text model live (None: none found)."""

    model_types: tuple[str, ...]
    outer: str
    inner: str
    tower: str | None
    text: str | None
    image_features: bool

    @property
    def name(self) -> str:
        return self.model_types[0]

    @property
    def has_tower_and_text(self) -> bool:
        """A separate vision tower, a text model and ``get_image_features``: the alignment's shape."""
        return self.tower is not None and self.text is not None and self.image_features

    def shape_gap(self) -> str:
        """Why the family is not of the alignment's shape ('' when it is)."""
        if self.tower is None:
            return "no separate vision tower attribute (patches embedded in the text model, a VQ tokenizer, or none)"
        if self.text is None:
            return f"no text model attribute ({' / '.join(TEXT_ATTRS)}): an encoder-decoder or a joint model"
        if not self.image_features:
            return "no get_image_features: the vision states feed the text model another way (cross-attention)"
        return ""


def _assigned(cls: type) -> set[str]:
    """The ``self.X = ...`` names of ``cls.__init__``'s source."""
    try:
        source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.(\w+)\s*(?::[^=]+)?=", source))


def discover_vlms() -> list[DiscoveredVlm]:
    """Every image-text-to-text family of the installed transformers, one per outer class, in registry order."""
    import transformers
    from transformers.models.auto import modeling_auto

    by_outer: dict[str, list[str]] = {}
    inner_of: dict[str, str] = {}
    for model_type, outer in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items():
        by_outer.setdefault(outer, []).append(model_type)
        inner_of.setdefault(outer, modeling_auto.MODEL_MAPPING_NAMES.get(model_type) or outer)
    found = []
    for outer, model_types in by_outer.items():
        inner = inner_of[outer]
        cls = getattr(transformers, inner, None)
        attrs = _assigned(cls) if cls is not None else set()
        found.append(
            DiscoveredVlm(
                model_types=tuple(model_types),
                outer=outer,
                inner=inner,
                tower=next((a for a in TOWER_ATTRS if a in attrs), None),
                text=next((a for a in TEXT_ATTRS if a in attrs), None),
                image_features=cls is not None and callable(getattr(cls, "get_image_features", None)),
            )
        )
    return found


#: A family's mixed-batch status, as docs/families.md spells it (the first words of its status cell).
STATUSES = ("trains", "row, not run", "named error", "not covered", "needs images")

#: Which path aligns a family, as docs/families.md's path column spells it: its row in the family table, the generic
#: mechanism (no row; :mod:`fsdp_compat.runtime.replay`), the named error (refused by name in
#: :mod:`fsdp_compat.runtime.vlm_families.refused`), or none (not covered: no run measures one; needs images: the
#: model itself cannot take a text-only micro-batch).
PATHS = ("row", "mechanism", "named error", "none")


def row_of(found: DiscoveredVlm) -> Any:
    """The family's row in :data:`fsdp_compat.runtime.mixed_batches.FAMILIES` (by inner class), or None."""
    from fsdp_compat.runtime.mixed_batches import FAMILIES

    held = _ROW_HOLDERS.get(found.inner, found.inner)
    return next((family for family in FAMILIES if held in family.classes), None)


#: Inner classes whose row names a submodule's class: T5Gemma2Model's encoder holds the tower and the text encoder.
_ROW_HOLDERS = {"T5Gemma2Model": "T5Gemma2Encoder"}

#: Zoo models' parity (``lab.vlms`` models carry theirs as ``TinyVlm.parity``).
_ZOO_PARITY = {"vipllava": "measured"}


def parity_of(found: DiscoveredVlm) -> str:
    """How the families test holds the family's aligned run: ``exact`` (0.0), ``reordered`` (within ``PARITY_TOL``
    relative) or ``measured`` (no further from one process than its own all-image run, measured in the same test:
    where FSDP2 alone, with no dummy, is already inexact for the family)."""
    tiny = tiny_of(found)
    return getattr(tiny, "parity", None) or _ZOO_PARITY.get(found.name, "exact")


def zoo_model(found: DiscoveredVlm) -> str | None:
    """The family's tiny model: the zoo's (the row's name, else one of its model types), else ``lab.vlms``'s
    (``"lab.vlms:<model_type>"``); None when there is none."""
    from fsdp_compat.testing.zoo import is_vlm
    from lab.vlms import tiny_models

    row = row_of(found)
    zoo = next((n for n in (row.name if row else None, *found.model_types) if n is not None and is_vlm(n)), None)
    lab = next((f"lab.vlms:{t}" for t in found.model_types if t in tiny_models()), None)
    if zoo is not None and lab is not None:
        raise ValueError(f"{found.name} has a tiny model in the zoo ({zoo}) and in lab.vlms ({lab}): keep one")
    return zoo or lab


def tiny_of(found: DiscoveredVlm) -> Any:
    from lab.vlms import tiny_models

    return next((tiny_models()[t] for t in found.model_types if t in tiny_models()), None)


def refused_of(found: DiscoveredVlm) -> str | None:
    """The one-line reason :data:`fsdp_compat.runtime.vlm_families.refused.REFUSED` gives for the family's inner (or
    outer) class, else None."""
    from fsdp_compat.runtime.vlm_families.refused import REFUSED

    return REFUSED.get(found.inner) or REFUSED.get(found.outer)


def family_status(found: DiscoveredVlm) -> str:
    """A zoo model and a path that aligns it: ``trains`` (the families test runs it; :func:`family_path` says whether
    its row or the generic mechanism); a row only: ``row, not run``; a zoo model and refused by name: ``named error``
    (the families test runs it); neither a row nor a zoo model: ``not covered``; a tiny model whose forward cannot
    take a text-only micro-batch and that fsdp-compat cannot name (``ShapeVlm.named`` False): ``needs images``."""
    row, zoo = row_of(found), zoo_model(found)
    tiny = tiny_of(found)
    if row is None and zoo is not None and tiny is not None and not getattr(tiny, "named", True):
        return STATUSES[4]  # its forward cannot take a text-only micro-batch, and fsdp-compat cannot name it
    if row is not None:
        return STATUSES[0] if zoo else STATUSES[1]
    if zoo is None:
        return STATUSES[3]
    return STATUSES[2] if refused_of(found) is not None else STATUSES[0]


def family_path(found: DiscoveredVlm) -> str:
    """Which path aligns the family (:data:`PATHS`): ``row`` where it has one, ``named error`` where it is refused,
    ``mechanism`` where a tiny model trains without either (measured by the families test), else ``none``."""
    status = family_status(found)
    if row_of(found) is not None:
        return PATHS[0]
    if status == STATUSES[2]:
        return PATHS[2]
    return PATHS[1] if status == STATUSES[0] else PATHS[3]


_KINDS = {
    "grid_inputs": "patch grid",
    "grid_patches_inputs": "patch grid, patches as images",
    "conv_grid_inputs": "patch grid, patches as images (Kimi)",
    "patch_grid_inputs": "patch grid",
    "merge_size_inputs": "patch grid with merge sizes (VideoLLaMA3)",
    "grid_hw_inputs": "patch grid, h x w (RADIO)",
    "fixed_inputs": "fixed resolution",
    "hybrid_inputs": "two fixed-resolution towers",
    "packed_patch_inputs": "packed patches (Inkling)",
    "flat_patch_inputs": "flattened patches (Fuyu)",
    "vq_inputs": "VQ tokenizer (Emu3)",
    "position_patch_inputs": "positioned patches (Gemma4 unified)",
    "sized_inputs": "image_sizes (Pixtral)",
    "anyres_inputs": "any resolution, pinpoint tiles (LLaVA-Next)",
    "aspect_tile_inputs": "tiles with aspect-ratio ids, cross-attention (Mllama)",
    "positioned_inputs": "patch rows with positions (Gemma4)",
    "naflex_inputs": "NaFlex patches (SigLIP2)",
    "tile_inputs": "tiles (Idefics3)",
    "masked_tile_inputs": "tiles with a mask",
    "packed_inputs": "NaViT-packed (MiniCPM-V)",
    "pooled_inputs": "crops, pooled (Molmo2)",
    "sam_inputs": "SAM global view (DeepSeek-OCR)",
    "token_tile_inputs": "one tile per token (Inkling 2)",
    "strided_inputs": "strided stages (DaViT)",
    "timm_inputs": "timm model (TimmWrapper)",
    "timm_tile_inputs": "timm model (TimmWrapper), tiles",
}


#: Notes of the zoo's own family models, and of families no tiny model can run image|text (lab.vlms models carry
#: theirs as ``TinyVlm.note``).
_ZOO_NOTES = {
    "vipllava": "FSDP2 alone is not exact here: the all-image run (no dummy) is 6.0e-08 off in gradients (the "
    "projector's linear_2.bias), 4.6e-06 in parameters after 2 AdamW steps (a vision k_proj bias); the aligned "
    "image|text run 4.5e-08 and 3.8e-06: FSDP2 reorders sums, the alignment adds no error of its own",
}


#: Why a family the generic mechanism aligns has no row (the mechanism's own run is the test's, said by the note).
_MECHANISM_NOTES = {
    "kosmos-2.5": "no row: the text model is called with input_ids and the features as image_embeds, which it places "
    "itself (image_embeds_position_mask), so a row's 0.0 * features has no inputs_embeds to join; the text rank "
    "replays the image rank's get_image_features call (vision_model, then image_to_text_projection) and joins "
    "(t * 0).sum() of its outputs to the next FSDP2 group's first input",
}

#: Notes of families without the alignment's shape that have no tiny model (read from transformers 5.25's code, not
#: run): what they are, and why a text-only micro-batch differs.
_SHAPE_NOTES = {
    "apertus1p5": "not run: a VQ image tokenizer (vision_tokenizer) that get_image_tokens runs once per image, each "
    "at its own size, so a text rank's dummy would have to match the image rank's count of images (not of pixel "
    "arguments); an audio tokenizer besides",
    "diffusion_gemma": "not run: a block-diffusion model; its encoder (DiffusionGemmaEncoderModel) has the "
    "alignment's shape (vision_tower, language_model, get_image_features), but DiffusionGemmaForBlockDiffusion's "
    "forward takes no labels and returns no loss (a denoising step), so the causal-LM run of this test does not "
    "apply",
    "t5gemma2": "not run: an encoder-decoder whose encoder holds the vision tower (model.encoder.vision_tower)",
    "evolla": "not a vision model: protein sequences (a SaProt encoder) and text; no image input",
    "pi0": "not a trainable VLM of this kind: a robotics action policy (a PaliGemma VLM, PI0Model.vlm, and an action "
    "expert) whose samples carry camera images",
    "pi05": "not a trainable VLM of this kind: a robotics action policy (a PaliGemma VLM, PI05Model.vlm, and a "
    "DiT action expert, PI05Model.dit) whose samples carry camera images",
    "mistral4": "not a vision model: Mistral4ForCausalLM is a text-only causal LM (no pixel input) registered under "
    "image-text-to-text",
}


def family_note(found: DiscoveredVlm) -> str:
    """The family's note in docs/families.md: why it has the status it has. A named error's: the one-line reason
    :mod:`fsdp_compat.runtime.vlm_families.refused` gives (the runtime's error says the same), then its tiny model's
    longer note where it has one."""

    status, row, path = family_status(found), row_of(found), family_path(found)
    tiny = tiny_of(found)
    own = tiny.note if tiny is not None else _ZOO_NOTES.get(found.name, "")
    gap = found.shape_gap()
    if status == STATUSES[0]:
        bound = {"reordered": "within 1e-6 relative", "measured": "no further off than its all-image run"}.get(
            parity_of(found), "0.0"
        )
        env = getattr(tiny, "env", "families525")  # the timm towers run beside torchvision (families524-timm)
        if path == PATHS[1]:
            if found.name not in _MECHANISM_NOTES:
                raise ValueError(f"{found.name}: a family the mechanism aligns needs a note saying why it has no row")
            # the tiny model's own note predates the mechanism (it said why no row and no dummy): this one replaces it
            ran = f"image and text ranks: gloo abort unaligned, {bound} aligned by the generic mechanism ({env})"
            ran = f"{ran}; {_MECHANISM_NOTES[found.name]}"
        else:
            ran = f"image and text ranks: gloo abort unaligned, {bound} aligned ({env})"
            ran = f"{ran}; {own}" if own else ran
        return f"{ran} (shape: {gap})" if gap else ran
    if status == STATUSES[1]:
        return f"the row of its tower kind ({row.dummy.__name__}); no tiny model, so no run asserts it"
    if status == STATUSES[2]:
        refused = f"refused by name: {refused_of(found)}"
        note = f"{refused}; {own}" if own else refused
        return f"{note} (shape: {gap})" if gap else note
    if status == STATUSES[4]:
        if not own:
            raise ValueError(f"{found.name}: a needs-images family needs a note saying why")
        return f"{own} (shape: {gap})" if gap else own
    if gap and found.name in _SHAPE_NOTES:
        return f"{gap}; {_SHAPE_NOTES[found.name]}"
    return gap or (own or "no row or tiny model yet; at run time the generic mechanism (untested here)")


def table_markdown(found: list[DiscoveredVlm]) -> str:
    """docs/families.md's table: one line per family (model types, inner class, tower, path, status, note)."""
    lines = [
        "| family (model types) | inner class | tower: attribute, kind | path | status | note |",
        "|---|---|---|---|---|---|",
    ]
    for f in found:
        row = row_of(f)
        builder = getattr(row.dummy, "__name__", "") if row else ""
        kind = _KINDS.get(builder, builder.removesuffix("_inputs").replace("_", " "))
        attr = f.tower or (row.tower if row else None)  # a row names the tower discovery cannot see (Fuyu, Emu3)
        tower = f"`{attr}`" + (f", {kind}" if kind else "") if attr else "none"
        types = ", ".join(f"`{t}`" for t in f.model_types)
        note = family_note(f).replace("|", "\\|")  # a note's "image|text" is no cell border
        lines.append(f"| {types} | `{f.inner}` | {tower} | {family_path(f)} | {family_status(f)} | {note} |")
    return "\n".join(lines)


def counts_sentence(found: list[DiscoveredVlm]) -> str:
    """The table's counts, as docs/families.md states them."""
    import transformers

    by = {s: sum(family_status(f) == s for f in found) for s in STATUSES}
    paths = {p: sum(family_status(f) == STATUSES[0] and family_path(f) == p for f in found) for p in PATHS[:2]}
    shaped = sum(family_status(f) == STATUSES[3] and f.has_tower_and_text for f in found)
    types = sum(len(f.model_types) for f in found)
    said = {s: f"{n} {s}" for s, n in by.items()}
    said[STATUSES[0]] += f" ({paths['row']} by a row, {paths['mechanism']} by the generic mechanism)"
    return (
        f"Count on transformers {transformers.__version__}: {len(found)} families ({types} model types): "
        + ", ".join(said.values())
        + f" ({shaped} of the not covered with the alignment's shape, {by[STATUSES[3]] - shaped} without)."
    )


def write_doc(path: str) -> None:
    """Rewrite the table and the counts sentence of docs/families.md from the code (``python -m lab.families``), on
    :data:`DOC_TRANSFORMERS` only."""
    import re
    from pathlib import Path

    import transformers

    if transformers.__version__ != DOC_TRANSFORMERS:
        raise SystemExit(f"docs/families.md is written for transformers {DOC_TRANSFORMERS}, not "
                         f"{transformers.__version__}: run it in that env (tox -e families525's)")  # fmt: skip
    found = discover_vlms()
    text = Path(path).read_text()
    start = text.index("| family (model types) |")
    end = text.find("\n\n", start)
    text = text[:start] + table_markdown(found) + ("\n" if end == -1 else text[end:])
    text = re.sub(r"Count on transformers .*?without\)\.", counts_sentence(found), text, flags=re.S)
    Path(path).write_text(text)


if __name__ == "__main__":
    import sys

    write_doc(sys.argv[1] if len(sys.argv) > 1 else "docs/families.md")
