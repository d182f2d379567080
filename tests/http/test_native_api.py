"""The native routes over HTTP as SGLang's clients use them: ``max_new_tokens = 0`` (prefill
only), SGLang's logprob shapes, the batches ``select`` sends, ``/get_model_info``,
``/concate_and_append_request`` and ``/apply_chat_template``; and OpenAI prompt scoring
(``echo`` with ``max_tokens = 0``).  A real server process serving the tiny chat model."""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import httpx
import orjson
import pytest
from helpers.assertions import assert_eventually, expected_cached_len
from helpers.server import (
    memory_checked_after_each_test,
    openai_client,
    server_info,
    tiny_chat_server,
)

from radixserve.chat.render import ChatTemplateError, render_without_tools
from radixserve.frontend.protocol import ApplyChatTemplateRequest

server = tiny_chat_server("--max-total-tokens", "8000", "--context-length", "1024")
memory_invariant = memory_checked_after_each_test("server")

TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the window."
MESSAGES = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What colour is the sky on a clear day?"}]
PREFILL = {"max_new_tokens": 0}


@functools.lru_cache(maxsize=2)
def tokenizer(folder: str) -> Any:
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def encode(folder: str, text: str) -> list[int]:
    return tokenizer(folder).encode(text, add_special_tokens=False)


