"""The failures the smoke runs and the tests reproduce before fsdp-compat fixes them, by the text they print: one
home, so a test and the smoke run that show the same crash match the same words."""

from __future__ import annotations

__all__ = ["GLOO_MISMATCH", "GRID_SAMPLER_CRASH"]

#: GLM4V's vision embeddings read ``position_embedding.weight`` raw while its FSDP2 group is sharded (verl's and
#: SkyRL's own wrap rules): the first training forward fails in ``F.grid_sample``.
GRID_SAMPLER_CRASH = "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor"
#: Ranks whose collectives differ (a tower group all-gathered on the image rank only, a reduce-scatter smaller on the
#: text rank): gloo aborts with this; NCCL hangs.
GLOO_MISMATCH = "Received data size doesn't match expected size"
