"""Sampling: parameter validation, penalties, logprobs, filters, seeded reproducibility."""

from __future__ import annotations

import math

import orjson
import pytest
import torch

from radixserve import cpu_ext
from radixserve.sampling import (
    SamplingBatch,
    SamplingParams,
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    count_tokens,
    counter_uniform,
    draw_seed,
    pad_token_ids,
    sample,
    sampler,
)
from radixserve.sampling.sampler import CANDIDATES

P = SamplingParams


@pytest.fixture(params=["cpu_kernel", "torch"])
def draw_path(request, monkeypatch):
    """A draw test through each path: the C++ kernel (cpu_ext/sampler.cpp, what a CPU runs) and
    the torch candidates (what a GPU runs)."""
    if request.param == "torch":
        monkeypatch.setattr(sampler, "_native_ops", lambda logits: None)
    else:
        assert cpu_ext.load() is not None, "the CPU kernels did not build"
    return request.param


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setattr(sampler, "_native_ops", lambda logits: None)


def _draw(
    params: list[SamplingParams],
    logits: torch.Tensor,
    seeds: list[int] | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    **kwargs,
):
    n, vocab = logits.shape
    batch = SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(n)),
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts,
        vocab,
        "cpu",
    )
    return sample(logits, batch, **kwargs)


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", -3),
        ("max_new_tokens", 10.0),
        ("max_new_tokens", True),
        ("max_new_tokens", "8"),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "1"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3),
        ("presence_penalty", -3),
        ("stop", 5),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", 5),
        ("stop_token_ids", [1, -1]),
        ("stop_token_ids", [1, 2.0]),
        ("stop_token_ids", [True]),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
        ("seed", 2**64),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("no_stop_trim", "false"),
        ("n", 2),
        ("n", 0),
        ("n", 1.0),
        ("stop_regex", "[0-9]+"),
        ("stop_regex", ["a+"]),
        ("spaces_between_special_tokens", False),
        ("spaces_between_special_tokens", "yes"),
    ],
)
def test_bad_values_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_sglang_frontend_sampling_params_are_accepted():
    """What SGLang's frontend sends for a plain gen (``to_srt_kwargs`` plus its two decoding
    flags): unset features as null, empty tuples (JSON lists) or their no-op value."""
    sent = {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 0,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
        "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
        "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None,
    }
    p = SamplingParams.from_dict(sent)
    assert p.max_new_tokens == 0 and p.temperature == 0.0 and p.stop == [] and p.grammar is None
    assert "n" not in p.to_dict() and "stop_regex" not in p.to_dict()
    assert SamplingParams.from_dict({"n": None, "stop_regex": "", "spaces_between_special_tokens": None}) == P()


def test_unknown_key_rejected_with_valid_names():
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"temprature": 0.5})
    message = str(err.value)
    assert "temprature" in message
    assert "temperature" in message and "max_new_tokens" in message


def test_defaults_none_and_normalisation():
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()
    p = SamplingParams.from_dict({"temperature": 0, "stop": "END", "seed": None, "top_p": 1})
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert isinstance(p.top_p, float)
    assert p.stop == ["END"] and p.seed is None
    assert P(stop=None).stop == []
    d = P().to_dict()
    assert d["max_new_tokens"] == 128 and d["top_k"] == -1 and d["skip_special_tokens"] is True


def test_round_trip_through_orjson():
    p = P(
        max_new_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 5],
        repetition_penalty=1.1,
        frequency_penalty=-0.5,
        presence_penalty=0.25,
        seed=-12345,
        ignore_eos=True,
        skip_special_tokens=False,
        no_stop_trim=True,
    )
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(orjson.loads(orjson.dumps(p.to_dict()))) == p


