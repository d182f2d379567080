"""The scheduler process's entry point: load the model (this rank's shard), build the scheduler
of the server's kind, then serve its sockets (``scheduler/process.py``).

It sits above ``scheduler/`` and ``disagg/`` because it chooses between them: a prefill or
decode worker runs ``DisaggScheduler``, a subclass of ``Scheduler`` that the base never names.
The launcher (``runtime/launcher.py``) starts it in a process of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.config import ServerArgs
from radixserve.ipc import messages as m

logger = logging.getLogger("radixserve.scheduler.process")


def dtype_note(args: Any) -> str:
    """The dtype, and for a CPU what decided it (bfloat16 needs AMX or AVX-512 BF16 to be fast)."""
    kv = "" if args.kv_cache_dtype == "auto" else f", KV cache {args.kv_cache_dtype}"
    if args.device != "cpu":
        return args.dtype + kv
    from radixserve.hardware import cpu_bf16_feature

    feature = cpu_bf16_feature()
    return f"{args.dtype} (CPU bfloat16 instructions: {feature or 'none'}){kv}"


def run_scheduler_process(
    args: ServerArgs, model_path: str, in_addr: str, out_addr: str, ready_pipe: Any, folder: str
) -> None:
    """The scheduler: rank 0 of the tensor-parallel group when ``args.tp_size > 1``, whose
    other ranks meet it in the server's private ``folder``."""
    from radixserve.logging_utils import (
        configure_logging,
        exit_on_sigterm,
        ignore_interrupts,
        on_sigterm,
        open_pipeline_sockets,
    )
    from radixserve.scheduler.process import serve

    ignore_interrupts()
    configure_logging("scheduler", args.log_level)
    exit_on_sigterm("scheduler")
    try:
        sched, info, threads_source = _start(args, model_path, folder)
        on_sigterm(sched.close)  # queued disk-tier writes land before the process goes
        recv, send = open_pipeline_sockets(in_addr, out_addr)
    except Exception as e:  # reported to the launcher, which fails the start with it
        logger.exception("scheduler failed to start")
        ready_pipe.send(("error", f"scheduler failed to start: {e!r}"))
        return
    ready_pipe.send(("ready", info))
    logger.info(
        "ready: %s, %d KV tokens (page %d), %d request rows, %d torch threads (%s), "
        "dtype %s, attention %s",
        model_path, sched.pool_tokens, sched.page_size, sched.max_running,
        info.torch_threads, threads_source, dtype_note(args), sched.runner.attention_path,
    )
    serve(sched, recv, send)


def _start(args: ServerArgs, model_path: str, folder: str) -> tuple[Any, m.ModelInfo, str]:
    """Load the model (this rank's shard), build the scheduler; its start-up info."""
    import torch

    from radixserve.checkpoint.gguf_index import gguf_source
    from radixserve.disagg.scheduler import DisaggScheduler
    from radixserve.distributed.group import SINGLE, init_group, rank_device
    from radixserve.executor.tp_worker import WorkerLink, rank_threads, share_setup
    from radixserve.model.loader import load_model
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.speculative import steps_carry_drafts
    from radixserve.tokenizer import DeferredTokenizer, load_decoder

    threads, threads_source = rank_threads(args.tp_size)
    torch.set_num_threads(threads)
    torch.manual_seed(args.random_seed)
    tp = SINGLE
    if args.tp_size > 1:
        tp = init_group(0, args.tp_size, folder, rank_device(args.device, 0))
    gguf_path = gguf_source(args.model) if args.quantization == "gguf" else None
    loaded = load_model(model_path, dtype=getattr(torch, args.dtype), device=args.device, tp=tp,
                        load_format=args.load_format, quantization=args.quantization,
                        gguf_path=gguf_path, int8_activations=args.int8_activations,
                        # a verify step's rows must be the one-row steps' own bits (quantization/)
                        wide_one_row=not steps_carry_drafts(args))
    kind = Scheduler if args.disaggregation_mode == "null" else DisaggScheduler
    sched = kind(args, loaded.model, loaded.config, None)
    # Stop strings only decode (the tokenizers library, milliseconds); grammars need the
    # transformers tokenizer, whose import takes seconds: loaded for the first of them.
    sched.attach_tokenizer(load_decoder(loaded.tokenizer_path),
                           DeferredTokenizer(loaded.tokenizer_path))
    if tp.size > 1:
        sched.runner.link = WorkerLink(folder, tp.size)
        share_setup({"num_slots": sched.allocator.num_slots})
    return sched, sched.info(loaded.tokenizer_path, torch.get_num_threads()), threads_source
