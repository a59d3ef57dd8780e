"""Smoke tables: one row per framework and case (expected crash or parity), printed as plain text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_compat.testing.launch import current_wording

if TYPE_CHECKING:
    from fsdp_compat.testing.launch import RunResult

__all__ = ["SmokeRow", "format_smoke_table"]


@dataclass
class SmokeRow:
    """One line of a smoke table: a framework/case, what should happen, and what did."""

    framework: str  # "core", "verl 0.9.1", "skyrl-train 0.3.1"
    case: str  # "legacy", "auto", "unpatched", "patched (pth hook)"...
    expected: str  # "crash" | "ok"
    outcome: str  # "crash" | "ok"
    detail: str  # the crash's exception line, or "parity Δgrad=0.0 Δparam=0.0"
    max_rel_grad_diff: float | None
    max_rel_param_diff: float | None
    seconds: float
    expect_text: str = ""  # for expected crashes: text the exception line must contain
    tolerance: float = 0.0  # for expected parity: the max relative difference accepted (0.0: exact)

    @property
    def passed(self) -> bool:
        if self.outcome != self.expected:
            return False
        if self.expected == "crash":  # older torches word some crashes differently
            return self.expect_text in current_wording(self.detail)
        return (
            self.max_rel_grad_diff is not None
            and self.max_rel_param_diff is not None
            and self.max_rel_grad_diff <= self.tolerance  # NaN fails: every comparison with NaN is False
            and self.max_rel_param_diff <= self.tolerance
        )

    @classmethod
    def from_run(
        cls,
        framework: str,
        case: str,
        expected: str,
        run: RunResult,
        *,
        expect_text: str = "",
        tolerance: float = 0.0,
    ) -> SmokeRow:
        """Summarise a :class:`RunResult` as a row. A crash's detail is the line naming ``expect_text`` in any
        rank's report (an aborted rank leaves only its output), else the first failing rank's exception line."""
        if run.ok:
            g, p = run.max_rel_grad_diff, run.max_rel_param_diff
            detail = f"parity Δgrad={_fmt(g)} Δparam={_fmt(p)}"
            return cls(framework, case, expected, "ok", detail, g, p, run.seconds, expect_text, tolerance)
        detail = run.exception or ""
        if expect_text and expect_text not in current_wording(detail):
            texts = [current_wording(f"{r.error or ''}\n{r.extra.get('log_tail', '')}") for r in run.failing_ranks]
            lines = [ln[ln.index(expect_text) :] for text in texts for ln in text.splitlines() if expect_text in ln]
            detail = f"(a rank aborted) {lines[0]}" if lines else detail
        return cls(framework, case, expected, "crash", detail, None, None, run.seconds, expect_text, tolerance)


def _fmt(x: float) -> str:
    return "0.0" if x == 0 else f"{x:.3g}"


def format_smoke_table(rows: list[SmokeRow]) -> str:
    """A plain-text table: one row per case, PASS/FAIL, and the crash line or the parity figures."""
    header = ("framework", "case", "expected", "outcome", "result", "seconds", "detail")
    body = [
        (
            r.framework,
            r.case,
            r.expected,
            r.outcome,
            "PASS" if r.passed else "FAIL",
            f"{r.seconds:.1f}",
            r.detail.splitlines()[0] if r.detail else "",
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    widths[-1] = 0  # the detail column is last and not padded
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (header, *body)]
    lines.insert(1, "  ".join("-" * max(w, 6) for w in widths).rstrip())
    return "\n".join(lines)
