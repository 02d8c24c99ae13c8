"""Which kernel library the engine runs, found once per process.

In order (docs/kernels.md):
1. ``SPARK_NATIVE_KERNELS=0``: none; the engine keeps its pure-torch path, which computes the same thing.
2. The developer build, on request (``SPARK_KERNELS_BUILD=1``, or ``SPARK_KERNELS_MARCH=<target>``): the
   sources compiled now for this CPU (``-march=native``) or the named target, cached by a hash of sources,
   flags, compiler and CPU.
3. The libraries built at install (``_lib/``, or ``SPARK_KERNELS_LIB_DIR``), when their manifest names the
   sources beside them: the portable library asks cpuid which target this CPU runs (as ggml picks its CPU
   variant), capped by ``SPARK_KERNELS_TARGET``, and the best one built up to it is opened. No compiler is
   needed here.
4. In a checkout whose libraries are missing or older than its sources: the developer build, where there is
   a compiler (else the stale libraries, which the ABI check still guards).

Each library links OpenMP by the soname torch already loaded (libgomp.so.1), so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

from engine.kernels import build
from engine.kernels.bindings import CpuKernels, open_library
from engine.kernels.signatures import TARGETS
from engine.model_loader import default_cache_dir

logger = logging.getLogger(__name__)

DISABLE_ENV = "SPARK_NATIVE_KERNELS"
BUILD_ENV = "SPARK_KERNELS_BUILD"  # truthy: compile for this CPU at first use instead of the installed ones
# another -march target instead of this CPU's (e.g. x86-64-v3: what a CPU with AVX2 but no AVX-512 runs), to
# see and test that build's paths on this machine; implies the developer build
MARCH_ENV = "SPARK_KERNELS_MARCH"
TARGET_ENV = "SPARK_KERNELS_TARGET"  # the highest installed target to pick: portable, avx2, avx512, avx512bf16
LIB_DIR_ENV = "SPARK_KERNELS_LIB_DIR"  # where the installed libraries are (default: the package's _lib)
NATIVE = "-march=native"  # this CPU's full instruction set (AVX-512 where it has it)
UNITS = build.UNITS
find_compiler = build.find_compiler

_lock = threading.Lock()
_loaded: CpuKernels | None = None
_failed = False
_targets: dict[str, CpuKernels] = {}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    return default_cache_dir() / "kernels"  # beside the converted models


def lib_dir() -> Path:
    return Path(os.environ.get(LIB_DIR_ENV) or build.LIB_DIR)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def kernel_march() -> str:
    """The -march flag of the developer build: this CPU's own, or ``SPARK_KERNELS_MARCH``'s target."""
    march = os.environ.get(MARCH_ENV)
    return f"-march={march}" if march else NATIVE


def build_library(cc: str, march: str | None = None, directory: Path | None = None,
                  extra_flags: tuple[str, ...] = (), bench: bool = False) -> Path:
    """The developer build: the sources compiled now (once: the file name carries a hash of sources, flags,
    compiler and CPU). ``march``: the target's flags (default ``kernel_march()``). ``extra_flags``: a
    benchmark variant's -D switches (tuning.h; with ``bench``). ``bench``: with the benchmarks' own unit
    (bench.c) and its variant switches allowed; such a library is never the engine's."""
    units = build.UNITS + ((build.BENCH_UNIT,) if bench else ())
    flags = [*build.CFLAGS, *(kernel_march() if march is None else march).split(),
             *(("-DSPARK_BENCH_VARIANT",) if bench else ()), *extra_flags]
    version = build.compiler_version(cc)
    # -march=native code is only valid on this CPU model: its flags are part of the key
    key = hashlib.sha256("\0".join([build.sources_digest(), " ".join(flags), *(u.name for u in units), version,
                                     platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"{'bench_' if bench else ''}cpu_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Several processes starting on a cold cache at once (a fleet's replicas, test workers): one compiles,
    # the others wait for its library instead of compiling the same one beside it.
    with open(directory / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        build.compile_library(cc, flags, target, units)
    logger.info("compiled fused CPU kernels into %s", target)
    return target


def installed_state() -> tuple[str, list[str]]:
    """("current" | "stale" | "absent", the targets built) of the installed libraries."""
    directory = lib_dir()
    manifest = build.read_manifest(directory)
    if manifest is None:
        return "absent", []
    targets = [t for t in manifest.get("targets", []) if (directory / build.library_name(t)).exists()]
    if "portable" not in targets:
        return "absent", []
    sources_here = any(build.SOURCE_DIR.glob("*.c"))
    if sources_here and manifest.get("sources") != build.sources_digest():
        return "stale", targets
    return "current", targets


def best_installed_target(targets: list[str]) -> str:
    """The highest of ``targets`` this CPU runs (cpuid, through the portable library), at most
    ``SPARK_KERNELS_TARGET``."""
    lib = ctypes.CDLL(str(lib_dir() / build.library_name("portable")))
    lib.spark_cpu_best_target.restype = ctypes.c_int
    best = TARGETS[lib.spark_cpu_best_target()]
    cap = os.environ.get(TARGET_ENV)
    if cap:
        if cap not in TARGETS:
            raise ValueError(f"{TARGET_ENV} must be one of {', '.join(TARGETS)}, not {cap!r}")
        best = min(best, cap, key=TARGETS.index)
    return max((t for t in targets if TARGETS.index(t) <= TARGETS.index(best)), key=TARGETS.index)


def _open_installed(targets: list[str]) -> CpuKernels:
    target = best_installed_target(targets)
    kernels = open_library(lib_dir() / build.library_name(target), f"prebuilt {target}")
    if kernels.target != target:
        raise RuntimeError(f"{build.library_name(target)} reports target {kernels.target}")
    return kernels


def _compile_for_this_cpu(cc: str) -> CpuKernels:
    if kernel_march() != NATIVE:
        logger.info("fused CPU kernels built for %s (%s), not this CPU's own", kernel_march(), MARCH_ENV)
    return open_library(build_library(cc), f"compiled for {kernel_march()}")


def _load() -> CpuKernels | None:
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        logger.info("fused CPU kernels disabled by %s", DISABLE_ENV)
        return None
    cc = find_compiler()
    if _truthy(os.environ.get(BUILD_ENV)) or os.environ.get(MARCH_ENV):
        if cc is None:
            logger.warning("%s asks for a build at start, but there is no C compiler", BUILD_ENV)
        else:
            return _compile_for_this_cpu(cc)
    state, targets = installed_state()
    if state == "current" or (state == "stale" and cc is None):
        if state == "stale":
            logger.warning("the installed kernel libraries are older than their sources and there is no C compiler "
                           "to rebuild them: running them as built")
        return _open_installed(targets)
    if cc is None:
        logger.warning("no kernel libraries installed (make install builds them) and no C compiler: the CPU "
                       "forward runs on plain torch ops (slower at small batch)")
        return None
    logger.info("the installed kernel libraries are %s (make install builds them): compiling for this CPU",
                "older than their sources" if state == "stale" else "absent")
    return _compile_for_this_cpu(cc)


def load_cpu_kernels() -> CpuKernels | None:
    """The engine's kernels, found on first use; None where they cannot be had (logged once)."""
    global _loaded, _failed
    with _lock:
        if _loaded is not None or _failed:
            return _loaded
        try:
            _loaded = _load()
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError, AttributeError) as exc:
            logger.warning("fused CPU kernels unavailable (%s): the CPU forward runs on plain torch ops", exc)
        _failed = _loaded is None
        if _loaded is not None:
            logger.info("fused CPU kernels: %s library (linear paths: %s)", _loaded.origin,
                        ", ".join(_loaded.linear_paths) or "portable C")
        return _loaded


def load_target(target: str) -> CpuKernels:
    """The library of one install target (tests and benchmarks compare them on one machine): the installed
    one where it is current, else compiled now with that target's flags. The CPU must be able to run it."""
    with _lock:
        if target not in _targets:
            state, targets = installed_state()
            if state == "current" and target in targets:
                _targets[target] = open_library(lib_dir() / build.library_name(target), f"prebuilt {target}")
            else:
                cc = find_compiler()
                if cc is None:
                    raise RuntimeError(f"no installed {target} kernel library and no C compiler to build one")
                path = build_library(cc, " ".join(build.target_flags(target)))
                _targets[target] = open_library(path, f"compiled for {target}")
        return _targets[target]


__all__ = ["BUILD_ENV", "DISABLE_ENV", "LIB_DIR_ENV", "MARCH_ENV", "NATIVE", "TARGET_ENV", "UNITS", "build_library",
           "cache_dir", "find_compiler", "kernel_march", "lib_dir", "load_cpu_kernels", "load_target"]
