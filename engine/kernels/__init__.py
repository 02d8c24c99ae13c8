"""Fused CPU kernels: a C library (csrc/) built at install for four instruction-set targets and picked at
run time by what the CPU has (loader.py; docs/kernels.md).

``load_cpu_kernels()`` returns the engine's ``CpuKernels``, or None where none can be had (disabled, or
neither an installed library nor a compiler); callers then keep the pure-torch path, which computes the
same thing.
"""

from engine.kernels.bindings import (
                                   ABI_VERSION,
                                   LINEAR_PATH_NAMES,
                                   CpuKernels,
                                   open_library,
)
from engine.kernels.loader import (
                                   BUILD_ENV,
                                   DISABLE_ENV,
                                   LIB_DIR_ENV,
                                   MARCH_ENV,
                                   NATIVE,
                                   TARGET_ENV,
                                   UNITS,
                                   _cpu_flags,
                                   build_library,
                                   cache_dir,
                                   find_compiler,
                                   installed_state,
                                   kernel_march,
                                   lib_dir,
                                   load_cpu_kernels,
                                   load_target,
)
from engine.kernels.signatures import (
                                   LINEAR_PATHS,
                                   TARGETS,
                                   ForwardStep,
                                   KernelUnsupported,
                                   LayerDesc,
                                   LinearDesc,
)

__all__ = ["ABI_VERSION", "BUILD_ENV", "DISABLE_ENV", "LIB_DIR_ENV", "LINEAR_PATHS", "LINEAR_PATH_NAMES", "MARCH_ENV",
           "NATIVE", "TARGETS", "TARGET_ENV", "UNITS", "CpuKernels", "ForwardStep", "KernelUnsupported", "LayerDesc",
           "LinearDesc", "_cpu_flags", "build_library", "cache_dir", "find_compiler", "installed_state",
           "kernel_march", "lib_dir", "load_cpu_kernels", "load_target", "open_library"]
