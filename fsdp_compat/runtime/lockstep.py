"""The generic alignment's rounds, without a process group: every rank's report at a sync point in, what each rank
does next out.

A model without a family row is aligned by replaying what a rank with media runs (:mod:`.replay`). In a forward
where the ranks' media differ, every rank stops at each FSDP2 group's pre-forward (before its all-gather) and at the
root's forward end, and reports where it is (the group's index, or :data:`END`), how many media calls it started
since its last report, and whether the last of them is still running. The ranks run the same groups in the same order
except inside media calls, so the reports agree unless a rank made a media call another did not:

* a rank with fewer calls replays the missing ones (the calls of the rank that made the most, recorded there);
* where that rank is still inside its call (stopped at the call's first group), a rank that replays the call
  meets it there: the replay's first group is that round's stop (it skips its own report there), and the replaying
  rank reports again where it was once the replay returns;
* where the calls ended before the stop (a media call without a group of its own), every rank reports again at the
  same stop after the replays;
* a rank with fewer calls that stands where the callers stand is running the same module already (a dummy call of
  the model's own, VeOmni's say): it owes nothing;
* anything else (ranks at different groups with no call to explain it) is a divergence: every rank raises the same
  error before the all-gather that would not pair.

Nothing here touches torch: :mod:`.replay` binds it to a model's hooks, tests/runtime/test_lockstep.py checks it on
tables alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["END", "Report", "Round", "settle"]

#: Where a rank stands at the root's forward end (group indices count from 0).
END = -1


@dataclass(frozen=True)
class Report:
    """One rank at a stop: ``where`` (its group index, or :data:`END`), ``started`` (media calls started since its
    last report) and ``running`` (the last of them has not returned)."""

    where: int
    started: int = 0
    running: bool = False

    def row(self) -> tuple[int, int, int]:
        return self.where, self.started, int(self.running)

    @classmethod
    def of(cls, row: tuple[int, ...]) -> Report:
        return cls(int(row[0]), int(row[1]), bool(row[2]))


@dataclass(frozen=True)
class Round:
    """What the ranks do after one round of reports. ``owed``: rank -> the calls it replays, as indices into the
    ``source`` rank's calls of this round (in order); ``meets``: the replaying ranks' last replay skips the report at
    its first group (the source stands there); ``again``: the ranks that report again at this stop;
    ``diverged``: no replay explains where the ranks stand (every rank raises)."""

    owed: Mapping[int, range]
    source: int | None = None
    meets: bool = False
    again: frozenset[int] = frozenset()
    diverged: bool = False

    @property
    def agreed(self) -> bool:
        return not self.owed and not self.again and not self.diverged


_AGREED = Round({})
_DIVERGED = Round({}, diverged=True)


def settle(reports: Mapping[int, Report]) -> Round:
    """The round every rank computes from the same ``reports`` (rank -> its report)."""
    if not reports:
        raise ValueError("a round has at least one rank's report")
    most = max(r.started for r in reports.values())
    callers = sorted(rank for rank, r in reports.items() if r.started == most)
    fewer = {rank: r for rank, r in reports.items() if r.started < most}
    wheres = {r.where for r in reports.values()}
    if not fewer:
        return _AGREED if len(wheres) == 1 else _DIVERGED
    running = {reports[rank].running for rank in callers}
    if len(running) > 1 or len({reports[rank].where for rank in callers}) > 1:
        return _DIVERGED
    source, at = callers[0], reports[callers[0]].where
    if running.pop():
        # the callers stand at their call's first group: a rank there too runs that module already
        owed = {rank: range(r.started, most) for rank, r in fewer.items() if r.where != at}
        if any(fewer[rank].running for rank in owed) or len({fewer[rank].where for rank in owed}) > 1:
            return _DIVERGED
        if not owed:
            return _AGREED
        return Round(owed, source, meets=True, again=frozenset(owed))
    if len(wheres) > 1:  # the calls ended before this stop: every rank stands at the same one
        return _DIVERGED
    owed = {rank: range(r.started, most) for rank, r in fewer.items()}
    return Round(owed, source, again=frozenset(reports))
