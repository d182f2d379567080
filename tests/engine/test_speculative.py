"""N-gram speculative decoding (``--speculative-algorithm ngram``, speculative/ngram.py).

The oracle is the same scheduler without speculation (and HF greedy for the tiny models):
greedy and seeded output must be the same tokens, with the same logprobs, on every path
(mixed batches, chunked prefill, page sizes, retraction, abort, penalties, grammars, stops,
tensor parallelism, HTTP).  The drafts' pages must be freed after every step.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import numpy as np
import pytest
from helpers.oracle import hf_greedy
from helpers.sched_driver import finish_dict, make_scheduler, run_until_idle, submit

from radixserve import config
from radixserve.cache.radix_tree import RadixCache
from radixserve.config import ServerArgs
from radixserve.speculative import (
    Proposer,
    SpecState,
    make_proposer,
    proposer_names,
    server_proposer,
    steps_carry_drafts,
)
from radixserve.speculative.ngram import NgramProposer, context_continuation, tree_continuation

NGRAM = {"speculative_algorithm": "ngram"}


def looping_prompts(n: int, seed: int, period: int = 7, repeats: int = 4, vocab: int = 256) -> list[list[int]]:
    """Prompts that repeat a short random phrase: their own text offers drafts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(6, vocab) for _ in range(period)]
        out.append([rng.randrange(6, vocab) for _ in range(rng.randint(2, 6))] + phrase * repeats)
    return out


def run_with_logprobs(sched: Any) -> dict[str, dict[str, Any]]:
    """Step to idle; per request its output ids, finish reason, logprobs and top logprobs."""
    results: dict[str, dict[str, Any]] = {}
    step = 0
    while sched.has_work:
        out = sched.step()
        check_drafts_freed(step, sched)
        step += 1
        for i, rid in enumerate(out.rids if out is not None else []):
            r = results.setdefault(rid, {"output_ids": [], "logprobs": [], "top": [], "finished": None})
            r["output_ids"] += out.new_ids[i]
            r["logprobs"] += out.logprobs[i] or []
            r["top"] += out.top_logprobs[i] or []
            r["finished"] = finish_dict(out.finished[i])
    assert sched.check_memory()["locked_tokens"] == 0
    return results


