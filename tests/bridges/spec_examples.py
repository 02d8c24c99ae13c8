"""Request bodies copied verbatim from ../shared/specs (single-modality examples)."""

TGI_GENERATE = {
    "inputs": "My name is Olivier and I",
    "parameters": {"decoder_input_details": True, "details": True, "do_sample": True, "max_new_tokens": 20,
                   "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5,
                   "top_k": 10, "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False,
                   "stop": None, "adapter_id": "None"},
}
TGI_GENERATE_STREAM = {
    "inputs": "My name is Olivier and I",
    "parameters": {"decoder_input_details": False, "details": True, "do_sample": True, "max_new_tokens": 20,
                   "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5,
                   "top_k": 10, "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False,
                   "stop": None, "adapter_id": "None"},
}
VLLM_GENERATE = {
    "prompt": "My name is Olivier and I", "max_tokens": 20, "repetition_penalty": 1.03, "presence_penalty": 1.2,
    "frequency_penalty": 1.2, "temperature": 0.5, "top_p": 0.95, "top_k": 10, "seed": None, "stream": False,
    "stop": None, "stop_token_ids": None, "model": "None", "include_stop_str_in_output": False,
    "skip_special_tokens": True, "ignore_eos": False,
}
TRITON_GENERATE = {
    "id": "a123", "text_input": "My name is Olivier and I",
    "parameters": {"details": True, "do_sample": True, "max_new_tokens": 5, "repetition_penalty": 1.1, "seed": 123,
                   "temperature": 1, "top_k": 10, "top_p": 0.99, "batch_size": 100, "typical_p": 0.5,
                   "watermark": False, "perf_stat": True, "priority": 5, "timeout": 10},
}
TRITON_INFER = {
    "id": "42",
    "inputs": [{"name": "input0", "shape": [1, 10], "datatype": "UINT32",
                "data": [396, 319, 13996, 29877, 29901, 29907, 3333, 20718, 316, 23924]}],
    "outputs": [{"name": "output0"}],
    "parameters": {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "do_sample": True, "seed": None,
                   "repetition_penalty": 1.03, "max_new_tokens": 20, "watermark": True, "priority": 5, "timeout": 10},
}
MINDIE_INFER = {
    "inputs": "My name is Olivier and I", "stream": False,
    "parameters": {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": True,
                   "seed": None, "repetition_penalty": 1.03, "details": True, "typical_p": 0.5, "watermark": False,
                   "priority": 5, "timeout": 10},
}
TOKENIZER = {"inputs": "what is your name?"}
SGLANG_GENERATE = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
