"""AReaL's next release over the installed code, judged by fingerprint (``fsdp_compat/fingerprints.json``, recorded
with ``python -m fsdp_compat.fingerprints record areal`` in ``areal104``): AReaL reported as 1.1.0, the first
release past the adapter's range, over 1.0.4's code is patched by fingerprint, with no warning, and says so
(``lab.next_release``); over another release's code (``newest-areal``) it stands aside with one warning naming what
changed.
"""

from __future__ import annotations

from importlib import metadata

import pytest
from lab.next_release import assert_judged, fake_next_release

pytestmark = pytest.mark.timeout(300)

NEXT = "1.1.0"


def test_the_next_release_over_unchanged_code_is_patched_by_fingerprint() -> None:
    out = fake_next_release("areal", "areal", NEXT)
    how = assert_judged(out, "areal", NEXT)
    print(f"areal {metadata.version('areal')} as {NEXT}: {how}")
    if metadata.version("areal") == "1.0.4":
        assert how == "patched by fingerprint", out
