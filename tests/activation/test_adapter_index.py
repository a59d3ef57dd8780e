"""The adapter index ``fsdp_compat.adapters.ADAPTERS`` and the release tables, against oracles written here again,
independently of the index (the frameworks' own module names and the releases the tox envs install, tox.ini):
triggers and ranges, a table row for every supported release, and the public names users import.
"""

from __future__ import annotations

import importlib

import lab.fakes as fakes
import pytest
from fsdp_compat.adapters import ADAPTERS
from packaging.version import Version

from fsdp_compat import activation

# the folder's fixtures live in lab.fakes (a conftest.py here would shadow tests/conftest.py, which test modules
# import by name); pytest finds a fixture by the name bound in the test module
_clean_env = fakes._clean_env


def test_index_is_the_one_home_of_triggers_and_ranges() -> None:
    """Oracle written independently of the index, on purpose: the module that defines verl's ``apply_fsdp2`` and
    SkyRL's ``fsdp_utils`` in each package layout, and the supported releases (docs/stacks.md)."""
    from fsdp_compat.adapters import skyrl, verl

    assert (ADAPTERS["verl"].module, tuple(ADAPTERS["verl"].triggers)) == (
        "fsdp_compat.adapters.verl",
        ("verl.utils.fsdp_utils",),
    )
    assert (ADAPTERS["skyrl"].module, tuple(ADAPTERS["skyrl"].triggers)) == (
        "fsdp_compat.adapters.skyrl",
        ("skyrl_train.distributed.fsdp_utils", "skyrl.backends.skyrl_train.distributed.fsdp_utils"),
    )
    assert verl.SUPPORTED == {"verl": ">=0.4.0,<0.10.0a0"} and verl.ADAPTER.supported is not None
    assert skyrl.SUPPORTED == {"skyrl-train": ">=0.1.0,<0.4", "skyrl": ">=0.1.0,<0.5"}
    assert verl.ADAPTER.trigger_modules == ("verl.utils.fsdp_utils",)


#: every release fsdp-compat was run or read on (oracle: the tox envs, docs/stacks.md), and one outside each range
KNOWN_RELEASES = {
    ("fsdp2", "torch"): ["2.8.0", "2.10.0", "2.11.0", "2.13.0+cpu", "2.14.1", "2.15.0"],
    ("verl", "verl"): ["0.4.0", "0.4.1", "0.5.0", "0.6.0", "0.6.1", "0.7.0", "0.7.1", "0.8.0", "0.9.0", "0.9.1"],
    ("skyrl", "skyrl-train"): ["0.1.0", "0.2.0", "0.3.0", "0.3.1"],
    ("skyrl", "skyrl"): ["0.1.0", "0.2.0", "0.3.0", "0.4.0"],
    ("transformers", "transformers"): ["5.16.1", "5.17.0", "5.20.0", "5.22.0", "5.23.0", "5.24.0", "5.25.0"],
    ("areal", "areal"): ["1.0.4"],
    ("llamafactory", "llamafactory"): ["0.9.5"],
    ("accelerate", "accelerate"): ["1.15.0", "1.16.0"],
    ("nemo_automodel", "nemo-automodel"): ["0.7.0"],
    ("axolotl", "axolotl"): ["0.19.0", "0.21.0"],
    ("verl_copies", "lmms-engine"): ["0.1.4"],
    ("verl_copies", "siirl"): ["0.2.0"],
    ("verl_copies", "trinity-rft"): ["0.6.0"],
}


OUTSIDE = {"verl": "0.3.1", "skyrl-train": "0.4.0", "skyrl": "0.0.1", "transformers": "5.10.4", "areal": "1.0.3",
           "accelerate": "1.14.0", "nemo-automodel": "0.8.0", "torch": "2.7.1", "axolotl": "0.18.0",
           "lmms-engine": "0.1.5", "siirl": "0.2.1", "trinity-rft": "0.7.0"}


@pytest.mark.parametrize(("key", "distribution"), list(KNOWN_RELEASES))
def test_every_supported_release_has_its_table_row(key: str, distribution: str) -> None:
    """The index says which versions are supported, the release table what to do for each: they must agree."""
    module = importlib.import_module(f"fsdp_compat.adapters.{key}")
    adapter = module.ADAPTER
    for raw in KNOWN_RELEASES[key, distribution]:
        version = Version(raw)
        assert adapter.is_supported(distribution, version), (distribution, raw)
        row = adapter.release_for(distribution, version)
        assert row is not None and row.replacements, (distribution, raw)
    outside = OUTSIDE.get(distribution)
    if outside is not None:
        assert not adapter.is_supported(distribution, Version(outside)), (distribution, outside)


def test_public_names_keep_working() -> None:
    """What users and the entry point import (stable across the redesign)."""
    from fsdp_compat.adapters import skyrl, verl

    for module in (verl, skyrl):
        assert module.patch == module.ADAPTER.patch and module.unpatch == module.ADAPTER.unpatch
        assert module.is_patched == module.ADAPTER.is_patched and isinstance(module.SUPPORTED, dict)
        assert callable(module.make_apply_fsdp2) and module.RELEASES
    assert callable(verl.make_select_fsdp2_wrap_targets) and callable(skyrl.make_modules_to_wrap_fsdp2)
    assert verl.release_for(Version("0.9.1")).name == "_select_fsdp2_wrap_targets"
    assert verl.release_for(Version("0.6.0")).importers[-1] == "verl.workers.engine.fsdp.transformer_impl"
    assert {activation.ENV_SWITCH, activation.ENV_AUTOLOAD, activation.ENV_POLICY, activation.ENV_FORCE} == {
        "FSDP_COMPAT",
        "FSDP_COMPAT_AUTOLOAD",
        "FSDP_COMPAT_POLICY",
        "FSDP_COMPAT_FORCE",
    }
    assert activation.ENV_LOG == "FSDP_COMPAT_LOG"
    from importlib import metadata

    points = [ep.value for ep in metadata.entry_points(group="verl.plugins") if ep.name == "fsdp_compat"]
    assert points == ["fsdp_compat.adapters.verl"], points


@pytest.mark.parametrize("key", sorted(ADAPTERS))
def test_importing_an_adapter_imports_no_torch_and_no_analysis(key: str) -> None:
    """An adapter module is loaded by the .pth hook or a framework's entry point, often before the job needs it: its
    replacements import the planner, the safety checker and torch when they run, not when the adapter loads (the
    start-up benchmark measured +6 ms on ``import verl`` when ``_selection`` imported the checker at load time)."""
    done = fakes._run(
        f"""
        import sys
        import fsdp_compat.adapters.{key}
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("fsdp_compat.analysis",
                       "fsdp_compat.safety", "fsdp_compat.plan", "fsdp_compat.repair")))
        assert heavy == [], heavy
        print("OK")
        """
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


def test_each_adapter_names_its_framework_one_way_in_its_warnings() -> None:
    """The selection helpers log the framework by the name each call passes (AReaL's adapter once wrote "areal" in
    one warning and "AReaL" in another): every adapter module passes one name."""
    import ast
    from pathlib import Path

    import fsdp_compat.adapters as package

    helpers = {"keep_safe", "outdated_fallback", "warn_unmatched"}
    for source in sorted(Path(package.__file__).parent.glob("[!_]*.py")):  # the adapters, not the helpers
        calls = [
            node
            for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers
        ]
        names = {c.args[0].value for c in calls if c.args and isinstance(c.args[0], ast.Constant)}
        assert len(names) <= 1, (source.name, sorted(names))
        assert all(c.args and isinstance(c.args[0], ast.Constant) for c in calls), source.name
