"""The body-validation worker process (``python -m schemas.off_process``): the serving process sends it
large bodies (bridges/validation_worker.py) so their validation never holds the serving process's GIL. It
runs at a lower CPU priority, one body a line, and answers each with its first violation or none."""

from __future__ import annotations

import json
import os
import sys

# CFS weighs nice 10 at about a tenth of nice 0: a body's validation yields a busy core to the engine
WORKER_NICENESS = 10


def _serve() -> None:
    """The worker's loop: a job a line, {"schema": name, "body": the parsed body}."""
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # a platform without priorities
        pass
    import schemas

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin.buffer:  # UTF-8 bytes each way (answers in ASCII), whatever the locale's encoding
        job = json.loads(line)  # the serving process's own line: a body it parsed and bounded already
        error = schemas.first_error(job["schema"], job["body"])
        answer = None if error is None else [schemas.describe(error), list(error.absolute_path)]
        print(json.dumps({"violation": answer}), flush=True)


if __name__ == "__main__":
    _serve()
