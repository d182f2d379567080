"""Compile every kernel for a GPU architecture without a GPU (Triton's ahead-of-time path).

The interpreter checks what the kernels compute; this checks that the compiled versions
build at all for the configurations the backend launches (type errors, layouts, ptxas), and
reports their shared memory (checked against the architecture's limit) and, when
``cuobjdump`` is available (Triton ships one), registers and spills.

    TRITON_INTERPRET=0 python -m radixserve.kernels.compile_check [--arch 90] [--level full]

It needs the JIT-compiled kernel objects, so it refuses to run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import triton
from radixserve.kernels.common import dot_precision, interpreting
from radixserve.kernels.decode_attention import (
    _decode_reduce_kernel,
    _decode_split_kernel,
    decode_config,
)
from radixserve.kernels.extend_attention import _extend_kernel, extend_config
from radixserve.kernels.kv_store import _store_kv_kernel
from radixserve.kernels.shared_prefix_decode import _shared_prefix_kernel, cascade_config
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Largest dynamic shared memory per block (bytes) by compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
TRITON_TYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Compiled:
    name: str
    shared: int
    regs: int | None
    spill_bytes: int | None


def _signature(fn: Any, pointers: dict[str, str], floats: tuple[str, ...],
               constexprs: dict[str, Any]) -> dict[str, str]:
    """Triton type of every argument: given pointers/floats, constexprs, the rest int32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, spill bytes) from ``cuobjdump -res-usage`` when available."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return (int(regs.group(1)) if regs else None, int(local.group(1)) if local else None)


