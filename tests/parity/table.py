"""The table of what each protocol can express, written from the parity harness's own descriptions
(tests/parity/protocols.py), so the documented table is what the harness checks.

    python -m tests.parity.table    # prints docs/protocol-parity.md's table
"""

from __future__ import annotations

from pathlib import Path

from tests.parity.protocols import ADAPTERS, Caps

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol-parity.md"

_USAGE = {"both": "prompt and output", "output": "output only", "none": "no"}
_FINISH = {"full": "end, stop string, length", "coarse": "stop, length", "none": "no"}


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _row(name: str, endpoint: str, caps: Caps) -> str:
    cells = [name, f"`{endpoint}`", "conversation" if caps.chat else "text", _yes(caps.tools), _yes(caps.seed),
             _yes(caps.stop), _USAGE[caps.usage], _FINISH[caps.finish], _yes(caps.streams), caps.note]
    return "| " + " | ".join(cells) + " |"


def markdown() -> str:
    head = ("| protocol | endpoint | prompt | tools | seed | stop strings | token counts | finish reasons | "
            "streams | notes |\n|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *(_row(a.name, a.endpoint, a.caps) for a in ADAPTERS)]) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
