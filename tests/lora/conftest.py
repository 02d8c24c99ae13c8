from __future__ import annotations

import pytest

from engine.model_loader import resolve_model_dir
from tests.lora.adapters import make_random_adapter, make_taught_adapter


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(resolve_model_dir(None))


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, model_dir) -> dict:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "taught": make_taught_adapter(model_dir, root / "taught"),
        "attn": make_random_adapter(model_dir, root / "attn", ["q_proj", "v_proj"], rank=16, seed=1),
        "mlp": make_random_adapter(model_dir, root / "mlp", ["o_proj", "gate_proj", "up_proj", "down_proj"],
                                   rank=4, seed=2),
    }
