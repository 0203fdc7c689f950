#!/usr/bin/env bash
# Smoke test of `kvvm serve` on the GPU machine: a few requests, metrics, graceful shutdown.
set -u
K="$(dirname "$0")/kvvm"
"$K" serve --backend cuda --listen 127.0.0.1:18080 --budget-bytes 4GiB --layout token-major > "${OUT:-.}/serve.log" 2>&1 &
pid=$!
for i in $(seq 1 50); do curl -sf http://127.0.0.1:18080/healthz >/dev/null && break; sleep 0.2; done
post() { curl -s -o /dev/stdout -w ' HTTP %{http_code}\n' -H 'content-type: application/json' -X "$1" "http://127.0.0.1:18080$2" ${3:+-d "$3"}; }
ids=$(python3 -c 'print([i % 1000 for i in range(64)])')
post POST /v1/sequences "{\"prompt_tokens\": 64, \"max_tokens\": 4096, \"token_ids\": $ids}"
post POST /v1/sequences "{\"prompt_tokens\": 64, \"max_tokens\": 4096, \"token_ids\": $ids}"
post POST /v1/sequences/1/append '{"tokens": 100}'
post POST /v1/sequences '{"prompt_tokens": 4000, "max_tokens": 4096}'
for i in $(seq 1 40); do post POST /v1/sequences '{"prompt_tokens": 4000, "max_tokens": 4096}'; done | awk '{print $NF}' | sort | uniq -c
post POST /v1/sequences '{"prompt_tokens": 4000, "max_tokens": 4096}' ; curl -s -D - -o /dev/null -H 'content-type: application/json' -d '{"prompt_tokens": 4000, "max_tokens": 4096}' http://127.0.0.1:18080/v1/sequences | grep -i -E 'HTTP|retry-after'
post DELETE /v1/sequences/1
curl -s http://127.0.0.1:18080/metrics | grep -E '^kvvm_(used|shared|pooled|quarantined|grants_refused|prefix_hits|live_sequences)' 
kill -TERM $pid; wait $pid; echo "serve exited $?"; tail -3 "${OUT:-.}/serve.log"