def check_drafts_freed(step: int, sched: Any) -> None:
    """After every step a running request holds no page past the one of its next token."""
    ps = sched.page_size
    for req in sched.running:
        assert req.spec is None or req.spec.draft == []
        assert req.kv.allocated_len <= -(-req.fill_len // ps) * ps, req
        assert req.kv.computed_len == req.fill_len - req.remaining_extend


def check_greedy_against_hf(folder: str, sched: Any, reqs: list[list[int]], max_new: int) -> dict[str, Any]:
    """Run greedy requests to idle (drafts freed after every step); each output is HF's.
    Returns the scheduler's stats."""
    rids = [submit(sched, p, max_new_tokens=max_new, ignore_eos=True) for p in reqs]
    results = run_until_idle(sched, on_step=check_drafts_freed)
    for rid, p in zip(rids, reqs, strict=True):
        assert results[rid]["output_ids"] == hf_greedy(folder, p, max_new), rid
    return sched.get_stats()


# ---- drafting -------------------------------------------------------------------------------


def test_context_continuation_takes_the_longest_latest_match() -> None:
    t = np.array([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7], dtype=np.int64)
    # Suffix [6, 7] occurs at 1 and 6; [x, 6, 7] with x = 4 never did before: the latest of the
    # longest (length 2) wins, and what followed it there is the draft.
    assert context_continuation(t, 1, 12, 3) == [3, 4, 6]
    assert context_continuation(t, 3, 12, 3) == []  # no 3-token match
    t2 = np.array([1, 2, 3, 9, 9, 1, 2, 3, 8, 0, 2, 3], dtype=np.int64)
    assert context_continuation(t2, 1, 12, 2) == [8, 0]  # [2, 3] at 6 is later than at 1
    t3 = np.array([1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3], dtype=np.int64)
    assert context_continuation(t3, 1, 12, 2) == [4, 0]  # [1, 2, 3] at 0 beats the later [2, 3]
    assert context_continuation(t3, 1, 2, 2) == [5, 1]  # with windows of 2 at most: the latest [2, 3]
    assert context_continuation(np.array([4, 4, 4, 4], dtype=np.int64), 1, 12, 5) == [4]
    assert context_continuation(np.array([7], dtype=np.int64), 1, 12, 5) == []


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_continuation_follows_the_tail_and_the_latest_branch(page_size: int) -> None:
    tree = RadixCache(page_size, lambda slots: None)
    a = list(range(10, 34))  # 24 tokens
    b = a[:12] + list(range(50, 62))
    tree.insert(a, np.arange(24, dtype=np.int64))
    tree.insert(b, np.arange(100, 124, dtype=np.int64))  # b is the latest: branch at token 12
    root = tree.root
    # From the root: a tail ending inside a run continues along that run.
    assert tree_continuation(root, np.array(a[:5], dtype=np.int64), page_size, 4) == a[5:9]
    # A tail ending at the branch point takes the most recently used child.
    tree.match_prefix(b)  # touch b's branch
    assert tree_continuation(root, np.array(a[:12], dtype=np.int64), page_size, 6) == b[12:18]
    tree.match_prefix(a)
    assert tree_continuation(root, np.array(a[:12], dtype=np.int64), page_size, 6) == a[12:18]
    # Starting below the root (a request's cached prefix ends at a node).
    node = tree.match_prefix(a[:8]).node
    assert tree_continuation(node, np.array(a[8:14], dtype=np.int64), page_size, 3) == a[14:17]
    # Not in the tree, or nothing after it.
    assert tree_continuation(root, np.array(a[:5] + [99], dtype=np.int64), page_size, 4) == []
    assert tree_continuation(root, np.array(a, dtype=np.int64), page_size, 4) == []
    assert tree_continuation(root, np.array(a[:22], dtype=np.int64), page_size, 9) == a[22:]


def test_spec_meta_is_sglangs() -> None:
    s = SpecState(verify_ct=4, proposed=10, accepted=6)
    assert s.meta(12) == {"spec_verify_ct": 4, "spec_accept_length": 3.0, "spec_accept_rate": 0.6,
                          "spec_num_proposed_drafts": 10, "spec_num_correct_drafts": 6}
    assert SpecState().meta(3) == {}


@pytest.mark.parametrize("settings,message", [
    ({"speculative_algorithm": "eagle"}, "speculative_algorithm must be one of ngram"),
    ({"speculative_num_draft_tokens": 1}, "speculative_num_draft_tokens must be an integer >= 2"),
    ({"speculative_ngram_min_match_window_size": 4, "speculative_ngram_max_match_window_size": 2}, "1 <= min <= max"),
    ({"speculative_disable_by_batch_size": 0}, "speculative_disable_by_batch_size must be a positive"),
])
def test_bad_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(**settings)


def test_the_registry_names_the_settings_algorithms() -> None:
    # config sits below speculative/ and keeps its own tuple for the settings check
    assert set(proposer_names()) == set(config.SPECULATIVE_ALGORITHMS)
    args = ServerArgs(speculative_algorithm="ngram", device="cpu").resolve()
    for name in proposer_names():
        assert isinstance(make_proposer(name, args), Proposer)
    with pytest.raises(ValueError, match="unknown speculative algorithm 'eagle'"):
        make_proposer("eagle", args)


def test_the_server_proposer_and_whether_steps_carry_drafts() -> None:
    on = ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=5,
                    disable_radix_cache=True, device="cpu").resolve()
    spec = server_proposer(on)
    assert isinstance(spec, NgramProposer)
    assert spec.max_drafts == 4 and spec.disable_by_batch_size == 4 and not spec.use_tree
    assert steps_carry_drafts(on)
    off = ServerArgs(device="cpu").resolve()
    assert server_proposer(off) is None and not steps_carry_drafts(off)


def test_settings_resolve() -> None:
    args = ServerArgs(speculative_algorithm="NGRAM", device="cpu").resolve()
    assert args.speculative_algorithm == "ngram"
    assert args.speculative_num_draft_tokens == 8 and args.speculative_disable_by_batch_size == 4
    off = ServerArgs(device="cpu").resolve()
    assert off.speculative_algorithm is None and off.speculative_num_draft_tokens is None


# ---- greedy output is unchanged -------------------------------------------------------------


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("llama", 4), ("qwen3-hd128", 1), ("qwen2", 16)])
def test_greedy_matches_hf_in_mixed_and_chunked_batches(tiny_model_dir, arch: str, page_size: int) -> None:
    folder = tiny_model_dir(arch)
    sched = make_scheduler(folder, page_size=page_size, max_prefill_tokens=40, chunked_prefill_size=16,
                           max_total_tokens=2048, **NGRAM)
    reqs = looping_prompts(4, seed=page_size) + [[random.Random(1).randrange(6, 256) for _ in range(45)]]
    stats = check_greedy_against_hf(folder, sched, reqs, 24)
    assert stats["mixed_steps"] > 0 and stats["spec_draft_tokens"] > 0
    assert stats["spec_verify_steps"] > 0
    assert 1.0 <= stats["spec_accept_length"] <= 8.0
    # Every generated token is counted once: the first from the prefill, the rest per verify.
    assert stats["generation_tokens"] == 5 * 24
    assert stats["spec_verify_steps"] + stats["spec_accepted_tokens"] == 5 * 23


