"""GGUF files as people publish them, loaded straight from the file: K-quant layers served as
stored, the cache folder without a float copy, and a bad file refused with one clear error."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.gguf_files import Q4_K_M, kind_of, small_model, tensor_type_offset, write_gguf

from radixserve.cli import main as cli_main
from radixserve.model.gguf_folder import check_gguf
from radixserve.model.loader import load_model


@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("gguf")
    return write_gguf(str(folder / "small-q8.gguf"), small_model("llama"), "llama",
                      kind_of({}, "Q8_0"))


@pytest.fixture
def cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty cache folder for the test, but for the compiled CPU kernels (a link to the
    usual cache's, so the test does not compile them again)."""
    from radixserve.checkpoint.cache_dir import cache_root

    folder = tmp_path / "cache"
    folder.mkdir()
    kernels = os.path.join(cache_root(), "cpu_ext")
    if os.path.isdir(kernels):
        os.symlink(kernels, folder / "cpu_ext")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(folder))
    return str(folder)


def _cache_entries(root: str) -> list[str]:
    found = []
    for where, _, files in os.walk(root):
        found += [os.path.join(where, f) for f in files if not f.endswith(".lock")]
    return found


def _refused(path: str, cache: str, capsys: pytest.CaptureFixture, *named: str) -> None:
    """The CLI refuses the file: exit code 2, one error naming the file (and the tensor), and
    nothing written into the cache."""
    with pytest.raises(ValueError) as raised:
        check_gguf(path)
    for text in (path, *named):
        assert text in str(raised.value)
    rc = cli_main(["generate", "--model", path, "--max-new-tokens", "2", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and path in err and all(text in err for text in named), err
    assert err.count("error") == 1, err
    assert _cache_entries(cache) == []


def test_truncated_file_is_refused(llama_q8: str, tmp_path, cache: str, capsys) -> None:
    path = str(tmp_path / "truncated.gguf")
    with open(llama_q8, "rb") as f, open(path, "wb") as out:
        out.write(f.read()[:-1000])
    _refused(path, cache, capsys, "truncated", "output_norm.weight")


def test_file_that_is_not_gguf_is_refused(tmp_path, cache: str, capsys) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + os.urandom(64))
    _refused(str(path), cache, capsys, "GGUF header ends early")


def test_unknown_tensor_type_is_refused(llama_q8: str, tmp_path, cache: str, capsys) -> None:
    data = bytearray(open(llama_q8, "rb").read())
    at = tensor_type_offset(llama_q8, "blk.1.ffn_up.weight")
    data[at:at + 4] = (99).to_bytes(4, "little")
    path = tmp_path / "unknown-type.gguf"
    path.write_bytes(bytes(data))
    _refused(str(path), cache, capsys, "blk.1.ffn_up.weight", "type 99")


def test_unsupported_architecture_is_refused(tmp_path, cache: str, capsys) -> None:
    import gguf
    import numpy as np

    path = str(tmp_path / "falcon.gguf")
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _refused(path, cache, capsys, "'falcon'", "not served")


PROMPTS = [[1, 504, 3050, 314, 253, 1345, 28, 1500, 200], [1, 9, 18, 27, 36, 45, 54],
           [1, 2000, 2001, 2002, 17, 30000, 41000, 12], [1, 77, 5, 900, 4000, 7]]
NEW_TOKENS = 16


def _transformers_greedy(path: str) -> list[list[int]]:
    from helpers.oracle import gguf_pure_calls_shared
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    with gguf_pure_calls_shared():  # the same model, the file parsed once
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("qwen3", marks=pytest.mark.slow)])
def test_kquant_file_served_as_stored(arch: str, tmp_path, cache: str) -> None:
    """A Q4_K_M-like file (Q4_K, with v, down and the embedding in Q6_K; o in Q5_K): every
    matmul and the embedding take the file's blocks (a layer's parts of different K-quant
    types together), which dequantize to the weights a float load of the same file reads; the
    cache holds no copy of the weights; greedy tokens are transformers' on the same file."""
    from helpers.model_runner import ModelRunner

    from radixserve.quantization import QuantizedWeight
    from radixserve.quantization.kquant import KQuantWeight

    path = write_gguf(str(tmp_path / f"small-{arch}.Q4_K_M.gguf"), small_model(arch), arch,
                      kind_of({"attn_output": "Q5_K", **Q4_K_M}, "Q4_K"))
    served = load_model(path, torch.float32, quantization="gguf")
    floats = load_model(path, torch.float32, quantization="none").model
    layers = dict(served.model.named_modules())
    quantized = {name: m.weight for name, m in layers.items()
                 if isinstance(getattr(m, "weight", None), QuantizedWeight)}
    config = served.config
    assert len(quantized) == 4 * config.num_layers + 1 + (not config.tie_word_embeddings)
    assert all(isinstance(w, KQuantWeight) for w in quantized.values())
    for name, module in floats.named_modules():
        if name in quantized:
            assert torch.equal(quantized[name].dequantized(torch.float32),
                               module.weight.detach()), name
    cached = _cache_entries(os.path.join(cache, "gguf"))
    assert cached and not [f for f in cached if f.endswith(".safetensors")]
    assert sum(os.path.getsize(f) for f in cached) < 8 * 2**20

    ours = ModelRunner(served.model, max_context=256).greedy(PROMPTS, NEW_TOKENS)
    theirs = _transformers_greedy(path)
    same = sum(a == b for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.95 * len(PROMPTS) * NEW_TOKENS, (ours, theirs)


def test_kquant_file_through_the_engine(tmp_path, cache: str) -> None:
    """The server's processes on a K-quant file (``auto`` picks its blocks): prefill through
    the dequantized buffer, decode through the kernels and the fused layers; the tokens of the
    in-process model, and the KV memory back to free."""
    from helpers.model_runner import ModelRunner

    from radixserve.engine import Engine

    path = write_gguf(str(tmp_path / "small.Q4_K_M.gguf"), small_model("llama"), "llama",
                      kind_of(Q4_K_M, "Q4_K"))
    want = ModelRunner(load_model(path, torch.float32, quantization="gguf").model,
                       max_context=256).greedy(PROMPTS, NEW_TOKENS)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(model=path, dtype="float32", max_total_tokens=2048) as engine:
        assert engine.info.quantization == "gguf"
        got = [engine.generate(input_ids=p, sampling_params=params)["output_ids"]
               for p in PROMPTS]
        report = engine.check_memory()
    assert got == want
    assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0, report
