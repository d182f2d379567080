"""KV moved through NIXL (``--disaggregation-transfer-backend nixl``): the prefill worker writes a
prompt's K and V straight from its pool into the decode worker's reserved slots, with no copy
on either side (UCX underneath: RDMA between hosts, shared memory or TCP on one, GPU memory
where the pools live on GPUs).  The control messages (the want, the first token, the ack) stay
on the ZeroMQ sockets; NIXL carries only the bulk.

Each worker registers its whole pool once (every layer's K and V planes, and an int8 pool's
scales).  The decode worker's want names its agent (NIXL metadata), its planes' base addresses
and the destination slots; the prefill worker turns its own slots and those into descriptors,
one per run of consecutive slots per plane (a page of slots is one), and posts one WRITE.  The
pools' layouts are equal (the want's layout string is checked), so a slot's row has the same
size in every plane on both sides.
"""

from __future__ import annotations

import base64
import logging
import uuid
from typing import Any

import numpy as np

from radixserve.disagg.wire import NixlTarget

logger = logging.getLogger(__name__)


class NixlEnd:
    """One worker's NIXL agent with its KV pool registered."""

    def __init__(self, pool: Any) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"radixserve-{uuid.uuid4().hex[:12]}"
        # No progress thread: it spins a core even when idle.  The step loop drives the
        # progress instead (the writer's state checks, the reader's ``progress``).
        self.agent = nixl_agent(
            self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self.planes = [
            plane
            for layer in range(pool.num_layers)
            for side in pool._planes(layer)
            for plane in side
        ]
        self.registered = self.agent.register_memory(self.planes)
        self.mem = "VRAM" if pool.device.type == "cuda" else "DRAM"
        self.device = pool.device.index or 0
        self.bases = np.array([p.data_ptr() for p in self.planes], dtype=np.uint64)
        self.rows = np.array(
            [p[0].numel() * p.element_size() for p in self.planes], dtype=np.uint64
        )
        self.remotes: set[str] = set()
        logger.info(
            "NIXL agent %s: %d KV planes registered (%s)", self.name, len(self.planes), self.mem
        )

    def target(self, slots: np.ndarray) -> NixlTarget:
        """What a want carries: where the prefill worker writes ``slots``' K and V."""
        return NixlTarget(
            agent=self.name,
            metadata=base64.b64encode(self.agent.get_agent_metadata()).decode(),
            bases=[int(b) for b in self.bases],
            slots=[int(s) for s in slots],
        )

    def write(self, src_slots: np.ndarray, target: NixlTarget, notif: str) -> Any:
        """Post the WRITE of ``src_slots`` into the target's slots; its handle."""
        if target.agent not in self.remotes:
            self.agent.add_remote_agent(base64.b64decode(target.metadata))
            self.remotes.add(target.agent)
        src = np.asarray(src_slots, dtype=np.uint64)
        dst = np.asarray(target.slots, dtype=np.uint64)
        if len(src) != len(dst) or len(target.bases) != len(self.bases):
            raise ValueError("the decode worker's NIXL target does not match this pool")
        # runs of slots consecutive on both sides
        breaks = np.flatnonzero(
            (np.diff(src.astype(np.int64)) != 1) | (np.diff(dst.astype(np.int64)) != 1)
        ) + 1
        starts = np.concatenate(([0], breaks)).astype(np.int64)
        lengths = np.diff(np.concatenate((starts, [len(src)]))).astype(np.uint64)
        remote_bases = np.array(target.bases, dtype=np.uint64)
        local = self._descs(self.bases, src[starts], lengths)
        remote = self._descs(remote_bases, dst[starts], lengths)
        handle = self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(local, self.mem),
            self.agent.get_xfer_descs(remote, self.mem),
            target.agent,
            notif.encode(),
        )
        if self.agent.transfer(handle) == "ERR":
            handle.release()
            raise RuntimeError("NIXL refused the transfer")
        return handle

    def _descs(self, bases: np.ndarray, first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """(address, bytes, device) of every run in every plane."""
        addr = bases[:, None] + first[None, :] * self.rows[:, None]
        size = lengths[None, :] * self.rows[:, None]
        dev = np.full(addr.shape, self.device, dtype=np.uint64)
        return np.stack([addr.ravel(), size.ravel(), dev.ravel()], axis=1)

    def progress(self) -> None:
        """Let writes into this worker's memory land (over TCP or shared memory the target's
        UCX worker has to make progress for them)."""
        self.agent.get_new_notifs()

    def state(self, handle: Any) -> str:
        """DONE (written on the remote side), PROC or ERR."""
        return self.agent.check_xfer_state(handle)

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.registered)
        except Exception:  # the process is ending: nothing to keep
            logger.debug("NIXL deregistration failed", exc_info=True)
