"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) from float weights, in numpy, for tests and benchmarks.

llama.cpp's quantizer searches each sub-block's scale and min iteratively; here each is chosen
in one vectorised pass (the sub-block's range, rounded up so that no weight is clipped), which
is enough for weights whose kernels and dequantization are checked against the ``gguf``
package's own dequantizer.  The blocks are laid out exactly as llama.cpp's block_q4_K,
block_q5_K and block_q6_K (``gguf.quants.dequantize`` reads them).  The package never imports
this module; ``gguf.quants.quantize`` does Q4_0, Q4_1 and Q8_0.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """``w`` float32 ``[N, K]`` (K a multiple of 256) as ``kind``'s blocks, uint8
    ``[N, K / 256 * bytes]`` (a GGUF tensor's rows)."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kind must be one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"w must be [N, K] with K a multiple of {QK_K}, got {w.shape}")
    n, k = w.shape
    blocks = w.reshape(n * k // QK_K, QK_K)
    out = _q6_k(blocks) if kind == "Q6_K" else _qx_k(blocks, 15 if kind == "Q4_K" else 31)
    return out.reshape(n, k // QK_K * BLOCK_BYTES[kind])


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0."""
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _qx_k(blocks: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (top 15) or Q5_K (top 31): w = (d sc) q - dmin m per sub-block of 32, with sc and m
    6-bit and d, dmin float16 per super-block."""
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 8, 32)
    # each sub-block's offset -min (0 where its weights are all positive) and step
    low = np.minimum(sub.min(axis=2), 0.0)
    mins = -low
    dmin = _f16(mins.max(axis=1) / 63)
    m = np.clip(np.round(_ratio(mins, dmin.astype(np.float32)[:, None])), 0, 63)
    offset = dmin.astype(np.float32)[:, None] * m  # what the blocks will subtract
    # the step that covers what the rounded offset leaves above it
    step = np.maximum(sub.max(axis=2) + offset, 0.0) / top
    d = _f16(step.max(axis=1) / 63)
    sc = np.clip(np.ceil(_ratio(step, d.astype(np.float32)[:, None])), 0, 63)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.round(_ratio(sub + offset[:, :, None], scale[:, :, None].repeat(32, axis=2)))
    q = np.clip(q, 0, top).astype(np.uint8)  # [nb, 8, 32]
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.empty((nb, 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    # 32-byte run u: sub-block 2u in the low nibbles, 2u + 1 in the high ones
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(nb, 128)
    parts = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), packed]
    if top == 31:  # bit s of qh[l]: the fifth bit of weight l of sub-block s
        bits = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(np.bitwise_or.reduce(bits, axis=1))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: w = (d sc) (q - 32) per sub-block of 16, sc int8 and d float16 per super-block."""
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d = _f16(step.max(axis=1) / 127)
    sc = np.clip(np.ceil(_ratio(step, d.astype(np.float32)[:, None])), 0, 127)
    scale = (d.astype(np.float32)[:, None] * sc)[:, :, None].repeat(16, axis=2)
    q = (np.clip(np.round(_ratio(sub, scale)), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    # weight 128 h + 32 t + l: ql[64 h + 32 (t % 2) + l] (low nibble for t < 2), bits 2t of
    # qh[32 h + l]
    ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)  # [nb, 2, 2, 32]
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None],
                              axis=2)  # [nb, 2, 32]
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64),
                           sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(nb, 2)],
                          axis=1)
