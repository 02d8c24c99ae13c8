"""The kernel probes' results (engine/models/weights.py ``LinearBuilder.tune``) kept beside the model.

What a start measures about the linears (which kernel path wins, up to how many rows the packed kernels
beat oneDNN, the weights' stream rate and a batch's arithmetic rate, from which the scheduler's cost
model follows) depends on the model, the CPU model, the kernel build and the thread count, not on the
moment: a warm start reads the last measurement instead of spending seconds re-timing it, and is not
swayed by a neighbour that happened to load the machine at that moment. ``--remeasure-kernels`` times
them again and replaces the entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# 3: a dense limit of None is "at every batch" (weights.LinearBuilder._dense_kernel_rows); 4: kept only from
# probes whose threads did not queue for a CPU (weights.LinearBuilder.tune), so an entry of an earlier start
# on a loaded machine is measured again
FORMAT_VERSION = 4


def cpu_model() -> str:
    """The CPU's model name (and the machine type): measurements are only valid on the same model."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()} {name or platform.processor()}"


def kernel_build() -> str:
    """The kernels' build, as far as it changes what they do: their sources and the build settings in the
    environment (the -march choice). A digest, read in a few milliseconds."""
    root = Path(__file__).resolve().parent.parent / "kernels"
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".c", ".h", ".inc", ".py"):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    for name in sorted(os.environ):
        if name.startswith("SPARK_KERNEL"):
            digest.update(f"{name}={os.environ[name]}".encode())
    return digest.hexdigest()[:16]


@dataclass
class TuningCache:
    """One model's entry: ``load`` gives the stored results (None: measure), ``save`` stores new ones."""

    path: Path
    remeasure: bool = False

    def load(self) -> dict[str, Any] | None:
        if self.remeasure:
            return None
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("version") == FORMAT_VERSION else None

    def save(self, results: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, staging = tempfile.mkstemp(prefix=".tuning-", dir=self.path.parent)
        except OSError:
            return  # a read-only cache: measured again next time
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": FORMAT_VERSION, **results}, f, indent=1)
            os.replace(staging, self.path)  # concurrent starts: each writes a whole entry, the last wins
        except OSError:
            Path(staging).unlink(missing_ok=True)


def tuning_cache(cache_dir: Path, model_identity: str, threads: int, settings: str,
                 remeasure: bool = False) -> TuningCache:
    """The entry for this model (its files' content digest), CPU model, kernel build, thread count and
    weight settings (``settings``: quantization, activations, dtype)."""
    key = hashlib.sha1(json.dumps([FORMAT_VERSION, model_identity, cpu_model(), kernel_build(), threads,
                                   settings]).encode()).hexdigest()[:16]
    return TuningCache(cache_dir / "tuning" / f"{key}.json", remeasure)
