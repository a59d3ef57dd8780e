"""Rank-side wrap fn for the outdated-wrap-list test: verl's own ``apply_fsdp2`` at its call site, with
fsdp-compat's log records captured, so the test can see the warning a job shows.

Imported in fresh rank interpreters (``tests/`` on PYTHONPATH); it imports no fsdp_compat adapter itself.
"""

from __future__ import annotations

import logging
from typing import Any

from lab.observe import LogLines


def verl_outdated(model: Any, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """verl's own ``apply_fsdp2`` at its call site (``FSDP_COMPAT_VERL_LAYERS`` names the wrap list)."""
    records = LogLines(levels=True)
    logging.getLogger("fsdp_compat").addHandler(records)
    from fsdp_compat.testing.verl_smoke import wrap_verl

    info = wrap_verl(model, fsdp_kwargs)
    return {**info, "log": records.lines}
