"""Byte sizes as people read them, one way everywhere (plan reasons, guard messages, the CLI, the benchmarks)."""

from __future__ import annotations

__all__ = ["fmt_bytes"]


def fmt_bytes(n: float, *, decimals: int | None = 1) -> str:
    """Binary units up to TiB: whole bytes as an integer (``512 B``), larger sizes with ``decimals`` places
    (``8.0 KiB``; the CLI's tables use 2), or ``decimals=None``: three significant figures (``69.1 KiB``,
    ``470 KiB``; the benchmark tables)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            if decimals is None:
                return f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}"
            return f"{n:.{decimals}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
