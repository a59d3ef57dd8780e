"""Ship ``fsdp_compat.pth`` at the top of the wheel, so pip installs it into site-packages.

Everything else about the build lives in pyproject.toml. The .pth starts fsdp-compat's import hook in every
Python process of the environment (SkyRL's Ray workers, verl's critic worker) and imports no torch and no
framework. Its cost, measured by ``python -m benchmarks startup --no-verl --runs 30`` (2-core machine under load):
1.3 ms of ``-X importtime`` and 1.3 ms in-process, +3.8 ms median wall time on ``python -c pass``.
setuptools has no declarative way to put a file at the wheel's root, hence this build_py subclass (the approach
pytest-cov used). Editable installs (pip install -e .) do not get the .pth.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path(__file__).resolve().parent / "src_pth" / "fsdp_compat.pth"


class BuildPyWithPth(build_py):
    """build_py that also copies the start-up .pth to the top of build_lib (the wheel root: site-packages)."""

    def _pth_target(self) -> str:
        return str(Path(self.build_lib) / PTH.name)

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(str(PTH), self._pth_target(), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), self._pth_target()]

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), self._pth_target(): str(PTH)}


setup(cmdclass={"build_py": BuildPyWithPth})
