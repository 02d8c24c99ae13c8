"""The kernel library's one signature table (engine/kernels/signatures.py) against its C headers: every
declaration of the public headers has its entry, with the same return type, argument count and types; the
entry points whose comment says they return a status are the ones bound to raise on it; the ctypes structs
have forward.h's fields in its order, and the library's sizes. The benchmarks' table against bench.h too.
Parsing only (the size check needs a library): milliseconds."""

from __future__ import annotations

import ctypes
import re

import pytest

from benchmarks.kernel_bench import BENCH_RETURNS_STATUS, BENCH_SIGNATURES
from engine.kernels import build
from engine.kernels.signatures import (
    HEADERS,
    RETURNS_STATUS,
    SIGNATURES,
    STRUCTS,
    ForwardStep,
    LayerDesc,
)

SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
           "uint64_t": ctypes.c_uint64, "void": None}
STRUCT_POINTERS = {"struct spark_layer_desc": ctypes.POINTER(LayerDesc),
                   "struct spark_forward_step": ctypes.POINTER(ForwardStep)}
DECLARATION = re.compile(r"(/\*(?:(?!\*/).)*\*/\s*)?^([A-Za-z_][\w ]*?)\s+(\w+)\(([^;{]*)\);", re.DOTALL | re.MULTILINE)


def c_type(text: str) -> object:
    """The ctypes type a C parameter or return type of these headers maps to."""
    text = re.sub(r"\bconst\b", "", text).strip()
    if "*" in text:
        base = text.replace("*", "").strip()
        return STRUCT_POINTERS.get(base, ctypes.c_void_p)
    if text not in SCALARS:
        raise AssertionError(f"a type the table has no mapping for: {text!r}")
    return SCALARS[text]


def declarations(header: str) -> dict[str, tuple[object, list[object], str]]:
    """name -> (return type, argument types, the comment above it) of every function a header declares (a
    declaration right after another, as a dtype's twin is, shares its comment)."""
    source = (build.SOURCE_DIR / header).read_text()
    found = {}
    previous = ""
    for comment, ret, name, params in DECLARATION.findall(source):
        comment = previous = comment or previous
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [c_type(re.sub(r"\w+$", "", p.strip())) for p in params.split(",")]
        found[name] = (c_type(ret), args, " ".join(comment.split()))
    return found


def check(headers: tuple[str, ...], table: dict, returns_status: frozenset[str]) -> None:
    declared = {}
    for header in headers:
        declared.update(declarations(header))
    assert sorted(declared) == sorted(table), "the headers and the table name different functions"
    for name, (restype, argtypes, comment) in declared.items():
        want_restype, want_args = table[name]
        assert want_restype == restype, f"{name}: returns {restype}, the table says {want_restype}"
        assert len(want_args) == len(argtypes), f"{name}: {len(argtypes)} arguments, the table has {len(want_args)}"
        for i, (got, want) in enumerate(zip(argtypes, want_args)):
            assert got == want, f"{name}: argument {i} is {got}, the table says {want}"
        says_status = "Returns SPARK_OK" in comment  # the headers' convention for a status return
        assert says_status == (name in returns_status), f"{name}: status return and the table disagree"


def test_the_table_matches_the_public_headers() -> None:
    check(HEADERS, SIGNATURES, RETURNS_STATUS)


def test_the_benchmarks_table_matches_bench_h() -> None:
    check(("bench.h",), BENCH_SIGNATURES, BENCH_RETURNS_STATUS)


def test_every_public_header_is_covered() -> None:
    """A new header of declarations must join the table's list (bench.h is the benchmarks' own)."""
    headers = {p.name for p in build.SOURCE_DIR.glob("*.h")}
    internal = {"common.h", "tuning.h", "spark_types.h", "forward_loop.h", "bench.h"}
    assert headers - internal == set(HEADERS)


def parse_struct(source: str, name: str) -> list[tuple[str, str]]:
    body = re.search(rf"struct {name} \{{(.*?)\}};", source, re.DOTALL).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.DOTALL)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.match(r"((?:struct )?\w+) (.*)", decl)
        fields += [(m.group(1), f.strip()) for f in m.group(2).split(",")]
    return fields


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_fields_match_forward_h(name: str) -> None:
    source = (build.SOURCE_DIR / "forward.h").read_text()
    struct = STRUCTS[name][1]
    expected = []
    for ctype, field in parse_struct(source, name):
        kind = STRUCTS[ctype.split()[1]][1] if ctype.startswith("struct ") else SCALARS[ctype]
        expected.append((field, kind))
    assert [tuple(f) for f in struct._fields_] == expected  # a bit field's 3-tuple differs


def test_struct_sizes_match_the_library() -> None:
    from engine.kernels import lib_dir, load_cpu_kernels
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no kernel library here")
    lib = ctypes.CDLL(str(lib_dir() / build.library_name(kernels.target))) if kernels.origin.startswith(
        "prebuilt") else None
    if lib is None:
        pytest.skip("the engine's library is a developer build")
    lib.spark_forward_struct_size.restype = ctypes.c_int64
    for which, struct in STRUCTS.values():
        assert lib.spark_forward_struct_size(which) == ctypes.sizeof(struct)
