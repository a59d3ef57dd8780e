"""SkyRL adapter: every released ``skyrl-train`` and ``skyrl`` shards GLM4V-style models with fsdp-compat.

Every SkyRL release gives each untied ``nn.Embedding`` its own FSDP2 group inside ``apply_fsdp2(model,
fsdp_kwargs, config)``, which crashes models that read an embedding's weight outside its forward (GLM4V:
``aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor``); skyrl-train 0.1.0-0.3.1 and skyrl 0.1.0
also index transformers 5's *set* ``_no_split_modules`` with ``[0]`` (``TypeError: 'set' object is not
subscriptable``). The replacement keeps SkyRL's contract (same arguments, the config's
``wrap_policy.transformer_layer_cls_to_wrap`` override, ``fsdp_kwargs`` passed to every ``fully_shard``, the
root wrapped last, returns None) and lets :func:`fsdp_compat.apply.apply_fsdp2` choose the groups.

``fsdp_strategy`` binds ``apply_fsdp2`` by name, so it is rebound there too, whether it is imported before or
after the patch. A future release that ships the upstream selector ``modules_to_wrap_fsdp2`` gets that function
replaced instead (its own ``apply_fsdp2`` already looks the selector up at call time).

Activation: the ``.pth`` start-up hook (SkyRL's Ray workers share the driver's environment), or
``import fsdp_compat.adapters.skyrl`` in a custom entry point; ``FSDP_COMPAT=off`` disables both.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from packaging.version import InvalidVersion, Version

from fsdp_compat.activation import Adapter, Replacement, activate_on_import, logger

__all__ = ["ADAPTER", "PACKAGES", "SUPPORTED", "SkyRLAdapter", "is_patched", "patch", "unpatch"]

#: distribution -> supported releases (skyrl-train is superseded by skyrl; skyrl 0.0.1 is a placeholder).
SUPPORTED: dict[str, str] = {
    "skyrl": ">=0.1.0,<0.5",
    "skyrl-train": ">=0.1.0,<0.4",
}

#: distribution -> the package holding ``fsdp_utils`` and its by-name importer ``fsdp_strategy``.
PACKAGES: dict[str, str] = {
    "skyrl": "skyrl.backends.skyrl_train.distributed",
    "skyrl-train": "skyrl_train.distributed",
}

#: skyrl-train 0.3.1's fsdp_strategy imports MixedPrecisionPolicy from fsdp_utils, which stopped importing it.
_MISSING_REEXPORT = {("skyrl-train", Version("0.3.1")): "MixedPrecisionPolicy"}

UPSTREAM_SELECTOR = "modules_to_wrap_fsdp2"


# ---------------------------------------------------------------------------------------------- replacements


def configured_layer_classes(config: Any) -> Any:
    """``config.wrap_policy.transformer_layer_cls_to_wrap`` when set, else None (the model's layer classes).

    Accepts what each release passes: skyrl-train's ``config.get("wrap_policy", {})`` on a DictConfig and
    skyrl's ``getattr(config, "wrap_policy", {})`` on its ``FSDPConfig`` dataclass or a DictConfig. An unset,
    None or empty override means "use ``model._no_split_modules``" (upstream crashed on None or empty).
    """
    if config is None:
        return None
    getter = getattr(config, "get", None)
    wrap_policy = getter("wrap_policy", None) if callable(getter) else getattr(config, "wrap_policy", None)
    if not wrap_policy:
        return None
    inner = getattr(wrap_policy, "get", None)
    names = (
        inner("transformer_layer_cls_to_wrap", None)
        if callable(inner)
        else getattr(wrap_policy, "transformer_layer_cls_to_wrap", None)
    )
    if not names:
        return None
    return [names] if isinstance(names, str) else list(names)  # ListConfig, tuple, set -> list


def make_apply_fsdp2(original: Callable[..., Any], policy: str) -> Callable[..., None]:
    """SkyRL's ``apply_fsdp2(model, fsdp_kwargs, config)``, with groups chosen by fsdp-compat's planner."""

    @functools.wraps(original)
    def apply_fsdp2(model: Any, fsdp_kwargs: Any, config: Any = None, *args: Any, **kwargs: Any) -> None:
        from fsdp_compat.apply import apply_fsdp2 as core_apply_fsdp2

        plan = core_apply_fsdp2(model, fsdp_kwargs, configured_layer_classes(config), policy=policy)
        logger.debug("skyrl apply_fsdp2 (policy %s):\n%s", policy, plan)

    apply_fsdp2.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return apply_fsdp2


def make_modules_to_wrap_fsdp2(original: Callable[..., Any], policy: str) -> Callable[..., list[Any]]:
    """The upstream selector ``modules_to_wrap_fsdp2(model, cls_names)``: fsdp-compat's bottom-up targets."""

    @functools.wraps(original)
    def modules_to_wrap_fsdp2(model: Any, cls_names: Any = None, *args: Any, **kwargs: Any) -> list[Any]:
        from fsdp_compat.guard import install_guard
        from fsdp_compat.plan import select_wrap_targets

        install_guard(model)  # before SkyRL's own fully_shard calls: it finds the groups at the first forward
        names = [cls_names] if isinstance(cls_names, str) else (list(cls_names) if cls_names else None)
        return select_wrap_targets(model, names, policy=policy)

    modules_to_wrap_fsdp2.__fsdp_compat__ = True  # type: ignore[attr-defined]
    return modules_to_wrap_fsdp2


# --------------------------------------------------------------------------------------------------- adapter


class SkyRLAdapter(Adapter):
    """skyrl-train 0.1.0-0.3.x, skyrl 0.1.0-0.4.x: ``fsdp_utils.apply_fsdp2`` (also in ``fsdp_strategy``)."""

    name = "skyrl"
    supported = SUPPORTED
    trigger_modules = tuple(f"{package}.fsdp_utils" for package in PACKAGES.values())

    def __init__(self) -> None:
        super().__init__()
        self._reexport: tuple[Any, str, Any] | None = None  # (module, name, object) added by repair_reexport

    def installed(self) -> tuple[str, Version] | None:
        """The distribution whose modules are loaded (both may be installed), else the first one installed."""
        found: list[tuple[str, Version]] = []
        for distribution in self.supported:
            try:
                found.append((distribution, Version(metadata.version(distribution))))
            except (metadata.PackageNotFoundError, InvalidVersion):
                continue
        for distribution, version in found:
            if f"{PACKAGES[distribution]}.fsdp_utils" in sys.modules:
                return distribution, version
        return found[0] if found else None

    def plan_patches(self, distribution: str, version: Version) -> list[Replacement]:
        package = PACKAGES[distribution]
        utils = importlib.import_module(f"{package}.fsdp_utils")
        policy = self.policy()
        if callable(getattr(utils, UPSTREAM_SELECTOR, None)):
            name, make = UPSTREAM_SELECTOR, make_modules_to_wrap_fsdp2
        else:
            name, make = "apply_fsdp2", make_apply_fsdp2
        return [
            Replacement(
                module=utils.__name__,
                name=name,
                make=lambda original, make=make: make(original, policy),
                importers=(f"{package}.fsdp_strategy",),
            )
        ]

    def patch(self, *, activated_by: str = "explicit") -> bool:
        patched = super().patch(activated_by=activated_by)
        if patched and self._reexport is None:
            self.repair_reexport()
        return patched

    def unpatch(self) -> None:
        with self._lock:
            if self._reexport is not None:
                module, name, value = self._reexport
                if vars(module).get(name) is value:
                    delattr(module, name)
                self._reexport = None
        super().unpatch()

    def describe(self) -> list[str]:
        lines = super().describe()
        if self._reexport is not None:
            module, name, _ = self._reexport
            lines.append(f"{module.__name__}.{name} re-exported (fsdp_strategy of this release imports it)")
        return lines

    def repair_reexport(self) -> None:
        """skyrl-train 0.3.1 only: give ``fsdp_utils`` back the ``MixedPrecisionPolicy`` its ``fsdp_strategy``
        imports from it (0.3.0 had it), so that ``fsdp_strategy`` can be imported at all."""
        if self.version is None or self.version not in _MISSING_REEXPORT:
            return
        name = _MISSING_REEXPORT[self.version]
        utils = sys.modules.get(f"{PACKAGES[self.version[0]]}.fsdp_utils")
        if utils is None or hasattr(utils, name):
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy

        with self._lock:
            setattr(utils, name, MixedPrecisionPolicy)
            self._reexport = (utils, name, MixedPrecisionPolicy)
        logger.info("%s: re-exported %s.%s (missing in this release)", self.name, utils.__name__, name)


ADAPTER = SkyRLAdapter()
patch, unpatch, is_patched = ADAPTER.patch, ADAPTER.unpatch, ADAPTER.is_patched
activate_on_import(ADAPTER)
