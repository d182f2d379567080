"""GGUF benchmark: radixserve against llama.cpp's ``llama-server`` on the same 1B-class files.

The model is built by bench/gguf_model.py from a config, with seeded random weights (decode
speed does not depend on their values): Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads,
8 KV heads, intermediate 8192, rope theta 500000, tied embeddings) with SmolLM2's 49,152-token
vocabulary, whose tokenizer and chat template are copied from the embedded default model's GGUF.
It is written as F16 with the metadata keys, tensor names and q / k row order of llama.cpp's
converter, then quantized to each of ``--files``: by ``--llama-quantize`` when given, else Q4_0
and Q8_0 by the ``gguf`` package and the K-quants by bench/gguf_quantize.py, each tensor's type
chosen by llama.cpp's rule (``tensor_type``).  The files stay in ``--cache-dir``.

Per file, radixserve (``radixserve serve --model FILE``: every setting its default but a KV pool
and context of ``--context`` tokens) and then ``llama-server`` (``-c --context -np 1``) each run
bench/agent_http.py's agent loop: one conversation of a ``--system-len``-token system prompt and
``--turns`` turns, ``--answer-tokens``-token answers (greedy, ``ignore_eos``), one request at a
time, both servers on ``--threads`` threads.  Per file and server:

  wall s          the whole loop
  prefill s       turn 1's time to its first token (the whole prompt computed)
  decode ms/tok   (last token - first token) / (tokens - 1), averaged over the turns
  floor ms/tok    (weight bytes a decode step reads: every tensor of the file, the tied table
                  being the LM head; + the KV bytes a step reads at the mean decode context)
                  / memory bandwidth (bench/agent.py's tensor copy, timed before each server
                  and at the end of this run; the best sample)
  x floor         decode / floor
  peak RSS GB     VmHWM summed over the server's process tree (radixserve: front end,
                  scheduler, detokenizer); the pages of a mapped file count as resident
  KV GB           the KV pool (radixserve: /server_info's tokens x bytes per token;
                  llama-server: ``--context`` tokens of float16 K and V, its default)
  start s         launch to ready; radixserve's with an empty cache folder (its compiled CPU
                  kernels kept: the folder's cpu_ext/ links to the usual one, built beforehand)
  cache MB        what radixserve wrote into that cache folder

A server that refuses a file is a row with its error (``failed`` in the table).  Both servers
want every core they are given: other work on the machine slows them (llama.cpp's spinning
threads most), so each row records the 1-minute load average before and after it.

    python bench/gguf_files.py --llama-server PATH --llama-quantize PATH     # every file, both servers
    python bench/gguf_files.py --files Q4_0,Q8_0           # radixserve only, gguf-package files
    python bench/gguf_files.py --quick --files Q8_0,Q4_K_M # tiny shape, 1 turn: a smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.agent import MODES, conversation, memory_bandwidth_gbs  # noqa: E402
from bench.agent_http import LlamaServer, RadixServer, run_loop  # noqa: E402
from bench.common import (  # noqa: E402
    Launched,
    align_columns,
    args_params,
    cpu_kind,
    machine_info,
    write_report,
)
from bench.gguf_model import LLAMA_1B, TINY, Shape, ensure_files  # noqa: E402
from radixserve.checkpoint.cache_dir import cache_root  # noqa: E402

KINDS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
SERVERS = ("radixserve", "llama-server")
DEFAULT_CACHE = Path(cache_root()) / "bench-gguf"  # ~/.cache/radixserve/bench-gguf by default
GB = 1e9


# ---------------------------------------------------------------- the files


def file_weights(path: Path) -> dict[str, Any]:
    """The file's size, the bytes of weights one decode step reads (every tensor but an untied
    embedding table, of which a step reads one row), and its tensor types."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    sizes = {t.name: int(t.n_bytes) for t in tensors}
    step = sum(sizes.values()) - (sizes["token_embd.weight"] if "output.weight" in sizes else 0)
    return {"file_bytes": path.stat().st_size, "weight_bytes_per_step": step,
            "tensor_types": dict(Counter(t.tensor_type.name for t in tensors))}


