"""tox's inline plugin for this project: remove a run environment's folder once it has run, when asked.

The default env list holds three CUDA builds of torch (the framework-torch and guard envs, 5-7 GB each) beside four
CPU ones: about 23 GB of virtual environments in all, more than a small CI disk has free. With
``FSDP_COMPAT_TOX_PRUNE=1`` (``.ci/run`` sets it) each run environment's folder is deleted as soon as its commands
have run, so the disk holds one environment at a time. Without it tox keeps every environment, as usual, for reruns.
"""

from __future__ import annotations

import os
import shutil

from tox.plugin import impl
from tox.tox_env.api import ToxEnv
from tox.tox_env.runner import RunToxEnv

PRUNE_SWITCH = "FSDP_COMPAT_TOX_PRUNE"


@impl
def tox_env_teardown(tox_env: ToxEnv) -> None:
    """Delete a finished run environment's folder (never the shared packaging one) under ``FSDP_COMPAT_TOX_PRUNE=1``."""
    if os.environ.get(PRUNE_SWITCH) != "1" or not isinstance(tox_env, RunToxEnv):
        return
    shutil.rmtree(tox_env.env_dir, ignore_errors=True)
