"""How a LoRA pack is named on a fleet's backends: the one rule the front end (``fleet/client.py``)
and the replicas' adapter endpoints (``spark_server/fleet.py``) share."""

from __future__ import annotations

from engine.request import LoraRef

CONTENT_PREFIX = "lora-"


def adapter_name(ref: LoraRef) -> str:
    """The name a pack is loaded under on every backend: ``lora-<md5>`` (a registered adapter keeps its name)."""
    return f"{CONTENT_PREFIX}{ref.md5.lower()}" if ref.md5 else str(ref.name)


def content_named(name: str) -> bool:
    """``lora-<md5>``: a name that states its pack's md5 (backends of this server take it for no other pack)."""
    md5 = name.removeprefix(CONTENT_PREFIX)
    return name.startswith(CONTENT_PREFIX) and len(md5) == 32 and all(c in "0123456789abcdef" for c in md5)
