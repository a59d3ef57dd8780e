"""The SkyRL smoke: tiny GLM4V on real gloo ranks through the name SkyRL calls, ``fsdp_strategy.apply_fsdp2``.

Whatever SkyRL release is installed (``skyrl-train`` or ``skyrl``), each rank builds SkyRL's own FSDP config
object and ``fsdp_kwargs`` the way ``FSDPStrategy._fsdp_init_model`` does (fp32 mixed-precision policy, so
parity is exact) and calls ``fsdp_strategy.apply_fsdp2(model, fsdp_kwargs, config)``:

- ``unpatched`` (``FSDP_COMPAT=off``): the upstream crash: the grid_sampler error, or, on releases that index
  the transformers-5 *set* ``_no_split_modules`` with ``[0]``, the ``TypeError`` when no wrap policy is set;
- ``patched (pth hook)``: nothing imports fsdp_compat's adapter; the installed ``.pth`` patches SkyRL when its
  ``fsdp_utils`` is imported; expected: exact fp32 parity against a single process;
- ``patched (explicit import)``: ``import fsdp_compat.adapters.skyrl`` before SkyRL, ``.pth`` hooks off.

The ``wrap_*`` and ``probe`` functions are the rank side (harness wrap fns). They import no fsdp_compat
adapter unless named so, which is what makes the ``.pth`` row a real test of automatic activation.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_compat import switches
from fsdp_compat.known_limits import SKYRL_GLM4V_POLICY_RELEASES, skyrl_loads_glm4v
from fsdp_compat.testing.crashes import GRID_SAMPLER_CRASH
from fsdp_compat.testing.parity import run_training
from fsdp_compat.testing.smoke import SmokeRow, format_smoke_table

__all__ = [
    "ENV_CONFIG",
    "GLM4V_CRITIC_ERROR",
    "GLM4V_LOAD_ERROR",
    "GRID_SAMPLER_CRASH",
    "MPP_IMPORT_ERROR",
    "SET_INDEX_CRASH",
    "installed_skyrl",
    "loads_glm4v",
    "probe",
    "run",
    "skyrl_config",
    "strategy_module",
    "wrap_explicit",
    "wrap_strategy",
]

SET_INDEX_CRASH = "TypeError: 'set' object is not subscriptable"
MPP_IMPORT_ERROR = "cannot import name 'MixedPrecisionPolicy'"

#: Releases whose apply_fsdp2 indexes ``_no_split_modules`` with [0] (a set in transformers 5).
SET_INDEX_RELEASES = {"skyrl-train": SpecifierSet("<0.4"), "skyrl": SpecifierSet("<0.2")}

#: Releases whose policy/ref model loads GLM4V: the one home is :mod:`fsdp_compat.known_limits` (doctor prints it).
VLM_POLICY_RELEASES = {dist: SpecifierSet(spec) for dist, spec in SKYRL_GLM4V_POLICY_RELEASES.items()}
GLM4V_LOAD_ERROR = (
    "ValueError: Unrecognized configuration class <class 'transformers.models.glm4v.configuration_glm4v.Glm4vConfig'>"
    " for this kind of AutoModel: AutoModelForCausalLM."
)
GLM4V_CRITIC_ERROR = "AttributeError: 'Glm4vConfig' object has no attribute 'hidden_size'"


def loads_glm4v(distribution: str, version: Version) -> bool:
    """Whether this SkyRL release's policy (and ref) model builder can load GLM4V."""
    return skyrl_loads_glm4v(distribution, version)


#: Rank-side choice of SkyRL config: "default" (the release's shipped defaults, no wrap policy), "explicit"
#: (wrap_policy.transformer_layer_cls_to_wrap names GLM4V's layer classes), "text-only" (only the text
#: decoder layer); a "dictconfig-" prefix gives skyrl an OmegaConf DictConfig instead of its FSDPConfig.
ENV_CONFIG = "FSDP_COMPAT_SKYRL_CONFIG"

