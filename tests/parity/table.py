"""The table of what each protocol can express, written from the parity harness's own descriptions
(tests/parity/protocols.py), so the documented table is what the harness checks; and the error table
(bridges/errors.py) as docs/errors.md shows it.

    python -m tests.parity.table           # prints docs/protocol-parity.md's table
    python -m tests.parity.table errors    # prints docs/errors.md's table of error kinds
"""

from __future__ import annotations

import sys
from pathlib import Path

from bridges.errors import KINDS
from tests.parity.protocols import ADAPTERS, Caps

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol-parity.md"
ERRORS_DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"

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


def errors_markdown() -> str:
    head = ("| kind | HTTP status | Spark code | public form's code | OpenAI type | OpenAI code | Anthropic type |\n"
            "|---|---|---|---|---|---|---|")
    rows = [f"| {name} | {k.status} | {int(k.spark)} | {int(k.public)} | {k.openai_type} | {k.code or k.status} | "
            f"{k.anthropic_type} |" for name, k in KINDS.items()]
    return "\n".join([head, *rows]) + "\n"


if __name__ == "__main__":
    print(errors_markdown() if sys.argv[1:] == ["errors"] else markdown(), end="")
