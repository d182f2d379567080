"""LoRA adapter routes: ``POST /load_lora_adapter`` and ``POST /unload_lora_adapter`` (SGLang's
names; vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` too).

The scheduler reads and checks the adapter (``lora/adapter.py``) and answers; the front end
then updates the names it accepts in ``model`` / ``lora_path`` and lists in ``/v1/models``.
A refused load (not a peft adapter folder, shapes or target modules this model does not have,
a rank above ``--max-lora-rank``, a name taken) is a 400; unloading an adapter that requests
still use is a 400, an unknown one a 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field

from radixserve.frontend.errors import APIError
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.state import ServerState
from radixserve.schema.base import RequestBody

router = APIRouter()


class LoadLoraRequest(RequestBody):
    lora_name: str = Field(..., min_length=1)
    lora_path: str = Field(..., min_length=1)
    pinned: bool = False  # SGLang's: keep it in a slot; every adapter may leave one here


class UnloadLoraRequest(RequestBody):
    lora_name: str = Field(..., min_length=1)


def _answer(st: ServerState, result: dict) -> JSONBytesResponse:
    if "error" in result:
        raise APIError(result["error"], int(result.get("status", 400)),
                       param=result.get("param", "lora_name"))
    st.loras = dict(result["loaded_adapters"])
    return JSONBytesResponse({"success": True, "error_message": "",
                              "loaded_adapters": st.loras})


@router.post("/load_lora_adapter")
@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> JSONBytesResponse:
    st: ServerState = request.app.state.server
    if body.lora_name == st.model_name:
        raise APIError(f"'{body.lora_name}' is the served model's name", 400, param="lora_name")
    result = await st.tm.control("lora_load", lora_name=body.lora_name,
                                 lora_path=body.lora_path)
    return _answer(st, result)


@router.post("/unload_lora_adapter")
@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> JSONBytesResponse:
    st: ServerState = request.app.state.server
    result = await st.tm.control("lora_unload", lora_name=body.lora_name)
    return _answer(st, result)
