#!/usr/bin/env bash
# `make loadtest`: start a local server, run a bounded headless locust load against it, stop the server.
# USERS, DURATION, PORT and CLASSES can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-9995}
USERS=${USERS:-50}
DURATION=${DURATION:-60s}
CLASSES=${CLASSES:-SparkWebSocketUser}
OUT=loadtests/reports
RUN="$OUT/run-$(date +%Y%m%d-%H%M%S)"  # every run keeps its own report
mkdir -p "$OUT"
export SPARK_LOADTEST_REPORT="$RUN"
"$PY" -m spark_server serve --port "$PORT" --log-level warning --max-num-seqs 64 > "$RUN-server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  sleep 0.2
done
PYTHONPATH=. "$PY" -m locust -f loadtests/locustfile.py $CLASSES --host "http://127.0.0.1:$PORT" --headless \
  -u "$USERS" -r "$USERS" -t "$DURATION" --stop-timeout 30 --csv "$RUN" --html "$RUN.html" --exit-code-on-error 1
echo "reports: $RUN.html, ${RUN}_stats.csv, $RUN-tokens.csv"
