"""Reasoning on the agent APIs: with ``--reasoning-parser``, ``/v1/responses`` answers a
``reasoning`` item before the ``message`` and ``/v1/messages`` a ``thinking`` block before the
text, streamed or not.

The model is scripted: a tiny Llama whose layers add nothing to the residual stream (their
output projections are zero), so each next token depends on the current token alone, and whose
``lm_head`` maps the last token of the generation prompt through the tokens of ``SCRIPT`` to
EOS.  Greedy decoding therefore writes ``SCRIPT`` whatever the conversation, and the template
(Qwen3-style) opens ``<think>`` in the prompt, so the text up to ``</think>`` is reasoning.
"""

from __future__ import annotations

import os
import shutil

import anthropic
import openai
import pytest
from helpers.api_clients import anthropic_client
from helpers.chat_templates import THINKING_TEMPLATE, use_chat_template
from helpers.server import memory_checked_after_each_test, openai_client, serving

# Opens <think> in the prompt unless enable_thinking is false (as Qwen3's template does).
SCRIPT = "Two plus two</think>Four."
REASONING, ANSWER = "Two plus two", "Four."
EOS = 2
GREEDY = {"temperature": 0, "top_k": 1}
ASK = [{"role": "user", "content": "2+2?"}]


def _scripted_model(tiny_chat_model: str, folder: str) -> str:
    import torch
    import transformers

    for name in os.listdir(tiny_chat_model):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tiny_chat_model, name), folder)
    use_chat_template(folder, THINKING_TEMPLATE)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    chain = [tok.encode(prompt, add_special_tokens=False)[-1],
             *tok.encode(SCRIPT, add_special_tokens=False), EOS]
    assert len(set(chain)) == len(chain), chain  # each token has one successor
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for current, following in zip(chain, chain[1:], strict=False):
            head[following] = 50.0 * emb[current] / emb[current].norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    folder = _scripted_model(tiny_chat_model, str(tmp_path_factory.mktemp("scripted")))
    with serving(folder, "--max-total-tokens", "8000", "--context-length", "1024",
                 "--reasoning-parser", "qwen3") as srv:
        yield srv


memory_invariant = memory_checked_after_each_test("server")


def test_the_chat_route_sees_the_script_as_reasoning_then_answer(server) -> None:
    out = openai_client(server).chat.completions.create(model="tiny", messages=ASK,
                                                        max_tokens=40, temperature=0)
    message = out.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (REASONING, ANSWER)


def test_responses_answer_a_reasoning_item_before_the_message(server) -> None:
    client = openai_client(server)
    resp = client.responses.create(model="tiny", input=ASK, max_output_tokens=40,
                                   temperature=0)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert [p.text for p in resp.output[0].content] == [REASONING]
    assert resp.output_text == ANSWER and resp.status == "completed"
    with client.responses.stream(model="tiny", input=ASK, max_output_tokens=40, temperature=0,
                                 store=False) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING and final.output_text == ANSWER
    # The next turn carries the conversation on; the template drops earlier reasoning, so the
    # stored tokens are reused up to the answer's start.
    again = client.responses.create(model="tiny", previous_response_id=resp.id,
                                    input="And 3+3?", max_output_tokens=40, temperature=0)
    assert [item.type for item in again.output] == ["reasoning", "message"]
    assert again.usage.input_tokens_details.cached_tokens >= resp.usage.input_tokens - 8
    # An answer's items handed back as input (no stored conversation), reasoning included.
    history = [*ASK, *(item.model_dump(exclude_none=True) for item in resp.output),
               {"role": "user", "content": "And 3+3?"}]
    handed = client.responses.create(model="tiny", input=history, max_output_tokens=40,
                                     temperature=0, store=False)
    assert handed.output_text == ANSWER


def test_responses_usage_counts_the_reasoning_tokens(server, tiny_chat_model) -> None:
    """``output_tokens_details.reasoning_tokens``: the tokens through ``</think>``, streamed or
    not; all of them when the block is cut off (none without a reasoning item:
    tests/http/test_responses_api.py)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    block = tok.encode(REASONING + "</think>", add_special_tokens=False)
    assert tok.encode(SCRIPT, add_special_tokens=False)[:len(block)] == block
    client = openai_client(server)
    resp = client.responses.create(model="tiny", input=ASK, max_output_tokens=40, temperature=0)
    with client.responses.stream(model="tiny", input=ASK, max_output_tokens=40, temperature=0,
                                 store=False) as stream:
        streamed = stream.get_final_response()
    for r in (resp, streamed):
        assert r.usage.output_tokens_details.reasoning_tokens == len(block)
        assert r.usage.output_tokens > len(block)
    # Cut off in its reasoning: the reasoning item alone, streamed or not.
    cut = client.responses.create(model="tiny", input=ASK, max_output_tokens=2, temperature=0)
    with client.responses.stream(model="tiny", input=ASK, max_output_tokens=2, temperature=0,
                                 store=False) as stream:  # ends with response.incomplete
        cut_streamed = [e.response for e in stream if e.type == "response.incomplete"][0]
    for r in (cut, cut_streamed):
        assert r.status == "incomplete" and [item.type for item in r.output] == ["reasoning"]
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 2
    assert cut.output[0].content[0].text == cut_streamed.output[0].content[0].text


def test_messages_answer_a_thinking_block_before_the_text(server) -> None:
    client = anthropic_client(server)
    msg = client.messages.create(model="tiny", max_tokens=40, messages=ASK, extra_body=GREEDY)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == (REASONING, ANSWER)
    assert msg.stop_reason == "end_turn"
    with client.messages.stream(model="tiny", max_tokens=40, messages=ASK,
                                extra_body=GREEDY) as stream:
        starts = [e.content_block.type for e in stream if e.type == "content_block_start"]
        final = stream.get_final_message()
    assert starts == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (REASONING, ANSWER)
    # Thinking turned off: the template closes the block, nothing is parsed as reasoning.
    off = client.messages.create(model="tiny", max_tokens=40, messages=ASK,
                                 extra_body={**GREEDY, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
    count = client.messages.count_tokens(model="tiny", messages=ASK)
    assert count.input_tokens == (msg.usage.input_tokens + msg.usage.cache_read_input_tokens
                                  + msg.usage.cache_creation_input_tokens)
    with pytest.raises(anthropic.BadRequestError, match="thinking.type"):
        client.messages.create(model="tiny", max_tokens=4, messages=ASK,
                               extra_body={"thinking": {"type": "sometimes"}})


def test_a_bad_request_still_names_the_responses_field(server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).responses.create(model="tiny", input=ASK, max_output_tokens=5000)
    assert e.value.body["param"] == "max_output_tokens"
