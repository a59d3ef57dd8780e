"""LLaMA-Factory's next release over the installed code, judged by fingerprint (``fsdp_compat/fingerprints.json``,
recorded with ``python -m fsdp_compat.fingerprints record llamafactory`` in ``llamafactory095``): LLaMA-Factory
reported as 0.10.0, the first release past the adapter's range, over 0.9.5's code is patched by fingerprint (the
class attribute ``FSDP2Engine.prepare_model`` and the module's ``fully_shard``), with no warning, and says so
(``lab.next_release``); over another release's code (``newest-llamafactory``) it stands aside with one warning
naming what changed.
"""

from __future__ import annotations

from importlib import metadata

import pytest
from lab.next_release import assert_judged, fake_next_release

pytestmark = pytest.mark.timeout(300)

NEXT = "0.10.0"
FSDP2 = "llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2"


def test_the_next_release_over_unchanged_code_is_patched_by_fingerprint() -> None:
    out = fake_next_release("llamafactory", "llamafactory", NEXT)
    how = assert_judged(out, "llamafactory", NEXT)
    print(f"llamafactory {metadata.version('llamafactory')} as {NEXT}: {how}")
    if metadata.version("llamafactory") == "0.9.5":
        assert how == "patched by fingerprint", out
        assert f"{FSDP2}.FSDP2Engine.prepare_model -> fsdp-compat (policy auto)" in out["replaced"], out
