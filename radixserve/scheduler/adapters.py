"""The scheduler's side of LoRA adapters: a slot for each admitted request, and the control
commands that load, unload and list adapters while serving.

The adapters and their slots live in the model runner's ``LoraPool`` (``lora/slots.py``).  An
adapter is held by the requests that use it: a waiting one keeps it from being unloaded, and a
live one (a row of the request table) keeps it in its slot.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixserve.cache.namespace import cache_namespace
from radixserve.ipc import messages as m

if TYPE_CHECKING:
    from radixserve.lora.slots import LoraPool
    from radixserve.scheduler.request import Req

logger = logging.getLogger(__name__)
NOT_ENABLED = ("this server serves no LoRA adapters (start it with --enable-lora or "
               "--lora-paths)")


class SchedulerAdapters:
    """Mixed into the Scheduler; it names what it reads."""

    reqs: dict[str, Req]

    @property
    def loras(self) -> LoraPool | None:
        return self.runner.lora  # type: ignore[attr-defined]

    def take_lora_slot(self, req: Req) -> bool:
        """Give an admitted request its adapter's slot; False when every slot holds an adapter
        a live request uses (the request waits for one to finish)."""
        if req.lora_name is None:
            req.lora_slot = -1
            return True
        slot = self.loras.acquire(req.lora_name, self._live_adapters)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _live_adapters(self) -> set[str]:
        return {r.lora_name for r in self.reqs.values()
                if r.lora_name is not None and r.kv.row is not None}

    def adapter_namespace(self, salt: str, name: str | None) -> str | None:
        """The tree namespace of requests with this salt and adapter (None: the adapter is not
        loaded)."""
        if name is None:
            return salt
        adapter = None if self.loras is None else self.loras.adapters.get(name)
        return None if adapter is None else cache_namespace(salt, adapter.key_name)

    def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        if self.loras is None:
            return {"error": NOT_ENABLED, "status": 400}
        try:
            self.loras.check_name(name)
        except ValueError as e:
            return {"error": str(e), "status": 400, "param": "lora_name"}
        try:
            adapter = self.loras.add(name, path)
        except ValueError as e:
            return {"error": str(e), "status": 400, "param": "lora_path"}
        logger.info("loaded LoRA adapter %r from %s (rank %d, %s)", name, adapter.path,
                    adapter.rank, ", ".join(sorted(adapter.targets)))
        return {"success": True, "loaded_adapters": self.loras.listing()}

    def unload_adapter(self, name: str) -> dict[str, Any]:
        if self.loras is None:
            return {"error": NOT_ENABLED, "status": 400}
        if name not in self.loras.adapters:
            return {"error": f"the LoRA adapter {name!r} is not loaded", "status": 404}
        users = sum(r.lora_name == name and not r.finished for r in self.reqs.values())
        if users:
            return {"error": f"the LoRA adapter {name!r} is in use by {users} request(s); "
                             "unload it when they have finished", "status": 400}
        self.loras.remove(name)
        logger.info("unloaded LoRA adapter %r", name)
        return {"success": True, "loaded_adapters": self.loras.listing()}


def _load(sched: SchedulerAdapters, msg: m.LoraLoadReq) -> dict[str, Any]:
    return sched.load_adapter(msg.lora_name, msg.lora_path)


def _unload(sched: SchedulerAdapters, msg: m.LoraUnloadReq) -> dict[str, Any]:
    return sched.unload_adapter(msg.lora_name)


def _list(sched: SchedulerAdapters, msg: m.ControlReq) -> dict[str, Any]:
    pool = sched.loras
    if pool is None:
        return {"enabled": False, "adapters": {}}
    return {"enabled": True, "adapters": pool.listing(), "max_lora_rank": pool.max_rank,
            "max_loras_per_batch": pool.max_loras, "target_modules": sorted(pool.targets),
            "slots": {name: pool.slot_of(name) for name in pool.adapters}}


COMMANDS = {m.LoraLoadReq.TYPE: _load, m.LoraUnloadReq.TYPE: _unload, "loras": _list}
