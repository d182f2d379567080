"""bench/gpu_e2e.py, the end-to-end half of the GPU proof run: its CPU dry run end to end (every
part, the parity check against transformers, the shared-prefix cache and the decode sweep on
both models); and bench/gpu_summary.py, the closing table over the files a gpu_check.sh run leaves.

No timing assertions: only the shape of the report and the token accounting are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gpu_summary import e2e_rows, main, summary_rows  # noqa: E402

PARTS = ["parity", "shared_prefix", "decode_default", "decode_llama"]


# The CPU dry run starts three engines and both decode models (about a minute): it runs with
# -m slow, before a GPU session; the default run keeps the summary's tests below.
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> tuple[dict, str]:
    """One ``--device cpu --quick`` run in a subprocess (it sets environment variables for its
    engines): the JSON report and what it printed."""
    out = tmp_path_factory.mktemp("gpu_e2e") / "gpu-e2e-cpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_e2e.py"), "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={k: v for k, v in os.environ.items() if k != "RADIXSERVE_SYNC_DEBUG"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_cpu_dry_run_runs_every_part(cpu_run: tuple[dict, str]) -> None:
    report, stdout = cpu_run
    assert list(report["parts"]) == PARTS
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"))
    assert report["sync"]["mode"] == "error" and report["sync"]["sync_errors"] == 0
    assert report["sync"]["other_failures"] == 0 and report["sync"]["failures"] == []
    # Equal settings share one engine: parity's is the shared-prefix radix engine and the
    # sweep's; on a CPU both CUDA-graph settings are that one engine too.
    engines = report["engines"]
    assert len(engines) == 3, [e["label"] for e in engines]
    assert all(e["memory_ok"] for e in engines)
    assert [e.get("load_format") for e in engines] == [None, None, "dummy"]
    assert "2 PASS, 0 FAIL" in stdout


@pytest.mark.slow
def test_cpu_parity_is_token_identical_to_transformers(cpu_run: tuple[dict, str]) -> None:
    parity = cpu_run[0]["parts"]["parity"]
    n = parity["new_tokens"]
    [row] = parity["rows"]
    assert (row["dtype"], row["system"], row["against"]) == ("float32", "radixserve torch", "transformers float32")
    assert row["greedy_match"] == [n] * len(parity["prompt_lens"]) and row["identical"] and row["ok"]
    assert row["max_abs_dlogprob"] < 1e-3


@pytest.mark.slow
def test_cpu_shared_prefix_hits_the_cache_only_with_it(cpu_run: tuple[dict, str]) -> None:
    sp = cpu_run[0]["parts"]["shared_prefix"]
    radix, no_radix = sp["runs"]
    assert (radix["config"], no_radix["config"]) == ("radix", "no-radix")
    prompt_tokens = sp["requests"] * (sp["system_len"] + sp["question_len"])
    for run in (radix, no_radix):
        assert run["prompt_tokens"] == prompt_tokens
        assert run["output_tokens"] == sp["requests"] * sp["output_len"]
        assert run["prefill_tokens_computed"] == prompt_tokens - run["cached_tokens"]
    assert no_radix["cached_tokens"] == 0
    # The system prompt is computed once: every other request finds it cached, within a page.
    assert radix["cached_tokens"] >= sp["ideal_cached_tokens"] - sp["requests"] * 16
    assert sp["speedup"] == pytest.approx(no_radix["wall_s"] / radix["wall_s"])


@pytest.mark.slow
def test_cpu_decode_sweep_covers_both_models_and_settings(cpu_run: tuple[dict, str]) -> None:
    parts = cpu_run[0]["parts"]
    assert parts["decode_llama"]["shape"]["vocab_size"] == 128256  # beyond the tokenizer's 49152
    for name in ("decode_default", "decode_llama"):
        rows = parts[name]["rows"]
        assert sorted((r["batch"], r["cuda_graphs"]) for r in rows) == [(1, False), (1, True), (4, False), (4, True)]
        for r in rows:
            assert r["decode_tokens_per_s"] > 0 and r["ms_per_decode_step"] > 0
            # The first of the decode_len tokens comes from the (cached) prefill step.  The batch's
            # requests may reach the scheduler over two of its loop turns (they are sent one by
            # one): one admitted a step after the others adds a decode-only step of its own.
            n = parts[name]["decode_len"] - 1
            assert n <= r["decode_only_steps"] < n + r["batch"], r


def test_summary_table_over_a_runs_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slug = "Fake-GPU"
    (tmp_path / f"gpu-steps-{slug}.tsv").write_text(
        "test_kernels\t0\t40\ntest_cuda_graph\t1\t12\ntest_device_guard\tleft out: not in this checkout\t0\n"
        "e2e\t124\t240\nbench\t0\t50\n")
    junit = '<testsuites><testsuite name="pytest" tests="{}" failures="{}" errors="0" skipped="{}"/></testsuites>'
    (tmp_path / f"gpu-junit-test_kernels-{slug}.xml").write_text(junit.format(79, 0, 2))
    (tmp_path / f"gpu-junit-test_cuda_graph-{slug}.xml").write_text(junit.format(10, 3, 0))
    parity_rows = [
        {"dtype": "float32", "system": "radixserve triton", "against": "transformers float32", "ok": True,
         "greedy_match": [32, 32], "identical": True, "mean_abs_dlogprob": 1e-6, "max_abs_dlogprob": 2e-6},
        {"dtype": "bfloat16", "system": "radixserve triton", "against": "transformers float32", "ok": False,
         "greedy_match": [32, 9], "identical": False, "mean_abs_dlogprob": 0.03, "max_abs_dlogprob": 0.7},
        {"dtype": "bfloat16", "system": "radixserve torch", "against": "transformers float32", "ok": False,
         "error": "RuntimeError: scheduler failed to start"},
    ]
    sweep_rows = [{"batch": 64, "cuda_graphs": True, "decode_tokens_per_s": 3000.0},
                  {"batch": 64, "cuda_graphs": False, "decode_tokens_per_s": 1000.0},
                  {"batch": 1, "cuda_graphs": True, "decode_tokens_per_s": 90.0}]
    e2e = {"parts": {"parity": {"status": "ok", "rows": parity_rows},
                     "decode_llama": {**llama_part(sweep_rows), "status": "timeout",
                                      "error": "decode_llama ran out of its 80 s budget"}},
           "sync": {"mode": "error", "acts": True, "sync_errors": 2, "other_failures": 0,
                    "turned_off_at": "parity/triton-float32", "failures": [
                        {"part": "parity", "engine": "triton-float32",
                         "error": "internal error in the scheduler: RuntimeError('called a synchronizing CUDA op')"}]},
           "engines": [{"memory_ok": True}, {"memory_ok": True}]}
    (tmp_path / f"gpu-e2e-{slug}.json").write_text(json.dumps(e2e))
    # bench/kernels.py's report from an earlier run: stale, so reported missing.
    kernels = tmp_path / f"kernels-{slug}.json"
    kernels.write_text(json.dumps({"targets": {"decode_b64_ctx4096_pct_of_copy": 80.0}}))
    os.utime(kernels, (1000, 1000))

    assert main(["--results", str(tmp_path), "--slug", slug, "--since", "2000"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 PASS, 7 FAIL"
    rows = summary_rows(tmp_path, slug, 2000)

    def verdict(*words: str) -> bool | None:
        """The verdict of the one check whose part, name, value and target hold every word."""
        [r] = [r for r in rows if all(w in " ".join(map(str, r.values())) for w in words)]
        return r["ok"]

    assert verdict("test_kernels", "77 passed, 0 failed, 2 skipped") is True
    assert verdict("test_cuda_graph", "7 passed, 3 failed") is False
    assert verdict("test_device_guard", "not in this checkout") is None
    assert verdict("e2e", "exit 124") is False
    assert verdict("parity float32", "identical") is True
    assert verdict("parity bfloat16", "radixserve triton") is False
    assert verdict("radixserve torch", "scheduler failed to start") is False
    assert verdict("sync debug", "parity/triton-float32") is False
    assert verdict("decode_llama", "timeout") is False
    assert verdict("batch 64", ">= 2x") is True
    assert verdict("batch 1,") is None  # the eager run never came
    assert verdict("kernels", f"kernels-{slug}.json", "missing") is False
    assert (sum(r["ok"] is True for r in rows), sum(r["ok"] is False for r in rows)) == (4, 7)


def llama_part(rows: list[dict]) -> dict:
    return {"status": "ok", "model": "Llama-3-8B shape, random", "llama": "8b", "dtype": "bfloat16",
            "prompt_len": 512, "decode_len": 128, "rows": rows}


def test_graph_target_fails_when_eager_is_not_measured() -> None:
    part = llama_part([{"batch": 64, "cuda_graphs": True, "decode_tokens_per_s": 10.0}])
    report = {"parts": {"decode_llama": part}, "engines": [],
              "sync": {"mode": "error", "acts": True, "sync_errors": 0, "other_failures": 0}}
    [target] = [r for r in e2e_rows(report) if r["target"] == ">= 2x"]
    assert target["ok"] is False


def test_summary_script_shows_the_cascade_decode_rows(tmp_path: Path) -> None:
    """bench/kernels.py's cascade rows, one per point, judged by their error only (no speed
    target); run as gpu_check.sh runs it: a script, from any folder, without torch."""
    slug = "Fake-GPU"

    def cascade(batch: int, shared: int, speedup: float, rel_err: float) -> dict:
        return {"kernel": "cascade-decode", "batch": batch, "shared": shared, "own": 256, "speedup": speedup,
                "plain_forward_ms": 1.25, "cascade_forward_ms": 1.25 / speedup, "rel_err": rel_err}

    kernels = {"copy_gbps": 4000.0, "matmul_tflops": 700.0, "targets": {}, "results": [
        {"kernel": "decode", "batch": 64, "ctx": 4096, "ms": 0.2, "pct_of_copy": 75.0},
        cascade(64, 4096, 2.5, 3e-3), cascade(64, 16384, 0.5, 3e-3), cascade(16, 4096, 2.5, 0.02)]}
    (tmp_path / f"kernels-{slug}.json").write_text(json.dumps(kernels))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_summary.py"), "--results", str(tmp_path),
                           "--slug", slug], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [x for x in lines if "cascade decode" in x]
    assert len(rows) == 3, lines
    assert "B=64 shared=4096" in rows[0] and rows[0].endswith("PASS")
    assert "B=64 shared=16384" in rows[1] and rows[1].endswith("PASS")  # slower, no speed target
    assert "B=16 shared=4096" in rows[2] and rows[2].endswith("FAIL")  # its error is over the limit
    assert lines[-1] == "2 PASS, 3 FAIL"
