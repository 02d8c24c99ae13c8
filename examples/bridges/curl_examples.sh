#!/usr/bin/env bash
# One call per bridge with curl.   SPARK_SERVER=http://127.0.0.1:9990 bash examples/bridges/curl_examples.sh
set -euo pipefail
S="${SPARK_SERVER:-http://127.0.0.1:9990}"
post() { echo "== POST $1"; curl -sS --fail-with-body -X POST "$S$1" -H 'Content-Type: application/json' -d "$2"; echo; }
MODEL=$(curl -sS "$S/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

post /v1/completions '{"prompt": "The capital of France is", "max_tokens": 8}'                      # OpenAI
post /v1/chat/completions '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}'       # OpenAI chat
post /generate '{"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}'         # TGI
post /generate_stream '{"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}}'  # TGI stream
post /generate '{"prompt": "The capital of France is", "max_tokens": 8}'                             # vLLM
post /generate '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}'      # SGLang
post "/v2/models/$MODEL/generate" '{"text_input": "The capital of France is", "parameters": {"max_new_tokens": 8}}'  # Triton
post /infer '{"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}'            # MindIE
post /api/chat "{\"model\": \"$MODEL\", \"stream\": false, \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"options\": {\"num_predict\": 8}}"  # Ollama
