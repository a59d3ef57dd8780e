"""``python -m benchmarks [policies|skeletons|startup|guard|no_grad|schedule ...] [-- extra args]``, from a source
checkout.

With no name every benchmark runs, in the order of :data:`NAMES`. Arguments after
a single benchmark name go to that benchmark (``python -m benchmarks policies --models glm4v --steps 3``).
"""

from __future__ import annotations

import importlib
import sys
import time

NAMES = ("skeletons", "startup", "policies", "guard", "no_grad", "mixed_batches", "exchange", "schedule", "mechanism",
         "matrix")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if args and args[0] in NAMES and (len(args) == 1 or args[1].startswith("-")):
        names, rest = [args[0]], args[1:]
    else:
        names = [a for a in args if a in NAMES] or list(NAMES)
        unknown = [a for a in args if a not in NAMES]
        if unknown:
            print(f"unknown benchmark(s) {unknown}; choose from {', '.join(NAMES)}", file=sys.stderr)
            return 2
        rest = []
    status = 0
    t0 = time.monotonic()
    for index, name in enumerate(names):
        if index:
            print("\n" + "=" * 100 + "\n", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        status |= int(module.main(rest) or 0)
        sys.stdout.flush()
    if len(names) > 1:
        print(f"\n(all benchmarks: {time.monotonic() - t0:.0f}s wall)")
    return status


if __name__ == "__main__":
    sys.exit(main())