# ---------------------------------------------------------------- the servers


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the fields after the command's closing parenthesis: state, ppid, ...
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def peak_memory(root: int, roles: dict[int, str]) -> dict[str, Any]:
    """Each process's peak resident set (VmHWM) in ``root``'s tree, and their sum; a process is
    named by its role in ``roles`` where it has one, else by its command."""
    processes = []
    for pid in process_tree(root):
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            status = dict(line.split(":", 1) for line in lines)
        except OSError:
            continue
        hwm = int(status.get("VmHWM", "0 kB").split()[0]) * 1024
        name = roles.get(pid, status["Name"].strip())
        processes.append({"pid": pid, "name": name, "vm_hwm_bytes": hwm})
    return {"peak_rss_bytes": sum(p["vm_hwm_bytes"] for p in processes), "processes": processes}


def fresh_cache_dir() -> Path:
    """An empty radixserve cache folder whose cpu_ext/ is the usual cache's: the compiled
    kernels are found, and everything else is written anew."""
    kernels = Path(cache_root()) / "cpu_ext"
    kernels.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="radixserve-bench-cache-"))
    (folder / "cpu_ext").symlink_to(kernels, target_is_directory=True)
    return folder


def bytes_written(folder: Path) -> int:
    """Bytes of the files under ``folder``, the links (cpu_ext/) not followed."""
    return sum(os.lstat(os.path.join(where, f)).st_size
               for where, _, names in os.walk(folder) for f in names
               if not os.path.islink(os.path.join(where, f)))


def server_info(base_url: str) -> dict[str, Any]:
    import json

    with urllib.request.urlopen(base_url + "/server_info", timeout=30) as r:
        return json.loads(r.read())


def run_server(name: str, path: Path, shape: Shape, args: argparse.Namespace, system: str,
               users: list[str]) -> dict[str, Any]:
    """Start ``name`` on ``path`` (timed), warm it up, run the loop, read its peak memory."""
    cache = fresh_cache_dir() if name == "radixserve" else None
    load_before = os.getloadavg()[0]
    try:
        t0 = time.perf_counter()
        if cache is not None:
            server: Launched = RadixServer(
                ["--model", str(path), "--max-total-tokens", str(args.context),
                 "--context-length", str(args.context)], args.startup_timeout,
                {"RADIXSERVE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": str(args.threads)})
        else:
            server = LlamaServer(args.llama_server, path, args.threads, args.context,
                                 args.startup_timeout)
        start_s = time.perf_counter() - t0
        try:
            params = {**MODES["greedy"], "max_new_tokens": args.answer_tokens}
            run_loop(server.base_url, "warm-up", ["Say hi."], {**params, "max_new_tokens": 2})
            loop = run_loop(server.base_url, system, users, params)
            info = server_info(server.base_url) if cache is not None else None
            roles = {pid: role for role, pid in info["pids"].items()} if info else {}
            memory = peak_memory(server.proc.pid, roles)
            load_after = os.getloadavg()[0]
        finally:
            server.stop()
        written = bytes_written(cache) if cache is not None else None
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    if info is not None:
        model = info["model_info"]
        kv_token, kv_tokens = model["kv_cache_bytes_per_token"], model["max_total_tokens"]
        settings = {k: model[k] for k in ("dtype", "quantization", "kv_cache_dtype",
                                          "torch_threads")}
    else:  # llama-server's default cache type: float16 K and V
        kv_token, kv_tokens, settings = shape.kv_bytes_per_token(2), args.context, None
    turns = loop["turns"]
    if any(t["prompt_tokens"] is None for t in turns):
        raise RuntimeError(f"{name} sent no token usage with its streamed answers")
    decode = [(t["last_s"] - t["ttft_s"]) / max(1, t["completion_tokens"] - 1) for t in turns]
    return {
        "server": name, "settings": settings, "first_start_s": start_s, "wall_s": loop["wall_s"],
        "prefill_s": turns[0]["ttft_s"], "ttft_s": [t["ttft_s"] for t in turns],
        "decode_ms_per_token": 1e3 * sum(decode) / len(decode),
        "prompt_tokens": [t["prompt_tokens"] for t in turns],
        "completion_tokens": [t["completion_tokens"] for t in turns],
        # a turn's decode steps read the KV of its prompt and of half its answer on average
        "mean_decode_context":
            sum(t["prompt_tokens"] + t["completion_tokens"] / 2 for t in turns) / len(turns),
        "kv_bytes_per_token": kv_token, "kv_pool_tokens": kv_tokens,
        "kv_pool_bytes": kv_token * kv_tokens,
        **memory, "cache_bytes_written": written,
        # other work on the machine shows here: the servers' threads want every core
        "load_average_1min": [load_before, load_after],
    }


