"""What the analysis reports: one piece of evidence (``RawRead``) and the result of a run (``Analysis``).

The planner, the safety checker, the audit and the plan repair consume these; they depend on nothing else in the
package, so a consumer can import them without the machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RawRead:
    """One piece of evidence: ``reader``'s code touches ``owner`` outside ``owner``'s own forward window.

    kind: ``"raw-read"`` (a parameter used directly, or reachable from a reference that escapes the analysis),
    ``"call"`` (``owner``'s forward called from ``reader``, which matters when it skips levels of the tree), or
    ``"opaque"`` (``reader``'s source could not be read). ``after_forward_of``: modules called before this read on
    every path through the reader's code.
    """

    reader: str
    owner: str
    param: str | None
    kind: str
    location: str
    after_forward_of: frozenset[str] = field(default=frozenset(), compare=False)

    def describe(self) -> str:
        reader = self.reader or "<root>"
        if self.kind == "opaque":
            return f"{reader}: forward source unreadable ({self.location}); assumed to read anything below it"
        if self.kind == "call":
            return f"{reader} calls {self.owner}.forward directly ({self.location})"
        return f"{self.param} read raw by {reader} ({self.location})"

    def __str__(self) -> str:
        return self.describe()


@dataclass
class Analysis:
    """Everything the static pass found: evidence events and the modules it could not read."""

    events: list[RawRead]
    opaque: dict[str, str]
