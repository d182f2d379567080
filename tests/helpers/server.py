"""Start a real `radixserve serve` process on a free port, for end-to-end tests.

A test module serving the tiny chat model writes ``server = tiny_chat_server(*flags)`` for its
module-scoped ``server`` fixture, and ``memory_invariant = memory_checked_after_each_test("server")``
to check the KV memory invariant after each test that used it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # ``bench`` importable from any test module
    sys.path.insert(0, REPO)

from bench.common import free_port  # noqa: E402, F401 - the tests' ports too


def build_chat_tiny_model(default_model_dir: str, folder: str, seed: int = 0) -> str:
    """A tiny random Llama with the default model's vocabulary and tokenizer (chat template)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(default_model_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(default_model_dir, name), folder)
    return folder


class LoggedProcess:
    """A command started with its output in a temporary log file; :meth:`stop` ends it
    (SIGTERM, then SIGKILL after ``timeout``) and closes the log."""

    def __init__(self, cmd: list[str], log_prefix: str, env: dict[str, str] | None = None) -> None:
        self.log_path = tempfile.mktemp(prefix=log_prefix, suffix=".log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ) if env is None else env)

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class ServerProcess(LoggedProcess):
    """``env`` is added to ``base_env`` (default: this process's environment).  The server runs
    in float32 unless ``args`` name a dtype: the tests compare with float32 oracles."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 base_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        dtype = [] if "--dtype" in args else ["--dtype", "float32"]
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(self.port), *dtype, *args]
        super().__init__(cmd, "radixserve-server-",
                         {**(os.environ if base_env is None else base_env), **(env or {})})

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()  # never leave a half-started server behind
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")


@contextlib.contextmanager
def serving(model: str, *flags: str) -> Iterator[ServerProcess]:
    """A ready server for ``model``, served as "tiny"; it must exit with code 0 when stopped."""
    srv = ServerProcess("--model", model, "--served-model-name", "tiny", *flags).wait_ready()
    try:
        yield srv
    except BaseException:
        srv.stop()  # a failing test leaves no server behind
        raise
    assert srv.stop() == 0, srv.log()


def tiny_chat_server(*flags: str) -> Callable[..., Any]:
    """A module-scoped fixture: :func:`serving` the ``tiny_chat_model`` with ``flags``.

    Pytest names the fixture after the module attribute it is assigned to.
    """

    @pytest.fixture(scope="module")
    def server(tiny_chat_model: str) -> Iterator[ServerProcess]:
        with serving(tiny_chat_model, *flags) as srv:
            yield srv

    return server


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def server_info(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.base_url + "/server_info", timeout=30).json()


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, Any]:
    """``/server_info`` once nothing is running or waiting; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(server)
        if info["stats"]["running"] == 0 and info["stats"]["waiting"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {info['stats']}")
        time.sleep(0.2)


def check_memory_idle(server: ServerProcess) -> None:
    """Once the server is idle, its memory invariant holds, no lock is left and no request holds pages."""
    info = wait_idle(server)
    assert info["memory"]["ok"], info["memory"]
    assert info["memory"]["locked_tokens"] == 0 and info["memory"]["request_pages"] == 0


def memory_checked_after_each_test(*server_fixtures: str) -> Callable[..., Any]:
    """An autouse fixture: after each test that used one of the named server fixtures, that
    server, once idle, passes :func:`check_memory_idle`."""

    @pytest.fixture(autouse=True)
    def memory_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
        yield
        for name in server_fixtures:
            if name in request.fixturenames:
                check_memory_idle(request.getfixturevalue(name))

    return memory_invariant