def with_floor(row: dict[str, Any], bandwidth_gbs: float) -> dict[str, Any]:
    step = row["weight_bytes_per_step"] + row["kv_bytes_per_token"] * row["mean_decode_context"]
    floor_ms = 1e3 * step / (bandwidth_gbs * GB)
    return {**row, "bytes_per_decode_step": step, "floor_ms_per_token": floor_ms,
            "decode_over_floor": row["decode_ms_per_token"] / floor_ms}


def llama_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return (done.stdout + done.stderr).strip()


def build_kernels() -> None:
    """Compile radixserve's CPU kernels into the usual cache now, so that no timed start
    builds them."""
    print("radixserve build-kernels (a build only where the sources changed) ...", flush=True)
    subprocess.run([sys.executable, "-m", "radixserve.cli", "build-kernels"], check=True)


# ---------------------------------------------------------------- the run


# Loop shapes the flags default to: the full run's and --quick's.
FULL_LOOP = {"turns": 4, "answer_tokens": 128, "system_len": 1024}
QUICK_LOOP = {"turns": 1, "answer_tokens": 16, "system_len": 128}


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default=",".join(KINDS),
                   help=f"comma list of {', '.join(KINDS)}, F16")
    p.add_argument("--servers", default=None, help="comma list of radixserve, llama-server "
                   "(default: both; llama-server only with --llama-server)")
    p.add_argument("--llama-server", type=Path, default=None,
                   help="llama.cpp's llama-server binary")
    p.add_argument("--llama-quantize", type=Path, default=None,
                   help="llama.cpp's llama-quantize binary (default: quantize in Python)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                   help=f"where the built files stay (default {DEFAULT_CACHE})")
    p.add_argument("--turns", type=int, default=None,
                   help="turns of the loop (default 4; --quick 1)")
    p.add_argument("--answer-tokens", type=int, default=None,
                   help="tokens per answer (default 128; --quick 16)")
    p.add_argument("--system-len", type=int, default=None,
                   help="system prompt tokens, text and tool list (default 1024; --quick 128)")
    p.add_argument("--user-len", type=int, default=64, help="tokens of each turn's tool result")
    p.add_argument("--context", type=int, default=4096,
                   help="KV pool and context of both servers, in tokens")
    p.add_argument("--threads", type=int, default=2, help="threads of both servers")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the conversation's seed")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="tiny model shape and 1 turn: a smoke run")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gguf.json")
    args = p.parse_args(argv)
    for key, value in (QUICK_LOOP if args.quick else FULL_LOOP).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.files = comma_list(args.files)
    if not args.files or set(args.files) - {*KINDS, "F16"}:
        p.error(f"--files takes {', '.join(KINDS)}, F16")
    default = [s for s in SERVERS if s != "llama-server" or args.llama_server]
    args.servers = default if args.servers is None else comma_list(args.servers)
    if not args.servers or set(args.servers) - set(SERVERS):
        p.error(f"--servers takes {', '.join(SERVERS)}")
    if "llama-server" in args.servers and not args.llama_server:
        p.error("llama-server needs --llama-server PATH")
    if min(args.turns, args.system_len, args.user_len, args.threads) < 1 or args.answer_tokens < 2:
        p.error("--turns, --system-len, --user-len and --threads must be >= 1, "
                "--answer-tokens >= 2")
    return args


def table(rows: list[dict[str, Any]]) -> str:
    lines = [["file", "server", "file GB", "wall s", "prefill s", "decode ms/tok", "floor ms/tok",
              "x floor", "peak RSS GB", "KV GB", "start s", "cache MB"]]
    for r in rows:
        if r["error"]:
            lines.append([r["file"], r["server"], f"{r['file_bytes'] / GB:.2f}", *["failed"] * 9])
            continue
        cache = "-" if r["cache_bytes_written"] is None else f"{r['cache_bytes_written'] / 1e6:.1f}"
        lines.append([r["file"], r["server"], f"{r['file_bytes'] / GB:.2f}", f"{r['wall_s']:.1f}",
                      f"{r['prefill_s']:.2f}", f"{r['decode_ms_per_token']:.1f}",
                      f"{r['floor_ms_per_token']:.1f}", f"{r['decode_over_floor']:.2f}",
                      f"{r['peak_rss_bytes'] / GB:.2f}", f"{r['kv_pool_bytes'] / GB:.3f}",
                      f"{r['first_start_s']:.1f}", cache])
    return align_columns(lines, left={0, 1})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    shape = TINY if args.quick else LLAMA_1B
    files = ensure_files(args, shape)
    loop_args = argparse.Namespace(seed=args.seed, system_len=args.system_len, turns=args.turns,
                                   user_len=args.user_len, workload="agent")
    system, users = conversation(load_tokenizer(default_model_path()), loop_args)
    if "radixserve" in args.servers:
        build_kernels()
    kind = cpu_kind()
    print(f"cpu: {kind['cpu_model']} ({kind['cpu_kind']}), {args.threads} threads; "
          f"{shape.name}: {', '.join(args.files)}", flush=True)
    bandwidth = []  # timed before each server and at the end: the floor takes the best
    rows = []
    for name, path in files.items():
        weights = file_weights(path)
        for server in args.servers:
            bandwidth.append(memory_bandwidth_gbs())
            print(f"[{name} {server}] ...", flush=True)
            try:
                row = run_server(server, path, shape, args, system, users)
            except (RuntimeError, OSError) as exc:  # a server that refuses a file is a result too
                print(f"[{name} {server}] failed: {exc}", flush=True)
                rows.append({"file": name, "path": str(path), **weights, "server": server,
                             "error": str(exc)})
                continue
            rows.append({"file": name, "path": str(path), **weights, **row, "error": None})
            print(f"[{name} {server}] {row['wall_s']:.1f} s, "
                  f"{row['decode_ms_per_token']:.1f} ms/token", flush=True)
    bandwidth.append(memory_bandwidth_gbs())
    best = max(bandwidth)  # other work on the machine only ever lowers a sample
    rows = [r if r["error"] else with_floor(r, best) for r in rows]
    print()
    print(table(rows))
    for r in rows:
        if r["error"]:
            print(f"{r['file']} {r['server']} failed: {r['error'].strip().splitlines()[-1]}")
    report = {
        "benchmark": "gguf", "params": args_params(args), "shape": asdict(shape),
        "machine": machine_info(), "memory_bandwidth_gbs": best, "bandwidth_samples_gbs": bandwidth,
        "llama_cpp": None if not args.llama_server and not args.llama_quantize else {
            "llama_server": str(args.llama_server) if args.llama_server else None,
            "llama_quantize": str(args.llama_quantize) if args.llama_quantize else None,
            "version": llama_version(args.llama_server or args.llama_quantize)},
        "results": rows,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
