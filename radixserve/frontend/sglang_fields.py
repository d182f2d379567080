"""SGLang's request fields beyond OpenAI's that radixserve has no field of its own for: one table.

SGLang's clients and its router (``sglang-router`` / ``sgl-model-gateway``) build request bodies
from SGLang's request schemas, so a worker behind the router receives every field those schemas
default (``return_hidden_states: false`` and ``stream_reasoning: true`` on chat, ``model: null``,
``log_metrics: true`` and ``lora_id: null`` on ``/generate``, ``sampling_seed`` in place of
``seed``, ...).  Each field of :data:`SGLANG_FIELDS` is accepted on the routes it lists:

- ``lacks``: the field asks for a feature radixserve does not have (hidden states,
  multimodal inputs, prefill-decode disaggregation, ...).  Null or its ``default`` asks for
  nothing and is accepted; so are an empty string, list or object, and a batch's list of
  such values.  Any other value is a 400 naming the field.
- ``ignored``: bookkeeping whose value cannot change an answer; type-checked and dropped.
- ``rename``: SGLang's name for a radixserve field (``sampling_seed`` is ``seed``).

Every value must have one of the entry's JSON ``kinds`` (a 400 naming the field otherwise).
SGLang fields that radixserve implements under the same name (``rid``, ``extra_key``,
``no_stop_trim``, ``separate_reasoning``, ``stream_reasoning``, ``model`` on ``/generate``, ...)
are ordinary fields of the request models in ``protocol.py``; any field in neither place stays
a 400 naming it.  :func:`take_sglang_fields` applies the table to a body before the model
validates what is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.schema.base import refuse_meaning, reject

# Route letters: "c" /v1/chat/completions, "p" /v1/completions, "g" /generate,
# "s" a /generate sampling_params object.
CHAT, COMPLETIONS, GENERATE, SAMPLING = "c", "p", "g", "s"
_KIND_NAMES = {
    bool: "a boolean", int: "an integer", str: "a string", list: "a list", dict: "an object",
}


@dataclass(frozen=True)
class SGLangField:
    routes: str  # route letters (above)
    kinds: tuple[type, ...]  # JSON types SGLang accepts for it
    lacks: str = ""  # what a value other than null / ``default`` asks for (refused)
    default: Any = None  # the value, besides null, that asks for nothing
    ignored: str = ""  # or: why any value is harmless
    rename: str = ""  # or: radixserve's name for the field

    def __post_init__(self) -> None:
        if sum(map(bool, (self.lacks, self.ignored, self.rename))) != 1:
            raise ValueError(f"give exactly one of lacks, ignored and rename: {self}")


_PD = "prefill-decode disaggregation"
_MULTIMODAL = "inputs other than text (radixserve serves text-only models)"

SGLANG_FIELDS: dict[str, SGLangField] = {
    # -- features radixserve lacks: accepted unset, refused when they ask for something
    "return_hidden_states": SGLangField("cpg", (bool, str, list), "hidden states in the output",
                                        False),
    "lora_id": SGLangField("g", (str, list), "SGLang's internal adapter ids (name the adapter with "
                           "lora_path)"),
    "session_params": SGLangField("cpg", (dict, list), "SGLang's sessions (the radix tree serves a "
                                  "conversation's shared prefix without one)"),
    "session_id": SGLangField("cpg", (str,), "SGLang's sessions (the radix tree serves a "
                              "conversation's shared prefix without one)"),
    "custom_logit_processor": SGLangField("cpg", (str, list), "custom logit processors"),
    "custom_params": SGLangField("cps", (dict, list), "parameters of a custom logit processor"),
    "stop_regex": SGLangField("cp", (str, list), "stopping on a regular expression "
                              "(use stop strings or a regex constraint)"),
    "token_ids_logprob": SGLangField("g", (list,),
                                     "logprobs of chosen token ids (use top_logprobs_num)"),
    "image_data": SGLangField("g", (str, list, dict),
                              "image inputs (radixserve serves text-only models)"),
    "video_data": SGLangField("g", (str, list, dict),
                              "video inputs (radixserve serves text-only models)"),
    "audio_data": SGLangField("g", (str, list, dict),
                              "audio inputs (radixserve serves text-only models)"),
    "modalities": SGLangField("g", (list,), _MULTIMODAL),
    "input_embeds": SGLangField("g", (list,), "prompts given as embeddings"),
    "bootstrap_pair_key": SGLangField("g", (str, list), _PD),
    "decode_tp_size": SGLangField("g", (int, list), _PD),
    "disagg_prefill_dp_rank": SGLangField("cpg", (int,), _PD),
    # A radixserve server is one data-parallel rank: rank 0 is the server itself.
    "data_parallel_rank": SGLangField("cpg", (int,), "a data-parallel rank other than 0 "
                                      "(a radixserve server is a single rank)", 0),
    "routed_dp_rank": SGLangField("cpg", (int,), "a data-parallel rank other than 0 (a radixserve "
                                  "server is a single rank)", 0),
    "background": SGLangField("g", (bool,), "background responses", False),
    "return_bytes": SGLangField("g", (bool,), "image bytes (image generation)", False),
    "return_entropy": SGLangField("g", (bool,), "the entropy of each output token's distribution",
                                  False),
    "return_routed_experts": SGLangField("cpg", (bool,), "routed experts (radixserve serves dense "
                                         "models)", False),
    # -- bookkeeping: any value is harmless
    "log_metrics": SGLangField("g", (bool,), ignored="/metrics counts every request"),
    "no_logs": SGLangField("g", (bool,), ignored="radixserve logs no request content, only ids and "
                           "token counts"),
    "conversation_id": SGLangField("g", (str,), ignored="an id for tracking; "
                                   "requests are not grouped by conversation"),
    "custom_labels": SGLangField("cpg", (dict,), ignored="radixserve's metrics carry no "
                                 "per-request labels"),
    "stream_interval": SGLangField("s", (int,), ignored="how often a stream sends; the tokens "
                                   "are the same (--stream-interval sets it for the server)"),
    # -- SGLang's names for radixserve's fields
    "sampling_seed": SGLangField("cps", (int,), rename="seed"),
}


def _asks_for_nothing(value: Any, default: Any) -> bool:
    if isinstance(value, list):
        return all(v is None or _asks_for_nothing(v, default) for v in value)
    return value is None or value in ("", {}) or (type(value) is type(default) and value == default)


def _has_kind(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # not an integer in JSON
        return bool in kinds
    return isinstance(value, kinds)


def take_sglang_fields(data: Any, route: str, *, where: str = "", param: str = "") -> Any:
    """``data`` (a parsed JSON body, or a ``sampling_params`` object) without the table's
    fields for ``route``: each checked (a 400 naming it when it asks for what radixserve
    lacks), renamed or dropped.  ``where`` is the object's path in the request, for messages
    (``"sampling_params[1]"``); ``param`` its path below the validator that calls this."""
    if not isinstance(data, dict) or not any(name in data for name in SGLANG_FIELDS):
        return data
    out = dict(data)
    for name, spec in SGLANG_FIELDS.items():
        if route not in spec.routes or name not in out:
            continue
        value = out.pop(name)
        full = f"{where}.{name}" if where else name
        at = f"{param}.{name}" if param else name
        if value is None:
            continue  # null: the default, for every field
        if not _has_kind(value, spec.kinds):
            kinds = " or ".join(_KIND_NAMES[k] for k in spec.kinds)
            raise reject(at, f"'{full}' must be {kinds}, got {type(value).__name__}")
        if spec.lacks and not _asks_for_nothing(value, spec.default):
            raise refuse_meaning(full, spec.lacks, at)
        if spec.rename:
            given = out.get(spec.rename)
            if given is not None and given != value:
                raise reject(at, f"'{full}' is SGLang's name for '{spec.rename}'; give one of them "
                                 f"(or both with the same value), got {value!r} and {given!r}")
            out[spec.rename] = value
    return out
