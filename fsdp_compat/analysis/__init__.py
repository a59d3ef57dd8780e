"""Static analysis: find parameter reads that happen outside the owning module's forward.

FSDP2 unshards a group only inside its module's forward (and backward). A module may therefore own a group only if
every read of its parameters happens there. This module reads the code that actually runs - each module's current
``forward`` (so a framework's monkey-patched forward counts), ``__call__`` overrides, forward hooks and pre-hooks,
and every Python method, property, function, closure and ``functools.partial`` that code hands a module to - and
reports where that code can reach a Parameter of another module.

It is conservative by construction: it models a short list of constructs exactly and treats everything else as an
*escape*. Modelled: attribute chains through registered children, parameters and plain attributes; constant and
computed indexing of containers; iteration (``for``, comprehensions, ``enumerate``/``zip``/``reversed``); local
aliases (flow-insensitive, tuple unpacking included); calling a module (its hooks run: FSDP2 unshards there);
calling or reading a Python method/property/function/closure/partial (followed, with the modules it is given bound
to its parameters, and its return value tracked); metadata of a Parameter (``.shape``, ``.dtype``...); identity
tests, truth tests and ``isinstance``-style builtins on a module; dynamic access Python resolves from constants
(``getattr`` with a name bound only to constant strings or a module-level constant, ``_modules``/``_parameters``
/``vars(...)``/``__dict__`` with a constant key, ``get_submodule``/``get_parameter``, ``operator.attrgetter``),
``modules()``/``named_parameters()``-style loops narrowed by an ``isinstance`` or constant-name test, and helpers
reached through a namespace object. A Parameter held in a local counts as read when it was fetched. Any other
use of a reference to a module or a Parameter - passed to code that is not followed, stored, returned from a
forward, reflected on (``_modules`` as a whole, ``vars``, ``getattr`` with a computed name), used as a value -
counts as a read, at that point and by the module whose code runs, of every Parameter below the reference (matched
by Parameter identity, so a wrapper that forwards ``.weight`` to an inner module is charged to the inner module).
Source it cannot read makes the module *opaque*: the planner then assumes it may read anything below it.

"After its own forward" is decided by a must-analysis over the control flow (branches, loops, early returns,
``try``): a read counts as after module M's call only if M was called earlier on every path to the read.

Known limits (the run-time guard covers them): objects reached only through ``gc``, C extensions or code
registered after planning; backward hooks; more than four levels of plain Python containers.

The package, one module per job: ``names`` (what is modelled by name), ``evidence`` (what is reported), ``refs``
(the facts' vocabulary), ``constants`` and ``collector`` (facts collection from source), ``facts`` (the cached
entry to it), ``resolver`` (references against real objects) and ``interpreter`` (the run over a tree).
"""

from fsdp_compat.analysis.evidence import Analysis, RawRead
from fsdp_compat.analysis.facts import function_facts
from fsdp_compat.analysis.interpreter import find_raw_reads
from fsdp_compat.analysis.names import INERT_CALLS, METADATA_ATTRS, MODULE_GETTERS, Step

__all__ = [
    "INERT_CALLS",
    "METADATA_ATTRS",
    "MODULE_GETTERS",
    "Analysis",
    "RawRead",
    "Step",
    "find_raw_reads",
    "function_facts",
]
