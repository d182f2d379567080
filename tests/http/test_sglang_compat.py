"""SGLang's own frontend language, unchanged (``sglang.RuntimeEndpoint``, ``sgl.function``,
``gen``, ``select``, ``fork``, ``run_batch``, streaming), against a real ``radixserve serve``.

Needs the ``sglang`` client package; its server side is never imported.  Without it the
module is skipped (it fails under ``CI``, where it must run).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from helpers.assertions import assert_eventually, expected_cached_len
from helpers.oracle import hf_greedy
from helpers.server import ServerProcess
from helpers.sglang_oracle import select_decision

SGLANG_INSTALL = ("pip install --no-deps sglang==0.5.23 pybase64 msgspec ipython traitlets aiohttp "
                  "multidict yarl propcache aiohappyeyeballs aiosignal frozenlist")
# The server's environment: as it was before sglang's import, which sets cache folders
# (TRITON_CACHE_DIR, ...) for its own server, and without the PYTHONPATH entries that only
# hold the client and its dependencies (their versions must not shadow the server's).
_ENV_BEFORE_SGLANG = dict(os.environ)
_CLIENT_PACKAGES = ("sglang", "msgspec", "pybase64", "aiohttp", "IPython", "traitlets", "multidict", "yarl",
                    "propcache", "aiohappyeyeballs", "aiosignal", "frozenlist")

try:
    import sglang as sgl
    from sglang.lang.choices import ChoicesSamplingMethod
except ImportError as e:
    message = f"the sglang client is not installed ({e}); install it with: {SGLANG_INSTALL}"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)

KEY = "sk-sglang-compat"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0}
DOC = ("Radix trees store strings by their shared prefixes. A serving engine keeps the keys and "
       "values of every prompt it has computed in such a tree, so that the next request that "
       "starts the same way reads them back instead of computing them again. ")


def server_env() -> dict[str, str]:
    env = dict(_ENV_BEFORE_SGLANG)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and not any(os.path.exists(os.path.join(p, name)) for name in _CLIENT_PACKAGES)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@pytest.fixture(scope="module")
def server(tiny_chat_model: str) -> Iterator[ServerProcess]:
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", "--api-key", KEY,
                        "--max-total-tokens", "8000", "--context-length", "1024", base_env=server_env())
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def backend(server: ServerProcess) -> Any:
    return sgl.RuntimeEndpoint(server.base_url, api_key=KEY)


@pytest.fixture(scope="module")
def tok(tiny_chat_model: str) -> Any:
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(tiny_chat_model)


def info(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.base_url + "/server_info", headers=AUTH, timeout=30).json()


@pytest.fixture(autouse=True)
def memory_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: the server idle, its KV memory invariant holds, no lock, no page held."""
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        assert_eventually(lambda: info(srv)["stats"]["running"] == 0 == info(srv)["stats"]["waiting"], 20,
                          "the server is idle")
        memory = info(srv)["memory"]
        assert memory["ok"] and memory["locked_tokens"] == 0 and memory["request_pages"] == 0, memory


def server_greedy(server: ServerProcess, prompt: str, max_new_tokens: int, **params: Any) -> dict[str, Any]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY, **params}}
    r = httpx.post(server.base_url + "/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- programs


@sgl.function
def qa(s, question: str) -> None:
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=12, **GREEDY)


# The tiny random model repeats its last token when greedy: a regex makes its output words.
WORDS = r"[a-z]{1,4}( [a-z]{1,4}){3}"


@sgl.function
def words_until(s, question: str, stop_at: str) -> None:
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=12, regex=WORDS, stop=stop_at, return_logprob=True, top_logprobs_num=2,
                 return_text_in_logprobs=True, **GREEDY)


@sgl.function
def constrained(s, schema: str) -> None:
    s += "Give three digits: " + sgl.gen("digits", regex=r"[0-9]{3}", max_tokens=8, **GREEDY)
    s += "\nA number: " + sgl.gen("number", dtype=int, max_tokens=6, **GREEDY)
    s += "\nA record: " + sgl.gen("record", json_schema=schema, max_tokens=64, **GREEDY)


@sgl.function
def pick(s, choices: list[str], method: ChoicesSamplingMethod) -> None:
    s += "Q: Which planet is the largest in the solar system?\nA:"
    s += sgl.select("answer", choices=choices, choices_method=method)


@sgl.function
def branches(s, join_mode: str, seen: list) -> None:
    s += DOC
    # fork() caches the parent with a prefill-only call if the parent's text is already
    # applied when it looks (the client applies it on another thread): wait for that.
    s.sync()
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Point {i + 1}:" + sgl.gen("point", max_tokens=4, **GREEDY)
    seen.extend((f.text(), f.get_meta_info("point")) for f in forks)
    forks.join(join_mode)
    s += "\nSummary:" + sgl.gen("summary", max_tokens=3, **GREEDY)


# ---------------------------------------------------------------- tests


