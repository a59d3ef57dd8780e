"""What a framework release can and cannot do that no patch of ours changes, for ``fsdp-compat doctor``.

One home for these facts: :mod:`fsdp_compat.doctor` prints them for the installed releases, and the SkyRL engine
tests (``tests/stacks/skyrl/test_skyrl_engine.py``) load GLM4V through every release's own model builders and assert
that the releases listed here are exactly the ones that load it. Imports only ``packaging`` (doctor imports no
framework).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["SKYRL_GLM4V_POLICY_RELEASES", "notes", "skyrl_loads_glm4v"]

#: Releases whose policy/ref ``HFModelWrapper`` builds ``AutoModelForImageTextToText`` for a config with a
#: ``vision_config``. Every other SkyRL release builds ``AutoModelForCausalLM`` only; ``language_model_only`` and
#: the critic cannot load GLM4V on any release.
SKYRL_GLM4V_POLICY_RELEASES: dict[str, str] = {"skyrl": ">=0.2"}


def skyrl_loads_glm4v(distribution: str, version: Version) -> bool:
    """Whether this SkyRL release's policy (and ref) model builder can load a GLM4V checkpoint at all."""
    spec = SKYRL_GLM4V_POLICY_RELEASES.get(distribution)
    return spec is not None and SpecifierSet(spec).contains(version, prereleases=True)


def notes(distribution: str, version: Version) -> list[str]:
    """One line per known limit of this installed release (empty when nothing is known)."""
    if distribution not in ("skyrl", "skyrl-train"):
        return []
    if skyrl_loads_glm4v(distribution, version):
        return [
            "GLM4V: the policy and ref models load it (AutoModelForImageTextToText); language_model_only and the "
            "critic cannot; fsdp-compat fixes the FSDP2 wrap (the grid_sampler crash)"
        ]
    return [
        "GLM4V: this release cannot load it (HFModelWrapper builds AutoModelForCausalLM only); fsdp-compat still "
        "fixes the wrap for the models it loads (e.g. the 'set' object is not subscriptable crash on transformers 5)"
    ]
