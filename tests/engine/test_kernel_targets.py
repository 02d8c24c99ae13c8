"""The instruction-set targets (engine/kernels/build.py's TARGETS) against what picks them: the cpuid check of
each target in target.c requires exactly the extensions that target's flags let the compiler use (a library
with one instruction the CPU lacks kills the server), the enum order agrees everywhere, and every installed
library this CPU runs opens as the target it is named for. Parsing and a few preprocessor runs: well under a
second.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from collections.abc import Iterator

import pytest
import torch

from engine.kernels import CpuKernels, build, installed_state, lib_dir, load_target, open_library
from engine.kernels.signatures import TARGETS
from tests.engine.test_linear_kernels import _weights
from tests.engine.threads import kernel_threads

TARGET_C = build.SOURCE_DIR / "target.c"
# What a predefined macro of the compiler says it may emit, as __builtin_cpu_supports names that extension.
CPUID_NAME = {
    "__SSE3__": "sse3", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4.1", "__SSE4_2__": "sse4.2",
    "__CRC32__": "sse4.2",  # crc32 is an SSE4.2 instruction
    "__POPCNT__": "popcnt", "__LAHF_SAHF__": "lahf_lm", "__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16": "cmpxchg16b",
    "__AVX__": "avx", "__AVX2__": "avx2", "__BMI__": "bmi", "__BMI2__": "bmi2", "__F16C__": "f16c", "__FMA__": "fma",
    "__LZCNT__": "lzcnt", "__MOVBE__": "movbe", "__XSAVE__": "xsave",
    "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512CD__": "avx512cd", "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl", "__AVX512BF16__": "avx512bf16", "__AVX512VNNI__": "avx512vnni",
    "__AVX512VBMI__": "avx512vbmi",
}
NOT_AN_EXTENSION = ("__BIGGEST_ALIGNMENT__", "__FP_FAST_FMA")  # macros that change with -march but enable nothing


def predefined_macros(cc: str, flags: tuple[str, ...]) -> set[str]:
    out = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", "-"], input="", capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


def enabled_extensions(cc: str, target: str) -> set[str]:
    """The cpuid names of what ``target``'s flags enable beyond the portable target's (any x86-64)."""
    added = predefined_macros(cc, build.TARGETS[target]) - predefined_macros(cc, build.TARGETS["portable"])
    added = {m for m in added if not m.startswith(NOT_AN_EXTENSION)}
    unknown = added - set(CPUID_NAME)
    assert not unknown, f"{target}'s flags enable {sorted(unknown)}: add their __builtin_cpu_supports names here " \
                        "and to target.c's check"
    return {CPUID_NAME[m] for m in added}


def cpu_checks() -> dict[str, str]:
    """target -> the body of target.c's cpu_runs_<target>."""
    source = TARGET_C.read_text()
    return dict(re.findall(r"static int cpu_runs_(\w+)\(void\) \{(.*?)\n\}", source, re.DOTALL))


def required_extensions(target: str, checks: dict[str, str]) -> set[str]:
    """What target.c's check of ``target`` requires, through the lower targets' checks it calls."""
    body = checks[target]
    found = set(re.findall(r'__builtin_cpu_supports\("([^"]+)"\)', body))
    for lower in re.findall(r"cpu_runs_(\w+)\(\)", body):
        found |= required_extensions(lower, checks)
    return found


def test_the_target_order_agrees_everywhere() -> None:
    """enum spark_target (the libraries' answers), the bindings' names and the build's table: one order."""
    enum = re.search(r"enum spark_target \{(.*?)\};", (build.SOURCE_DIR / "spark_types.h").read_text(), re.DOTALL)
    assert enum is not None, "spark_types.h has no enum spark_target"
    values = {int(v): name.lower() for name, v in re.findall(r"SPARK_TARGET_(\w+) = (\d+)", enum.group(1))}
    assert tuple(values[i] for i in range(len(values))) == TARGETS == tuple(build.TARGETS)