def test_gen_equals_the_servers_greedy_output_and_stops(server, backend, tok, tiny_chat_model) -> None:
    question = "What do radix trees store?"
    state = qa.run(question=question, backend=backend)
    prompt = "Q: " + question + "\nA:"
    ref = server_greedy(server, prompt, 12)
    assert state["answer"] == ref["text"] and state.text() == prompt + ref["text"]
    assert ref["output_ids"] == hf_greedy(tiny_chat_model, tok.encode(prompt, add_special_tokens=False), 12)
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 12 and meta["finish_reason"]["type"] == "length"
    # A stop string cuts the text before it; the logprobs SGLang asked for come in its shape.
    words = server_greedy(server, prompt, 12, regex=WORDS)
    assert " " in words["text"][1:], words
    cut = words_until.run(question=question, stop_at=" ", backend=backend)
    assert cut["answer"] == words["text"][: words["text"].index(" ", 1)]
    meta = cut.get_meta_info("answer")
    assert meta["finish_reason"] == {"type": "stop", "matched": " "}
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == words["output_ids"][: len(lps)] and len(lps) == meta["completion_tokens"]
    assert all(e[2] == tok.decode([e[1]]) and len(top) == 2 and top[0][1] == e[1]
               for e, top in zip(lps, meta["output_top_logprobs"], strict=True))


def test_regex_int_and_json_schema(backend) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    state = constrained.run(schema=json.dumps(schema), backend=backend)
    assert re.fullmatch(r"[0-9]{3}", state["digits"]), state["digits"]
    assert re.fullmatch(r"[-+]?[0-9]+", state["number"]), state["number"]
    jsonschema.validate(json.loads(state["record"]), schema)


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_select_decides_as_hf_logprobs_say(backend, tok, tiny_chat_model, method: str) -> None:
    choices = [" Jupiter", " Mars", " the planet Saturn", " Earth"]
    state = pick.run(choices=choices, method=getattr(sgl, method), backend=backend)
    prompt = "Q: Which planet is the largest in the solar system?\nA:"
    expected, scores = select_decision(tiny_chat_model, tok, prompt, choices, method)
    ranked = sorted(scores, reverse=True)
    assert ranked[0] - ranked[1] > 1e-3, f"a near tie would make the test meaningless: {scores}"
    assert state["answer"] == expected
    meta = state.get_meta_info("answer")
    key = ("normalized_unconditional_prompt_logprobs" if method == "unconditional_likelihood_normalized"
           else "normalized_prompt_logprobs")
    assert meta[key] == pytest.approx(scores, abs=1e-4)
    # The choices' shared prompt positions got the same logprob in every row of the batch
    # (greedy_token_selection compares them for equality).
    rows = meta["input_token_logprobs"]
    shared = min(len(r) for r in rows)
    for j in range(shared):
        if len({r[j][1] for r in rows}) == 1:
            assert len({r[j][0] for r in rows}) == 1, (j, rows)


@pytest.mark.parametrize("join_mode", ["gather_variable", "concate_and_append"])
def test_fork_branches_read_the_parent_from_the_cache(server, backend, tok, join_mode: str) -> None:
    assert sgl.flush_cache(backend) is None  # the client raises on failure
    seen: list[tuple[str, dict[str, Any]]] = []
    state = branches.run(join_mode=join_mode, seen=seen, backend=backend)
    page = info(server)["model_info"]["page_size"]
    parent = tok.encode(DOC, add_special_tokens=False)
    assert len(seen) == 3
    for i, (text, meta) in enumerate(seen):
        assert text.startswith(DOC + f"Point {i + 1}:") and meta["completion_tokens"] == 4
        prompt = tok.encode(DOC + f"Point {i + 1}:", add_special_tokens=False)
        assert meta["prompt_tokens"] == len(prompt)
        # The fork cached the parent (a prefill-only call) before the branches ran.
        assert meta["cached_tokens"] >= expected_cached_len(prompt, [parent], page) >= len(parent) - 1 - page
    # The parent goes on after the join; concate_and_append put the branches' text in it.
    text = state.text()
    assert all((t[len(DOC):] in text) == (join_mode == "concate_and_append") for t, _ in seen)
    before = tok.encode(text[: len(text) - len(state["summary"])], add_special_tokens=False)
    in_tree = [parent] + [tok.encode(t, add_special_tokens=False) for t, _ in seen]
    summary = state.get_meta_info("summary")
    assert summary["prompt_tokens"] == len(before)
    assert summary["cached_tokens"] >= expected_cached_len(before, in_tree, page) >= len(parent) - 1 - page


def test_run_batch_and_stream(server, backend) -> None:
    questions = ["What is a prefix?", "Why cache keys and values?", "What is a page?"]
    states = qa.run_batch([{"question": q} for q in questions], backend=backend, progress_bar=False)
    for q, state in zip(questions, states, strict=True):
        assert state["answer"] == server_greedy(server, "Q: " + q + "\nA:", 12)["text"]
    state = qa.run(question=questions[0], stream=True, backend=backend)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"] == states[0]["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] == 12


def test_flush_cache_and_server_info(server, backend) -> None:
    qa.run(question="Anything cached?", backend=backend).sync()  # run() returns before the request ends
    assert info(server)["stats"]["tree_tokens"] > 0
    assert sgl.flush_cache(backend) is None  # the client raises on failure
    assert info(server)["stats"]["tree_tokens"] == 0
    got = sgl.get_server_info(backend)
    assert got["model"] == "tiny" and got["model_info"]["context_length"] == 1024
    assert backend.get_model_name() == backend.model_info["model_path"] and backend.model_info["is_generation"]


def test_without_the_key_the_client_is_refused(server) -> None:
    with pytest.raises(RuntimeError, match="authentication_error"):
        sgl.RuntimeEndpoint(server.base_url)
