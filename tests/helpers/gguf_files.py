"""GGUF files of small Llama / Qwen2 / Qwen3 models, written in the test as llama.cpp's converter
writes them (its metadata keys, q / k rows interleaved for the llama architecture), with
SmolLM2's tokenizer (the embedded default model's metadata) and each tensor in a chosen type:
floats, Q4_0 / Q4_1 / Q8_0 by the ``gguf`` package, K-quants by bench/gguf_quantize.py.  The
tokenizer keys, the q / k row order and the blocks are bench/gguf_model.py's, as the benchmark
writes them."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # ``bench`` importable from any test module
    sys.path.insert(0, str(REPO))

from bench.gguf_model import encode, llama_order, tokenizer_fields  # noqa: E402

# A shape whose matmuls are whole K-quant super-blocks (256) along every row.
SMALL = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
CONFIGS = {"llama": ("LlamaConfig", {"rope_theta": 500000.0, "tie_word_embeddings": True}),
           "qwen2": ("Qwen2Config", {"rope_theta": 1000000.0, "tie_word_embeddings": False}),
           "qwen3": ("Qwen3Config", {"head_dim": 128, "tie_word_embeddings": True})}
# llama.cpp's Q4_K_M, roughly: Q4_K, with v and down in Q6_K, the embedding / head in Q6_K
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output.": "Q6_K"}


def small_model(arch: str, seed: int = 0) -> Any:
    """A transformers model of :data:`SMALL`'s shape, random weights (norms around 1)."""
    import transformers

    cls_name, overrides = CONFIGS[arch]
    config = getattr(transformers, cls_name)(**{**SMALL, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model.eval()


def kind_of(mix: dict[str, str], default: str) -> Callable[[str], str]:
    """The type of a GGUF tensor: the first entry of ``mix`` its name contains, else
    ``default``."""
    return lambda name: next((kind for part, kind in mix.items() if part in name), default)


def write_gguf(path: str, model: Any, arch: str, kind: Callable[[str], str]) -> str:
    """Write the transformers ``model`` as a GGUF of architecture ``arch``; each 2-D weight in
    the type ``kind(gguf name)``, norms and biases in F32."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"small {arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta")
                              else config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    for key, value, vtype, sub in tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        w = p.detach().float().numpy()
        part = hf_name.rsplit(".", 2)[-2]
        if arch == "llama" and part in heads and hf_name.endswith(".weight"):
            w = llama_order(w, heads[part])
        qtype = gguf.GGMLQuantizationType[kind(name) if w.ndim == 2 else "F32"]
        writer.add_tensor(name, encode(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_type_offset(path: str, tensor: str) -> int:
    """Where in the file the type field of ``tensor``'s header entry is (to corrupt it)."""
    data = open(path, "rb").read()
    at = data.index(tensor.encode()) + len(tensor)
    dims = int.from_bytes(data[at:at + 4], "little")
    return at + 4 + 8 * dims


def save_hf(model: Any, folder: str) -> str:
    model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return folder
