"""Start SGLang's router (``sglang-router``: a Rust binary behind a Python launcher) in front of
``radixserve serve`` workers, for end-to-end tests.

``RouterProcess(worker_urls, *flags).wait_ready(n)`` returns once the router lists ``n`` healthy
workers.  Its own settings (``ROUTER_TEST_FLAGS``) keep a test's provoked 4xx answers from
ejecting a worker and notice a dead worker within seconds.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx

from helpers.server import LoggedProcess, free_port

# The circuit breaker counts every non-2xx answer (a test's 400s included) against a worker;
# health checks every second notice a killed worker quickly, and retries of a request whose
# worker is gone (connection refused) span a few seconds, longer than that; a stopped router
# waits for no request in flight.
ROUTER_TEST_FLAGS = ("--disable-circuit-breaker", "--health-check-interval-secs", "1",
                     "--health-failure-threshold", "1", "--retry-initial-backoff-ms", "200",
                     "--retry-max-retries", "8", "--shutdown-grace-period-secs", "1")


class RouterProcess(LoggedProcess):
    """``python -m sglang_router.launch_router`` on free ports of 127.0.0.1 (its Prometheus
    exporter too), logging to a temporary file."""

    def __init__(self, worker_urls: list[str], *flags: str, policy: str = "cache_aware") -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
                          "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                          "--log-level", "warn", *flags], "sglang-router-")

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(self.base_url + "/workers", timeout=10).json()["workers"]

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
