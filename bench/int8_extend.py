"""Extend batches (a prompt's chunk, a verify step) through the 4-bit weights: the path the
runtime takes today against dynamic int8 activations times int8 weights.

For each row count in ``--rows`` and each dtype in ``--dtypes`` (bfloat16 only where the CPU has
bfloat16 instructions), the default model's four matmuls of a layer (q/k/v, o, gate/up, down;
random weights of those shapes, quantized to 4-bit blocks as ``--quantization int4`` does) run

  served        what ``--quantization gguf`` / ``int4`` do with more than a few rows: the
                blocks dequantized into a shared buffer, then torch's float matmul
  int8-dynamic  the 4-bit weights requantized once to int8 with a scale per output row, and per
                call: each row of x quantized to int8 (its own scale, amax / 127), torch's
                int8 x int8 -> int32 matmul (``torch._int_mm``, oneDNN: VNNI / AMX-INT8 where
                the CPU has them), then both scales applied, in x's dtype

and the table shows the time of the 30 layers' matmuls for one extend step of that many rows,
the ratio int8 / served, and each path's relative error against a float64 product with the 4-bit
weights' own values (served: rounding only; int8: the two quantizations).

    python bench/int8_extend.py                  # rows 32, 128, 512, 2048; float32 and bfloat16
    python bench/int8_extend.py --quick          # 32 and 128 rows, fewer repeats
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import align_columns, args_params, cpu_kind, machine_info, write_report  # noqa: E402

PATHS = ("served", "int8-dynamic")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,128,512,2048", help="comma list: rows of x per extend step")
    p.add_argument("--dtypes", default="float32,bfloat16", help="bfloat16 skipped without the instructions")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per matmul (after two warm-ups)")
    p.add_argument("--quick", action="store_true", help="rows 32 and 128, 3 repeats")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "int8_extend.json")
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.quick:
        args.rows, args.repeats = [32, 128], 3
    if not args.rows or min(args.rows) < 17 or args.repeats < 1:
        p.error("--rows must each be > 16 (torch's int8 matmul needs 17 or more) and --repeats >= 1")
    return args


def layer_shapes() -> tuple[int, list[tuple[str, int, int]]]:
    """The default model's layer count and its matmuls' (name, N, K)."""
    from radixserve.model.default_model import default_model_path
    from radixserve.model.loader import read_config

    cfg = read_config(default_model_path())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    o_in = cfg.num_attention_heads * head_dim
    return cfg.num_hidden_layers, [("qkv", qkv, h), ("o", h, o_in), ("gate_up", 2 * inter, h), ("down", h, inter)]


def int8_dynamic(w: Any) -> Callable[[Any], Any]:
    """x [M, K] -> x @ w.T through int8: ``w`` (float [N, K]) per output row, x per row of each call."""
    import torch

    w_scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    wq_t = torch.round(w / w_scale[:, None]).clamp_(-127, 127).to(torch.int8).t()  # [K, N], a view

    def matmul(x: Any) -> Any:
        xf = x.float()
        x_scale = (xf.abs().amax(dim=1) / 127).clamp_min_(1e-12)
        xq = torch.round(xf / x_scale[:, None]).clamp_(-127, 127).to(torch.int8)
        out = torch._int_mm(xq, wq_t).float()
        return (out * x_scale[:, None] * w_scale[None, :]).to(x.dtype)

    return matmul


def seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def relative_error(got: Any, want: Any) -> float:
    return float((got.double() - want).norm() / want.norm())


def measure(dtype_name: str, rows: int, shapes: list[tuple[str, int, int]], layers: int,
            repeats: int) -> list[dict[str, Any]]:
    import torch

    from radixserve.quantization.weights import Int4Weight

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(rows)
    totals = {p: 0.0 for p in PATHS}
    errors: dict[str, list[float]] = {p: [] for p in PATHS}
    for _name, n, k in shapes:
        w4 = Int4Weight.quantize((torch.randn((n, k), generator=gen) * 0.05).to(dtype))
        w_float = w4.dequantized(torch.float32)  # the 4-bit weights' own values
        x = torch.randn((rows, k), generator=gen).to(dtype)
        want = x.double() @ w_float.double().T
        fns = {"served": w4.matmul, "int8-dynamic": int8_dynamic(w_float)}
        for path in PATHS:
            errors[path].append(relative_error(fns[path](x), want))
            totals[path] += seconds(lambda f=fns[path], x=x: f(x), repeats) * layers
    return [{"dtype": dtype_name, "rows": rows, "path": p, "step_ms": totals[p] * 1e3,
             "ms_per_token": totals[p] * 1e3 / rows, "ratio_vs_served": totals[p] / totals["served"],
             "relative_error": max(errors[p])} for p in PATHS]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from radixserve.hardware import cpu_bf16_feature

    torch.manual_seed(0)
    layers, shapes = layer_shapes()
    dtypes = [d for d in args.dtypes if d != "bfloat16" or cpu_bf16_feature()]
    kind = cpu_kind()
    print(f"cpu: {kind['cpu_model']} ({kind['cpu_kind']}); {torch.get_num_threads()} threads; {layers} layers of "
          f"{', '.join(f'{name} {n}x{k}' for name, n, k in shapes)}; dtypes {dtypes}")
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for m in args.rows:
            print(f"[{dtype} {m} rows] ...", flush=True)
            rows.extend(measure(dtype, m, shapes, layers, args.repeats))
    header = ["dtype", "rows", "path", "matmuls ms / step", "ms / token", "x served", "max rel. error"]
    lines = [header] + [[r["dtype"], str(r["rows"]), r["path"], f"{r['step_ms']:.1f}", f"{r['ms_per_token']:.3f}",
                         f"{r['ratio_vs_served']:.2f}", f"{r['relative_error']:.1e}"] for r in rows]
    print()
    print(align_columns(lines, left={0, 2}))
    report = {"benchmark": "int8_extend", "params": args_params(args), "machine": machine_info(),
              "layers": layers, "shapes": [list(s) for s in shapes], "results": rows}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
