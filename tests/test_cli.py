"""The command line: every setting documented with its default, RADIXSERVE_* overrides,
`radixserve generate` on the default model and `radixserve chat` against a live server."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from radixserve.cli import main
from radixserve.config import ServerArgs


def run_cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, input=stdin, timeout=timeout)


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_help_documents_every_setting_with_default(command: str) -> None:
    out = run_cli(command, "--help", env={"COLUMNS": "200"}).stdout
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out, flag
    assert "(default: 30000)" in out and "(default: lpm)" in out


def test_environment_sets_defaults() -> None:
    out = run_cli("serve", "--help", env={"RADIXSERVE_PORT": "31234", "RADIXSERVE_SCHEDULE_POLICY": "fcfs",
                                          "COLUMNS": "200"}).stdout
    assert "(default: 31234)" in out and "(default: fcfs)" in out


def test_bad_setting_is_a_clear_error(capsys) -> None:
    assert main(["generate", "hi", "--schedule-policy", "random"]) == 2
    assert "schedule_policy" in capsys.readouterr().err


def test_generate_prints_a_completion(default_model_path) -> None:
    r = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "12", "--max-total-tokens", "2048")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_chat_against_a_live_server(default_model_path) -> None:
    from helpers.server import ServerProcess

    srv = ServerProcess("--max-total-tokens", "4096").wait_ready()
    try:
        r = run_cli("chat", "--base-url", srv.base_url, "--max-new-tokens", "16", "--temperature", "0",
                    stdin="What is the capital of France?\n/reset\nSay hi.\n/exit\n", timeout=120)
    finally:
        assert srv.stop() == 0
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert r.stdout.count("> ") >= 3
