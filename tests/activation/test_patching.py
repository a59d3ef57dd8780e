"""The patch transaction (``fsdp_compat.patching``) through an adapter, on throwaway modules (``lab.fakes``): a
replacement reaches the definer and every module that bound the name (declared importers, late importers, a
stranger), ``unpatch`` restores each identity, threads patch once, other wrappers survive, a failure rolls back
everything, ``deferred`` waits for its module and ``when`` is read when the row is applied.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import lab.fakes as fakes
import pytest
import wrapt
from lab.fakes import (
    FakeAdapter,
    FakeFramework,
    _write,
    tag,
)
from packaging.version import Version

from fsdp_compat.activation import (
    FsdpCompatWarning,
    Reexport,
    Replacement,
)
from fsdp_compat.errors import FsdpCompatError
from fsdp_compat.patching import Patch
from fsdp_compat.policies import Auto

# the folder's fixtures live in lab.fakes (a conftest.py here would shadow tests/conftest.py, which test modules
# import by name); pytest finds a fixture by the name bound in the test module
_clean_env = fakes._clean_env
fw = fakes.fw


# ----------------------------------------------------------------------------------------------- patch basics


def test_patch_is_idempotent_and_unpatch_restores_identity(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    imp0 = fw.mod("imp0")  # imported before the patch
    original = utils.fn
    adapter = FakeAdapter(fw)

    assert adapter.patch() is True
    replacement = utils.fn
    assert replacement is not original
    assert adapter.patch() is True  # idempotent: same objects, factory called once
    assert utils.fn is replacement and adapter.make_calls == 1
    assert imp0.fn is replacement and imp0.call(1) == ("patched", ("orig", 1))
    assert adapter.is_patched() and adapter.activated_by == "explicit"

    imp1 = fw.mod("imp1")  # imported after the patch: gets the replacement through the definer
    stranger = fw.mod("stranger")
    assert imp1.fn is replacement and stranger.fn is replacement
    assert f"{fw.pkg}.imp1.fn -> fsdp-compat (policy auto)" in adapter.describe()

    adapter.unpatch()
    adapter.unpatch()  # idempotent too
    assert not adapter.is_patched()
    for module in (utils, imp0, imp1, stranger):
        assert module.fn is original, module.__name__
    assert adapter.describe() == []


def test_declared_importer_imported_later_is_rebound_by_hook_even_if_it_held_the_original(
    fw: FakeFramework,
) -> None:
    """A module that captured the original before the patch but finished importing after it gets rebound."""
    adapter = FakeAdapter(fw)
    utils = fw.mod("utils")
    original = utils.fn
    adapter.patch()
    # an importer that bound the original although the patch is in place: the post-import hook rebinds it
    _write(fw.root / fw.pkg / "imp0.py", f"import {fw.pkg}.utils as u\nfn = u.__dict__['_saved']\n")
    utils._saved = original
    imp0 = fw.mod("imp0")
    assert imp0.fn is utils.fn is not original
    adapter.unpatch()
    assert imp0.fn is original


def test_importer_holding_another_object_is_left_alone(fw: FakeFramework) -> None:
    imp0 = fw.mod("imp0")
    mine = object.__new__(type("Other", (), {}))
    imp0.fn = mine
    adapter = FakeAdapter(fw)
    adapter.patch()
    assert imp0.fn is mine
    adapter.unpatch()
    assert imp0.fn is mine


def test_post_import_hook_does_nothing_after_unpatch(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    original = utils.fn
    adapter = FakeAdapter(fw)
    adapter.patch()
    adapter.unpatch()
    imp1 = fw.mod("imp1")  # its hook fires now, while unpatched
    assert imp1.fn is original


def test_patch_imports_the_definer_when_not_loaded(fw: FakeFramework) -> None:
    adapter = FakeAdapter(fw)
    assert f"{fw.pkg}.utils" not in sys.modules
    assert adapter.patch()
    assert fw.mod("imp0").call(2) == ("patched", ("orig", 2))
    adapter.unpatch()


# ------------------------------------------------------------------------------------------------- threads


def test_concurrent_imports_and_patch_from_threads(tmp_path: Path) -> None:
    sys.path.insert(0, str(tmp_path))
    fw = FakeFramework(tmp_path, importers=16)
    try:
        utils = fw.mod("utils")
        original = utils.fn
        early = [importlib.import_module(n) for n in fw.importer_names[:4]]
        adapter = FakeAdapter(fw)
        adapter.make_delay = 0.05
        barrier = threading.Barrier(len(fw.importer_names) - 4 + 4)
        errors: list[BaseException] = []

        def import_one(name: str) -> None:
            try:
                barrier.wait()
                importlib.import_module(name)
            except BaseException as exc:
                errors.append(exc)

        def patch_one() -> None:
            try:
                barrier.wait()
                adapter.patch()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=import_one, args=(n,)) for n in fw.importer_names[4:]]
        threads += [threading.Thread(target=patch_one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors and not any(t.is_alive() for t in threads)
        assert adapter.make_calls == 1
        replacement = utils.fn
        modules = [importlib.import_module(n) for n in fw.importer_names]
        assert all(m.fn is replacement for m in modules), [
            m.__name__ for m in modules if m.fn is not replacement
        ]
        assert early[0].call(3) == ("patched", ("orig", 3))
        adapter.unpatch()
        assert all(m.fn is original for m in modules)
    finally:
        fw.cleanup()
        sys.path.remove(str(tmp_path))


# -------------------------------------------------------------------------------------- other wrappers


def test_preexisting_wrapt_wrapper_keeps_working_and_is_restored(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    seen: list[Any] = []

    def spy(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.append(args)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(utils, "fn", spy)
    theirs = utils.fn
    imp0 = fw.mod("imp0")
    assert imp0.fn is theirs
    adapter = FakeAdapter(fw)
    adapter.patch()
    assert imp0.call(5) == ("patched", ("orig", 5)) and seen == [(5,)]  # their wrapper still runs inside ours
    adapter.unpatch()
    assert utils.fn is theirs and imp0.fn is theirs
    assert isinstance(utils.fn, wrapt.FunctionWrapper)


def test_preexisting_plain_wrapper_keeps_working_and_is_restored(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    inner = utils.fn

    @functools.wraps(inner)
    def theirs(x: Any) -> Any:
        return ("theirs", inner(x))

    utils.fn = theirs
    imp0 = fw.mod("imp0")
    adapter = FakeAdapter(fw)
    adapter.patch()
    assert imp0.call(1) == ("patched", ("theirs", ("orig", 1)))
    adapter.unpatch()
    assert utils.fn is theirs and imp0.fn is theirs


def test_wrapper_added_after_the_patch_is_left_in_place(fw: FakeFramework, caplog: Any) -> None:
    utils = fw.mod("utils")
    adapter = FakeAdapter(fw)
    adapter.patch()
    wrapt.wrap_function_wrapper(utils, "fn", lambda wrapped, instance, args, kwargs: ("late", wrapped(*args)))
    late = utils.fn
    with caplog.at_level(logging.WARNING, logger="fsdp_compat"):
        adapter.unpatch()
    assert utils.fn is late  # theirs stays; nothing breaks
    assert utils.fn(1) == ("late", ("patched", ("orig", 1)))
    assert "replaced again after fsdp-compat patched it" in caplog.text


# ------------------------------------------------------------------------------------------- all or nothing


def test_failed_second_replacement_rolls_back_everything(fw: FakeFramework) -> None:
    utils = fw.mod("utils")
    imp0 = fw.mod("imp0")
    fn, helper = utils.fn, utils.helper
    adapter = FakeAdapter(fw, fail_second=True)
    with pytest.raises(RuntimeError, match="second replacement failed on purpose"):
        adapter.patch()
    assert not adapter.is_patched()
    assert utils.fn is fn and utils.helper is helper and imp0.fn is fn and imp0.helper is helper
    # automatic activation: the same failure is a warning, never an exception in the user's import
    with pytest.warns(FsdpCompatWarning, match="rolled back; nothing stays patched"):
        assert adapter.patch(activated_by="import") is False
    assert utils.fn is fn and imp0.fn is fn


def test_missing_target_name_is_a_clear_error(fw: FakeFramework) -> None:
    class Missing(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            return Patch(
                (
                    Replacement(f"{self.fw.pkg}.utils", "fn", tag),
                    Replacement(f"{self.fw.pkg}.utils", "no_such_name", tag),
                )
            )

    utils = fw.mod("utils")
    fn = utils.fn
    with pytest.raises(FsdpCompatError, match=r"utils\.no_such_name does not exist in this release"):
        Missing(fw).patch()
    assert utils.fn is fn


# ------------------------------------------------------------------ row conditions, repairs, deferred replacements


def test_a_row_condition_is_checked_when_the_row_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Replacement(when=...)`` is read at apply time (verl's GLM4V repair: transformers >= 5), not at import."""
    import types

    from fsdp_compat.patching import apply

    module = types.ModuleType("fsdp_compat_when_probe")
    module.fn = lambda: "original"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    holds = {"now": False}
    conditional = Replacement(module.__name__, "fn", lambda original, _policy: lambda: "new", when=lambda: holds["now"])
    always = Replacement(module.__name__, "other", lambda original, _policy: original, optional=True)
    with pytest.raises(FsdpCompatError, match="nothing of this release matches"):
        apply(Patch((conditional, always)), Auto())  # condition false: left out, and nothing else applies
    assert module.fn() == "original"
    holds["now"] = True
    applied = apply(Patch((conditional,)), Auto())
    try:
        assert module.fn() == "new"
    finally:
        applied.restore()
    assert module.fn() == "original"
    from fsdp_compat.adapters import verl, verl_glm4v

    assert verl.RELEASES[-1].replacements[-1] == verl_glm4v.REPAIRS[0]  # the row is declared whatever is installed
    assert verl_glm4v.REPAIRS[0].when is verl_glm4v.transformers_5


