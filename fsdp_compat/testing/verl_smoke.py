"""The verl smoke: tiny GLM4V on real gloo ranks through the ``apply_fsdp2`` that verl itself calls.

Each rank looks ``apply_fsdp2`` up where verl's call site bound it (``workers.engine.fsdp.transformer_impl`` on
0.8+, ``workers.fsdp_workers`` on 0.4-0.7.x) and calls it with a verl-style ``fsdp_config`` dict:

- ``unpatched`` (``FSDP_COMPAT=off``): the grid_sampler crash of every FSDP2 release;
- ``patched (external_lib)``: verl's own ``import_external_libs("fsdp_compat.adapters.verl")`` after the call site
  is loaded, as verl's workers do for ``actor_rollout_ref.model.external_lib``; expected: exact fp32 parity;
- on 0.7.1+, verl's fused kernels (``use_fused_kernels``, torch backend: verl's own forward reads
  ``lm_head.weight`` raw): unpatched crashes, patched trains with parity.

The ``wrap_*`` functions and :func:`probe` are the rank side (harness wrap fns). They never import fsdp_compat's
adapter themselves (except ``wrap_external_lib``, through verl), so tests can prove which loading path patched.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from importlib import metadata
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_compat import switches
from fsdp_compat.testing.crashes import GRID_SAMPLER_CRASH
from fsdp_compat.testing.parity import run_training
from fsdp_compat.testing.smoke import SmokeRow, format_smoke_table

__all__ = [
    "ADAPTER_MODULE",
    "FUSED_CRASH",
    "GRID_SAMPLER_CRASH",
    "call_site",
    "enable_verl_fused_kernels",
    "glm4v_position_ids",
    "installed_verl",
    "probe",
    "run",
    "verl_config",
    "wrap_external_lib",
    "wrap_fused",
    "wrap_verl",
]

FUSED_CRASH = "got mixed torch.Tensor and DTensor"
ADAPTER_MODULE = "fsdp_compat.adapters.verl"

#: where verl calls ``apply_fsdp2`` (the name bound by ``from verl.utils.fsdp_utils import apply_fsdp2``)
CALL_SITES: tuple[tuple[str, str], ...] = (
    (">=0.8.0", "verl.workers.engine.fsdp.transformer_impl"),
    (">=0.4.0,<0.8.0", "verl.workers.fsdp_workers"),
)
#: releases that give an untied lm_head its own group (so verl's fused kernels crash unpatched)
LM_HEAD_GROUP = SpecifierSet(">=0.7.1")


def installed_verl() -> Version | None:
    """The installed verl version (importlib.metadata, no import)."""
    try:
        return Version(metadata.version("verl"))
    except metadata.PackageNotFoundError:
        return None


def _require_verl() -> Version:
    version = installed_verl()
    if version is None:
        raise RuntimeError("verl is not installed: pip install --no-deps verl==X plus its minimal deps (README)")
    return version


def call_site(version: Version | None = None) -> str:
    """The module whose ``apply_fsdp2`` binding verl's workers call for this release."""
    version = version or _require_verl()
    for spec, module in CALL_SITES:
        if SpecifierSet(spec).contains(version, prereleases=True):
            return module
    raise RuntimeError(f"verl {version} has no FSDP2 call site (FSDP2 arrived in 0.4.0)")


def verl_config() -> dict[str, Any]:
    """A verl ``fsdp_config`` as a plain dict: the shipped default (no wrap-list override, no prefetch)."""
    layers = switches.text("FSDP_COMPAT_VERL_LAYERS") or None
    wrap_policy: dict[str, Any] = {"min_num_params": 0}
    if layers:
        wrap_policy["transformer_layer_cls_to_wrap"] = layers.split(",")
    return {"wrap_policy": wrap_policy, "forward_prefetch": False}