def test_validate_for_model_and_is_greedy():
    P(stop_token_ids=[0, 99]).validate_for_model(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        P(stop_token_ids=[0, 100]).validate_for_model(100)
    assert P(temperature=0).is_greedy and P(top_k=1).is_greedy
    assert not P().is_greedy and not P(temperature=0.01, top_k=2).is_greedy
    assert 0 <= draw_seed() < 2**63


# ---------------------------------------------------------------- penalties


def test_count_tokens_ignores_padding_and_out_of_range():
    padded = pad_token_ids([[1, 1, 3], [], [4, 9, -1]], vocab_size=5, device="cpu")
    assert padded.tolist() == [[1, 1, 3], [5, 5, 5], [4, 5, 5]]
    counts = count_tokens(padded, 5)
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0], [2.0, -2.0, 4.0, -1.0]])
    seen = torch.tensor([[True, True, False, False], [True, True, True, True]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0, 1.0]))
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 4.0, -1.0], [2.0, -2.0, 4.0, -1.0]]))


def test_frequency_and_presence_penalties_openai_semantics():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    out = apply_frequency_presence_penalties(
        logits, counts, torch.tensor([0.5, 0.0]), torch.tensor([0.25, -1.0])
    )
    expected = torch.tensor([[1.0, 1.0 - 0.5 - 0.25, 1.0 - 1.5 - 0.25, 1.0], [1.5, 0.5, 0.5, 0.5]])
    assert torch.allclose(out, expected)


@pytest.mark.usefixtures("draw_path")
def test_penalties_in_sample_use_prompt_for_repetition_and_output_for_frequency():
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0, 0.0]] * 3)
    prompts = [[0], [0], [0]]
    outputs = [[3, 1], [1, 1, 2], [1]]
    params = [
        P(temperature=0, repetition_penalty=2.0),
        P(temperature=0, frequency_penalty=1.0, presence_penalty=0.5),
        P(temperature=0),  # neutral companion: untouched
    ]
    out = _draw(params, logits, outputs=outputs, prompts=prompts, top_logprobs_num=[5, 5, 5])
    expected = torch.tensor(
        [
            [1.5, 1.0, 1.0, -2.0, 0.0],  # seen {0, 1, 3}: 3/2, 2/2, -1*2
            [3.0, 2.0 - 2.0 - 0.5, 1.0 - 1.0 - 0.5, -1.0, 0.0],
            [3.0, 2.0, 1.0, -1.0, 0.0],
        ]
    )
    want = torch.log_softmax(expected, dim=-1)
    assert out.next_token_ids == [0, 0, 0]
    for row, pairs in enumerate(out.top_logprobs):
        got = torch.zeros(5)
        for token, lp in pairs:
            got[token] = lp
        assert torch.allclose(got, want[row], atol=1e-6)
    # A penalty that flips the argmax.
    flipped = _draw([P(temperature=0, repetition_penalty=4.0)], logits[:1], outputs=[[0]])
    assert flipped.next_token_ids == [1]


# ---------------------------------------------------------------- greedy


@pytest.mark.usefixtures("draw_path")
def test_greedy_rows_are_argmax_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen) * 3
    params = [
        P(temperature=0) if i % 3 == 0 else P(top_k=1) if i % 3 == 1 else P() for i in range(64)
    ]
    out = _draw(params, logits).next_token_ids
    argmax = logits.argmax(-1).tolist()
    for i in range(64):
        if i % 3 != 2:
            assert out[i] == argmax[i]
    assert [out[i] for i in range(2, 64, 3)] != [argmax[i] for i in range(2, 64, 3)]
    assert _draw([P(temperature=0)] * 64, logits).next_token_ids == argmax
    assert _draw([P(top_k=1, temperature=5.0)] * 64, logits).next_token_ids == argmax


@pytest.mark.usefixtures("draw_path")
def test_logits_not_modified():
    logits = torch.randn(3, 20)
    before = logits.clone()
    _draw(
        [P(repetition_penalty=1.5), P(frequency_penalty=1.0, top_p=0.5), P(temperature=0.3)],
        logits,
        outputs=[[1, 2], [3], [4]],
    )
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeds


