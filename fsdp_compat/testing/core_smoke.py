"""The core FSDP2 smoke: tiny GLM4V on real gloo ranks, upstream rule versus fsdp-compat's plan.

``legacy`` (the verl/SkyRL selection) must reproduce the real crash; ``auto`` must train with exact parity
against a single process. Both rows must pass for the smoke to pass.
"""

from __future__ import annotations

from fsdp_compat.testing.harness import SmokeRow, format_smoke_table, run_training

__all__ = ["GRID_SAMPLER_CRASH", "run"]

GRID_SAMPLER_CRASH = "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor"

_CASES = (
    ("legacy", "fsdp_compat.testing.wraps:core_legacy", "crash", GRID_SAMPLER_CRASH),
    ("auto", "fsdp_compat.testing.wraps:core_auto", "ok", ""),
)


def run(world_size: int = 2, steps: int = 3, device: str = "cpu", timeout_s: float = 300.0) -> list[SmokeRow]:
    """GLM4V under ``legacy`` (expected: the grid_sampler crash) and ``auto`` (expected: parity)."""
    rows = []
    for case, wrap, expected, text in _CASES:
        env = {"FSDP_COMPAT_GUARD": "off"} if expected == "crash" else None  # the guard would turn it into parity
        result = run_training(
            "glm4v", wrap, world_size=world_size, steps=steps, device=device, timeout_s=timeout_s, env=env
        )
        rows.append(SmokeRow.from_run("core", case, expected, result, expect_text=text))
    return rows


if __name__ == "__main__":
    import sys

    table_rows = run()
    print(format_smoke_table(table_rows))
    sys.exit(0 if all(r.passed for r in table_rows) else 1)
