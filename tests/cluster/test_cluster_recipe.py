"""examples/cluster/: the two commands of the recipe, as a user runs them — two workers, SGLang's
router in front with its cache-aware policy, a chat through it, and everything stopped by the
signal a service manager sends (the script traps Ctrl-C the same way)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "cluster"


def free_base_port() -> int:
    """A port P with P, P+1, P+2, P+1000 (the router's metrics) and the EVENTS=1 ports (gRPC
    P+101, P+102; KV events P+201, P+202; their replay P+301, P+302; PD=1's bootstrap P+401) free on
    loopback."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 1000 > 65535:
            continue
        try:
            socks = []
            for p in (base, base + 1, base + 2, base + 1000, *(base + k + i for k in (100, 200, 300, 400) for i in (1, 2))):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


def wait_for(predicate, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} while waiting for {what}"
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not ready after {timeout} s: {what}")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM (trapped like Ctrl-C's SIGINT; a test run in the background, as CI may be, has
    SIGINT ignored, and a shell cannot trap a signal ignored when it started)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


# PD=1 runs both scripts end to end and the pairing on top; the plain HTTP recipe and EVENTS=1
# (gRPC workers, KV-event routing: tests/cluster/test_router_grpc.py, test_kv_events.py) run
# with -m slow.
@pytest.mark.parametrize("mode", [pytest.param("http", marks=pytest.mark.slow),
                                  pytest.param("grpc-kv-events", marks=pytest.mark.slow), "pd"])
def test_workers_and_router_scripts_serve_a_chat_and_stop_together(tiny_chat_model: str, tmp_path, mode: str) -> None:
    """EVENTS=1: the same recipe with smg talking to the workers over gRPC and routing on their
    KV events.  PD=1: worker 1 prefills, worker 2 decodes, smg pairs them."""
    base = free_base_port()
    events = mode == "grpc-kv-events"
    env = {**os.environ, "PORT": str(base),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           **({"EVENTS": "1"} if events else {}), **({"PD": "1"} if mode == "pd" else {})}
    log = open(tmp_path / "workers.log", "w")  # noqa: SIM115 - closed below
    workers = subprocess.Popen([str(RECIPE / "workers.sh"), "2", "--model", tiny_chat_model, "--dtype", "float32",
                                "--served-model-name", "tiny"], env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    router = None
    try:
        wait_for(lambda: "workers ready" in (tmp_path / "workers.log").read_text(), 240, "the workers", [workers])
        worker_pids = [c.pid for c in psutil.Process(workers.pid).children(recursive=True)]
        router = subprocess.Popen([str(RECIPE / "router.sh"), "2", "--log-level", "warn"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{base}"

        def both_listed() -> bool:
            listed = httpx.get(url + "/workers", timeout=5).json()["workers"]
            return len(listed) == 2 and all(w.get("is_healthy", True) for w in listed)

        wait_for(both_listed, 120, "the router's workers", [workers, router])
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Say something about radix trees."}]
        through = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        direct = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 1}/v1", api_key="none").chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0)
        got, want = through.choices[0].message.content, direct.choices[0].message.content  # same weights, greedy
        assert got == want if not events else (got or "").strip() == want.strip()  # smg trims whitespace
        assert through.usage.completion_tokens == 8
        if mode == "pd":  # the decode worker took the prompt's KV from the prefill worker
            stats = httpx.get(f"http://127.0.0.1:{base + 2}/server_info", timeout=10).json()["stats"]
            assert stats["disaggregation"]["transfers"] == 1
        if events:  # smg subscribed to both workers' KV events
            metrics = httpx.get(f"http://127.0.0.1:{base + 1000}/metrics", timeout=10).text
            for i in (1, 2):
                assert f'smg_kv_event_subscriptions_total{{worker="grpc://127.0.0.1:{base + 100 + i}"}} 1' in metrics
        assert stop(router) in (0, -signal.SIGTERM, 143)
        router = None
        assert stop(workers) == 0  # every worker stopped, a clean exit
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in worker_pids if psutil.pid_exists(p)], timeout=30)
        assert not alive, f"workers left running: {alive}"
    finally:
        if router is not None:
            router.kill()
        if workers.poll() is None:
            os.killpg(workers.pid, signal.SIGKILL)
        log.close()


@pytest.mark.parametrize("script", ["workers.sh", "router.sh"])
def test_scripts_say_how_to_use_them(script: str) -> None:
    out = subprocess.run([str(RECIPE / script)], capture_output=True, text=True)
    assert out.returncode != 0 and "usage:" in out.stderr