def _generate(params: SamplingParams, seed: int, steps: int, vocab: int = 500) -> list[int]:
    """A fake decode loop: the logits depend on the step only, the draw on (seed, step)."""
    out: list[int] = []
    for step in range(steps):
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(step))
        out += _draw([params], logits, seeds=[seed], outputs=[list(out)]).next_token_ids
    return out


@pytest.mark.usefixtures("draw_path")
def test_same_seed_same_tokens_over_many_steps():
    params = P(temperature=1.2, top_p=0.95)
    first = _generate(params, seed=42, steps=40)
    assert _generate(params, seed=42, steps=40) == first
    assert len(set(first)) > 10  # actually sampling, not stuck


@pytest.mark.usefixtures("draw_path")
def test_different_seeds_give_different_tokens():
    params = P(temperature=1.0)
    runs = [tuple(_generate(params, seed=s, steps=12)) for s in range(8)]
    assert len(set(runs)) == 8
    # First tokens over many seeds on flat logits spread over the vocabulary.
    firsts = _draw([params] * 400, torch.zeros(400, 1000), seeds=list(range(400))).next_token_ids
    assert len(set(firsts)) > 250


@pytest.mark.usefixtures("draw_path")
def test_seed_result_independent_of_batch_position_and_companions():
    target = P(temperature=0.8, top_p=0.9, min_p=0.01, repetition_penalty=1.2)
    companions = [
        P(temperature=0),
        P(top_k=5, frequency_penalty=0.7),
        P(temperature=1.5, presence_penalty=-1.0),
        P(top_k=1),
        P(min_p=0.3, top_p=0.5),
    ]
    vocab = 400
    alone: list[int] = []
    for step in range(25):
        row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1000 + step))
        alone += _draw(
            [target], row, seeds=[777], outputs=[list(alone)], prompts=[[1, 2]]
        ).next_token_ids
    for position in range(4):
        gen = torch.Generator().manual_seed(position)
        mine: list[int] = []
        for step in range(25):
            row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1000 + step))
            others = [companions[(position + j) % len(companions)] for j in range(3)]
            logits = torch.randn(len(others) + 1, vocab, generator=gen)
            logits[position] = row[0]
            params = list(others)
            params.insert(position, target)
            seeds = [int(torch.randint(0, 2**31, (1,), generator=gen)) for _ in params]
            seeds[position] = 777
            outputs = [
                [int(t) for t in torch.randint(0, vocab, (step,), generator=gen)] for _ in params
            ]
            outputs[position] = list(mine)
            prompts = [[5, 6, 7] for _ in params]
            prompts[position] = [1, 2]
            mine.append(_draw(params, logits, seeds, outputs, prompts).next_token_ids[position])
        assert mine == alone


def test_counter_uniform_is_in_open_interval_and_pure():
    seeds = torch.tensor([0, 1, -5, 2**62], dtype=torch.int64)
    steps = torch.tensor([0, 0, 3, 9], dtype=torch.int64)
    u = counter_uniform(seeds, steps, 50_000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(counter_uniform(seeds[2:3], steps[2:3], 100), u[2:3, :100])
    assert not torch.equal(u[0], u[1])


# ---------------------------------------------------------------- filters and distribution

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])


def _frequencies(params: SamplingParams, n: int = 20_000, by_step: bool = False) -> torch.Tensor:
    logits = PROBS.log().expand(n, -1).clone()
    if by_step:  # one request over many steps
        batch = SamplingBatch.build([params] * n, [9] * n, [[]] * n, None, 6, "cpu")
        batch.steps = torch.arange(n, dtype=torch.int64)
    else:  # many requests, one step
        batch = SamplingBatch.build([params] * n, list(range(n)), [[]] * n, None, 6, "cpu")
    ids = torch.tensor(sample(logits, batch).next_token_ids)
    return torch.bincount(ids, minlength=6).double() / n


def _chi_square(freq: torch.Tensor, expected: torch.Tensor, n: int = 20_000) -> float:
    keep = expected > 0
    assert (freq[~keep] == 0).all(), "a filtered token was sampled"
    e = expected[keep].double() * n
    return float(((freq[keep] * n - e) ** 2 / e).sum())