def test_a_repeated_prompt_drafts_from_the_tree(tiny_model_dir) -> None:
    """The second request with the same prompt finds the first one's output in the tree and
    accepts every draft (greedy: the same tokens follow)."""
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=2048, **NGRAM)
    prompt = [random.Random(3).randrange(6, 256) for _ in range(20)]
    rid = submit(sched, prompt, max_new_tokens=40, ignore_eos=True)
    one = run_until_idle(sched, on_step=check_drafts_freed)[rid]
    before = sched.get_stats()
    rid = submit(sched, prompt, max_new_tokens=40, ignore_eos=True)
    two = run_until_idle(sched, on_step=check_drafts_freed)[rid]
    after = sched.get_stats()
    assert one["output_ids"] == two["output_ids"] == hf_greedy(folder, prompt, 40)
    meta = two["meta"]
    # 39 tokens after the first, 7 drafts per verify, all accepted: 5 verifies of 8 tokens.
    assert meta["spec_num_correct_drafts"] == meta["spec_num_proposed_drafts"] > 0
    assert meta["spec_verify_ct"] == 5 and meta["spec_accept_rate"] == 1.0
    assert after["spec_draft_tokens_from_tree"] - before["spec_draft_tokens_from_tree"] == meta["spec_num_proposed_drafts"]


def test_triton_backend_verifies_drafts_as_the_torch_backend(tiny_model_dir) -> None:
    """The GPU path's attention (Triton; its interpreter on a CPU) over verify extends of a
    16-token page: the same tokens as the torch backend, drafts accepted from the tree."""
    folder = tiny_model_dir("llama")
    prompt = [random.Random(5).randrange(6, 256) for _ in range(20)]
    outs = {}
    for backend in ("torch", "triton"):
        sched = make_scheduler(folder, attention_backend=backend, page_size=16, max_total_tokens=1024, **NGRAM)
        assert sched.runner.backend.name == backend
        outs[backend] = []
        for _ in range(2):
            rid = submit(sched, prompt, max_new_tokens=12, ignore_eos=True)
            outs[backend].append(run_until_idle(sched, on_step=check_drafts_freed)[rid]["output_ids"])
        assert sched.get_stats()["spec_accepted_tokens"] > 0  # the second run drafts from the first
    assert outs["torch"] == outs["triton"] and outs["torch"][0] == outs["torch"][1]


def test_no_drafts_above_the_batch_size_limit(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=2048, speculative_disable_by_batch_size=2, **NGRAM)
    reqs = looping_prompts(3, seed=4)
    for p in reqs:
        submit(sched, p, max_new_tokens=10, ignore_eos=True)
    run_until_idle(sched, on_step=check_drafts_freed)
    stats = sched.get_stats()
    # Three ran together the whole time (admitted in one step): no step could draft.
    assert stats["spec_draft_tokens"] == 0 and stats["spec_verify_steps"] == 3 * 9


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_with_drafts_matches_hf(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("qwen2")
    # ~25 prompt + 60 output tokens each outgrow a 200-token pool (admission reserves only
    # part of each request's future tokens): requests are retracted and recomputed.
    sched = make_scheduler(folder, page_size=page_size, max_total_tokens=200, max_running_requests=8, **NGRAM)
    reqs = looping_prompts(10, seed=11, period=5, repeats=4)
    stats = check_greedy_against_hf(folder, sched, reqs, 60)
    assert stats["retractions"] > 0 and stats["spec_accepted_tokens"] > 0


def test_abort_while_drafting_frees_everything(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=1024, **NGRAM)
    rids = [submit(sched, p, max_new_tokens=200, ignore_eos=True) for p in looping_prompts(2, seed=8)]

    def abort_midway(step: int, s: Any) -> None:
        check_drafts_freed(step, s)
        if step == 6:
            s.abort(rids[0])

    results = run_until_idle(sched, on_step=abort_midway)
    assert results[rids[0]]["finished"]["type"] == "abort"
    assert len(results[rids[1]]["output_ids"]) == 200
    assert sched.check_memory()["request_pages"] == 0


# ---- sampled output keeps the model's distribution ------------------------------------------


def test_seeded_sampling_penalties_and_logprobs_are_unchanged(tiny_model_dir) -> None:
    """Each position draws the uniform it would draw without drafts, so a seeded request's
    tokens and logprobs are the same (the rejection-sampling rule of a deterministic draft)."""
    folder = tiny_model_dir("llama")
    reqs = looping_prompts(4, seed=21)
    params = [
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 20, "frequency_penalty": 0.5},
        {"temperature": 0.5, "min_p": 0.1, "repetition_penalty": 1.3},
        {"temperature": 0.8, "presence_penalty": 0.4, "min_new_tokens": 30},
    ]
    outs = {}
    for spec in (False, True):
        sched = make_scheduler(folder, max_total_tokens=2048, **(NGRAM if spec else {}))
        outs[spec] = []
        # Twice: the second round drafts from the first round's outputs in the tree (the same
        # seeds draw the same tokens, so those drafts are accepted).
        for _ in range(2):
            rids = [
                submit(sched, p, {"return_logprob": True, "top_logprobs_num": 2}, max_new_tokens=32,
                       ignore_eos=i != 3, **params[i])
                for i, p in enumerate(reqs)
            ]
            results = run_with_logprobs(sched)
            outs[spec] += [results[r] for r in rids]
        if spec:
            assert sched.get_stats()["spec_accepted_tokens"] > 0
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["finished"] == b["finished"]
        assert len(a["logprobs"]) == len(a["output_ids"]) == len(b["logprobs"])
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-4, atol=1e-4)
        assert [[t for t, _ in row] for row in a["top"]] == [[t for t, _ in row] for row in b["top"]]
    assert len(outs[True][3]["output_ids"]) >= 30  # min_new_tokens held with drafts


