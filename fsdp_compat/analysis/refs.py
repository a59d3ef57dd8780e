"""The per-function facts' vocabulary: a reference chain, an argument, a use, and the facts of one function.

The collector produces these from source and the interpreter consumes them against real objects; both import
them from here, so neither has to import the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_compat.analysis.names import MAX_STEPS, Step


@dataclass(frozen=True)
class Ref:
    """A value reachable from ``root`` (a name of the function, or ``#n``: what call node n returned)."""

    root: str
    steps: tuple[Step, ...]

    def plus(self, step: Step) -> Ref:
        if self.steps and self.steps[-1] == ("**",) and step == ("[]", None):
            return self
        steps = (*self.steps, step)
        if len(steps) > MAX_STEPS:
            steps = (*self.steps[: MAX_STEPS - 1], ("**",))
        return Ref(self.root, steps)


Refs = frozenset[Ref]
NONE: Refs = frozenset()


@dataclass(frozen=True)
class Arg:
    refs: Refs
    kind: str  # "pos" | "star" | "kw" | "dstar"
    name: str | None = None


@dataclass(frozen=True)
class Use:
    """One expression whose value may be a module, a Parameter or a callable, and what is done with it.

    how: ``call`` (it is called with ``args``), ``value`` (any unmodelled use: a read / an escape), ``test``
    (truth test), ``inert`` (identity test, ``isinstance``...), ``iter`` (iterated), ``store`` (an attribute
    ``attr`` of it is assigned), ``return`` (returned), ``discard`` (evaluated and dropped).
    """

    index: int
    refs: Refs
    how: str
    lineno: int
    before: frozenset[int]
    args: tuple[Arg, ...] = ()
    node: int = -1
    attr: str = ""
    bases: tuple[str, ...] = ()  # the variables the expression (and a call's arguments) start from
    bound: frozenset[int] | None = None  # when some are locals: calls that ran before every binding of them


@dataclass(frozen=True)
class FunctionFacts:
    positional: tuple[str, ...]
    kwonly: tuple[str, ...]
    vararg: str | None
    kwarg: str | None
    uses: tuple[Use, ...]
    filename: str
    qualname: str
    lineno_offset: int
    exit_before: frozenset[int] = frozenset()


class Opaque(Exception):
    pass
