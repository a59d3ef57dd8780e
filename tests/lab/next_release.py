"""A framework's next release over the installed code, judged by fingerprint (``fsdp_compat.fingerprints``).

:func:`fake_next_release` runs, in a fresh interpreter with nothing patched (``FSDP_COMPAT=off``: importing the
framework activates nothing), the adapter's own table as if ``importlib.metadata`` reported ``version`` for
``distribution``: the version gate compares the installed code with the recorded fingerprints of the newest tested
release, and the adapter patches (unchanged) or stands aside with one warning (changed). :func:`assert_judged`
holds the result to what the installed release's record says. The stack tests of each framework call them
(``tests/stacks/<framework>/test_fingerprint.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from typing import Any

from fsdp_compat import fingerprints
from fsdp_compat.adapter_index import ADAPTERS

__all__ = ["assert_judged", "fake_next_release"]

_CODE = """
    import importlib, json, logging, warnings
    from packaging.version import Version
    from fsdp_compat.activation import Adapter
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("fsdp_compat").addHandler(handler)
    logging.getLogger("fsdp_compat").setLevel(logging.DEBUG)
    table = importlib.import_module({module!r}).RELEASES
    class Next(Adapter):
        def version_of(self, distribution):
            return Version({version!r})
    adapter = Next({key!r}, table)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = adapter.patch(distribution={distribution!r}, activated_by="import")
    verdict = adapter.fingerprint_verdict({distribution!r}, Version({version!r}))
    out = {{
        "ok": ok,
        "patched": {{d: str(v) for d, (v, _, _) in adapter.patched().items()}},
        "replaced": adapter.describe(),
        "verdict": None if verdict is None else {{"basis": verdict.basis, "changes": verdict.changes}},
        "warnings": [str(w.message) for w in caught],
        "log": lines,
    }}
    adapter.unpatch()
    out["after_unpatch"] = adapter.describe()
    print(json.dumps(out))
"""


def fake_next_release(
    key: str, distribution: str, version: str, timeout_s: float = 240, prelude: str = ""
) -> dict[str, Any]:
    """What the ``key`` adapter does for ``distribution`` reported as ``version`` over the installed code: whether it
    patched, what it replaced (``describe()``), the fingerprint verdict, the warnings and fsdp-compat's log lines
    (DEBUG included), and what stays replaced after ``unpatch()``. ``prelude``: statements run first (a workaround a
    framework needs on this Python, as SkyRL's tests set ``typing.TypedDict`` on 3.11)."""
    code = textwrap.dedent(prelude) + textwrap.dedent(
        _CODE.format(module=ADAPTERS[key].module, key=key, distribution=distribution, version=version)
    )
    env = {**os.environ, "FSDP_COMPAT": "off", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    env.pop("FSDP_COMPAT_POLICY", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_judged(out: dict[str, Any], distribution: str, version: str) -> str:
    """Hold a :func:`fake_next_release` result to the record: where the installed release is the newest recorded one
    (its code is what was recorded), the next release is patched by fingerprint, with no warning, and says so;
    where the installed code differs from that record, nothing is patched and one warning names the change.
    Returns which of the two it was."""
    installed = fingerprints.release(metadata.version(distribution))
    spec = next(e.supported[distribution] for e in ADAPTERS.values() if distribution in e.supported)
    newest = fingerprints.newest_tested(distribution, spec)
    assert newest is not None, f"no fingerprint recorded for {distribution} (python -m fsdp_compat.fingerprints record)"
    assert out["verdict"] is not None and out["verdict"]["basis"] == str(newest), out
    if out["verdict"]["changes"] == []:
        assert out["ok"] is True and out["patched"] == {distribution: version}, out
        assert any(line.endswith(" -> fsdp-compat (policy auto)") for line in out["replaced"]), out
        assert out["warnings"] == [], out
        assert any(
            f"{distribution} {version} is newer than the tested range" in line
            and f"unchanged from {newest} (fingerprint)" in line
            for line in out["log"]
        ), out
        assert out["after_unpatch"] == [], out
        return "patched by fingerprint"
    assert installed != fingerprints.release(str(newest)), f"{distribution} {installed}'s own record differs: {out}"
    assert out["ok"] is False and out["patched"] == {} and out["replaced"] == [], out
    assert [w for w in out["warnings"] if f"may have changed since {newest}" in w and "nothing was patched" in w], out
    return "left alone"