def post(server, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def error(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The ``error`` object of a 400 answer, in OpenAI's shape."""
    err = post(server, path, body, 400)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def page_size(server) -> int:
    return server_info(server)["model_info"]["page_size"]


# ---------------------------------------------------------------- max_new_tokens = 0


def test_prefill_only_caches_the_prompt(server, tiny_chat_model) -> None:
    ids = encode(tiny_chat_model, TEXT)
    assert post(server, "/flush_cache", {})["success"]
    first = post(server, "/generate", {"text": TEXT, "sampling_params": PREFILL})
    assert first["text"] == "" and first["output_ids"] == []
    meta = first["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "matched": None, "length": 0}
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == (len(ids), 0, 0)
    assert "output_token_logprobs" not in meta
    # Cached: the same prompt is served all but its last token, a longer one all of it.
    again = post(server, "/generate", {"text": TEXT, "sampling_params": PREFILL})["meta_info"]
    assert again["cached_tokens"] == expected_cached_len(ids, [ids], page_size(server))
    longer = TEXT + " Then it sleeps."
    grown = post(server, "/generate", {"text": longer, "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert grown["meta_info"]["cached_tokens"] == expected_cached_len(encode(tiny_chat_model, longer), [ids],
                                                                      page_size(server))
    assert grown["meta_info"]["completion_tokens"] == 3


def test_prefill_only_with_prompt_logprobs(server, tiny_chat_model) -> None:
    ids = encode(tiny_chat_model, TEXT)
    post(server, "/generate", {"text": TEXT, "sampling_params": PREFILL})  # cached now
    body = {"text": TEXT, "sampling_params": PREFILL, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 5}
    meta = post(server, "/generate", body)["meta_info"]
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[5:]
    assert all(e[0] < 0 and e[2] is None for e in meta["input_token_logprobs"])
    assert [len(t) for t in meta["input_top_logprobs"]] == [2] * (len(ids) - 5)
    # Logits are owed from position 4: the cache serves the prompt up to there only.
    assert meta["cached_tokens"] == 4 // page_size(server) * page_size(server)
    # Computed after a cache hit or not, the values are the same.
    assert post(server, "/flush_cache", {})["success"]
    cold = post(server, "/generate", body)["meta_info"]
    assert [e[0] for e in cold["input_token_logprobs"]] == pytest.approx(
        [e[0] for e in meta["input_token_logprobs"]], abs=1e-4)


def test_prefill_only_stream_grammar_and_errors(server) -> None:
    r = httpx.post(server.base_url + "/generate", json={"text": TEXT, "sampling_params": PREFILL, "stream": True},
                   timeout=60)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2
    last = orjson.loads(events[0])
    assert last["text"] == "" and last["meta_info"]["finish_reason"]["type"] == "length"
    # A constraint is compiled (a bad one is still refused) but nothing is generated.
    out = post(server, "/generate", {"text": TEXT, "sampling_params": {**PREFILL, "regex": "[0-9]+"}})
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 0
    assert "regex" in error(server, "/generate", {"text": TEXT, "sampling_params": {**PREFILL, "regex": "("}})["message"]
    # min_new_tokens must not exceed it.
    err = error(server, "/generate", {"text": TEXT, "sampling_params": {**PREFILL, "min_new_tokens": 1}})
    assert err["param"] == "sampling_params.min_new_tokens"


# ---------------------------------------------------------------- logprob shapes


def test_logprob_triples_and_text_only_when_asked(server, tiny_chat_model) -> None:
    ids = encode(tiny_chat_model, TEXT)
    tok = tokenizer(tiny_chat_model)
    body = {"text": TEXT, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    plain = post(server, "/generate", body)
    meta = plain["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, ids[0], None] and meta["input_top_logprobs"][0] is None
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert [e[1] for e in meta["output_token_logprobs"]] == plain["output_ids"]
    every = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    every += [e for top in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"] for e in top]
    assert all(e[2] is None for e in every)
    for (lp, t, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == t and math.isclose(top[0][0], lp, abs_tol=1e-5)  # greedy
        assert top[0][0] >= top[1][0] >= top[2][0]
    texted = post(server, "/generate", {**body, "return_text_in_logprobs": True})["meta_info"]
    assert [e[1] for e in texted["output_token_logprobs"]] == plain["output_ids"]
    assert [e[0] for e in texted["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in meta["output_token_logprobs"]], abs=1e-4)
    assert [e[2] for e in texted["input_token_logprobs"]] == [tok.decode([t]) for t in ids]
    assert [e[2] for e in texted["output_token_logprobs"]] == [tok.decode([t]) for t in plain["output_ids"]]
    assert all(e[2] == tok.decode([e[1]]) for top in texted["output_top_logprobs"] for e in top)
    # The stream's last event carries the same lists.
    r = httpx.post(server.base_url + "/generate", json={**body, "stream": True}, timeout=60)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = orjson.loads(events[-1])["meta_info"]
    assert [e[1] for e in streamed["output_token_logprobs"]] == plain["output_ids"]
    assert [e[1] for e in streamed["input_token_logprobs"]] == ids


def test_the_batches_select_sends(server, tiny_chat_model) -> None:
    """Exactly what ``RuntimeEndpoint.select`` sends: the prefix, the choices as a batch of
    texts from ``prompt_len - 2``, then the choices' tokens alone as ``input_ids``."""
    prefix = "Question: is the sky blue?\nAnswer:"
    choices = [" yes", " no", " it depends on the weather"]
    n = post(server, "/generate", {"text": prefix, "sampling_params": PREFILL})["meta_info"]["prompt_tokens"]
    start = max(n - 2, 0)
    batch = post(server, "/generate", {
        "text": [prefix + c for c in choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start,
    })
    assert len(batch) == len(choices)
    for c, r in zip(choices, batch, strict=True):
        ids = encode(tiny_chat_model, prefix + c)
        entries = r["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[start:] and r["meta_info"]["output_token_logprobs"] == []
        assert all(e[0] < 0 and e[2] == tokenizer(tiny_chat_model).decode([e[1]]) for e in entries)
    alone = [[e[1] for e in r["meta_info"]["input_token_logprobs"][1:]] for r in batch] + [[42]]
    unconditional = post(server, "/generate", {"input_ids": alone, "sampling_params": PREFILL, "return_logprob": True})
    # logprob_start_len -1: the last position only (None for a one-token prompt).
    for ids, r in zip(alone, unconditional, strict=True):
        entries = r["meta_info"]["input_token_logprobs"]
        assert len(entries) == 1 and entries[0][1:] == [ids[-1], None]
        assert (entries[0][0] is None) == (len(ids) == 1)


# ---------------------------------------------------------------- model info, fork joins


def test_model_info_and_concate_and_append(server, tiny_chat_model) -> None:
    info = httpx.get(server.base_url + "/get_model_info", timeout=30).json()
    assert info == httpx.get(server.base_url + "/model_info", timeout=30).json()
    assert info["model_path"] == tiny_chat_model and info["tokenizer_path"] == tiny_chat_model
    assert info["is_generation"] is True and info["preferred_sampling_params"] is None
    assert isinstance(info["weight_version"], str) and info["served_model_name"] == "tiny"
    assert info["context_length"] == 1024 and info["has_chat_template"] is True
    assert post(server, "/concate_and_append_request", {"src_rids": ["a", "b"], "dst_rid": "c"}) == {"success": True}


# ---------------------------------------------------------------- /apply_chat_template


def test_apply_chat_template_is_what_the_chat_route_renders(server, tiny_chat_model) -> None:
    tok = tokenizer(tiny_chat_model)
    out = post(server, "/apply_chat_template", {"messages": MESSAGES})
    assert out["text"] == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = encode(tiny_chat_model, out["text"])
    assert out["num_tokens"] == len(ids)
    assert post(server, "/flush_cache", {})["success"]
    chat = openai_client(server).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert chat.usage.prompt_tokens == out["num_tokens"]
    # The chat request cached its prompt: generating from the rendered text reuses it.
    meta = post(server, "/generate", {"text": out["text"], "sampling_params": PREFILL})["meta_info"]
    assert meta["cached_tokens"] == expected_cached_len(ids, [ids], page_size(server)) > 0
    # Continuing the last (assistant) message: no generation prompt, the text left open.
    cont = MESSAGES + [{"role": "assistant", "content": "The sky is"}]
    opened = post(server, "/apply_chat_template", {"messages": cont, "continue_final_message": True})
    assert opened["text"].endswith("The sky is") and opened["text"].startswith(out["text"])
    chat = openai_client(server).chat.completions.create(
        model="tiny", messages=cont, max_tokens=2, extra_body={"continue_final_message": True})
    assert chat.usage.prompt_tokens == opened["num_tokens"]
    closed = post(server, "/apply_chat_template", {"messages": MESSAGES, "add_generation_prompt": False})
    assert out["text"].startswith(closed["text"]) and len(closed["text"]) < len(out["text"])


@pytest.mark.parametrize("body, param, fragment", [
    ({"messages": []}, "messages", "'messages'"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'messages[0].role'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "needs content"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message", "assistant message"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set"),
    ({"messages": MESSAGES, "tools": []}, "tools", "'tools'"),
])
def test_apply_chat_template_refuses_bad_requests(server, body, param, fragment) -> None:
    err = error(server, "/apply_chat_template", body)
    assert err["param"] == param and fragment in err["message"], err
    assert post(server, "/apply_chat_template", {"messages": MESSAGES})["num_tokens"] > 0  # still serving


def test_a_model_without_chat_template_is_refused(tiny_chat_model) -> None:
    import copy

    tok = copy.copy(tokenizer(tiny_chat_model))
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template") as e:
        render_without_tools(tok, "auto", ApplyChatTemplateRequest.model_validate({"messages": MESSAGES}))
    assert e.value.param == "messages"


# ---------------------------------------------------------------- OpenAI prompt scoring


def test_completions_echo_scores_the_prompt_with_max_tokens_0(server, tiny_chat_model) -> None:
    ids = encode(tiny_chat_model, TEXT)
    client = openai_client(server)
    out = client.completions.create(model="tiny", prompt=TEXT, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    native = post(server, "/generate", {"input_ids": ids, "sampling_params": PREFILL, "return_logprob": True,
                                        "logprob_start_len": 0})["meta_info"]["input_token_logprobs"]
    assert lp.token_logprobs[1:] == pytest.approx([e[0] for e in native[1:]], abs=1e-4)
    two = client.completions.create(model="tiny", prompt=TEXT, max_tokens=0, echo=True, n=2)
    assert [c.text for c in two.choices] == [TEXT, TEXT] and two.usage.completion_tokens == 0
    chunks = list(client.completions.create(model="tiny", prompt=TEXT, max_tokens=0, echo=True, logprobs=2,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert chunks[-1].choices[0].finish_reason == "length"


def test_v1_loads_reports_what_the_scheduler_holds(server, tiny_chat_model) -> None:
    """SGLang's /v1/loads, which smg polls: idle, then with one request streaming (it runs,
    holds its prompt and output in KV, and generates), then idle again with the prompt cached
    (evictable: not in use); sections by ``include``; an unknown section is a 400."""
    post(server, "/flush_cache", {})

    def loads(include: str | None = None) -> dict[str, Any]:
        r = httpx.get(server.base_url + "/v1/loads", params={"include": include} if include else None, timeout=30)
        assert r.status_code == 200, r.text
        (load,) = r.json()["loads"]
        return load

    info = server_info(server)
    idle = loads()
    assert idle["dp_rank"] == 0 and idle["num_running_reqs"] == idle["num_waiting_reqs"] == 0
    assert idle["num_used_tokens"] == 0 and idle["token_usage"] == 0.0
    assert idle["max_total_num_tokens"] == info["max_total_num_tokens"] == idle["memory"]["token_capacity"]
    assert idle["max_running_requests"] == info["max_running_requests"]
    assert idle["disaggregation"] == {"mode": "null"} and idle["queues"]["waiting"] == 0
    assert set(loads("core")).isdisjoint({"memory", "disaggregation", "queues"})
    assert set(loads("core,memory")) - set(loads("core")) == {"memory"}
    err = httpx.get(server.base_url + "/v1/loads", params={"include": "core,gpu"}, timeout=30).json()["error"]
    assert err["param"] == "include" and "'gpu'" in err["message"]

    prompt = encode(tiny_chat_model, TEXT)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as s:
        lines = s.iter_lines()
        for _ in range(3):
            next(lines)
        busy = loads()
        time.sleep(1.1)  # a second poll, at least a second later, measures the generation rate
        rate = loads()["gen_throughput"]
    assert busy["num_running_reqs"] == 1 and busy["num_waiting_reqs"] == 0
    assert busy["num_used_tokens"] > len(prompt) and busy["num_total_tokens"] == busy["num_used_tokens"]
    assert busy["token_usage"] == round(busy["num_used_tokens"] / busy["max_total_num_tokens"], 4)
    assert rate > 0
    # The closed stream aborted the request: nothing runs, and what it cached is evictable.
    assert_eventually(lambda: loads()["num_running_reqs"] == 0, 20, "the abandoned request stops")
    after = loads()
    assert after["num_used_tokens"] == 0 and after["token_usage"] == 0.0
    assert after["total_prefill_uncached_tokens"] >= len(prompt)
