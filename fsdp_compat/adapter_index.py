"""The adapter index: the little the start-up hook, activation and ``fsdp-compat doctor`` must know before any
adapter module is imported. A low module (it imports nothing), so the core rooms read it without an arrow up to
``adapters/`` (``fsdp_compat.adapters`` re-exports it for the adapters and for users).

Each adapter module (``adapters/verl.py``, ``skyrl.py``, ...) reads as its release table: for these versions, in
these modules, this name becomes that function, and these repairs run.
Importing an adapter module activates it (that is how ``external_lib=fsdp_compat.adapters.verl`` works), so what
must be known *before* that import lives here, in :data:`ADAPTERS`: per distribution the module whose import
activates the adapter (the trigger) and the versions it supports. The ``.pth`` hook watches the triggers in every
Python process, and ``fsdp-compat doctor`` shows the ranges without activating anything; the release tables split
these ranges into rows (``tests/activation`` checks that every supported version has a row).

This module imports nothing: the ``.pth`` imports it at interpreter start. Adding an adapter is one row here plus
its module (docs/development.md)::

    "myframework": AdapterEntry(
        "fsdp_compat.adapters.myframework",  # the adapter module (adapters/myframework.py)
        {"myframework": ("myframework.distributed.fsdp", ">=1.2,<1.4")},  # distribution: (trigger, supported)
    ),
"""

from __future__ import annotations

__all__ = ["ADAPTERS", "AdapterEntry", "trigger"]


class AdapterEntry:
    """One adapter: its module and, per distribution, ``(trigger module, supported versions as PEP 440)``.

    ``repaired``: module -> distribution, modules a deferred repair of that distribution replaces names in; their
    import activates the distribution too, so a repair is in place whatever the user imported first.
    """

    __slots__ = ("distributions", "module", "repaired")

    def __init__(
        self, module: str, distributions: dict[str, tuple[str, str]], repaired: dict[str, str] | None = None
    ) -> None:
        self.module = module
        self.distributions = distributions
        self.repaired = repaired or {}

    @property
    def triggers(self) -> dict[str, str]:
        """trigger module -> distribution."""
        return {trigger: dist for dist, (trigger, _) in self.distributions.items()}

    @property
    def activating(self) -> dict[str, str]:
        """Every module whose import activates a distribution (the triggers, then the repaired modules)."""
        return {**self.triggers, **self.repaired}

    @property
    def supported(self) -> dict[str, str]:
        """distribution -> supported versions."""
        return {dist: spec for dist, (_, spec) in self.distributions.items()}

    def __repr__(self) -> str:
        return f"AdapterEntry({self.module!r}, {self.distributions!r})"


#: adapter key -> entry. verl: 0.10.0.dev* is main (same selector as 0.9.1); 0.10.0a0 and later are unknown.
#: SkyRL: skyrl-train is superseded by skyrl (both can be installed side by side); skyrl 0.0.1 is a placeholder.
ADAPTERS: dict[str, AdapterEntry] = {
    # The generic layer (fsdp_compat.runtime.every_root): every FSDP2 root, whoever called fully_shard (the reach).
    "fsdp2": AdapterEntry(
        "fsdp_compat.adapters.fsdp2", {"torch": ("torch.distributed.fsdp._fully_shard._fsdp_state", ">=2.8,<2.16")}
    ),
    "verl": AdapterEntry(
        "fsdp_compat.adapters.verl",
        {"verl": ("verl.utils.fsdp_utils", ">=0.4.0,<0.10.0a0")},
        # the GLM4V and Qwen2-VL forward repairs of verl's table (deferred)
        {"verl.models.transformers.glm4v": "verl", "verl.models.transformers.qwen2_vl": "verl"},
    ),
    "skyrl": AdapterEntry(
        "fsdp_compat.adapters.skyrl",
        {
            "skyrl-train": ("skyrl_train.distributed.fsdp_utils", ">=0.1.0,<0.4"),
            "skyrl": ("skyrl.backends.skyrl_train.distributed.fsdp_utils", ">=0.1.0,<0.5"),
        },
    ),
    "transformers": AdapterEntry(
        "fsdp_compat.adapters.transformers", {"transformers": ("transformers.distributed.fsdp", ">=5.16.1,<5.26")}
    ),
    "areal": AdapterEntry("fsdp_compat.adapters.areal", {"areal": ("areal.engine.fsdp_utils", ">=1.0.4,<1.1")}),
    "llamafactory": AdapterEntry(
        "fsdp_compat.adapters.llamafactory",
        {"llamafactory": ("llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2", ">=0.9.5,<0.10")},
    ),
    "accelerate": AdapterEntry(
        "fsdp_compat.adapters.accelerate", {"accelerate": ("accelerate.utils.fsdp_utils", ">=1.15.0,<1.17")}
    ),
    "nemo_automodel": AdapterEntry(
        "fsdp_compat.adapters.nemo_automodel",
        {"nemo-automodel": ("nemo_automodel.components.distributed.parallelizer", ">=0.7.0,<0.8")},
    ),
    # axolotl replaces accelerate's fsdp2_prepare_model with its own (adapters/axolotl.py wraps axolotl's)
    "axolotl": AdapterEntry(
        "fsdp_compat.adapters.axolotl", {"axolotl": ("axolotl.monkeypatch.accelerate.fsdp2", ">=0.19.0,<0.22")}
    ),
    # trainers with their own copy of verl's old apply_fsdp2 (adapters/verl_copies.py: one row each)
    "verl_copies": AdapterEntry(
        "fsdp_compat.adapters.verl_copies",
        {
            "lmms-engine": ("lmms_engine.utils.fsdp2_utils", ">=0.1.4,<0.1.5"),
            "siirl": ("siirl.utils.model_utils.fsdp_utils", ">=0.2.0,<0.2.1"),
            "trinity-rft": ("trinity.trainer.verl_legacy.utils", ">=0.6.0,<0.6.1"),
        },
    ),
}


def trigger(distribution: str) -> str:
    """The trigger module of ``distribution`` (an adapter names the module it patches through this, not again)."""
    for entry in ADAPTERS.values():
        if distribution in entry.distributions:
            return entry.distributions[distribution][0]
    raise KeyError(distribution)