GLM4V_LAYERS = ["Glm4vTextDecoderLayer", "Glm4vVisionBlock"]
_CONFIG_LAYERS: dict[str, list[str] | None] = {
    "default": None,
    "explicit": GLM4V_LAYERS,
    "text-only": ["Glm4vTextDecoderLayer"],
}

_PACKAGES = {"skyrl": "skyrl.backends.skyrl_train.distributed", "skyrl-train": "skyrl_train.distributed"}


# ------------------------------------------------------------------------------------------------- rank side


def installed_skyrl() -> tuple[str, Version] | None:
    """The installed SkyRL distribution and version (importlib.metadata, no import); ``skyrl`` first."""
    for distribution in _PACKAGES:
        try:
            return distribution, Version(metadata.version(distribution))
        except metadata.PackageNotFoundError:
            continue
    return None


def _require_skyrl() -> tuple[str, Version]:
    found = installed_skyrl()
    if found is None:
        raise RuntimeError("no SkyRL distribution is installed: pip install skyrl (or skyrl-train)")
    return found


def strategy_module() -> ModuleType:
    """SkyRL's ``fsdp_strategy`` module of the installed release (it imports ``fsdp_utils`` first)."""
    distribution, _ = _require_skyrl()
    return importlib.import_module(f"{_PACKAGES[distribution]}.fsdp_strategy")


def skyrl_config(case: str | None = None) -> Any:
    """The FSDP config object the installed release hands to ``apply_fsdp2``.

    skyrl-train: an OmegaConf ``DictConfig`` equal to ``trainer.policy.fsdp_config`` of its shipped
    ``ppo_base_config.yaml``; skyrl: its ``FSDPConfig`` dataclass (or a DictConfig for ``dictconfig-*``).
    """
    from omegaconf import OmegaConf

    case = case or switches.text(ENV_CONFIG, "default")
    layers = _CONFIG_LAYERS.get(case.removeprefix("dictconfig-"), ())
    if layers == ():
        raise ValueError(f"{ENV_CONFIG}={case!r}: expected [dictconfig-]default, explicit or text-only")
    distribution, _ = _require_skyrl()
    wrap_policy = {"transformer_layer_cls_to_wrap": list(layers)} if layers else None
    if distribution == "skyrl-train":
        base: dict[str, Any] = {"cpu_offload": False, "reshard_after_forward": True, "fsdp_size": -1}
        if wrap_policy:
            base["wrap_policy"] = wrap_policy
        return OmegaConf.create(base)
    from skyrl.train.config import FSDPConfig

    config = FSDPConfig(wrap_policy=dict(wrap_policy or {}))
    return OmegaConf.structured(config) if case.startswith("dictconfig") else config