@pytest.mark.usefixtures("draw_path")
@pytest.mark.parametrize("by_step", [False, True])
@pytest.mark.parametrize(
    "params, expected",
    [
        (P(), PROBS),
        (P(temperature=0.5), PROBS**2 / (PROBS**2).sum()),
        (P(top_k=3), torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
        # exclusive cumulative mass 0, .4, .65, .8 ...: top_p .7 keeps the first three
        (P(top_p=0.7), torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
        # top_k 3 leaves mass .8; top_p .75 of it = .6 < .65: keeps .4 and .25 (top_p is
        # measured on what top_k left, renormalised; on the full mass it would keep .15 too)
        (P(top_k=3, top_p=0.75), torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65),
        # min_p .3 of max .4 = .12: keeps .4, .25, .15
        (P(min_p=0.3), torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
    ],
)
def test_distribution_matches_filtered_softmax(params, expected, by_step):
    freq = _frequencies(params, by_step=by_step)
    dof = int((expected > 0).sum()) - 1
    # Deterministic (fixed seeds); the bound is far in the tail of chi-square(dof).
    assert _chi_square(freq, expected) < 20 + 4 * dof


@pytest.mark.usefixtures("draw_path")
def test_filters_never_sample_a_filtered_token_large_vocab():
    gen = torch.Generator().manual_seed(3)
    n, vocab = 3000, 2000
    logits = (torch.randn(vocab, generator=gen) * 2).expand(n, -1).clone()
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    cases = {
        "top_k": (P(top_k=7), set(order[:7].tolist())),
        "min_p": (P(min_p=0.2), set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())),
    }
    cumulative = probs[order].cumsum(0)
    kept = int((cumulative - probs[order] <= 0.5).sum())
    cases["top_p"] = (P(top_p=0.5), set(order[:kept].tolist()))
    for name, (params, allowed) in cases.items():
        drawn = set(_draw([params] * n, logits, seeds=list(range(n))).next_token_ids)
        assert drawn <= allowed, name
        assert len(drawn) >= min(len(allowed), 5), name


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution by a full stable sort of the vocabulary (the reference the
    candidate path must equal): temperature, top-k, top-p on what top-k left, min-p."""
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logp.exp()
    order = probs.argsort(descending=True, stable=True)
    sorted_p = probs[order]
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if 0 < params.top_k < len(probs):
        keep[params.top_k:] = False
    kept = sorted_p * keep
    cumulative = kept.cumsum(0)
    keep &= (cumulative - kept) <= params.top_p * cumulative[-1]
    keep &= sorted_p >= params.min_p * sorted_p[0]
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


# A flat row keeps far more than sampler.CANDIDATES tokens under top-p / min-p (the rerun: with
# this vocabulary of 3000, every token a candidate); a peaked one keeps a few (the candidate path
# alone).
_FLAT = torch.randn(3000, generator=torch.Generator().manual_seed(11)) * 0.3
_PEAKED = torch.randn(3000, generator=torch.Generator().manual_seed(12)) * 3


@pytest.mark.usefixtures("draw_path")
@pytest.mark.parametrize(
    "logits, params",
    [
        (_FLAT, P(top_p=0.9)),  # the rerun with every token a candidate
        pytest.param(_FLAT, P(min_p=0.5, temperature=0.7), marks=pytest.mark.slow),
        # top_k above the candidates: all of it taken
        pytest.param(_FLAT, P(top_k=400, top_p=0.8), marks=pytest.mark.slow),
        pytest.param(_PEAKED, P(top_p=0.95, temperature=1.3), marks=pytest.mark.slow),
        (_PEAKED, P(top_k=20, min_p=0.02)),  # the candidates alone
    ],
)
def test_large_vocab_distribution_matches_a_full_sort(logits, params):
    """Chi-square of 30k seeded draws against the full-sort reference, with the kept set
    larger and smaller than the candidates; never a token the reference filters."""
    n = 30_000
    expected = _reference_probs(logits, params)
    counts = torch.bincount(torch.tensor(_draw([params] * n, logits.expand(n, -1).clone()).next_token_ids),
                            minlength=len(logits)).double()
    keep = expected > 0
    assert (counts[~keep] == 0).all(), "a filtered token was sampled"
    # Tokens with tiny expected counts pooled into one cell, so every cell expects >= 5 draws.
    e = expected[keep].double() * n
    o = counts[keep]
    small = e < 5
    cells_e = torch.cat([e[~small], e[small].sum()[None]]) if small.any() else e
    cells_o = torch.cat([o[~small], o[small].sum()[None]]) if small.any() else o
    dof = len(cells_e) - 1
    chi2 = float(((cells_o - cells_e) ** 2 / cells_e).sum())
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.mark.usefixtures("draw_path")
def test_logprobs_read_back_beside_the_candidates_flag():
    """Filtered rows add a flag column to the one read-back: the chosen logprobs and the top
    logprobs are still the columns after it (a top-k row, a flat top-p row that reruns)."""
    for params, logits in ((P(top_k=20, temperature=0.7), _PEAKED), (P(top_p=0.99), _FLAT)):
        out = _draw([params, P(temperature=0)], torch.stack([logits, logits]),
                    return_logprob=[True, True], top_logprobs_num=[3, 2])
        logp = torch.log_softmax(logits, dim=-1)
        for row, n in ((0, 3), (1, 2)):
            tok = out.next_token_ids[row]
            assert out.logprobs[row] == pytest.approx(float(logp[tok]), abs=1e-5)
            values, ids = logp.topk(n)
            assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
            assert [v for _, v in out.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.mark.usefixtures("draw_path")
def test_a_rerun_for_a_flat_neighbour_leaves_other_rows_as_they_were():
    """A flat top-p row makes sample() run the batch again with more candidates; the peaked rows
    beside it draw what they draw without it."""
    assert int((_reference_probs(_FLAT, P(top_p=0.99)) > 0).sum()) > CANDIDATES
    peaked = [P(top_p=0.9), P(top_k=50, temperature=0.8), P(min_p=0.1), P(temperature=1.1)]
    logits = torch.stack([_PEAKED * (1 + 0.1 * i) for i in range(len(peaked))])
    alone = _draw(peaked, logits, seeds=[5, 6, 7, 8]).next_token_ids
    with_flat = _draw(peaked + [P(top_p=0.99)], torch.cat([logits, _FLAT[None]]), seeds=[5, 6, 7, 8, 9])
    assert with_flat.next_token_ids[:4] == alone


@pytest.mark.usefixtures("torch_path")
def test_reruns_take_more_candidates_and_draw_what_every_candidate_draws(monkeypatch):
    """A flat row whose top-p set outgrows CANDIDATES reruns with RERUN_CANDIDATES; one that
    outgrows those too, with the whole vocabulary.  Each draws what a run with every token a
    candidate draws for the same seeds."""
    vocab = 20_000
    rows = {scale: torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * scale
            for scale in (5.0, 2.5, 1.0)}  # top-p 0.9 keeps 10, 1927 and 12168 tokens
    sizes = {scale: int((_reference_probs(x, P(top_p=0.9)) > 0).sum()) for scale, x in rows.items()}
    assert sizes[5.0] < CANDIDATES < sizes[2.5] < sampler.RERUN_CANDIDATES < sizes[1.0]
    seen: list[int] = []
    real = sampler._filtered_candidates
    monkeypatch.setattr(sampler, "_filtered_candidates", lambda *a: seen.append(a[-1]) or real(*a))
    for flat, passes in ((2.5, [CANDIDATES, sampler.RERUN_CANDIDATES]),
                         (1.0, [CANDIDATES, sampler.RERUN_CANDIDATES, vocab])):
        logits = torch.stack([rows[5.0], rows[flat]] * 4)
        params = [P(top_p=0.9)] * 8
        seen.clear()
        ids = _draw(params, logits, seeds=list(range(8))).next_token_ids
        assert seen == passes
        assert ids == _draw(params, logits, seeds=list(range(8)), candidates=vocab).next_token_ids


def test_cpu_argmax_is_torch_argmax_on_ties_nans_and_infinities():
    """argmax_rows (greedy rows on a CPU) answers what torch.argmax answers: the first of equal
    maxima, the first NaN, 0 for a row of -inf; rows of every length around the vector width."""
    ops = cpu_ext.load()
    assert ops is not None, "the CPU kernels did not build"
    gen = torch.Generator().manual_seed(3)
    for vocab in (1, 2, 7, 8, 15, 16, 17, 33, 300, 49152):
        logits = (torch.randn(12, vocab, generator=gen) * 4).round()  # small integers: many ties
        logits[1] = -math.inf
        logits[2, vocab // 2] = math.inf
        logits[3, vocab - 1] = math.nan
        logits[4, vocab // 3] = math.nan
        logits[4, vocab - 1] = math.inf
        logits[5] = logits[5, 0]  # every value equal
        logits[6, vocab - 1] = 1e9  # the maximum in the scalar tail
        logits[7] = -1e30
        logits[7, -1] = -1e29
        assert ops.argmax_rows(logits).tolist() == logits.argmax(-1).tolist(), vocab
    assert ops.argmax_rows(torch.zeros(0, 5)).tolist() == []
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 5, dtype=torch.bfloat16))


def test_cpu_kernel_draws_what_the_torch_path_draws(monkeypatch):
    """The same seeds, the same filters and the same order: cpu_ext/sampler.cpp picks the token
    the torch path picks (all but a rounding at a cumulative boundary), so its uniforms are
    counter_uniform's and its kept sets those of the candidates path; rows with flat and peaked
    distributions, each filter alone and combined, a greedy row beside them."""
    vocab = 20_000
    gen = torch.Generator().manual_seed(21)
    knobs = [P(temperature=0.7), P(temperature=1.0), P(top_p=0.9, temperature=0.7), P(top_k=50),
             P(min_p=0.05), P(top_k=300, top_p=0.8), P(top_p=0.95, min_p=0.01, temperature=1.3),
             P(temperature=0)]
    rows = 400
    logits = torch.randn(rows, vocab, generator=gen) * torch.tensor([1.0, 2.5, 5.0]).repeat(rows)[:rows, None]
    params = [knobs[i % len(knobs)] for i in range(rows)]
    seeds = list(range(1000, 1000 + rows))
    native = _draw(params, logits, seeds=seeds).next_token_ids
    monkeypatch.setattr(sampler, "_native_ops", lambda logits: None)
    reference = _draw(params, logits, seeds=seeds).next_token_ids
    same = sum(a == b for a, b in zip(native, reference, strict=True))
    assert same >= rows - 2, f"{rows - same} of {rows} rows differ"


@pytest.mark.parametrize("params", [P(), P(top_k=50), P(top_p=0.9), P(min_p=0.1), P(top_k=3, top_p=0.5)])
def test_cpu_kernel_draws_only_tokens_a_grammar_leaves(params):
    """Rows whose logits are -inf but for a few tokens (a grammar's mask): only those are drawn,
    each of them over enough seeds (when no filter drops it); one left, always that one."""
    vocab, allowed = 5000, [7, 1234, 4999, 2500, 42]
    logits = torch.full((600, vocab), float("-inf"))
    logits[:, allowed] = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2])
    drawn = set(_draw([params] * 600, logits).next_token_ids)
    expected = set(torch.nonzero(_reference_probs(logits[0], params) > 0).flatten().tolist())
    assert drawn == expected
    one = torch.full((1, vocab), float("-inf"))
    one[0, 4321] = 3.0
    assert _draw([params], one).next_token_ids == [4321]


@pytest.mark.usefixtures("draw_path")
@pytest.mark.parametrize("vocab", [1, 2, 3, 5, 7, 17, 33])
def test_small_vocabularies_and_confident_rows_draw_from_the_reference_set(vocab):
    """Vocabularies shorter than a vector (and not a multiple of one), and a confident row (its
    top token alone passes top-p and leaves every other under min-p): 400 seeded draws stay in
    the full-sort reference's kept set and reach every token it keeps with probability >= 5%."""
    gen = torch.Generator().manual_seed(vocab)
    confident = torch.randn(vocab, generator=gen)
    confident[vocab // 2] += 30
    for logits in (torch.randn(vocab, generator=gen) * 2, confident):
        for params in (P(), P(top_p=0.8), P(min_p=0.2), P(top_k=2, top_p=0.9), P(temperature=0.5, min_p=0.05)):
            drawn = set(_draw([params] * 400, logits.expand(400, -1).clone()).next_token_ids)
            reference = _reference_probs(logits, params)
            assert drawn <= set(torch.nonzero(reference > 0).flatten().tolist()), (params, drawn)
            assert drawn >= set(torch.nonzero(reference >= 0.05).flatten().tolist()), (params, drawn)


# ---------------------------------------------------------------- logprobs


@pytest.mark.usefixtures("draw_path")
def test_logprobs_are_log_softmax_of_penalised_logits_before_temperature():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen)
    params = [P(temperature=0.3), P(temperature=0), P(top_k=3, temperature=2.0), P()]
    out = _draw(
        params, logits, return_logprob=[True, False, True, True], top_logprobs_num=[3, 0, 5, 1]
    )
    reference = torch.log_softmax(logits, -1)
    for row, token in enumerate(out.next_token_ids):
        assert math.isclose(out.logprobs[row], reference[row, token].item(), abs_tol=1e-6)
    assert [len(t) for t in out.top_logprobs] == [3, 0, 5, 1]
    for row, pairs in enumerate(out.top_logprobs):
        values = [lp for _, lp in pairs]
        assert values == sorted(values, reverse=True)
        expected_ids = reference[row].argsort(descending=True)[: len(pairs)].tolist()
        assert [t for t, _ in pairs] == expected_ids
        for token, lp in pairs:
            assert math.isclose(lp, reference[row, token].item(), abs_tol=1e-6)

    plain = _draw(params, logits)
    assert plain.logprobs is None and plain.top_logprobs is None
    assert plain.next_token_ids == out.next_token_ids


def test_bad_batch_shapes_raise():
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError):
        _draw([P()] * 2, logits, return_logprob=[True])
    batch = SamplingBatch.build([P()], [0], [[]], None, 10, "cpu")
    with pytest.raises(ValueError):
        sample(logits, batch)
    with pytest.raises(ValueError):
        SamplingBatch.build([P()], [0, 1], [[]], None, 10, "cpu")


@pytest.mark.usefixtures("draw_path")
def test_seeds_beyond_int64_wrap_consistently():
    logits = torch.zeros(2, 1000)
    out = _draw([P(), P()], logits, seeds=[2**64 - 1, -1]).next_token_ids
    assert out[0] == out[1]


@pytest.mark.usefixtures("draw_path")
def test_logit_bias_adds_to_logits_and_round_trips() -> None:
    import orjson

    params = SamplingParams.from_dict({"temperature": 0, "logit_bias": {"3": 100, 7: -100}})
    assert params.logit_bias == {3: 100.0, 7: -100.0}
    assert SamplingParams.from_dict(orjson.loads(orjson.dumps(params.to_dict()))) == params
    logits = torch.zeros(2, 10)
    logits[:, 7] = 5.0
    batch = SamplingBatch.build([params, SamplingParams(temperature=0)], [0, 0], [[], []], None, 10, "cpu")
    out = sample(logits, batch)
    assert out.next_token_ids == [3, 7]  # row 0 biased to 3 (and away from 7); row 1 untouched
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"x": 1}})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"1": 101}})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"9999": 1}}).validate_for_model(10)
