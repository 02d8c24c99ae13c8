"""How long the kernels' OpenMP threads spin before they sleep: set before the runtime starts.

libgomp (torch's, which the fused kernels share) reads GOMP_SPINCOUNT and OMP_WAIT_POLICY once, when torch is
first imported. With neither set, a thread that reaches a barrier, or the end of a parallel region, spins for
300,000 rounds (milliseconds of a core) before it sleeps. Alone on its cores that costs nothing. Beside
another process computing on the same cores (a second server, a build), the spinning thread holds a core
its descheduled sibling needs, and each of a step's hundreds of parallel regions can lose a scheduler tick:
two engines sharing two cores each ran at a fifth of one engine's rate. With 1,000 rounds (tens of
microseconds) a thread still waits through the short gaps inside a step, and sleeps soon after one: the
pair ran 1.7x faster and one engine alone measured level (docs/performance.md). Sleeping at once
(OMP_WAIT_POLICY=passive) let the pair run faster still, but cost one engine alone 40%, every region's
wake-up on the critical path. An operator's own setting of either variable wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_COUNT = "1000"


def limit_openmp_spin(environ: MutableMapping[str, str] | None = None) -> bool:
    """Sets GOMP_SPINCOUNT where neither it nor OMP_WAIT_POLICY is set; True where it did. Without effect (and
    False) once torch is imported into this process (``environ`` None: this process's environment)."""
    if environ is None:
        if "torch" in sys.modules:
            return False  # the runtime has read its settings already
        environ = os.environ
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
