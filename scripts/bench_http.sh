#!/usr/bin/env bash
# bench_http.sh — what the HTTP front end costs, as a table:
#   1. GET /health throughput with wrk (2 threads, 64 keep-alive connections);
#   2. one POST /generate with max_new_tokens = 1 on the embedded default model, one request at a
#      time: latency over HTTP + JSON (wrk, 1 connection) against the same request submitted to
#      the same engine in process (tools/bench_inproc.c); the difference is the front end's cost;
#   3. the same with max_new_tokens = 0 (the engine finishes the job at admission): the round trip
#      with almost no model work, where the front end's share is easiest to see.
#
#   scripts/bench_http.sh [BUILD_DIR]        (default: build; rolloutd and bench-inproc are built there)
#   DURATION=10 THREADS=2 scripts/bench_http.sh build
#
# Needs wrk (scripts/install-deps.sh installs it). Runs on the CPUs it is given; on a 2-core machine
# the client, the HTTP threads and the engine share them, as they would in CI.
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${1:-build}
DURATION=${DURATION:-10}
THREADS=${THREADS:-2}
ITER=${ITER:-2000}
command -v wrk >/dev/null || ./scripts/install-deps.sh
command -v wrk >/dev/null || { echo "bench_http: wrk is not installed"; exit 1; }

make --no-print-directory BUILD="$BUILD" -j2 "$BUILD/rolloutd" "$BUILD/librolloutd.a" >/dev/null
# tools/bench_inproc.c links against the library like the other tools
cc -std=c11 -O2 -g -Wall -Wextra -ffp-contract=off -fno-fast-math -pthread -D_GNU_SOURCE \
   tools/bench_inproc.c "$BUILD/librolloutd.a" -lmicrohttpd -ljansson -luv -lisal -lm -pthread -o "$BUILD/bench-inproc"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
tmp=$(mktemp -d)
"$BUILD/rolloutd" --host 127.0.0.1 --port "$port" --threads "$THREADS" --kv-cache-mb 256 --log-level warn \
  >"$tmp/rolloutd.log" 2>&1 &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
for _ in $(seq 1 600); do
  curl -sf "$url/health" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { cat "$tmp/rolloutd.log"; exit 1; }
  sleep 0.1
done

# wrk prints latencies as 812.00us / 1.23ms / 1.01s: to milliseconds
to_ms() { awk '{ v = $1; if (v ~ /us$/) { sub(/us$/, "", v); v /= 1000 } else if (v ~ /ms$/) { sub(/ms$/, "", v) }
                 else if (v ~ /s$/) { sub(/s$/, "", v); v *= 1000 } printf "%.3f", v }'; }

wrk -t2 -c64 -d"${DURATION}s" "$url/health" >"$tmp/health.txt"
health_rps=$(awk '/Requests\/sec/ { print $2 }' "$tmp/health.txt")

cat >"$tmp/post.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1}}'
wrk.headers["Content-Type"] = "application/json"
EOF
curl -sf "$url/generate" -H 'Content-Type: application/json' -d '{"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1}}' >/dev/null
wrk -t1 -c1 -d"${DURATION}s" --latency -s "$tmp/post.lua" "$url/generate" >"$tmp/gen.txt"
http_p50=$(awk '$1 == "50%" { print $2 }' "$tmp/gen.txt" | to_ms)
http_p99=$(awk '$1 == "99%" { print $2 }' "$tmp/gen.txt" | to_ms)
http_rps=$(awk '/Requests\/sec/ { print $2 }' "$tmp/gen.txt")
# max_new_tokens = 0 without scoring: the engine finishes the job as it admits it, so this is the
# round trip through HTTP, JSON, the engine's queue and back with (almost) no model work
sed 's/"max_new_tokens": 1/"max_new_tokens": 0/' "$tmp/post.lua" >"$tmp/post0.lua"
wrk -t1 -c1 -d"${DURATION}s" --latency -s "$tmp/post0.lua" "$url/generate" >"$tmp/gen0.txt"
http0_p50=$(awk '$1 == "50%" { print $2 }' "$tmp/gen0.txt" | to_ms)
http0_p99=$(awk '$1 == "99%" { print $2 }' "$tmp/gen0.txt" | to_ms)
model=$(curl -sf "$url/get_model_info" | python3 -c 'import json, sys; print(json.load(sys.stdin)["model_path"])')
kill "$pid"; wait "$pid" 2>/dev/null || true

line=$("$BUILD/bench-inproc" --model "$model" --threads "$THREADS" --kv-cache-mb 256 --iterations "$ITER")
in_p50=$(sed -E 's/.*median_ms=([0-9.]+).*/\1/' <<<"$line")
in_p99=$(sed -E 's/.*p99_ms=([0-9.]+).*/\1/' <<<"$line")
line0=$("$BUILD/bench-inproc" --model "$model" --threads "$THREADS" --kv-cache-mb 256 --iterations "$ITER" \
        --max-new-tokens-per-request 0)
in0_p50=$(sed -E 's/.*median_ms=([0-9.]+).*/\1/' <<<"$line0")
in0_p99=$(sed -E 's/.*p99_ms=([0-9.]+).*/\1/' <<<"$line0")

printf '\n%-58s %s\n' "benchmark ($(nproc) CPUs, engine --threads $THREADS, ${DURATION}s runs)" "result"
printf '%-58s %s\n' "----------------------------------------------------------" "--------------------"
printf '%-58s %s req/s\n' "GET /health, wrk -t2 -c64" "$health_rps"
printf '%-58s %s ms / %s ms\n' "POST /generate max_new_tokens=1, HTTP (median / p99)" "$http_p50" "$http_p99"
printf '%-58s %s ms / %s ms\n' "same request in process (median / p99), $ITER iterations" "$in_p50" "$in_p99"
printf '%-58s %s ms / %s ms\n' "HTTP + JSON overhead (median / p99)" \
  "$(awk -v a="$http_p50" -v b="$in_p50" 'BEGIN { printf "%.3f", a - b }')" \
  "$(awk -v a="$http_p99" -v b="$in_p99" 'BEGIN { printf "%.3f", a - b }')"
printf '%-58s %s req/s\n' "POST /generate max_new_tokens=1, 1 connection" "$http_rps"
printf '%-58s %s ms / %s ms\n' "POST /generate max_new_tokens=0, HTTP (median / p99)" "$http0_p50" "$http0_p99"
printf '%-58s %s ms / %s ms\n' "same request in process (median / p99)" "$in0_p50" "$in0_p99"
