"""The code states rules, not experiments: no machine names, dates or work-session numbers in the packages.

A comment says what a constant encodes and one line of why; the measurement that chose it (which CPU,
when, how much faster) goes to the commit message and docs/performance.md, where it can be dated and
replaced when the hardware changes. Instruction-set levels and the microarchitectures that introduced
them ("AVX-512 BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later)") are rules for the CPU dispatch and
stay; a product line or a particular machine ("a 2-core AMD EPYC", "the Intel Xeon") does not.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "bridges", "spark_server", "lora_store", "fleet", "schemas")
SUFFIXES = {".py", ".c", ".h", ".inc"}

LAB_NOTES = re.compile(
    r"\bEPYC\b|\bXeon\b|\bKVM\b"  # a machine's product line
    r"|\b\d+[- ]core (?:AMD|Intel|machine|virtual|VM|box|host)"  # "a 2-core machine", "2-core AMD ..."
    r"|\bfamily \d+ model \d+"  # a CPUID signature of one machine
    r"|\b(?:work )?session \d+"  # a work-session number
    r"|\b20\d\d-[01]\d-[0-3]\d\b"  # a date
)

# (path, text on the line) pairs that match for a reason other than a lab note. Keep it short.
ALLOWED: set[tuple[str, str]] = set()

# Files whose notes are still to be moved to docs/performance.md. This list may only shrink.
NOT_YET_CLEANED: set[str] = {
    "engine/kernels/csrc/layer_ops.c", "engine/kernels/csrc/linear.c",
    "engine/models/weights.py",
}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")
                  if p.suffix in SUFFIXES and p.is_file() and "_lib" not in p.parts)


def lab_notes() -> list[str]:
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in NOT_YET_CLEANED:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = LAB_NOTES.search(line)
            if match and not any(rel == p and text in line for p, text in ALLOWED):
                found.append(f"{rel}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return found


def test_no_machine_names_dates_or_session_numbers_in_the_packages():
    found = lab_notes()
    assert not found, ("lab notes in the code; keep the rule and one line of why, move the measurement to "
                       "docs/performance.md:\n" + "\n".join(found))


def test_the_pattern_catches_what_it_is_for():
    for note in ("on a 2-core AMD EPYC: ~7 tokens", "On the Intel Xeon (model 207)", "(AMD EPYC, session 55)",
                 "measured 2026-11-23", "family 6 model 207", "on a 2-core machine"):
        assert LAB_NOTES.search(note), note
    for rule in ("AVX-512 BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later)", "JSON Schema draft 2020-12",
                 "one session per connection", "16 cores"):
        assert not LAB_NOTES.search(rule), rule


def test_the_unfinished_list_only_names_files_that_still_need_it():
    for rel in NOT_YET_CLEANED:
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert LAB_NOTES.search(text), f"{rel} is clean now: take it off NOT_YET_CLEANED"
