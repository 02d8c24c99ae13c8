"""The fleet client: an ``EngineClient`` over OpenAI-compatible backends (``--engine-url``).

It sits between the protocols and the engine: the app builds it, every protocol talks to it as to a
local engine, and it imports only the engine's types (``engine/`` knows nothing of it). How the
backends spell a request's sampling parameters is handed to it (``bridges/openai_fields.py``), so the
one sampling table stays the only vocabulary."""
