"""Start a real `radixserve serve` process on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.mktemp(prefix="radixserve-server-", suffix=".log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

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
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

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
