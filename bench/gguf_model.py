"""The GGUF files of bench/gguf_files.py, built from a model shape with seeded random weights.

A Llama decoder of a :class:`Shape` is written as F16 with the metadata keys, tensor names and
q / k row order of llama.cpp's converter and SmolLM2's tokenizer (the embedded default model's
``tokenizer.*`` keys), then quantized by llama-quantize or here: Q4_0 and Q8_0 by the ``gguf``
package, the K-quants by bench/gguf_quantize.py, each tensor's type chosen by llama.cpp's rule
(:func:`tensor_type`).  tests/helpers/gguf_files.py writes its files with :func:`llama_order`,
:func:`encode` and :func:`tokenizer_fields` too.

"""

from __future__ import annotations

import argparse
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's hyper-parameters, as the GGUF's ``llama.*`` keys hold them."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 49152  # SmolLM2's tokenizer
    rope_theta: float = 500000.0
    context: int = 131072
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


LLAMA_1B = Shape("llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192)
# --quick: K-quant rows are whole super-blocks of 256 weights, so hidden and intermediate are too.
TINY = Shape("tiny", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, context=4096)


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Each tensor's GGUF name and numpy shape ``[rows, cols]``; no ``output.weight``: the
    embedding table is the LM head."""
    h, kv, ff = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    plan: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        plan += [(f"blk.{i}.{name}.weight", dims) for name, dims in (
            ("attn_norm", (h,)), ("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
            ("attn_output", (h, h)), ("ffn_norm", (h,)), ("ffn_gate", (ff, h)),
            ("ffn_up", (ff, h)), ("ffn_down", (h, ff)))]
    return [*plan, ("output_norm.weight", (h,))]


def llama_order(w: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows as llama.cpp's converter stores a Llama's (each head's RoPE halves
    interleaved), from HF's order."""
    pairs = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def random_tensor(shape: Shape, name: str, dims: tuple[int, ...], index: int,
                  seed: int) -> np.ndarray:
    """Norms are ones; matrices N(0, 0.02) drawn in HF's row order from a generator of their
    own (seed, index), then put in the file's order."""
    if len(dims) == 1:
        return np.ones(dims, np.float32)
    w = np.random.default_rng([seed, index]).standard_normal(dims, dtype=np.float32) * 0.02
    heads = shape.heads if name.endswith("attn_q.weight") else (
        shape.kv_heads if name.endswith("attn_k.weight") else 0)
    return (llama_order(w, heads) if heads else w).astype(np.float16)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third
    one between them."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, kind: str, layers: int) -> Any:
    """The type llama-quantize gives this model's tensor for ``kind`` without an imatrix
    (src/llama-quant.cpp): norms stay F32; the tied table takes the output's type (Q6_K unless
    the file is Q8_0 or F16); Q4_K_M and Q5_K_M put attn_v and ffn_down in Q6_K on
    :func:`more_bits` layers."""
    from gguf import GGMLQuantizationType as T

    base = {"F16": T.F16, "Q4_0": T.Q4_0, "Q8_0": T.Q8_0, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K,
            "Q6_K": T.Q6_K}[kind]
    if name.endswith("norm.weight"):
        return T.F32
    if name in ("token_embd.weight", "output.weight"):
        return base if base in (T.F16, T.Q8_0) else T.Q6_K
    if kind in ("Q4_K_M", "Q5_K_M") and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return T.Q6_K if more_bits(int(name.split(".")[1]), layers) else base
    return base


def encode(w: np.ndarray, qtype: Any) -> np.ndarray:
    """float32 ``[rows, cols]`` (or a norm's ``[cols]`` in F32) as the tensor data of
    ``qtype``: the K-quants by bench/gguf_quantize.py, the other blocks (Q4_0, Q4_1, Q8_0, ...)
    by the ``gguf`` package."""
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype in (T.F32, T.F16):
        return w.astype(np.float32 if qtype == T.F32 else np.float16)
    if qtype.name.endswith("_K"):
        from bench import gguf_quantize

        return gguf_quantize.quantize(w, qtype.name)
    return gguf.quants.quantize(w, qtype)


@functools.lru_cache(maxsize=1)
def tokenizer_fields() -> list[tuple[str, Any, Any, Any]]:
    """The embedded default model's ``tokenizer.*`` keys (SmolLM2's vocabulary, merges and chat
    template): key, value, GGUF value type and element type (arrays).  Read once: parsing the
    49,152-token arrays takes seconds."""
    import gguf

    from radixserve.checkpoint.default_gguf import default_gguf_path

    fields = []
    for key, field in gguf.GGUFReader(default_gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub))
    return fields


