"""The core FSDP2 smoke: tiny GLM4V on real gloo ranks, each rank its own micro-batch, upstream rule versus
fsdp-compat's plan, then a data-parallel step where only rank 0 has images.

``legacy`` (the verl/SkyRL selection) must reproduce the real crash; ``auto`` must train with exact parity (0.0)
against one process training on all the ranks' micro-batches with the mean loss. With ``FSDP_COMPAT_MIXED_BATCHES
=off`` the image-less rank's collectives fall out of step (gloo: "Received data size doesn't match expected size");
by default they stay in step and parity is exact again. Every row must pass for the smoke to pass.
"""

from __future__ import annotations

from fsdp_compat.testing.crashes import GLOO_MISMATCH, GRID_SAMPLER_CRASH
from fsdp_compat.testing.parity import run_training
from fsdp_compat.testing.smoke import SmokeRow, format_smoke_table

__all__ = ["GRID_SAMPLER_CRASH", "MIXED_BATCH_MISMATCH", "run"]

MIXED_BATCH_MISMATCH = GLOO_MISMATCH
_LEGACY, _AUTO = "fsdp_compat.testing.wraps:core_legacy", "fsdp_compat.testing.wraps:core_auto"
_GUARD_OFF = {"FSDP_COMPAT_GUARD": "off"}  # the guard would turn the legacy crash into parity
_MIXED_OFF = {"FSDP_COMPAT_MIXED_BATCHES": "off"}

_CASES = (  # case, wrap, env, images on rank 0 only, expected, crash text
    ("legacy", _LEGACY, _GUARD_OFF, False, "crash", GRID_SAMPLER_CRASH),
    ("auto", _AUTO, None, False, "ok", ""),
    ("auto, rank 1 without images, alignment off", _AUTO, _MIXED_OFF, True, "crash", MIXED_BATCH_MISMATCH),
    ("auto, rank 1 without images", _AUTO, None, True, "ok", ""),
)


def run(world_size: int = 2, steps: int = 3, device: str = "cpu", timeout_s: float = 300.0) -> list[SmokeRow]:
    """The four rows above; on NCCL the mixed-batch mismatch is a hang, so the harness deadline ends that row."""
    rows = []
    for case, wrap, env, mixed, expected, text in _CASES:
        variants = ["image"] + ["text"] * (world_size - 1) if mixed else None
        if mixed and world_size < 2:
            continue  # one rank cannot disagree with itself
        deadline = 60.0 if expected == "crash" and mixed else timeout_s
        result = run_training(
            "glm4v", wrap, world_size=world_size, steps=steps, device=device, timeout_s=deadline, env=env,
            variants=variants,
        )  # fmt: skip
        if expected == "crash" and mixed and device != "cpu":
            text = "timed out"
        rows.append(SmokeRow.from_run("core", case, expected, result, expect_text=text))
    return rows


if __name__ == "__main__":
    import sys

    table_rows = run()
    print(format_smoke_table(table_rows))
    sys.exit(0 if all(r.passed for r in table_rows) else 1)