def compile_kernel(fn: Any, name: str, arch: int, pointers: dict[str, str],
                   floats: tuple[str, ...], constexprs: dict[str, Any], **options: Any) -> Compiled:
    src = ASTSource(fn, _signature(fn, pointers, floats, constexprs), constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    regs, spills = _resources(kernel.asm["cubin"])
    return Compiled(name, kernel.metadata.shared, regs, spills)


def configurations(level: str, arch: int) -> list[tuple[torch.dtype, int, int, str | None]]:
    """(dtype, head_dim, GQA group, 8-bit KV pool type or None) points to compile.  fp8 pools
    need sm_89 or newer (Triton has no e4m3 before it)."""
    pools = ["i8", "fp8e4nv", "fp8e5"] if arch >= 89 else ["i8", "fp8e5"]
    if level == "headline":  # the headline shapes: bf16, head dim 128, 32 / 8 heads
        return [(torch.bfloat16, 128, 4, kv) for kv in (None, *pools[:2])]
    if level == "default":
        return [(torch.bfloat16, 128, 4, None), (torch.float32, 128, 4, None),
                (torch.float16, 64, 1, None), (torch.float32, 16, 2, None),
                *[(torch.bfloat16, 128, 4, kv) for kv in pools], (torch.float32, 64, 1, "i8")]
    return [(dt, d, g, kv) for dt in TRITON_TYPE for d in (16, 64, 128) for g in (1, 4, 8)
            for kv in (None, *pools)]


def check(arch: int, level: str) -> list[Compiled]:
    out = []
    stores = set()
    for dtype, dim, group, kv in configurations(level, arch):
        ty = "*" + TRITON_TYPE[dtype]
        # The pool's buffers, and its scales (an int8 pool's; the buffers stand in otherwise).
        kv_ty = ty if kv is None else "*" + kv
        pool = {"K_buf": kv_ty, "V_buf": kv_ty, "K_scale": "*fp16" if kv == "i8" else kv_ty,
                "V_scale": "*fp16" if kv == "i8" else kv_ty}
        block_d = triton.next_power_of_2(dim)
        tag = f"{TRITON_TYPE[dtype]} d{dim} g{group}" + ("" if kv is None else f" kv {kv}")
        common = dict(HEAD_DIM=dim, PRECISION=dot_precision(dtype), DOT_IN_FP32=False)

        dc = decode_config(dim, dtype)
        # The plain split kernel (seq_lens stands in for the unread Kv_start), and the
        # cascade's (own keys from Kv_start on).
        for has_kv_start in (False, True):
            out.append(compile_kernel(
                _decode_split_kernel, f"decode_split{' cascade' if has_kv_start else ''} {tag}",
                arch,
                {"Q": ty, **pool, "Req_to_token": "*i32", "Table_rows": "*i64",
                 "Seq_lens": "*i64", "Token_idx": "*i64",
                 "Kv_start": "*i32" if has_kv_start else "*i64", "Mid_o": "*fp32",
                 "Mid_lse": "*fp32"},
                ("qk_scale",),
                dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
                     BLOCK_D=block_d, BLOCK_N=dc.block_n, HAS_KV_START=has_kv_start, **common),
                num_warps=dc.num_warps, num_stages=dc.num_stages,
            ))
        cc = cascade_config(group, dim, dtype)
        out.append(compile_kernel(
            _shared_prefix_kernel, f"cascade_shared {tag}", arch,
            {"Q": ty, **pool, "Req_to_token": "*i32", "Token_idx": "*i64",
             "Tile_row": "*i32", "Tile_len": "*i32", "Tile_ptr": "*i32", "Tile_members": "*i32",
             "Mid_o": "*fp32", "Mid_lse": "*fp32"},
            ("qk_scale",),
            dict(GROUP=group, BLOCK_M=cc.block_m, BLOCK_D=block_d, BLOCK_N=cc.block_n, **common),
            num_warps=cc.num_warps, num_stages=cc.num_stages,
        ))
        ec = extend_config(dim, dtype)
        out.append(compile_kernel(
            _extend_kernel, f"extend {tag}", arch,
            {"Q": ty, "K": ty, "V": ty, **pool, "Out": ty,
             "Req_to_token": "*i32", "Item_req": "*i64", "Item_m": "*i64",
             "Req_table_row": "*i64", "Req_prefix": "*i64", "Req_extend": "*i64",
             "Req_start": "*i64"},
            ("qk_scale",),
            dict(GROUP=group, BLOCK_M=ec.block_m, BLOCK_N=ec.block_n, BLOCK_D=block_d, **common),
            num_warps=ec.num_warps, num_stages=ec.num_stages,
        ))
        if group == 1 and kv is None:
            # Plain: up to 8 splits; cascade: 2 x 64 splits (own + shared), its widest.
            for has_shared, block_s, warps in ((False, 8, 2), (True, 128, 4)):
                out.append(compile_kernel(
                    _decode_reduce_kernel,
                    f"decode_reduce{' cascade' if has_shared else ''} {tag}", arch,
                    {"Mid_o": "*fp32", "Mid_lse": "*fp32", "Out": ty, "Seq_lens": "*i64",
                     "Token_idx": "*i64", "Kv_start": "*i32" if has_shared else "*i64"},
                    (), dict(HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=dc.block_n, BLOCK_S=block_s,
                             HAS_SHARED=has_shared),
                    num_warps=warps,
                ))
        if (dtype, dim, kv) not in stores:  # the store has no group
            stores.add((dtype, dim, kv))
            out.append(compile_kernel(
                _store_kv_kernel, f"store_kv {tag}", arch,
                {"K": ty, "V": ty, **pool, "Loc": "*i64"}, (),
                dict(NUM_KV_HEADS=8, HEAD_DIM=dim, BLOCK_H=8, BLOCK_D=block_d), num_warps=4,
            ))
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    p.add_argument(
        "--level",
        choices=("headline", "default", "full"),
        default="default",
        help="headline: bf16 d128 GQA 4 (float, int8 and fp8 pools); default: 10 points; "
        "full: every dtype, head dim, group and pool",
    )
    args = p.parse_args()
    if interpreting():
        print("compile_check needs TRITON_INTERPRET=0 (the interpreter replaces the JIT kernels)",
              file=sys.stderr)
        return 2
    limit = SHARED_LIMIT.get(args.arch)
    failed = False
    for c in check(args.arch, args.level):
        over = limit is not None and c.shared > limit
        failed |= over
        regs = "?" if c.regs is None else c.regs
        spills = "?" if c.spill_bytes is None else c.spill_bytes
        flag = "  OVER SHARED LIMIT" if over else ("  spills" if c.spill_bytes else "")
        print(f"sm_{args.arch} {c.name:40s} shared {c.shared:7d} B  regs {regs:>4}  "
              f"local {spills:>5}{flag}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