@pytest.mark.parametrize("target", [t for t in build.TARGETS if t != "portable"])
def test_the_cpu_check_requires_what_the_flags_enable(target: str) -> None:
    cc = build.find_compiler()
    if cc is None or not build.is_x86_64():
        pytest.skip("needs a C compiler on x86-64")
    checks = cpu_checks()
    assert target in checks, f"target.c has no cpu_runs_{target}"
    enabled, required = enabled_extensions(cc, target), required_extensions(target, checks)
    assert enabled - required == set(), f"{target}: the CPU check lets a CPU without these run it"
    assert required - enabled == set(), f"{target}: the CPU check asks for what its flags do not use"


def test_the_best_target_is_tried_highest_first() -> None:
    body = re.search(r"int spark_cpu_best_target\(void\) \{(.*?)\n\}", TARGET_C.read_text(), re.DOTALL)
    assert body is not None, "target.c has no spark_cpu_best_target"
    tried = re.findall(r"cpu_runs_(\w+)\(\)\s*\?\s*SPARK_TARGET_(\w+)", body.group(1))
    assert [(name, enum.lower()) for name, enum in tried] == [(t, t) for t in reversed(TARGETS[1:])]


def cpu_best_target() -> str:
    lib = ctypes.CDLL(str(lib_dir() / build.library_name("portable")))
    lib.spark_cpu_best_target.restype = ctypes.c_int
    return TARGETS[lib.spark_cpu_best_target()]


def runnable(target: str) -> None:
    """Skips unless ``target``'s library is installed, current, and this CPU runs it."""
    state, built = installed_state()
    if state != "current" or target not in built:
        pytest.skip(f"no current installed {target} library (`make kernels` builds it)")
    if TARGETS.index(target) > TARGETS.index(cpu_best_target()):
        pytest.skip(f"this CPU does not run the {target} library")


@pytest.mark.parametrize("target", TARGETS)
def test_each_installed_library_this_cpu_runs_opens_as_its_target(target: str) -> None:
    """Opening checks the ABI version and the structs' sizes; a symbol one target's #if paths leave undefined
    would fail here (and, since -z defs, at its build)."""
    runnable(target)
    kernels = open_library(lib_dir() / build.library_name(target), f"prebuilt {target}")
    assert kernels.target == target
    if target.startswith("avx"):
        assert "fma" in kernels.linear_paths and kernels.linear_isa >= 1


@pytest.fixture(scope="module")
def avx512_pair() -> Iterator[tuple[CpuKernels, CpuKernels]]:
    runnable("avx512bf16")
    plain, bf16 = load_target("avx512"), load_target("avx512bf16")
    with kernel_threads(plain, bf16):
        yield plain, bf16


def test_the_avx512_target_has_the_fma_linears_only(avx512_pair) -> None:
    plain, _ = avx512_pair
    assert (plain.linear_isa, plain.linear_paths) == (1, ("fma",))
    assert not plain.greedy_head_fast and not plain.int8_activations_fast


@pytest.mark.parametrize("kind", ["bf16", "u4"])
def test_the_avx512_fma_linears_give_the_bf16_targets_bits(avx512_pair, kind: str) -> None:
    """Same tiles in both builds; bf16 outputs rounded in integer arithmetic without AVX512-BF16 round as
    vcvtneps2bf16 does (round to nearest even)."""
    plain, bf16 = avx512_pair
    gen = torch.Generator().manual_seed(11)
    packed, _ = _weights(kind, 40, 256, gen)
    x = (torch.randn(5, 256, generator=gen) * 3).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen)
    for out in (None, torch.empty(5, 40)):
        want = bf16.linear(x, packed, bias, None if out is None else out.clone(), path="fma")
        got = plain.linear(x, packed, bias, None if out is None else out.clone(), path="fma")
        assert torch.equal(got, want), (kind, "bf16" if out is None else "fp32")
