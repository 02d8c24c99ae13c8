"""One module per foreign protocol (OpenAI, TGI, vLLM, Triton, SGLang, MindIE, tokenizer)."""
