"""The vision-language families of the installed transformers, found from its own registries (test support).

Why: the mixed micro-batch table (:data:`fsdp_compat.mixed_batches.FAMILIES`) must cover every VLM whose vision
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

__all__ = ["STATUSES", "DiscoveredVlm", "discover_vlms", "family_status", "row_of", "table_markdown", "zoo_model"]

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
STATUSES = ("trains", "row, not run", "named error", "not covered")


def row_of(found: DiscoveredVlm) -> Any:
    """The family's row in :data:`fsdp_compat.mixed_batches.FAMILIES` (by inner class), or None."""
    from fsdp_compat.mixed_batches import FAMILIES

    return next((family for family in FAMILIES if found.inner in family.classes), None)


def zoo_model(found: DiscoveredVlm) -> str | None:
    """The family's tiny zoo model: the row's name, else one of its model types; None when the zoo has none."""
    from fsdp_compat.testing.zoo import is_vlm

    row = row_of(found)
    return next((n for n in (row.name if row else None, *found.model_types) if n is not None and is_vlm(n)), None)


def family_status(found: DiscoveredVlm) -> str:
    """A row and a zoo model: ``trains`` (the families test runs it); a row only: ``row, not run``; a zoo model
    only: ``named error`` (the families test runs it); neither: ``not covered``."""
    row, zoo = row_of(found), zoo_model(found)
    if row is not None:
        return STATUSES[0] if zoo else STATUSES[1]
    return STATUSES[2] if zoo else STATUSES[3]


_KINDS = {"grid_inputs": "patch grid", "fixed_inputs": "fixed resolution", "sized_inputs": "image_sizes (Pixtral)",
          "tile_inputs": "tiles (Idefics3)"}  # fmt: skip


def table_markdown(found: list[DiscoveredVlm], notes: dict[str, str] | None = None) -> str:
    """docs/families.md's table: one line per family (model types, inner class, tower, status, note)."""
    lines = ["| family (model types) | inner class | tower: attribute, kind | status | note |", "|---|---|---|---|---|"]
    for f in found:
        row = row_of(f)
        kind = _KINDS.get(getattr(row.dummy, "__name__", ""), "") if row else ""
        tower = f"`{f.tower}`" + (f", {kind}" if kind else "") if f.tower else "none"
        types = ", ".join(f"`{t}`" for t in f.model_types)
        note = (notes or {}).get(f.name) or f.shape_gap()
        lines.append(f"| {types} | `{f.inner}` | {tower} | {family_status(f)} | {note} |")
    return "\n".join(lines)
