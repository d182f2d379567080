"""Chat templates the tests give a tiny model's folder."""

from __future__ import annotations

import json
import os

# A Qwen3-style template: the generation prompt opens a <think> block, or an empty one when the
# request turns thinking off (chat_template_kwargs / Anthropic's ``thinking: disabled``).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def use_chat_template(folder: str, template: str) -> None:
    """``folder``'s chat template becomes ``template`` (a chat_template.jinja file; the one in
    tokenizer_config.json, which would win, is removed)."""
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(template)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(config_path, "w") as f:
        json.dump(config, f)