def test_host_tier_with_drafts_matches_hf(tiny_model_dir) -> None:
    """A pool too small for the prompts: prefixes move to the host tier and back, drafts come
    from the tree (device and host nodes alike) and the output is HF's."""
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=200, host_cache_size=1024, **NGRAM)
    reqs = looping_prompts(3, seed=31, period=9, repeats=5)
    for _ in range(2):  # the second round finds the first round's text on the host
        stats = check_greedy_against_hf(folder, sched, reqs, 40)
    assert stats["demoted_tokens"] > 0 and stats["spec_draft_tokens_from_tree"] > 0


def test_tensor_parallel_with_drafts_equals_one_rank(tiny_model_dir, default_model_path) -> None:
    import os
    import shutil

    from radixserve import Engine

    folder = tiny_model_dir("llama")
    for name in os.listdir(default_model_path):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(default_model_path, name), folder)
    prompts = looping_prompts(3, seed=41)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 30}
    outs = []
    for tp, spec in ((1, {}), (2, NGRAM)):
        with Engine(folder, dtype="float32", tp_size=tp, max_total_tokens=2048, **spec) as eng:
            for _ in range(2):  # the second round drafts from the tree
                outs.append(eng.generate(input_ids=prompts, sampling_params=params, progress=False,
                                         return_logprob=True))
            stats = eng.get_stats()
            assert eng.check_memory()["ok"]
    assert stats["spec_accepted_tokens"] > 0
    for a, b in zip(outs[:2], outs[2:], strict=True):
        assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose([e[0] for e in x["meta_info"]["output_token_logprobs"]],
                                       [e[0] for e in y["meta_info"]["output_token_logprobs"]], rtol=1e-4, atol=1e-4)


# ---- the default model: grammars, stop strings, HTTP ----------------------------------------

CODE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''


@pytest.fixture(scope="module")
def tok(default_model_path: str) -> Any:
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def default_pair(default_model_path: str, tok: Any, **settings: Any) -> tuple[Any, Any]:
    return (make_scheduler(default_model_path, tok, max_total_tokens=8192, **settings),
            make_scheduler(default_model_path, tok, max_total_tokens=8192, **settings, **NGRAM))


@pytest.fixture(scope="module")
def pair(default_model_path: str, tok: Any) -> tuple[Any, Any]:
    """A plain and an n-gram scheduler of the default model at the server's defaults, shared by
    the tests below: each compares the two over its own requests (both see the same ones)."""
    return default_pair(default_model_path, tok)


