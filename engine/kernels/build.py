"""Compiles the kernel libraries (csrc/) with the system C compiler. Standard library only: setup.py loads
this file by path at install, before any dependency is there.

Install (``make install``, ``pip install -e .``, or ``python engine/kernels/build.py``): one shared library
per instruction-set target into ``_lib/`` beside this file, and a manifest naming the sources' digest; the
engine picks one at run time by what the CPU has (engine/kernels/loader.py). Developer builds (a variant's
-D flags, a -march of choice, the benchmarks' library) go through ``compile_library`` into a cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
LIB_DIR = Path(__file__).resolve().parent / "_lib"
MANIFEST = "manifest.json"
# The translation units, compiled side by side (the linears take most of the time), then linked.
UNITS = tuple(SOURCE_DIR / f"{name}.c" for name in ("linear", "layer_ops", "greedy_head", "sampling", "forward",
                                                    "repack", "target"))
BENCH_UNIT = SOURCE_DIR / "bench.c"  # the benchmarks' entry points: only their library has it
# A function a target's #if paths leave undefined must fail its build (that target is then left out), not
# make a library that only fails when it is opened: an error for an implicit declaration, and no undefined
# symbol at link (LDFLAGS; -z defs is the ELF linkers' option).
CFLAGS = ("-O3", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c11", "-Werror=implicit-function-declaration")
LDFLAGS = ("-shared", "-Wl,-z,defs") if sys.platform.startswith("linux") else ("-shared",)
# The targets, lowest first (enum spark_target's order): the flags each adds. x86-64 only; elsewhere the
# portable library alone is built, for the compiler's default target.
TARGETS: dict[str, tuple[str, ...]] = {
    "portable": ("-march=x86-64",),  # any x86-64: the plain-C loops, vectorised for SSE2
    "avx2": ("-march=x86-64-v3",),  # AVX2, FMA, F16C, BMI2 (Haswell, Zen 1 and later)
    # AVX-512 F/BW/VL/DQ/CD (Skylake-X, Cascade Lake, Ice Lake): the AVX-512 fp32 FMA linears and the
    # AVX-512 norms, attention and sampling. No VNNI: outside the BF16 build it would only add the greedy
    # head's int8 path, and would leave Skylake-X (no VNNI) on the AVX2 library.
    "avx512": ("-march=x86-64-v4",),
    # plus BF16, VNNI and VBMI, every extension the fast paths use: the BF16 dot-product linears, int8
    # activations, the greedy head (Cooper Lake, Sapphire Rapids, Zen 4 and later)
    "avx512bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"),
}
# target.c's spark_cpu_best_target requires, for each target, every extension these flags enable
# (tests/engine/test_kernel_targets.py checks it against the compiler).


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def install_targets() -> tuple[str, ...]:
    """The targets this machine's install builds."""
    return tuple(TARGETS) if is_x86_64() else ("portable",)


def target_flags(target: str) -> tuple[str, ...]:
    return TARGETS[target] if is_x86_64() else ()


def library_name(target: str) -> str:
    return f"libspark_kernels_{target}.so"


def find_compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def sources_digest() -> str:
    """A digest of every source file and of the flags: what a built library must match to be current."""
    h = hashlib.sha256(repr((CFLAGS, LDFLAGS, TARGETS)).encode())
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".c", ".h", ".inc"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout


def compile_library(cc: str, flags: list[str], out: Path, units: tuple[Path, ...] = UNITS) -> None:
    """Compiles ``units`` side by side, links them into ``out`` (replaced atomically: a reader sees the whole
    library or none). Raises RuntimeError with the compiler's message where it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{unit.stem}.o" for unit in units]
        built = Path(tmp) / out.name
        run_all([[cc, *flags, "-c", str(unit), "-o", str(obj)] for unit, obj in zip(units, objects)], cc)
        run_all([[cc, *flags, *LDFLAGS, *map(str, objects), "-o", str(built), "-lm"]], cc)
        os.replace(built, out)


# Compiler processes at once, over every library being built: the install builds its targets side by side
# (most of a target's time is one unit, linear.c, so one target at a time leaves cores idle), without more
# processes than cores competing for them.
_JOBS = threading.BoundedSemaphore(max(2, os.cpu_count() or 1))


def run_all(commands: list[list[str]], cc: str) -> None:
    """Runs compiler commands side by side (at most one per core, counting every build running in this
    process); the first failure's message is raised."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        errors = [error for error in pool.map(_run_one, commands) if error]
    if errors:
        raise RuntimeError(f"{cc} failed: {errors[0][:2000]}")


def _run_one(command: list[str]) -> str:
    """One compiler command; its message where it fails, else ''."""
    with _JOBS:
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            return f"timed out after 300 s. {stderr}"
    if proc.returncode == 0:
        return ""
    return proc.stderr.strip() or f"exit status {proc.returncode}"


def read_manifest(directory: Path = LIB_DIR) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def build_installed(directory: Path = LIB_DIR, cc: str | None = None, log=print) -> list[str]:
    """Builds every install target's library into ``directory``, then the manifest (last: a build cut short
    leaves no manifest, and the loader treats the libraries as absent). A target the compiler cannot build
    (too old for its -m flags) is left out with a message; the CPU then runs the best one built. Returns the
    targets built; raises RuntimeError where there is no compiler or not even the portable one builds."""
    cc = cc or find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install cc / gcc / clang)")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    digest = sources_digest()
    built = []
    targets = install_targets()
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:  # side by side; _JOBS bounds the processes
        builds = {target: pool.submit(compile_library, cc, [*CFLAGS, *target_flags(target)],
                                      directory / library_name(target)) for target in targets}
        for target, future in builds.items():
            try:
                future.result()
            except RuntimeError as exc:
                if target == "portable":
                    raise
                log(f"kernels: the {target} library did not build ({str(exc)[:300]}); CPUs with {target} run a "
                    "lower one")
                (directory / library_name(target)).unlink(missing_ok=True)
                continue
            built.append(target)
            log(f"kernels: built {directory / library_name(target)}")
    manifest = {"sources": digest, "targets": built, "compiler": (compiler_version(cc).splitlines() or [""])[0],
                "machine": platform.machine()}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the fused CPU kernel libraries for every target.")
    parser.add_argument("--out", type=Path, default=LIB_DIR, help=f"where the libraries go (default: {LIB_DIR})")
    parser.add_argument("--cc", default=None, help="the C compiler (default: $CC, cc, gcc or clang)")
    args = parser.parse_args(argv)
    try:
        build_installed(args.out, args.cc)
    except RuntimeError as exc:
        print(f"kernels: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
