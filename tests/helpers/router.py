"""Start a router in front of ``radixserve serve`` workers, for end-to-end tests: smg (SGLang
Model Gateway, the successor of ``sglang-router``) or ``sglang-router`` itself; both are a Rust
binary behind a Python launcher and take the same flags.

``RouterProcess(worker_urls, *flags).wait_ready(n)`` returns once the router lists ``n`` healthy
workers.  Its own settings (``ROUTER_TEST_FLAGS``) keep a test's provoked 4xx answers from
ejecting a worker and notice a dead worker within seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from helpers.server import LoggedProcess, free_port

# The circuit breaker counts every non-2xx answer (a test's 400s included) against a worker;
# health checks every second notice a killed worker quickly, and retries of a request whose
# worker is gone (connection refused) span a few seconds, longer than that; a stopped router
# waits for no request in flight.  smg's /get_loads answers from its load monitor, which polls
# each worker's /v1/loads every second here (ten by default).
_COMMON_FLAGS = ("--disable-circuit-breaker", "--health-check-interval-secs", "1",
                 "--health-failure-threshold", "1", "--retry-initial-backoff-ms", "200",
                 "--retry-max-retries", "8", "--shutdown-grace-period-secs", "1")
ROUTER_TEST_FLAGS = {"smg": (*_COMMON_FLAGS, "--load-monitor-interval", "1"), "sglang-router": _COMMON_FLAGS}


# The routers' launchers, by their package names.
ROUTERS = {"smg": "smg.launch_router", "sglang-router": "sglang_router.launch_router"}


class RouterProcess(LoggedProcess):
    """``python -m smg.launch_router`` (or ``sglang_router.launch_router``) on free ports of
    127.0.0.1 (its Prometheus exporter too), logging to a temporary file."""

    def __init__(self, worker_urls: list[str], *flags: str, policy: str = "cache_aware",
                 router: str = "smg") -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.router = router
        self.metrics_port = free_port()
        urls = ["--worker-urls", *worker_urls] if worker_urls else []  # none: --prefill / --decode flags
        super().__init__([sys.executable, "-m", ROUTERS[router], *urls,
                          "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                          "--log-level", "warn", *flags], f"{router}-")

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(self.base_url + "/workers", timeout=10).json()["workers"]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the router's own Prometheus samples ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text.splitlines():
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def labels(self, worker: dict[str, Any]) -> dict[str, str]:
        """What the router read from a listed worker's /server_info and /model_info (smg calls
        them ``labels``, sglang-router ``metadata``)."""
        return worker["labels" if self.router == "smg" else "metadata"]

    def loads(self) -> dict[str, int]:
        """Each worker's load by URL, from the router's /get_loads: smg reads the KV tokens in
        use from the worker's /v1/loads, sglang-router the tokens in flight from its /get_load
        (-1 when it cannot read one)."""
        body = httpx.get(self.base_url + "/get_loads", timeout=10).json()
        if self.router == "smg":
            return {x["worker"]: x["num_used_tokens"] for x in body["loads"]}
        return {x["worker"]: x["load"] for x in body["workers"]}

    def wait_loads(self, ready: Callable[[dict[str, int]], bool], timeout: float = 10.0) -> dict[str, int]:
        """The router's loads once ``ready(loads)`` holds (smg's are up to a poll interval old)."""
        deadline = time.monotonic() + timeout
        while not ready(loads := self.loads()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return loads

    def metric_name(self, name: str) -> str:
        """A worker's metric as the router's /engine_metrics names it (sglang-router writes
        ``:`` as ``_``)."""
        return name if self.router == "smg" else name.replace(":", "_")

    def wait_ready(self, n_workers: int, timeout: float = 60.0) -> RouterProcess:
        """Wait until the router lists ``n_workers`` healthy workers; RuntimeError (with the
        router's log) after ``timeout`` seconds or if it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if sum(w["is_healthy"] for w in self.workers()) == n_workers:
                    return self
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the router did not list {n_workers} healthy workers in {timeout} s:\n{self.log()}")
