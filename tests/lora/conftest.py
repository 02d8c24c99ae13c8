from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from engine.model_loader import resolve_model_dir
from tests.lora import adapters as adapter_builders
from tests.lora.adapter_cache import cached_adapters, content_key
from tests.lora.adapters import make_random_adapter, make_taught_adapter


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(resolve_model_dir(None))


def _build_adapters(model_dir: str, root: Path) -> dict[str, Path]:
    return {
        "taught": make_taught_adapter(model_dir, root / "taught"),
        "attn": make_random_adapter(model_dir, root / "attn", ["q_proj", "v_proj"], rank=16, seed=1),
        "mlp": make_random_adapter(model_dir, root / "mlp", ["o_proj", "gate_proj", "up_proj", "down_proj"],
                                   rank=4, seed=2),
    }


@pytest.fixture(scope="session")
def adapters(request, tmp_path_factory, model_dir) -> dict:
    """Built once per content under the pytest cache (shared by the workers and later runs); built in a
    temporary folder where the cache is off (-p no:cacheprovider)."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return _build_adapters(model_dir, tmp_path_factory.mktemp("adapters"))
    key = content_key(model_dir, [Path(adapter_builders.__file__), Path(__file__)])
    return cached_adapters(Path(cache.mkdir("lora-adapters")), key, partial(_build_adapters, model_dir))