def _call_verl(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    site = importlib.import_module(call_site())
    apply_fsdp2 = site.apply_fsdp2
    apply_fsdp2(model, fsdp_kwargs, verl_config())
    return {"call_site": site.__name__, "apply_fsdp2_patched": bool(getattr(apply_fsdp2, "__fsdp_compat__", 0))}


def wrap_verl(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """verl's own ``apply_fsdp2`` as its call site binds it; whatever activation the environment gives."""
    return {**_call_verl(model, fsdp_kwargs), **probe()}


def wrap_external_lib(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Like verl's workers with ``model.external_lib``: call site loaded, then ``import_external_libs``."""
    importlib.import_module(call_site())
    from verl.utils.import_utils import import_external_libs

    import_external_libs(ADAPTER_MODULE)
    return wrap_verl(model, fsdp_kwargs)


def enable_verl_fused_kernels(model: Any) -> None:
    """Turn on verl's own fused-kernel forward (torch backend, runs on CPU) and give its output a ``.loss``.

    verl's forward returns log-probs, not a loss; the harness needs ``.loss``. The wrapper keeps
    ``__wrapped__`` (functools.wraps) so static analysis still sees verl's forward and its raw ``lm_head.weight``
    read. The class forward is swapped (as verl does), so the harness's reference copy runs it too.
    """
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    cls = type(model)
    fused = cls.forward
    if getattr(fused, "__fsdp_compat_loss__", False):
        return

    @functools.wraps(fused)
    def forward(self: Any, *args: Any, labels: Any = None, **kwargs: Any) -> Any:
        import torch

        kwargs.setdefault("return_dict", True)  # verl's dense forward requires it
        if getattr(self.config, "model_type", "") == "glm4v" and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = glm4v_position_ids(self, kwargs)
        out = fused(self, *args, **kwargs)  # labels=None: verl rolls input_ids (no -100 ids to gather)
        if labels is not None:
            mask = torch.roll(labels, shifts=-1, dims=-1) != -100
            out.loss = -(out.log_probs.float() * mask).sum() / mask.sum()
        return out

    forward.__fsdp_compat_loss__ = True  # type: ignore[attr-defined]
    cls.forward = forward


def glm4v_position_ids(model: Any, batch: dict[str, Any]) -> Any:
    """verl's GLM4V forward takes (4, B, L) position ids: text positions, then the 3 mrope rows (as verl's
    datasets build them)."""
    import inspect

    import torch

    input_ids = batch["input_ids"]
    get_rope_index = model.model.get_rope_index
    kwargs = {"image_grid_thw": batch.get("image_grid_thw"), "attention_mask": batch.get("attention_mask")}
    if "mm_token_type_ids" in inspect.signature(get_rope_index).parameters:  # transformers 5
        kwargs["mm_token_type_ids"] = batch.get("mm_token_type_ids")
    vision, _ = get_rope_index(input_ids, **kwargs)
    text = torch.arange(input_ids.shape[-1], device=input_ids.device).expand(1, *input_ids.shape)
    return torch.cat([text, vision], dim=0)


def wrap_fused(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """verl's fused kernels on (as ``use_fused_kernels=True`` does before ``apply_fsdp2``), then verl's wrap."""
    enable_verl_fused_kernels(model)
    return wrap_verl(model, fsdp_kwargs)


def wrap_fused_external_lib(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The fused-kernel run with the adapter loaded through verl's ``import_external_libs``."""
    enable_verl_fused_kernels(model)
    return wrap_external_lib(model, fsdp_kwargs)


def probe() -> dict[str, Any]:
    """This process's adapter state, read without importing the adapter (so a probe cannot activate it)."""
    module = sys.modules.get(ADAPTER_MODULE)
    adapter = getattr(module, "ADAPTER", None)
    version = installed_verl()
    state: dict[str, Any] = {
        "pid": os.getpid(),
        "verl": str(version) if version else None,
        "adapter_loaded": module is not None,
        "patched": bool(adapter and adapter.is_patched()),
        "activated_by": getattr(adapter, "activated_by", None),
        "policy": getattr(adapter, "policy_name", None),
        "describe": adapter.describe() if adapter else [],
    }
    return state


# ----------------------------------------------------------------------------------------------- the smoke


def _automatic_path(version: Version) -> str | None:
    """The zero-config loading path this environment has: verl's entry point (0.9+), else the .pth, else none."""
    import site
    from pathlib import Path

    if version in SpecifierSet(">=0.9.0") and any(
        ep.value == ADAPTER_MODULE for ep in metadata.entry_points(group="verl.plugins")
    ):
        return "entry point"
    if any((Path(d) / "fsdp_compat.pth").exists() for d in [*site.getsitepackages(), site.getusersitepackages()]):
        return "pth hook"
    return None


def _cases(version: Version) -> list[tuple[str, str, str, str, str, dict[str, str]]]:
    """(model, case, wrap fn, expected, crash text, env) for the installed release."""
    off = {"FSDP_COMPAT": "off"}
    hooks_off = {"FSDP_COMPAT_AUTOLOAD": "0", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    here = "fsdp_compat.testing.verl_smoke"
    cases = [
        ("glm4v", "unpatched", f"{here}:wrap_verl", "crash", GRID_SAMPLER_CRASH, off),
        ("glm4v", "patched (external_lib)", f"{here}:wrap_external_lib", "ok", "", hooks_off),
    ]
    automatic = _automatic_path(version)
    if automatic is not None:  # the zero-config path alone: the other automatic path is switched off
        only = {"FSDP_COMPAT_AUTOLOAD": "0"} if automatic == "entry point" else {"VERL_USE_EXTERNAL_PLUGINS": "none"}
        cases.append(("glm4v", f"patched ({automatic})", f"{here}:wrap_verl", "ok", "", only))
    if LM_HEAD_GROUP.contains(version, prereleases=True):
        cases += [
            ("qwen2", "fused kernels, unpatched", f"{here}:wrap_fused", "crash", FUSED_CRASH, off),
            ("qwen2", "fused kernels, patched", f"{here}:wrap_fused_external_lib", "ok", "", hooks_off),
        ]
    return cases


def run(world_size: int = 2, steps: int = 3, device: str = "cpu", timeout_s: float = 300.0) -> list[SmokeRow]:
    """GLM4V through verl's own ``apply_fsdp2``: unpatched must crash, patched must match a single process."""
    version = _require_verl()
    rows = []
    for model, case, wrap, expected, text, env in _cases(version):
        result = run_training(
            model, wrap, world_size=world_size, steps=steps, device=device, timeout_s=timeout_s, env=env
        )
        label = f"{case} [{model}]" if model != "glm4v" else case
        rows.append(SmokeRow.from_run(f"verl {version}", label, expected, result, expect_text=text))
    return rows


if __name__ == "__main__":
    table_rows = run()
    print(format_smoke_table(table_rows))
    sys.exit(0 if all(r.passed for r in table_rows) else 1)