def test_repair_is_part_of_the_transaction(fw: FakeFramework) -> None:
    """A re-export repair is applied with the replacements, rolled back with them, undone by unpatch."""
    utils = fw.mod("utils")
    repair = Reexport(f"{fw.pkg}.utils", "Restored", "collections:OrderedDict", why="test")

    class Repairing(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            return Patch(super().plan(distribution, version).replacements, (repair,))

    failing = Repairing(fw, fail_second=True)
    with pytest.raises(RuntimeError, match="on purpose"):
        failing.patch()
    assert not hasattr(utils, "Restored")  # rolled back together with the replacements
    adapter = Repairing(fw)
    assert adapter.patch()
    import collections

    assert utils.Restored is collections.OrderedDict
    assert any("Restored re-exported from collections:OrderedDict (test)" in line for line in adapter.describe())
    adapter.unpatch()
    assert not hasattr(utils, "Restored")


def test_deferred_replacement_waits_for_its_module(fw: FakeFramework) -> None:
    """A replacement in a module the framework imports late (verl's model code) is applied when it loads."""

    class Deferred(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            late = Replacement(f"{self.fw.pkg}.imp1", "call", lambda original, policy: tag(original), deferred=True)
            return Patch((*super().plan(distribution, version).replacements, late))

    adapter = Deferred(fw)
    adapter.patch()
    assert f"{fw.pkg}.imp1" not in sys.modules
    assert any("deferred" in line for line in adapter.describe())
    imp1 = fw.mod("imp1")
    assert imp1.call(2) == ("patched", ("patched", ("orig", 2)))
    adapter.unpatch()
    assert imp1.call(2) == ("orig", 2)


def test_deferred_replacement_waits_for_a_module_still_importing(fw: FakeFramework) -> None:
    """transformers' ``core_model_loading`` imports the adapter's trigger before it defines its loader: patched from
    inside that import, a deferred replacement there waits until the module finished, then reaches it and its
    by-name importers at the next import the transaction watches; unpatch restores both."""
    pkg = fw.pkg
    _write(
        fw.root / pkg / "midway.py",
        f"from {pkg} import utils\n\nutils.patch_now()\n\n\ndef call(x):\n    return ('orig', x)\n",
    )
    _write(fw.root / pkg / "later.py", f"from {pkg}.midway import call\n")

    class Deferred(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            late = Replacement(
                f"{pkg}.midway", "call", lambda original, policy: tag(original), (f"{pkg}.later",), deferred=True
            )
            return Patch((*super().plan(distribution, version).replacements, late))

    adapter = Deferred(fw)
    fw.mod("utils").patch_now = adapter.patch
    midway = fw.mod("midway")  # patched while midway runs, before it defines call
    assert adapter.is_patched() and midway.call(1) == ("orig", 1)
    assert any(f"{pkg}.midway.call (deferred" in line for line in adapter.describe())
    later = fw.mod("later")
    assert midway.call(1) == ("patched", ("orig", 1)) and later.call is midway.call
    adapter.unpatch()
    assert midway.call(1) == ("orig", 1) and later.call is midway.call


def test_deferred_replacement_of_a_name_defined_before_the_trigger_import_is_made_at_once(fw: FakeFramework) -> None:
    """verl's GLM4V forward module defines what is repaired, then (through verl's imports) the adapter's trigger:
    patched from inside that import, the name already exists, so it is replaced at once, as in a loaded module (no
    later import would reach it); unpatch restores it."""
    pkg = fw.pkg
    _write(
        fw.root / pkg / "defined_first.py",
        f"def call(x):\n    return ('orig', x)\n\n\nfrom {pkg} import utils  # noqa: E402\n\nutils.patch_now()\n",
    )

    class Deferred(FakeAdapter):
        def plan(self, distribution: str, version: Version) -> Patch:
            late = Replacement(f"{pkg}.defined_first", "call", lambda original, policy: tag(original), deferred=True)
            return Patch((*super().plan(distribution, version).replacements, late))

    adapter = Deferred(fw)
    fw.mod("utils").patch_now = adapter.patch
    module = fw.mod("defined_first")  # patched while it runs, after it defined call
    assert adapter.is_patched() and module.call(1) == ("patched", ("orig", 1))
    adapter.unpatch()
    assert module.call(1) == ("orig", 1)
