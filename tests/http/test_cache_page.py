"""The ``/cache`` page in headless Chromium (Debian's ``chromium``; ``.ci/run`` installs it):
the server runs with an API key and real traffic; the page, loaded without the key, says that
one is needed; loaded with it, it draws the tree, names the heaviest prefix and logs no error.
A screenshot is saved in the test's temp folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from helpers.server import serving

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (.ci/run installs Debian's chromium)")
KEY = "page-test-key"
SYSTEM = "Alpha desk. You answer questions about trains: timetables, platforms, fares and delays. " * 3


def chromium(url: str, *flags: str, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000",
         "--window-size=1400,1000", *flags, url],
        capture_output=True, text=True, timeout=120)


def console_lines(stderr: str, origin: str) -> list[str]:
    """What the page wrote to the console (it writes nothing: any line is an error or an
    uncaught exception), from Chromium's log."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line and origin in line]


def test_cache_page_draws_the_tree_in_headless_chromium(tiny_chat_model: str, tmp_path: Path) -> None:
    with serving(tiny_chat_model, "--api-key", KEY, "--max-total-tokens", "8000") as server:
        auth = {"Authorization": f"Bearer {KEY}"}
        for i in range(3):
            r = httpx.post(server.base_url + "/v1/chat/completions", headers=auth, timeout=60, json={
                "model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{i} question?"}]})
            assert r.status_code == 200, r.text
        page = httpx.get(server.base_url + "/cache")  # the page itself needs no key
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert httpx.get(server.base_url + "/cache/tree").status_code == 401

        locked = chromium(server.base_url + "/cache", "--dump-dom", tmp=tmp_path)
        assert locked.returncode == 0, locked.stderr[-2000:]
        assert "an API key is needed" in locked.stdout and 'data-drawn="1"' not in locked.stdout
        assert not console_lines(locked.stderr, server.base_url), console_lines(locked.stderr, server.base_url)

        drawn = chromium(f"{server.base_url}/cache#key={KEY}", "--dump-dom", tmp=tmp_path)
        assert drawn.returncode == 0, drawn.stderr[-2000:]
        dom = drawn.stdout
        assert 'data-drawn="1"' in dom, dom[-3000:]
        assert "<rect" in dom and "Alpha desk. You answer questions about trains" in dom
        assert '<span id="errors"></span>' in dom  # window.onerror writes there
        assert not console_lines(drawn.stderr, server.base_url), console_lines(drawn.stderr, server.base_url)

        shot = tmp_path / "cache.png"
        taken = chromium(f"{server.base_url}/cache#key={KEY}", f"--screenshot={shot}", tmp=tmp_path)
        assert taken.returncode == 0 and shot.stat().st_size > 10_000
