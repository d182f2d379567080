"""Thread placement: the scheduler gets the cores it may run on, the helper processes one."""

from __future__ import annotations

import os
import subprocess
import sys

from radixserve.threads import available_cores, scheduler_threads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_scheduler_uses_the_cores_of_its_affinity_mask_unless_told(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert scheduler_threads() == (len(os.sched_getaffinity(0)), "cores available (sched_getaffinity)")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert scheduler_threads() == (3, "OMP_NUM_THREADS")
    for ignored in ("0", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", ignored)
        assert scheduler_threads()[0] == available_cores()


def run_python(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=environ)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_helper_process_gets_one_torch_thread_before_or_after_torch_loads() -> None:
    before = ("from radixserve.threads import use_one_thread; use_one_thread(); import os, torch; "
              "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
    assert run_python(before) == "1 1"
    after = ("import os, torch; from radixserve.threads import use_one_thread; use_one_thread(); "
             "print(torch.get_num_threads(), os.environ.get('OMP_NUM_THREADS'))")
    assert run_python(after) == "1 None"  # loaded already: only torch's pool shrinks
