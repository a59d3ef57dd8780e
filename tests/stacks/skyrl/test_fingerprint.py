"""SkyRL's next release over the installed code, judged by fingerprint (``fsdp_compat/fingerprints.json``, recorded
with ``python -m fsdp_compat.fingerprints record skyrl-train`` in ``skyrltrain031`` and ``record skyrl`` in
``skyrl040``).

Each installed distribution is reported as the first release past its adapter range (skyrl-train 0.4.0, skyrl 0.5.0)
over the code installed here (``lab.next_release``): on the newest recorded release (skyrl-train 0.3.1, skyrl 0.4.0)
the adapter patches by fingerprint, with no warning, and says so; on an older release's code (``skyrl-all``) it
stands aside with one warning naming what changed.
"""

from __future__ import annotations

from importlib import metadata

import pytest
from lab.next_release import assert_judged, fake_next_release

pytestmark = pytest.mark.timeout(300)

#: Python 3.11: skyrl 0.2-0.4 declare pydantic models over ``typing.TypedDict``, which pydantic rejects before 3.12
#: (lab.stacks.skyrl_ranks applies the same workaround)
PRELUDE = "import typing, typing_extensions\ntyping.TypedDict = typing_extensions.TypedDict\n"
#: distribution -> the first release past the adapter's range (fsdp_compat.adapter_index)
NEXT = {"skyrl-train": "0.4.0", "skyrl": "0.5.0"}


def _installed() -> list[str]:
    found = []
    for distribution in NEXT:
        try:
            metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        found.append(distribution)
    return found


def test_the_next_release_over_unchanged_code_is_patched_by_fingerprint() -> None:
    installed = _installed()
    assert installed, "neither skyrl-train nor skyrl is installed (tests/stacks/skyrl runs only where one is)"
    for distribution in installed:
        out = fake_next_release("skyrl", distribution, NEXT[distribution], prelude=PRELUDE)
        how = assert_judged(out, distribution, NEXT[distribution])
        print(f"{distribution} {metadata.version(distribution)} as {NEXT[distribution]}: {how}")
