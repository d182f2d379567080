"""The program API over both backends (an in-process Engine and a real server), tiny chat model.

Each program's results are checked against the same calls made by hand, ``select`` against
transformers' float32 logprobs, and the cache counters against the workload's unique tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers.choices_oracle import decide
from helpers.server import memory_checked_after_each_test, tiny_chat_server, wait_idle

from radixserve.program import (
    EngineBackend,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    greedy_token_selection,
    select,
    system,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
)

FLAGS = ("--max-total-tokens", "16384", "--context-length", "2048")
server = tiny_chat_server(*FLAGS)
memory_invariant = memory_checked_after_each_test("server")

DOC = ("The lighthouse keeper climbed the stairs every evening, trimmed the wick, polished the lens "
       "and wrote the weather in a book that nobody read. ") * 6
GREEDY = {"temperature": 0}
METHODS = [token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized]


@pytest.fixture(scope="module")
def engine(tiny_chat_model: str) -> Iterator[Any]:
    from radixserve import Engine

    with Engine(tiny_chat_model, max_total_tokens=16384, context_length=2048, dtype="float32") as eng:
        yield eng


@pytest.fixture(params=["engine", "http"])
def backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "engine":
        return EngineBackend(request.getfixturevalue("engine"))
    return RuntimeEndpoint(request.getfixturevalue("server").base_url)


@pytest.fixture(autouse=True)
def engine_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        report = request.getfixturevalue("engine").check_memory()
        assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0, report


def by_hand(backend: Any, text: str, max_new_tokens: int) -> str:
    return backend.generate(text, {"max_new_tokens": max_new_tokens, **GREEDY})["text"]


@function
def story(s: Any, opening: str) -> None:
    s += opening
    s += gen("first", max_tokens=6, temperature=0)
    s += " Then"
    s += gen("second", max_tokens=5, temperature=0, stop=["\n"])


def test_gen_equals_the_same_calls_by_hand(backend: Any) -> None:
    state = story.run(opening="Once upon a time", backend=backend)
    first = by_hand(backend, "Once upon a time", 6)
    second = backend.generate("Once upon a time" + first + " Then",
                              {"max_new_tokens": 5, "stop": ["\n"], **GREEDY})["text"]
    assert state["first"] == first and state["second"] == second
    assert state.text() == "Once upon a time" + first + " Then" + second
    meta = state.get_meta_info("second")
    assert meta["completion_tokens"] >= 1 and meta["prompt_tokens"] > 0


@function
def chat_turn(s: Any, question: str) -> None:
    s += system("You answer in one word.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8, temperature=0))


def test_roles_render_as_the_chat_api_does(backend: Any) -> None:
    state = chat_turn.run(question="Colour of the sky?", backend=backend)
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Colour of the sky?"}]
    asked = backend.render_chat(messages, True)
    assert state.text().startswith(asked + state["answer"])
    assert state["answer"] == by_hand(backend, asked, 8)
    full = [*messages, {"role": "assistant", "content": state["answer"]}]
    assert state.messages() == full
    assert state.text() == backend.render_chat(full, False)


def test_programs_agree_across_backends(engine: Any, server: Any) -> None:
    results = []
    for be in (EngineBackend(engine), RuntimeEndpoint(server.base_url)):
        s1 = story.run(opening="The ship", backend=be)
        s2 = chat_turn.run(question="Best fruit?", backend=be)
        results.append((s1.text(), s1.variables(), s2.text(), s2.messages()))
    assert results[0] == results[1]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_select_matches_transformers(backend: Any, tiny_chat_model: str, method: Any) -> None:
    prompt = "Question: which animal says moo?\nAnswer:"
    choices = [" cow", " horse that neighs", " cat", "dog"]

    @function
    def pick(s: Any) -> None:
        s += prompt
        s += select("animal", choices=choices, choices_method=method)

    state = pick.run(backend=backend)
    expected, scores = decide(tiny_chat_model, prompt, choices, method.name)
    assert state["animal"] == expected
    assert state.text() == prompt + expected
    meta = state.get_meta_info("animal")
    assert meta["choices"] == choices and meta["method"] == method.name
    assert meta["normalized_prompt_logprobs"][0] == pytest.approx(decide(tiny_chat_model, prompt, choices,
                                                                         "token_length_normalized")[1][0], abs=1e-3)
    if method is not greedy_token_selection:
        assert meta["scores"] == pytest.approx(scores, abs=1e-3)
    # The prompt was computed once: every choice was served it from the cache, up to the
    # position whose logits score the prompt's last token (recomputed for its logprob).
    assert all(c == meta["prompt_tokens"] - 2 for c in meta["cached_tokens"])


def test_gen_with_choices_is_a_select(backend: Any) -> None:
    @function
    def pick(s: Any) -> None:
        s += "Yes or no?"
        s += gen("answer", choices=[" yes", " no"])

    assert pick.run(backend=backend)["answer"] in (" yes", " no")


def test_fork_branches_share_the_parent_prefix(backend: Any) -> None:
    @function
    def branches(s: Any) -> None:
        s += DOC
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"\nQuestion {i}:"
            f += gen("q", max_tokens=4, temperature=0)
        forks.join()
        s += "\nSummary:" + gen("summary", max_tokens=4, temperature=0)
        s.forks = forks  # for the test to read

    state = branches.run(backend=backend)
    parent_tokens = backend.generate(DOC, {"max_new_tokens": 0})["meta_info"]["prompt_tokens"]
    for i, f in enumerate(state.forks):
        assert f["q"] == by_hand(backend, DOC + f"\nQuestion {i}:", 4)
        assert f.get_meta_info("q")["cached_tokens"] >= parent_tokens - 1
        assert f.text() == DOC + f"\nQuestion {i}:" + f["q"]
    assert state.text() == DOC + "\nSummary:" + state["summary"]


def test_join_concatenates_branches(backend: Any) -> None:
    @function
    def gather(s: Any) -> None:
        s += "List:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" item{i}"
        forks.join(mode="concate_and_append")

    assert gather.run(backend=backend).text() == "List: item0 item1"


def test_run_batch_computes_a_shared_prefix_once(engine: Any) -> None:
    @function
    def ask(s: Any, q: str) -> None:
        s += DOC + f"\nQuestion: {q}\nAnswer:"
        s += gen("a", max_tokens=3, temperature=0)

    questions = ["who?", "what?", "where?", "when?", "why?", "how?"]
    assert engine.flush_cache()
    before = engine.get_stats()["prefill_tokens_computed"]
    states = ask.run_batch([{"q": q} for q in questions], backend=EngineBackend(engine), progress_bar=True)
    computed = engine.get_stats()["prefill_tokens_computed"] - before
    prompts = [engine.tokenizer.encode(DOC + f"\nQuestion: {q}\nAnswer:", add_special_tokens=False)
               for q in questions]
    unique = len({tuple(ids[: i + 1]) for ids in prompts for i in range(len(ids))})
    assert unique <= computed <= 1.1 * unique, (computed, unique)
    for q, st in zip(questions, states, strict=True):
        assert st.error is None and st["a"] == by_hand(EngineBackend(engine), DOC + f"\nQuestion: {q}\nAnswer:", 3)


def test_stream_iterates_a_variable(backend: Any) -> None:
    @function
    def tell(s: Any) -> None:
        s += "Once upon a time"
        s += gen("story", max_tokens=12, temperature=0, ignore_eos=True)
        s += " The end."

    state = tell.run(backend=backend, stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == state["story"]
    assert "".join(state.text_iter()) == state.text() == "Once upon a time" + state["story"] + " The end."
    assert state["story"] == by_hand(backend, "Once upon a time", 12)


def test_run_defaults_apply_to_gens_that_set_nothing(backend: Any) -> None:
    @function
    def short(s: Any) -> None:
        s += "Count:"
        s += gen("n")

    state = short.run(backend=backend, max_new_tokens=3, temperature=0, ignore_eos=True)
    assert state.get_meta_info("n")["completion_tokens"] == 3
    assert state["n"] == by_hand(backend, "Count:", 3)


# ---------------------------------------------------------------- bad programs


def test_bad_programs_raise_value_error_in_the_caller(backend: Any) -> None:
    with pytest.raises(ValueError, match="non-empty list of choices"):
        select("x", choices=[])
    with pytest.raises(ValueError, match="one constraint"):
        gen("x", regex="a+", json_schema={"type": "string"})

    @function
    def unknown(s: Any) -> None:
        s += "Hi" + gen("a", max_tokens=2)
        s["b"]  # noqa: B018 - the read raises

    with pytest.raises(ValueError, match="no variable 'b'"):
        unknown.run(backend=backend)

    @function
    def bad_regex(s: Any) -> None:
        s += "Number:" + gen("n", max_tokens=4, regex="([0-9")

    with pytest.raises(ValueError, match="regex"):
        bad_regex.run(backend=backend)
    # The backend still serves.
    assert story.run(opening="Again", backend=backend)["first"] == by_hand(backend, "Again", 6)


def test_run_batch_reports_a_failed_item_and_finishes_the_others(backend: Any) -> None:
    @function
    def maybe(s: Any, regex: str) -> None:
        s += "Digits:" + gen("d", max_tokens=3, regex=regex, temperature=0)

    states = maybe.run_batch([{"regex": "[0-9]+"}, {"regex": "(["}, {"regex": "[a-c]+"}], backend=backend)
    assert states[1].error is not None and isinstance(states[1].error, ValueError)
    with pytest.raises(ValueError):
        states[1].text()
    assert states[0].error is None and states[0]["d"].isdigit()
    assert states[2].error is None and set(states[2]["d"]) <= set("abc")


def test_http_backend_reports_server_state(server: Any) -> None:
    be = RuntimeEndpoint(server.base_url)
    assert be.model_info["model_path"]
    wait_idle(server)
    assert be.flush_cache()
    assert be.get_stats()["running"] == 0
    with pytest.raises(RuntimeError, match="cannot reach"):
        RuntimeEndpoint("http://127.0.0.1:1")


# ---------------------------------------------------------------- the default model


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_select_on_the_default_model_matches_transformers(default_engine: Any, default_model_path: str,
                                                          method: Any) -> None:
    @function
    def sentiment(s: Any, review: str) -> None:
        s += user(f"Review: {review}\nIs this review positive, negative or mixed? Answer with one word.")
        s += assistant(select("label", choices=["positive", "negative", "mixed", "unclear"],
                              choices_method=method))

    review = "The food was cold and the waiter was rude; we will not come back."
    state = sentiment.run(review=review, backend=EngineBackend(default_engine))
    prompt = state.text()[: len(state.text()) - len(state["label"]) - len(_assistant_closing(default_engine))]
    expected, scores = decide(default_model_path, prompt, ["positive", "negative", "mixed", "unclear"], method.name)
    assert state["label"] == expected
    if method is not greedy_token_selection:
        assert state.get_meta_info("label")["scores"] == pytest.approx(scores, abs=2e-3)


def _assistant_closing(engine: Any) -> str:
    """What the chat template writes after an assistant message's content."""
    msgs = [{"role": "user", "content": "x"}]
    full = engine.apply_chat_template([*msgs, {"role": "assistant", "content": "MARK"}], add_generation_prompt=False)
    return full[full.index("MARK") + len("MARK"):]


@pytest.fixture(scope="module")
def default_engine() -> Iterator[Any]:
    from radixserve import Engine

    with Engine(max_total_tokens=8192, dtype="float32") as eng:
        yield eng