def chat_ids(tok: Any, text: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_default_model_copies_code_faster_with_the_same_tokens(pair, tok) -> None:
    plain, spec = pair
    prompt = chat_ids(tok, "Rewrite this Python code exactly, with the same names:\n" + CODE)
    outs, steps = [], []
    for sched in (plain, spec):
        before = sched.get_stats()["forward_steps"]
        rid = submit(sched, prompt, max_new_tokens=60)
        outs.append(run_until_idle(sched, on_step=check_drafts_freed)[rid])
        steps.append(sched.get_stats()["forward_steps"] - before)
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    meta = outs[1]["meta"]
    # Copying text from the prompt: most drafts are accepted, several tokens per forward.
    assert meta["spec_num_correct_drafts"] > 20 and meta["spec_accept_length"] > 1.5
    assert steps[1] < steps[0], steps


def test_stop_strings_and_token_ids_cut_inside_accepted_drafts(pair, tok) -> None:
    plain, spec = pair
    prompt = chat_ids(tok, "Rewrite this Python code exactly:\n" + CODE)
    width = tok.encode(" width")[0]
    cases = [{"stop": ["perimeter"]}, {"stop_token_ids": [width]}, {"stop": ["* h"], "no_stop_trim": True}]
    for params in cases:
        outs = []
        for sched in (plain, spec):
            rid = submit(sched, prompt, max_new_tokens=80, **params)
            outs.append(run_until_idle(sched, on_step=check_drafts_freed)[rid])
        assert outs[0]["output_ids"] == outs[1]["output_ids"], params
        assert outs[0]["finished"] == outs[1]["finished"] and outs[1]["finished"]["type"] == "stop", params


# With jump-forward (the server's default) in the default run; without it with -m slow.
@pytest.mark.parametrize("jump", [pytest.param(False, marks=pytest.mark.slow, id="no-jump-forward"),
                                  pytest.param(True, id="jump-forward")])
def test_grammar_drafts_stay_inside_the_grammar(default_model_path, tok, pair, jump: bool) -> None:
    """A JSON array of repeated objects: its keys recur, so the request's own text offers
    drafts; only what the grammar accepts is proposed, and the output is the same."""
    import json

    schema = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "country": {"type": "string", "maxLength": 12}}}}
    prompt = chat_ids(tok, "List three European capitals with their countries as JSON.")
    plain, spec = pair if jump else default_pair(default_model_path, tok, disable_jump_forward=True)
    outs = []
    for sched in (plain, spec):
        rid = submit(sched, prompt, max_new_tokens=120, json_schema=json.dumps(schema))
        outs.append(run_until_idle(sched, on_step=check_drafts_freed)[rid])
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    value = json.loads(tok.decode(outs[1]["output_ids"], skip_special_tokens=True))
    assert len(value) == 3 and all(set(v) == {"city", "country"} for v in value)
    assert outs[1]["meta"]["spec_num_correct_drafts"] > 0


def test_valid_prefix_cuts_a_draft_at_the_first_token_the_grammar_refuses(default_model_path, tok) -> None:
    from radixserve.grammar import GrammarCompiler, RequestGrammar

    compiler = GrammarCompiler(tok, 49152, [2])
    g = RequestGrammar(compiler.compile_now(("regex", "[a-c]{4}x")), [2])
    ids = [tok.encode(c)[0] for c in "abcax"]
    assert g.valid_prefix(ids) == 5
    assert g.valid_prefix(ids + [2]) == 5  # the stop token that ends the grammar is not drafted
    assert g.valid_prefix(ids[:2] + [tok.encode("z")[0]] + ids[2:]) == 2
    assert g.num_accepted == 0 and g.valid_prefix(ids[:3]) == 3  # the matcher's state is unchanged
    compiler.shutdown()


def test_http_server_with_ngram(default_model_path) -> None:
    from helpers.server import check_memory_idle, openai_client, serving

    with serving(default_model_path, "--speculative-algorithm", "ngram", "--dtype", "float32",
                 "--max-total-tokens", "8192") as srv:
        client = openai_client(srv)
        messages = [{"role": "user", "content": "Rewrite this Python code exactly:\n" + CODE}]
        full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(model="tiny", messages=messages, max_tokens=48,
                                                    temperature=0, stream=True)
            if c.choices
        )
        assert streamed == full.choices[0].message.content
        assert "def perimeter(width, height)" in streamed and full.choices[0].finish_reason == "stop"
        ids = [int(t) for t in np.random.default_rng(0).integers(100, 2000, 12)] * 4
        r = httpx.post(srv.base_url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}},
            timeout=60).json()
        assert r["output_ids"] == hf_greedy(default_model_path, ids, 24)
        meta = r["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] == 24 / meta["spec_verify_ct"]
        info = httpx.get(srv.base_url + "/server_info", timeout=30).json()
        assert info["speculative_algorithm"] == "ngram" and info["server_args"]["speculative_num_draft_tokens"] == 8
        assert info["stats"]["spec_verify_steps"] > 0
        metrics = httpx.get(srv.base_url + "/metrics", timeout=30).text
        assert "radixserve:spec_accept_length" in metrics
        check_memory_idle(srv)
