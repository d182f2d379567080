"""The README as a newcomer follows it: its Python example runs as a plain script, its set-up
and test commands are the ones CI runs, and every command it shows is one the code accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers.doc_commands import ROOT, check_commands, fenced_blocks

SERVE = " && radixserve serve"


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_engine_example_runs_as_a_plain_script(tmp_path, default_model_path) -> None:
    code = next(b for b in fenced_blocks(readme(), "python") if "from radixserve import Engine" in b)
    assert "__main__" not in code and "with Engine() as engine" in code
    script = tmp_path / "example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout  # the first print: the greedy completion of "The capital of France is"
    assert "'finish_reason': {'type': 'length', 'matched': None, 'length': " in r.stdout
    assert "cache_hit_rate" in r.stdout  # the last print: get_stats()
    assert "can only join a started process" not in r.stderr
    assert "Traceback" not in r.stderr


def test_setup_and_test_commands_are_what_ci_runs() -> None:
    """The README's two commands: the set-up (which ends by serving) is, without its final
    ``radixserve serve``, the set-up line of tests/run.sh; the test command is .ci/run's."""
    bash = fenced_blocks(readme(), "bash")
    setup = next(b for b in bash if b.startswith("python3 -m venv .venv"))
    assert "\n" not in setup, "the set-up is one command"
    assert setup.endswith(SERVE)
    with open(os.path.join(ROOT, "tests", "run.sh")) as f:
        run_sh = [line.strip() for line in f]
    assert setup[: -len(SERVE)] in run_sh
    assert "python -m pytest \"$@\"" in run_sh
    test_command = next(b for b in bash if "tests/run.sh" in b)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line.strip() for line in f]
    assert test_command in ci and ci[-1] == test_command
    assert "rm -rf .venv" in ci  # CI's set-up starts from nothing, as a newcomer's does


def test_every_readme_command_parses() -> None:
    """Each ``radixserve ...`` and ``python bench/NAME.py ...`` the README shows takes the
    options it is given: a renamed or dropped flag fails here, not for the reader."""
    checked = check_commands(readme(), "README.md")
    assert any(c.startswith("radixserve serve") for c in checked)
    assert any(c.startswith("python bench/agent_http.py") for c in checked)


def test_readme_links_point_at_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme())
    local = [link for link in links if "://" not in link]
    assert "docs/settings.md" in local
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, f"README links to missing files: {missing}"
