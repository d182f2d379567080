"""The README's Python example, saved as a script and run with ``python script.py`` exactly
as a new user would: no ``if __name__ == "__main__":`` guard; its set-up line is CI's; and each
benchmark command it gives is one its benchmark accepts."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(section: str) -> str:
    """The first ```python block after the heading ``section``."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index(f"\n## {section}\n")
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match, f"no python block under '## {section}'"
    return match.group(1)


def test_python_api_example_runs_as_a_plain_script(tmp_path, default_model_path) -> None:
    code = readme_block("Python API")
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


def test_ci_runs_the_readme_commands_word_for_word() -> None:
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    start = readme.index("Set up (CPU machine")
    setup = re.search(r"```bash\n(.*?)\n```", readme[start:], re.S).group(1)
    assert "\n" not in setup, "the set-up is one command"
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().splitlines()
    assert setup in ci
    assert ci[-1] == "python -m pytest" and "python -m pytest\n" in readme


def test_every_readme_benchmark_command_parses() -> None:
    """Each ``python bench/NAME.py ...`` the README shows (the command that made a table) takes
    the options it is given: a renamed or dropped option fails here, not for the reader."""
    with open(os.path.join(ROOT, "README.md")) as f:
        commands = re.findall(r"python (bench/\w+)\.py([^`\n]*)", f.read())
    assert len(commands) >= 40
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    for script, rest in commands:
        argv = shlex.split(rest.split("#")[0])  # a comment after the command is not an option
        try:
            importlib.import_module(script.replace("/", ".")).parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"python {script}.py{rest}: exit {e.code}") from None
