"""A GGUF's K-quant tensors served as stored (``--quantization gguf``): llama.cpp's Q4_K, Q5_K
and Q6_K, super-blocks of 256 weights along a row (:class:`KQuantWeight`).

- Q4_K (144 bytes, 4.5 bits a weight): float16 ``d`` and ``dmin``, 8 sub-blocks of 32 weights
  with a 6-bit scale ``sc`` and min ``m`` each (packed in 12 bytes), 4-bit ``q``:
  ``w = (d sc) q - dmin m``.
- Q5_K (176 bytes, 5.5 bits): Q4_K's scales, a fifth bit of ``q`` per weight (32 bytes).
- Q6_K (210 bytes, 6.56 bits): 16 sub-blocks of 16 weights with an int8 scale each, float16
  ``d``, 6-bit ``q``: ``w = (d sc) (q - 32)``.

A Q4_K_M or Q5_K_M file mixes them (its LM head, ``output`` or a tied ``token_embd``, and some
``ffn_down`` / ``attn_v`` in Q6_K).  Each weight is formed as the ``gguf`` package's numpy
dequantizer forms it, to the bit, so a matmul differs from one by the dequantized float32 weight
only in the order of its sums.

Kernels (cpu_ext/kquant_ops.cpp): ``kq_linear`` for decode rows (float activations, the blocks
of each part streamed once for all the rows), ``kq_dequant_`` for prefill (the weight
dequantized into the shared buffer, then torch's matmul).  On a VNNI CPU, a server that drafts
no tokens takes one-row steps through ``kq_linear_q16`` (``wide_one_row``, as int4.py's 4-bit
blocks): the products with x in 16-bit integers per block of 32 (cpu_ext/kquant_wide.cpp: VNNI
dot products of the stored q, an error of at most dx / 2 an element of x).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve import cpu_ext
from radixserve.quantization.base import GGUFType
from radixserve.quantization.weights import QuantizedWeight

QK_K = 256  # weights per super-block (QK_K in cpu_ext/kquant.h)
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


class KQuantWeight(QuantizedWeight):
    """A GGUF K-quant tensor's blocks as the file stores them: ``blocks`` uint8
    ``[N, K / 256, bytes]`` (contiguous) of the type ``kind`` ("Q4_K", "Q5_K" or "Q6_K").

    A merged layer's weight may join up to :data:`MAX_PARTS` runs of rows of different types
    (:meth:`cat`: a Q4_K_M file's q and k in Q4_K, its v in Q6_K): ``blocks``, ``blocks_1`` and
    ``blocks_2`` (None where there are fewer), one kernel call for all of them."""

    kernels = ("kq_linear", "kq_linear_q16", "kq_dequant_")
    takes_wide_one_row = True

    def __init__(self, blocks: torch.Tensor, kind: str, dtype: torch.dtype) -> None:
        self.blocks, self.blocks_1, self.blocks_2 = _checked(blocks, kind), None, None
        self.kinds = (kind,)
        self.dtype = dtype
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1] * QK_K))
        self.wide_one_row = False  # one-row steps through kq_linear_q16 (apply.py sets it)

    @property
    def kind(self) -> str:
        """The type of its blocks ("Q4_K+Q6_K" for parts of several)."""
        return "+".join(self.kinds)

    @property
    def parts(self) -> list[tuple[str, torch.Tensor]]:
        """``(kind, blocks)`` of each run of rows, in row order."""
        tensors = (self.blocks, self.blocks_1, self.blocks_2)
        return list(zip(self.kinds, tensors[:len(self.kinds)], strict=True))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(None).to(dtype)

    def dequantize_into(self, out: torch.Tensor, start: int = 0) -> None:
        ops, first, stop = cpu_ext.load(), 0, start + out.shape[0]
        for kind, blocks in self.parts:  # the part's rows first .. first + len(blocks)
            lo, hi = max(start, first), min(stop, first + blocks.shape[0])
            if lo < hi:
                ops.kq_dequant_(blocks[lo - first:hi - first], kind, out[lo - start:hi - start])
            first += blocks.shape[0]

    def kernel_args(self, rows: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        tensors = [blocks for _, blocks in self.parts]
        name = "kq_linear_q16" if self.wide_one_row and rows == 1 else "kq_linear"
        return name, (*tensors, *[_EMPTY] * (MAX_PARTS - len(tensors)))

    def rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        if len(self.kinds) == 1:
            blocks = self.blocks if ids is None else self.blocks[ids]
            return _dequantized(blocks, self.kind)
        start = 0
        ids = torch.arange(self.shape[0]) if ids is None else ids
        result = torch.empty(len(ids), self.shape[1])
        for kind, blocks in self.parts:
            inside = (ids >= start) & (ids < start + blocks.shape[0])
            result[inside] = _dequantized(blocks[ids[inside] - start], kind)
            start += blocks.shape[0]
        return result

    def take_rows(self, index: torch.Tensor) -> KQuantWeight:
        if len(self.kinds) != 1:
            raise ValueError("K-quant weight: rows are taken from a weight of one type")
        return KQuantWeight(self.blocks[index], self.kind, self.dtype)

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> KQuantWeight:
        runs: list[tuple[str, list[torch.Tensor]]] = []
        for part in parts:
            if not isinstance(part, KQuantWeight):
                raise ValueError(f"K-quant weights join only K-quant parts, got {type(part)}")
            for kind, blocks in part.parts:
                if runs and runs[-1][0] == kind:
                    runs[-1][1].append(blocks)
                else:
                    runs.append((kind, [blocks]))
        if len(runs) > MAX_PARTS:
            raise ValueError(f"K-quant weight: at most {MAX_PARTS} runs of rows of one type, got "
                             f"{'+'.join(kind for kind, _ in runs)}")
        joined = cls(torch.cat(runs[0][1]), runs[0][0], parts[0].dtype)
        for i, (kind, tensors) in enumerate(runs[1:], start=1):
            setattr(joined, f"blocks_{i}", _checked(torch.cat(tensors), kind))
        joined.kinds = tuple(kind for kind, _ in runs)
        rows = sum(sum(t.shape[0] for t in tensors) for _, tensors in runs)
        if len({t.shape[1] for _, tensors in runs for t in tensors}) != 1:
            raise ValueError("K-quant weight: parts of different in-features")
        joined.shape = torch.Size((rows, joined.shape[1]))
        return joined

    @property
    def nbytes(self) -> int:
        return sum(blocks.numel() for _, blocks in self.parts)


MAX_PARTS = 3  # runs of rows of one type a weight joins (kq_linear's parts)
_EMPTY = torch.empty(0, dtype=torch.uint8)


def _checked(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    if kind not in BLOCK_BYTES:
        raise ValueError(f"K-quant weight: kind must be one of {list(BLOCK_BYTES)}, got {kind!r}")
    size = BLOCK_BYTES[kind]
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != size:
        raise ValueError(f"{kind} weight: blocks must be uint8 [N, K / {QK_K}, {size}], got "
                         f"{tuple(blocks.shape)} {blocks.dtype}")
    return blocks.contiguous()


def _dequantized(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Blocks [n, nb, bytes] of ``kind`` as float32 [n, nb * 256]."""
    w = _q6_k(blocks) if kind == "Q6_K" else _qx_k(blocks, kind == "Q5_K")
    return w.reshape(blocks.shape[0], -1)


def _halves(b: torch.Tensor) -> torch.Tensor:
    """Float16s stored as byte pairs (the last dimension, 2) as float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _qx_k(blocks: torch.Tensor, fifth_bit: bool) -> torch.Tensor:
    """Q4_K or Q5_K blocks [n, nb, bytes] as float32 [n, nb, 256], as gguf.quants forms them:
    ``(d * sc) * q - dmin * m`` (the product exact, one rounding)."""
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
    packed = blocks[..., 4:16].long()
    lo, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lo & 63, (top & 15) | ((lo >> 6) << 4)], dim=-1).float()
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1).float()
    qs = blocks[..., 48:] if fifth_bit else blocks[..., 16:]
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    q = (runs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 15  # [.., 4, 2, 32]
    q = q.reshape(*qs.shape[:-1], 8, 32)
    if fifth_bit:  # bit s of qh[l]: the fifth bit of weight l of sub-block s
        qh = blocks[..., 16:48].unsqueeze(-2)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    scale = (d[..., None] * sc)[..., None]
    offset = (dmin[..., None] * m)[..., None]
    return (scale * q.float() - offset).flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, nb, 210] as float32 [n, nb, 256], as gguf.quants forms them:
    ``(d * sc) * (q - 32)`` (an exact product)."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64)
    ql = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 15).reshape(*lead, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    qh = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(*lead, 16, 16).float()
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = _halves(blocks[..., 208:210])
    return ((d[..., None] * sc)[..., None] * q).flatten(-2)


def _reader(kind: str) -> Callable[[torch.Tensor, torch.dtype], KQuantWeight]:
    def read(blocks: torch.Tensor, dtype: torch.dtype) -> KQuantWeight:
        return KQuantWeight(blocks, kind, dtype)

    read.__doc__ = f"{kind}: the tensor's super-blocks of {QK_K} weights, taken as stored."
    return read


Q4_K = GGUFType("Q4_K", block_weights=QK_K, block_bytes=BLOCK_BYTES["Q4_K"], read=_reader("Q4_K"),
                weight=KQuantWeight, label="K-quant blocks")
Q5_K = GGUFType("Q5_K", block_weights=QK_K, block_bytes=BLOCK_BYTES["Q5_K"], read=_reader("Q5_K"),
                weight=KQuantWeight, label="K-quant blocks")
Q6_K = GGUFType("Q6_K", block_weights=QK_K, block_bytes=BLOCK_BYTES["Q6_K"], read=_reader("Q6_K"),
                weight=KQuantWeight, label="K-quant blocks")
