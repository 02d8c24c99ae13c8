"""The server sets libgomp's spin count before torch starts its OpenMP runtime, unless the operator did."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.openmp_env import SPIN_COUNT, limit_openmp_spin

_MAIN = """
import os, sys
from spark_server.cli import main
assert "torch" not in sys.modules, "the command line's module imported torch: too late to set the spin count"
try:
    main(["--help"])
except SystemExit:
    pass
print(os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def test_the_spin_count_is_set_only_where_the_operator_set_nothing() -> None:
    env: dict[str, str] = {}
    assert limit_openmp_spin(env) and env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for own in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(own)
        assert not limit_openmp_spin(env) and env == own


def test_the_command_line_sets_it_before_torch_is_imported() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", _MAIN], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == [SPIN_COUNT, "False"], out.stdout
