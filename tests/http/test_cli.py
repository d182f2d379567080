"""The command line: every setting documented with its default, RADIXSERVE_* overrides,
`radixserve generate` on the default model and `radixserve chat` against a live server."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from radixserve.cli import main
from radixserve.config import DEFAULT_MAX_RUNNING_REQUESTS, ServerArgs


def run_cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, input=stdin, timeout=timeout)


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_help_documents_every_setting_with_default(command: str) -> None:
    from radixserve.cli import SERVER_ONLY

    out = run_cli(command, "--help", env={"COLUMNS": "200"}).stdout
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        if command != "serve" and f.name in SERVER_ONLY and f.name != "api_key" or (
                command == "generate" and f.name == "api_key"):
            assert not re.search(re.escape(flag) + r"(?![\w-])", out), f"{flag} is a server setting, offered by {command}"
        else:
            assert flag in out, flag
            # the help is the field's own text (config.setting), written nowhere else; chat's
            # --api-key is the client's key, with help of its own
            assert f.name == "api_key" and command == "chat" or f.metadata["help"] and "".join(f.metadata["help"].split()) in "".join(out.split()), flag
    assert "(default: None)" not in out  # computed defaults are described, not shown as None
    assert "(default: lpm)" in out
    assert f"most requests running at once (default: {DEFAULT_MAX_RUNNING_REQUESTS})" in out
    assert "(default: the model's max_position_embeddings)" in out
    if command == "serve":
        assert "(default: 30000)" in out
    else:
        assert "--max-new-tokens MAX_NEW_TOKENS" in out and "most tokens" in out
        assert "sampling temperature; 0 is greedy (default: " in out
        assert "(default: warning)" in out  # terminal commands keep INFO logs off the text


def test_top_level_help_is_plain_text() -> None:
    out = run_cli("--help").stdout
    assert "``" not in out
    assert 'radixserve generate "What is the capital of France?"' in out


@pytest.mark.parametrize("argv, says", [
    (["serve", "--model", "/nonexistent"], "'/nonexistent' is neither a model folder nor a .gguf file"),
    (["generate", ""], "the prompt is empty"),
    # Checked before the model is looked for: the missing model is never reached.
    (["generate", "hi", "--temperature", "-1", "--model", "/nonexistent"], "temperature must be >= 0"),
    (["generate", "hi", "--max-new-tokens", "-1", "--model", "/nonexistent"], "max_new_tokens must be >= 0"),
    (["chat", "--temperature", "-2", "--model", "/nonexistent"], "temperature must be >= 0"),
    (["serve", "--page-size", "0", "--model", "/nonexistent"], "page_size must be a positive integer"),
])
def test_user_errors_are_one_line_and_exit_2(argv: list[str], says: str) -> None:
    r = run_cli(*argv, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixserve: error: ") and says in lines[0], r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_on_a_cpu_machine_is_one_line() -> None:
    r = run_cli("serve", "--device", "cuda", timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no usable CUDA device" in lines[0] and "--device cpu" in lines[0], r.stderr


def test_environment_sets_defaults() -> None:
    out = run_cli("serve", "--help", env={"RADIXSERVE_PORT": "31234", "RADIXSERVE_SCHEDULE_POLICY": "fcfs",
                                          "COLUMNS": "200"}).stdout
    assert "(default: 31234)" in out and "(default: fcfs)" in out


def test_bad_setting_is_a_clear_error(capsys) -> None:
    assert main(["generate", "hi", "--schedule-policy", "newest-first"]) == 2
    assert "schedule_policy" in capsys.readouterr().err


def test_generate_prints_a_completion(default_model_path) -> None:
    r = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "12", "--max-total-tokens", "2048")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert " INFO " not in r.stdout + r.stderr  # no log lines between the words on the terminal


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
