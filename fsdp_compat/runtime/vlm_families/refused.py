"""Families the alignment refuses by name: measured (the families test: ``tox -e families525`` on transformers 5.25,
``families524`` on 5.24), neither a row nor the generic mechanism (:mod:`fsdp_compat.runtime.replay`) can align them,
so where their ranks' media differ every rank raises one named error first. Each reason here is the headline the
error prints; docs/families.md's table gives it with its family's measurement in full.

Why a list and not the mechanism: the mechanism sees FSDP2 groups and module calls; these families differ by rank
inside a group (a text layer whose vision experts run only for image tokens: its reduce-scatter shrinks) or cannot
take a text-only micro-batch at all (the model raises by itself), which no replay changes.
"""

from __future__ import annotations

__all__ = ["OUTER", "REFUSED", "refusal"]

#: Inner model class -> why (one line; the families doc has the measurement).
REFUSED: dict[str, str] = {
    "BlipModel": "its forward cannot run without an image (no text-only micro-batch exists)",
    "Blip2Model": "its forward cannot run without an image (no text-only micro-batch exists)",
    "Kosmos2Model": "its forward cannot run without an image (no text-only micro-batch exists)",
    "IdeficsModel": "its forward cannot run without an image (no text-only micro-batch exists)",
    "InstructBlipModel": "its forward cannot run without an image (no text-only micro-batch exists)",
    "InstructBlipVideoModel": "its forward cannot run without an image (no text-only micro-batch exists)",
    "PPFormulaNetForConditionalGeneration": "its forward cannot run without an image (no text-only micro-batch exists)",
    "GitModel": "its loss cannot take a text-only micro-batch with labels",
    "ChameleonModel": "the generic mechanism's replay leaves its collectives out of step (image and text ranks: a "
    "collective mismatch, transformers 5.25)",
    "UdopModel": "the generic mechanism trains it with gradients within FSDP2's own distance, but its parameters "
    "after 2 AdamW steps are 5.2x FSDP2's own distance (over the families' 4x rule, transformers 5.25)",
    "Ernie4_5_VLMoeModel": "its sparse text layers run their vision experts only for image tokens, so a text rank's "
    "reduce-scatters differ whatever the tower does",
}


#: Outer classes that do not hold their family's inner one (``BlipForConditionalGeneration`` has no ``BlipModel``:
#: its tower and text decoder are its own attributes) -> that inner class, the key of its reason.
OUTER: dict[str, str] = {
    "BlipForConditionalGeneration": "BlipModel",
    "Blip2ForConditionalGeneration": "Blip2Model",
    "InstructBlipForConditionalGeneration": "InstructBlipModel",
    "InstructBlipVideoForConditionalGeneration": "InstructBlipVideoModel",
    "Kosmos2ForConditionalGeneration": "Kosmos2Model",
    "UdopForConditionalGeneration": "UdopModel",
}


def refusal(class_names: set[str]) -> tuple[str, str] | None:
    """The (class, reason) of the first refused class among ``class_names`` (an outer class of :data:`OUTER`
    counts as its inner one), else None."""
    names = class_names | {OUTER[n] for n in class_names if n in OUTER}
    for name, reason in REFUSED.items():
        if name in names:
            return name, reason
    return None