def write_gguf(path: Path, shape: Shape, kind: str, plan: list[tuple[str, tuple[int, ...], Any]],
               data: Any) -> None:
    """Write ``plan``'s tensors (name, numpy shape, type), ``data(i)`` giving the i-th one's
    bytes, streamed one tensor at a time; the file appears whole or not at all."""
    import gguf
    from tqdm import tqdm

    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"radixserve bench {shape.name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{kind}"))
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    if kind != "F16":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub)
    for name, dims, qtype in plan:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) // block * size,
                               raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i in tqdm(range(len(plan)), desc=f"writing {path.name}", unit="tensor"):
            writer.write_tensor_data(data(i))
        writer.close()
    except BaseException:  # Ctrl-C or a failed tensor: no half file left behind
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(path)


def build_f16(path: Path, shape: Shape, seed: int) -> None:
    from gguf import GGMLQuantizationType as T

    names = tensor_plan(shape)
    plan = [(name, dims, T.F32 if len(dims) == 1 else T.F16) for name, dims in names]
    write_gguf(path, shape, "F16", plan, lambda i: random_tensor(shape, *names[i], i, seed))


def quantize_here(f16: Path, out: Path, kind: str, shape: Shape) -> None:
    """``kind`` from the F16 file by the ``gguf`` package and bench/gguf_quantize.py."""
    import gguf

    tensors = gguf.GGUFReader(f16).tensors
    plan = [(t.name, tuple(int(n) for n in reversed(t.shape)),
             tensor_type(t.name, kind, shape.layers)) for t in tensors]

    def data(i: int) -> np.ndarray:
        return encode(np.asarray(tensors[i].data, np.float32), plan[i][2])

    write_gguf(out, shape, kind, plan, data)


def quantize_llama(binary: Path, f16: Path, out: Path, kind: str, threads: int) -> None:
    """``kind`` from the F16 file by llama-quantize; its per-tensor lines drive the bar."""
    import gguf
    from tqdm import tqdm

    tmp = out.with_name(out.name + ".tmp")
    total = len(gguf.GGUFReader(f16).tensors)
    proc = subprocess.Popen([str(binary), str(f16), str(tmp), kind, str(threads)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    lines = []
    with tqdm(total=total, desc=f"llama-quantize {out.name}", unit="tensor") as bar:
        for line in proc.stdout:
            lines.append(line)
            if line.lstrip().startswith("[") and "/" in line.split("]", 1)[0]:
                bar.update(1)
    if proc.wait() != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {kind} failed:\n{''.join(lines[-20:])}")
    tmp.rename(out)


def ensure_files(args: argparse.Namespace, shape: Shape) -> dict[str, Path]:
    """Each of ``--files`` (and the F16 file it comes from), built unless cached."""
    folder = args.cache_dir
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{shape.name}-seed{args.seed}"
    f16 = folder / f"{stem}-F16.gguf"
    if not f16.exists():
        build_f16(f16, shape, args.seed)
    quantizer = "llama-quantize" if args.llama_quantize else "gguf-py"
    files = {}
    for kind in args.files:
        path = f16 if kind == "F16" else folder / f"{stem}-{kind}-{quantizer}.gguf"
        if not path.exists():
            if args.llama_quantize:
                quantize_llama(args.llama_quantize, f16, path, kind, args.threads)
            else:
                quantize_here(f16, path, kind, shape)
        files[kind] = path
    return files

