"""The project's own test lab, the one home of what only fsdp-compat's tests and benchmarks use, kept out of the wheel.

- :mod:`lab.support`: where the distributed tests run (device, world size), the ``breadth`` mark,
  ``require_framework``, the ranks' ``PYTHONPATH``.
- :mod:`lab.stacks`: one rank module per framework (``lab.stacks.verl_engine_ranks``, ...), each driving that
  framework's own code; :mod:`lab.stacks.verl_cpu_platform` is verl's CPU platform plugin.
- :mod:`lab.generation`, :mod:`lab.whole_step`: generation, log-prob and whole-step rank routines.
- :mod:`lab.fakes`: the activation tests' throwaway packages and fixtures; ``lab/stubs``: stand-ins for modules a CPU
  machine lacks (SkyRL's ``flash_attn``), put on a rank's ``PYTHONPATH`` by the tests that need them.

- :mod:`lab.guard_models`: small models that read a parameter while its FSDP2 group is sharded, the guard tests'
  wrap functions and probes, and the rank routine that checks every FSDP2 internal the guard relies on.
- :mod:`lab.read_corpus`: the 67 read patterns of the static analysis's corpus and their rank routine.
- :mod:`lab.checkpoints`: save on one wrap plan, resume on another (distributed checkpoints).
- :mod:`lab.transformers_smoke`: transformers' native FSDP2 (``fsdp_plan``) on tiny checkpoints.
- :mod:`lab.peft_glm4v`: tiny GLM4V under peft LoRA.
- :mod:`lab.wraps`: hand-written ``fully_shard`` wraps that do not use the planner, ranks that raise or hang on
  purpose, and ``auto`` with test-only settings.

Importable as ``lab`` because ``tests/`` is on ``sys.path`` and on ``PYTHONPATH`` (tests/conftest.py puts it there,
so every rank process inherits it; ``benchmarks`` puts it on ``sys.path`` itself). Rank routines and wrap functions
are named to :func:`fsdp_compat.testing.launch.run_ranks` as ``"lab.MODULE:FUNCTION"``.
"""
