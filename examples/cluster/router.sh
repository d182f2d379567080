#!/usr/bin/env bash
# smg, SGLang's model gateway (pip install "radixserve[router]"), in front of the N workers of
# workers.sh, with its cache-aware policy, on 127.0.0.1:$PORT (clients talk to it as to one
# server).  ROUTER=sglang_router runs its predecessor, sglang-router, with the same flags.
# EVENTS=1 (with EVENTS=1 workers.sh) routes on the workers' KV events: smg talks to them over
# gRPC and tokenizes with the model's tokenizer, found through worker 1's /model_info:
#
# PD=1 (with PD=1 workers.sh) pairs the prefill workers (the first half) with the decode workers:
# smg sends each request to one of each, with the prefill worker's bootstrap port.
#
#   examples/cluster/router.sh 2                         # http://127.0.0.1:30000 -> 30001, 30002
#   PORT=40000 examples/cluster/router.sh 4 --balance-abs-threshold 32
#
# Flags after N go to the router (they win over the ones below).  What the thresholds do, and
# how they meet radixserve's own cache: examples/cluster/README.md.
set -euo pipefail
n=${1:?usage: router.sh N [router flags...]}
shift
port=${PORT:-30000}
urls=()
extra=()
for i in $(seq 1 "$n"); do urls+=("http://127.0.0.1:$(( port + i ))"); done
if [ -n "${EVENTS:-}" ]; then
  urls=()
  for i in $(seq 1 "$n"); do urls+=("grpc://127.0.0.1:$(( port + 100 + i ))"); done
  tokenizer=$(curl -sf "http://127.0.0.1:$(( port + 1 ))/model_info" |
              python3 -c 'import json, sys; print(json.load(sys.stdin)["tokenizer_path"])')
  # A request is booked on the worker chosen for it until that worker's events report it.
  extra=(--model-path "$tokenizer" --selection-accounting-ttl-ms 3000)
fi
workers=(--worker-urls "${urls[@]}")
if [ -n "${PD:-}" ]; then
  workers=(--pd-disaggregation)
  for i in $(seq 1 "$n"); do
    if [ "$i" -le $(( n / 2 )) ]; then
      workers+=(--prefill "${urls[$(( i - 1 ))]}" $(( port + 400 + i )))
    else
      workers+=(--decode "${urls[$(( i - 1 ))]}")
    fi
  done
fi
# --disable-circuit-breaker: a worker's 4xx answers to bad requests must not take it out of
# rotation; health checks every 5 s take out a dead worker after two misses, and a request
# sent to it is retried (backing off from 200 ms) long enough to land on a live one.
# The router's metrics listen on loopback, beside its own port.
exec python -m "${ROUTER:-smg}.launch_router" \
  --host 127.0.0.1 --port "$port" "${workers[@]}" \
  --policy cache_aware --cache-threshold 0.3 \
  --balance-abs-threshold 64 --balance-rel-threshold 1.5 \
  --disable-circuit-breaker \
  --health-check-interval-secs 5 --health-failure-threshold 2 \
  --retry-max-retries 8 --retry-initial-backoff-ms 200 \
  --prometheus-host 127.0.0.1 --prometheus-port $(( port + 1000 )) \
  "${extra[@]}" "$@"