def skyrl_fsdp_kwargs(strategy: ModuleType, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fsdp_kwargs`` as ``_fsdp_init_model`` builds them (mesh, mp_policy, offload_policy, reshard)."""
    import torch

    mp_policy = strategy.MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    return {"mp_policy": mp_policy, "offload_policy": None, **fsdp_kwargs}


def _adapter_state() -> dict[str, Any]:
    adapter_module = sys.modules.get("fsdp_compat.adapters.skyrl")
    adapter = getattr(adapter_module, "ADAPTER", None)
    if adapter is None:
        return {"adapter_loaded": False, "patched": False, "activated_by": None, "describe": []}
    return {
        "adapter_loaded": True,
        "patched": adapter.is_patched(),
        "activated_by": adapter.activated_by,
        "describe": adapter.describe(),
    }


def _is_replacement(fn: Any) -> bool:
    return bool(getattr(fn, "__fsdp_compat__", False))


def wrap_strategy(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Harness wrap fn: import SkyRL's ``fsdp_strategy`` and call its ``apply_fsdp2`` with SkyRL's config."""
    adapter_before = "fsdp_compat.adapters.skyrl" in sys.modules
    strategy = strategy_module()
    distribution, version = _require_skyrl()
    utils = sys.modules[f"{_PACKAGES[distribution]}.fsdp_utils"]
    info = {
        "release": f"{distribution} {version}",
        "adapter_imported_before_skyrl": adapter_before,
        "strategy_apply_fsdp2_patched": _is_replacement(strategy.apply_fsdp2),
        "utils_apply_fsdp2_patched": _is_replacement(utils.apply_fsdp2),
        "config": type(skyrl_config()).__name__,
        **_adapter_state(),
    }
    strategy.apply_fsdp2(model, skyrl_fsdp_kwargs(strategy, fsdp_kwargs), skyrl_config())
    return info


def wrap_explicit(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Harness wrap fn: ``import fsdp_compat.adapters.skyrl`` (explicit activation), then SkyRL."""
    importlib.import_module("fsdp_compat.adapters.skyrl")
    return wrap_strategy(model, fsdp_kwargs)


def probe() -> dict[str, Any]:
    """Harness probe: the adapter's state in this rank after training."""
    return _adapter_state()


# ----------------------------------------------------------------------------------------------- parent side


def _crash_text(distribution: str, version: Version, config_case: str) -> str:
    if config_case == "default" and version in SET_INDEX_RELEASES[distribution]:
        return SET_INDEX_CRASH
    return GRID_SAMPLER_CRASH


def run(
    world_size: int = 2,
    steps: int = 3,
    device: str = "cpu",
    timeout_s: float = 300.0,
    *,
    rank_module: str = "fsdp_compat.testing.skyrl_smoke",
    env: dict[str, str] | None = None,
) -> list[SmokeRow]:
    """Unpatched (crash expected) and patched (parity expected) rows for the installed SkyRL release.

    ``rank_module`` names the module holding the rank-side functions (a test module may wrap these with its
    own interpreter workarounds); ``env`` is added to every rank's environment.
    """
    found = installed_skyrl()
    if found is None:
        missing = "no skyrl or skyrl-train distribution installed"
        return [SmokeRow("skyrl", "installed", "ok", "crash", missing, None, None, 0.0)]
    distribution, version = found
    framework = f"{distribution} {version}"
    base = dict(env or {})
    cases = [
        (
            "unpatched, no wrap policy",
            "wrap_strategy",
            {"FSDP_COMPAT": "off", ENV_CONFIG: "default"},
            "crash",
            _crash_text(distribution, version, "default"),
        ),
        (
            "unpatched, explicit wrap policy",
            "wrap_strategy",
            {"FSDP_COMPAT": "off", ENV_CONFIG: "explicit"},
            "crash",
            GRID_SAMPLER_CRASH,
        ),
        ("patched (pth hook)", "wrap_strategy", {ENV_CONFIG: "default"}, "ok", ""),
        ("patched (explicit import)", "wrap_explicit", {"FSDP_COMPAT_AUTOLOAD": "0", ENV_CONFIG: "explicit"}, "ok", ""),
    ]
    if distribution == "skyrl-train" and version == Version("0.3.1") and rank_module == __name__:
        # Released broken: without the adapter its fsdp_strategy cannot be imported at all.
        cases[0] = (cases[0][0], cases[0][1], cases[0][2], "crash", MPP_IMPORT_ERROR)
        cases[1] = (cases[1][0], cases[1][1], cases[1][2], "crash", MPP_IMPORT_ERROR)
    rows = []
    for case, fn, case_env, expected, text in cases:
        result = run_training(
            "glm4v",
            f"{rank_module}:{fn}",
            world_size=world_size,
            steps=steps,
            device=device,
            timeout_s=timeout_s,
            env={**base, **case_env},
            probe=f"{rank_module}:probe",
        )
        row = SmokeRow.from_run(framework, case, expected, result, expect_text=text)
        if expected == "ok" and result.ok and not all(r.extra.get("probe", {}).get("patched") for r in result.ranks):
            row.outcome, row.detail = "unpatched", f"trained, but the adapter was not active: {row.detail}"
        rows.append(row)
    return rows


if __name__ == "__main__":
    table_rows = run()
    print(format_smoke_table(table_rows))
    sys.exit(0 if all(r.passed for r in table_rows) else 1)
