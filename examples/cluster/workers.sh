#!/usr/bin/env bash
# Start N radixserve workers for smg (or sglang-router), on 127.0.0.1:$PORT+1 .. $PORT+N, each
# pinned to its own share of the cores (OMP_NUM_THREADS and taskset), one command for all of them:
#
#   examples/cluster/workers.sh 2                        # ports 30001 and 30002
#   PORT=40000 examples/cluster/workers.sh 4 --dtype bfloat16 --max-total-tokens 50000
#   EVENTS=1 examples/cluster/workers.sh 2               # + gRPC on 30101, 30102 and KV events
#   PD=1 examples/cluster/workers.sh 2                   # worker 1 prefills, worker 2 decodes
#
# EVENTS=1: each worker i also serves SGLang's scheduler gRPC service on $PORT+100+i and
# publishes its KV events on $PORT+200+i (replay on $PORT+300+i), for smg's event-driven
# routing (EVENTS=1 router.sh).
# PD=1: prefill-decode disaggregation; the first half of the workers are prefill workers (their
# decode workers fetch KV from bootstrap port $PORT+400+i), the others decode workers (PD=1
# router.sh pairs them).
# Flags after N go to every `radixserve serve`.  It returns once every worker answers /health,
# then keeps running: Ctrl-C (or SIGTERM) stops all workers, and one worker exiting stops the rest.
set -euo pipefail
n=${1:?usage: workers.sh N [radixserve serve flags...]}
shift
if [ -n "${PD:-}" ] && [ "$n" -lt 2 ]; then echo "PD=1 needs at least 2 workers (prefill and decode)" >&2; exit 2; fi
port=${PORT:-30000}
cores=$(nproc)
per=$(( cores / n > 0 ? cores / n : 1 ))
pids=()
stop() { kill "${pids[@]}" 2>/dev/null || true; wait || true; }
trap 'stop; exit 0' INT TERM
trap stop EXIT
for i in $(seq 1 "$n"); do
  first=$(( (i - 1) * per % cores ))
  events=()
  if [ -n "${EVENTS:-}" ]; then
    events=(--grpc-port $(( port + 100 + i )) --kv-events-config "{\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:$(( port + 200 + i ))\", \"bind\": true, \"replay_endpoint\": \"tcp://127.0.0.1:$(( port + 300 + i ))\"}")
  fi
  if [ -n "${PD:-}" ]; then
    if [ "$i" -le $(( n / 2 )) ]; then
      events+=(--disaggregation-mode prefill --disaggregation-bootstrap-port $(( port + 400 + i )))
    else
      events+=(--disaggregation-mode decode)
    fi
  fi
  OMP_NUM_THREADS=$per taskset -c "$first-$(( first + per - 1 ))" \
    radixserve serve --host 127.0.0.1 --port $(( port + i )) "${events[@]}" "$@" &
  pids+=("$!")
done
for i in $(seq 1 "$n"); do
  until curl -sf "http://127.0.0.1:$(( port + i ))/health" >/dev/null; do
    kill -0 "${pids[$(( i - 1 ))]}" 2>/dev/null || { echo "worker $i exited during start-up" >&2; exit 1; }
    sleep 1
  done
done
echo "workers ready: $(for i in $(seq 1 "$n"); do printf 'http://127.0.0.1:%d ' $(( port + i )); done)"
wait -n
echo "a worker exited; stopping the others" >&2
exit 1
