#!/usr/bin/env bash
# The Spark HTTP form: the same body as the WebSocket, one JSON answer.
#   SPARK_SERVER=http://127.0.0.1:9990 bash examples/spark_curl.sh
set -euo pipefail
cd "$(dirname "$0")"
curl -sS --fail-with-body -X POST "${SPARK_SERVER:-http://127.0.0.1:9990}/turing/v3/func/gpt" \
     -H 'Content-Type: application/json' -d @request.json
echo
