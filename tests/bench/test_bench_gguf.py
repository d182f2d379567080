"""Smoke test of bench/gguf_files.py (radixserve and llama-server on built GGUF files): the files
bench/gguf_model.py writes, llama.cpp's per-tensor type rule, and a quick run's report against
radixserve alone (llama.cpp is not installed here); no timing assertion."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import gguf_files as bench  # noqa: E402
from bench import gguf_model  # noqa: E402


def test_mixes_follow_llama_quantize() -> None:
    """Q4_K_M and Q5_K_M: attn_v and ffn_down in Q6_K on half of 16 layers (the first and last
    two, every third between); the tied table in Q6_K unless the file is Q8_0."""
    from gguf import GGMLQuantizationType as T

    wide = [i for i in range(16) if gguf_model.tensor_type(f"blk.{i}.attn_v.weight", "Q4_K_M", 16) == T.Q6_K]
    assert wide == [0, 1, 4, 7, 10, 13, 14, 15]
    assert gguf_model.tensor_type("blk.4.ffn_down.weight", "Q5_K_M", 16) == T.Q6_K
    assert gguf_model.tensor_type("blk.5.ffn_down.weight", "Q5_K_M", 16) == T.Q5_K
    assert gguf_model.tensor_type("blk.4.attn_q.weight", "Q4_K_M", 16) == T.Q4_K
    assert gguf_model.tensor_type("token_embd.weight", "Q4_0", 16) == T.Q6_K
    assert gguf_model.tensor_type("token_embd.weight", "Q8_0", 16) == T.Q8_0
    assert gguf_model.tensor_type("blk.0.ffn_norm.weight", "Q6_K", 16) == T.F32


def test_built_file_has_llamas_keys_and_smollm2s_tokenizer(tmp_path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    gguf_model.build_f16(path, gguf_model.TINY, seed=3)
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    shape = gguf_model.TINY
    assert fields["general.architecture"] == "llama"
    assert fields["llama.embedding_length"] == shape.hidden
    assert fields["llama.attention.head_count_kv"] == shape.kv_heads
    assert fields["llama.rope.dimension_count"] == shape.head_dim
    assert fields["llama.rope.freq_base"] == shape.rope_theta
    source = {key: value for key, value, _, _ in gguf_model.tokenizer_fields()}  # the default model's
    assert fields["tokenizer.chat_template"] == source["tokenizer.chat_template"]
    assert "<|im_start|>" in fields["tokenizer.chat_template"]
    assert len(fields["tokenizer.ggml.tokens"]) == shape.vocab
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: the table is the LM head
    assert len(tensors) == 2 + 9 * shape.layers
    q = tensors["blk.1.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.F16 and q.data.shape == (shape.hidden, shape.hidden)
    # the same seed draws the same weights, in the converter's q row order
    expected = gguf_model.random_tensor(shape, q.name, (shape.hidden, shape.hidden), 11, seed=3)
    assert list(tensors).index(q.name) == 11 and (q.data == expected).all()
    hf = expected.reshape(shape.heads, shape.head_dim // 2, 2, -1).swapaxes(1, 2).reshape(expected.shape)
    assert (gguf_model.llama_order(hf, shape.heads) == expected).all()


@pytest.mark.slow
def test_quick_run_reports_each_file(tmp_path) -> None:
    """``--quick`` on a Q8_0 and a Q6_K file (quantized here), radixserve only."""
    out = tmp_path / "gguf.json"
    report = bench.main(["--quick", "--files", "Q8_0,Q6_K", "--cache-dir", str(tmp_path / "files"),
                         "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["llama_cpp"] is None and report["shape"]["name"] == "tiny"
    assert {"cpu_model", "cpu_kind", "cpu_flags"} <= set(report["machine"])
    rows = {r["file"]: r for r in report["results"]}
    assert set(rows) == {"Q8_0", "Q6_K"} and all(r["server"] == "radixserve" for r in rows.values())
    assert rows["Q8_0"]["tensor_types"] == {"Q8_0": 15, "F32": 5}
    assert rows["Q6_K"]["tensor_types"] == {"Q6_K": 15, "F32": 5}
    # every matrix holds the same weights: Q8_0's 34 bytes per 32 against Q6_K's 210 per 256
    ratio = rows["Q8_0"]["weight_bytes_per_step"] / rows["Q6_K"]["weight_bytes_per_step"]
    assert abs(ratio - (34 / 32) / (210 / 256)) < 0.01
    bandwidth = report["memory_bandwidth_gbs"] * 1e9
    assert report["memory_bandwidth_gbs"] == max(report["bandwidth_samples_gbs"])
    for r in rows.values():
        assert r["error"] is None
        assert r["completion_tokens"] == [16] and r["prompt_tokens"][0] > 100
        assert r["mean_decode_context"] == r["prompt_tokens"][0] + 8
        assert r["weight_bytes_per_step"] < r["file_bytes"] == Path(r["path"]).stat().st_size
        step = r["weight_bytes_per_step"] + r["kv_bytes_per_token"] * r["mean_decode_context"]
        assert abs(r["floor_ms_per_token"] - 1e3 * step / bandwidth) < 1e-9
        assert abs(r["decode_over_floor"] - r["decode_ms_per_token"] / r["floor_ms_per_token"]) < 1e-9
        assert r["wall_s"] > r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0
        element = {"bfloat16": 2, "float16": 2, "float32": 4}[r["settings"]["dtype"]]
        assert r["kv_bytes_per_token"] == bench.TINY.kv_bytes_per_token(element)
        assert r["kv_pool_tokens"] == 4096 and r["kv_pool_bytes"] == 4096 * r["kv_bytes_per_token"]
        assert r["settings"]["torch_threads"] == report["params"]["threads"]
        # the process tree: the front end and its scheduler, each named by its role
        names = {p["name"] for p in r["processes"]}
        assert {"server", "scheduler"} <= names
        assert r["peak_rss_bytes"] == sum(p["vm_hwm_bytes"] for p in r["processes"]) > r["file_bytes"]
        # a fresh cache folder: the model's config and tokenizer were written into it
        assert r["first_start_s"] > 0 and r["cache_bytes_written"] > 0
