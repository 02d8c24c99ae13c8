"""Builds the fused CPU kernel libraries at install (engine/kernels/build.py), beside the package's
Python files: into the source tree for an editable install (``pip install -e .``), into the wheel otherwise.
Everything else about the package is in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _kernel_build():
    # by path: the package itself cannot be imported before its dependencies are installed
    spec = importlib.util.spec_from_file_location("spark_kernel_build", ROOT / "engine" / "kernels" / "build.py")
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass-free, but keep the usual import invariants
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """build_py, then the kernel libraries. A machine without a C compiler still installs: the engine then
    runs its pure-torch path (or compiles the kernels at start where a compiler appears later)."""

    def run(self) -> None:
        super().run()
        kernels = _kernel_build()
        out = kernels.LIB_DIR if self.editable_mode else Path(self.build_lib) / "engine" / "kernels" / "_lib"
        try:
            kernels.build_installed(out, log=lambda line: print(line, file=sys.stderr))
        except RuntimeError as exc:
            print(f"WARNING: fused CPU kernels not built ({exc}); the engine will run without them", file=sys.stderr)


class BinaryDistribution(Distribution):
    """The wheel carries shared libraries for this platform: never a pure-Python wheel."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution)
