"""Both ends of the per-step link between rank 0 (the scheduler) and the other ranks.

Rank 0 binds one PUSH socket per worker rank in the server's private folder and sends each
forward's :class:`StepBatch`; a worker waits on its socket (checking that the launcher is
alive), runs the same forward on its shard, and takes part in the collectives inside it.
A worker never answers: the logits reach rank 0 through the gather at the end of the forward.

Start-up: every rank joins the group and loads its shard; rank 0 then builds the scheduler
(which sizes the KV pool) and broadcasts the pool size, the one thing the workers need from it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
import zmq

from radixserve.config import ServerArgs
from radixserve.distributed import TensorParallelError
from radixserve.distributed.group import init_group, leave_group, rank_device
from radixserve.distributed.step_message import STOP, StepBatch

logger = logging.getLogger(__name__)


def link_address(folder: str, rank: int) -> str:
    return f"ipc://{folder}/tp-rank-{rank}"


def share_setup(setup: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0 passes its start-up facts (``setup``); the other ranks pass None and get them."""
    import torch.distributed as dist

    box = [setup]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as e:
        raise TensorParallelError(f"tensor-parallel start-up broadcast failed: {e}") from e
    return box[0]


class WorkerLink:
    """Rank 0's side: sends each forward's batch to every other rank."""

    def __init__(self, folder: str, size: int) -> None:
        ctx = zmq.Context.instance()
        self.sockets = []
        for rank in range(1, size):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind(link_address(folder, rank))
            self.sockets.append(sock)

    def send(self, batch: StepBatch) -> None:
        frames = batch.encode()
        for sock in self.sockets:
            sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        """Tell the workers to exit (best effort: the launcher stops them anyway)."""
        for sock in self.sockets:
            try:
                sock.send(STOP, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the worker is already gone: nothing to tell it
            sock.close()
        self.sockets = []


def rank_threads(tp_size: int) -> tuple[int, str]:
    """Torch threads for one rank: the scheduler's share of the cores, split over the ranks."""
    from radixserve.threads import scheduler_threads

    threads, source = scheduler_threads()
    if source == "OMP_NUM_THREADS" or tp_size == 1:
        return threads, source
    return max(1, threads // tp_size), f"{source}, split over {tp_size} tensor-parallel ranks"


class RankRunner:
    """A worker rank's model, KV shard and attention backend; runs what rank 0 sends."""

    def __init__(self, model: torch.nn.Module, kv_pool: Any, backend: Any, device: str) -> None:
        self.model, self.kv_pool, self.backend, self.device = model, kv_pool, backend, device
        backend.layer = model.model.layers[0].self_attn.info

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> None:
        from radixserve.batch import ForwardBatch

        host = batch.table()
        table = torch.from_numpy(host).to(self.device)  # compact: one row per request, each step
        fb = ForwardBatch.build(
            input_ids=batch.input_ids,
            prefix_lens=batch.prefix_lens.tolist(),
            extend_lens=batch.extend_lens.tolist(),
            req_pool_indices=list(range(len(batch.prefix_lens))),
            out_cache_loc=batch.out_cache_loc,
            req_to_token=table,
            table_host=host,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            device=self.device,
            extra_logits_indices=batch.extra_logits if len(batch.extra_logits) else None,
        )
        self.backend.prepare(fb)
        self.model.forward(fb)  # its logits go to rank 0 in the final gather


def run_tp_worker_process(
    args: ServerArgs, model_path: str, rank: int, folder: str, ready_pipe: Any
) -> None:
    from radixserve.logging_utils import (
        configure_logging,
        exit_on_sigterm,
        ignore_interrupts,
        parent_alive,
        wait_for_input,
    )

    ignore_interrupts()
    configure_logging(f"tp-rank-{rank}", args.log_level)
    exit_on_sigterm(f"tp-rank-{rank}")
    try:
        from radixserve.attention import create_backend
        from radixserve.cache.kv_pool import KVPool
        from radixserve.model.loader import load_model

        threads, _ = rank_threads(args.tp_size)
        torch.set_num_threads(threads)
        device = rank_device(args.device, rank)
        tp = init_group(rank, args.tp_size, folder, device)
        dtype = getattr(torch, args.dtype)
        loaded = load_model(
            model_path, dtype=dtype, device=device, tp=tp, load_format=args.load_format
        )
        setup = share_setup(None)
        config = loaded.config
        kv_pool = KVPool(setup["num_slots"], config.num_layers, loaded.model.num_local_kv_heads,
                         config.head_dim, dtype, device, kv_cache_dtype=args.kv_cache_dtype)
        runner = RankRunner(loaded.model, kv_pool, create_backend(args.attention_backend), device)
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.connect(link_address(folder, rank))
    except Exception as e:  # reported to the launcher, which fails the start with it
        logger.exception("tensor-parallel rank %d failed to start", rank)
        ready_pipe.send(("error", f"tensor-parallel rank {rank} failed to start: {e!r}"))
        return
    ready_pipe.send(("ready", None))
    logger.info("ready: rank %d of %d (pid %d), %d KV heads, %d torch threads", rank, args.tp_size,
                os.getpid(), loaded.model.num_local_kv_heads, threads)
    parent = os.getppid()
    while True:
        if not parent_alive(parent):
            logger.info("launcher is gone; tensor-parallel rank %d exits", rank)
            return
        if not wait_for_input(sock, 1000):
            continue
        frames = sock.recv_multipart()
        if frames[0] == STOP:
            logger.info("rank 0 stopped; tensor-parallel rank %d exits", rank)
            leave_group()
            return
        try:
            runner.forward(StepBatch.decode(frames))
        except TensorParallelError as e:
            logger.error("%s; tensor-parallel rank %d exits", e, rank)
            sys.exit(1)
        except Exception:  # rank 0 waits for this rank in a collective: leaving ends that wait
            logger.exception("a forward failed on tensor-parallel rank %d; it exits", rank)
            sys.exit(1)


__all__ = ["RankRunner", "WorkerLink", "rank_threads", "run_tp_worker_process", "share_setup"]
