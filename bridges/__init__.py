"""One module per foreign protocol; each declares its ``PROTOCOL`` (bridges/registry.py), maps its
requests onto GenerationRequests and renders the engine's outputs in its own wire format."""
