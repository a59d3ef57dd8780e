"""Families the alignment refuses by name: measured on transformers 5.24 (``tox -e families524``), neither a row nor
the generic mechanism (:mod:`fsdp_compat.runtime.replay`) can align them, so where their ranks' media differ every
rank raises one named error first (docs/families.md gives each reason in full).

Why a list and not the mechanism: the mechanism sees FSDP2 groups and module calls; these families differ by rank
inside a group (a text layer whose vision experts run only for image tokens: its reduce-scatter shrinks) or cannot
take a text-only micro-batch at all (the model raises by itself), which no replay changes.
"""

from __future__ import annotations

__all__ = ["REFUSED", "refusal"]

#: Inner model class -> why (one line; the families doc has the measurement).
REFUSED: dict[str, str] = {
    "BlipModel": "its forward runs the tower on every call: a micro-batch without pixel_values fails in the model",
    "Blip2Model": "its forward runs the tower on every call: a micro-batch without pixel_values fails in the model",
    "Kosmos2Model": "its forward runs the tower on every call: a micro-batch without pixel_values fails in the model",
    "IdeficsModel": "every micro-batch needs an image (its gated cross-attention always attends to image states)",
    "InstructBlipModel": "pixel_values is a required argument of its forward",
    "InstructBlipVideoModel": "pixel_values is a required argument of its forward",
    "PPFormulaNetForConditionalGeneration": "its forward raises without pixel_values (the image is the decoder's only "
    "context)",
    "GitModel": "GitForCausalLM's loss skips a fixed count of image positions: a text-only micro-batch with labels "
    "fails by itself",
    "ChameleonModel": "its VQ tokenizer's codes are embedded inside the model itself; the generic mechanism's replay "
    "does not line its collectives up (image|text: a collective mismatch, transformers 5.25)",
    "UdopModel": "the page image is patch-embedded inside the encoder's own forward; the generic mechanism trains it "
    "with gradients within FSDP2's own distance, but its parameters after 2 AdamW steps are 5.2x FSDP2's own "
    "distance (over the families' 4x rule, transformers 5.25)",
    "Ernie4_5_VLMoeModel": "image tokens run the vision experts of every sparse text layer, which a text rank skips: "
    "its text layers' reduce-scatters differ whatever the tower does",
}


def refusal(class_names: set[str]) -> tuple[str, str] | None:
    """The (class, reason) of the first refused class among ``class_names``, else None."""
    for name, reason in REFUSED.items():
        if name in class_names:
            return name, reason
    return None
