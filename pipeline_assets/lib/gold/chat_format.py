"""The chat format and its special tokens, defined once for gold, the trainer and evaluation.

A record becomes one sequence::

    <|bos|>[<|system|>SYSTEM<|end|>]<|user|>PROMPT<|end|><|assistant|>RESPONSE<|end|><|eos|>

Everything up to and including ``<|assistant|>`` is the prefix (context, no loss); the response
with its closing ``<|end|><|eos|>`` is what the model is trained to produce. A conversation repeats
the turns, ``<|role|>CONTENT<|end|>`` each, and ``<|eos|>`` closes the last (an assistant's)::

    <|bos|>[<|system|>..<|end|>]<|user|>..<|end|><|assistant|>..<|end|><|user|>..<|end|>
    <|assistant|>..<|end|><|eos|>

Each assistant turn's content and ``<|end|>`` are trained, and the final ``<|eos|>``.
``CHAT_TEMPLATE`` is the same layout as a Hugging Face chat template, for the exported model's
users. Pure Python: no Dagster, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"

# The order fixes the ids of a trained tokenizer: PAD first so that its id is 0.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END)


def prefix_text(system: str | None, prompt: str) -> str:
    """Everything before the response: BOS [SYSTEM system END] USER prompt END ASSISTANT
    (no system part when system is None/empty)."""
    system_part = f"{SYSTEM}{system}{END}" if system else ""
    return f"{BOS}{system_part}{USER}{prompt}{END}{ASSISTANT}"


def response_text(response: str) -> str:
    """The response and what closes it: response END EOS. These are the tokens the loss is computed
    on."""
    return f"{response}{END}{EOS}"


def conversation_text(turns: Iterable[Mapping[str, str]]) -> str:
    """A conversation (``role``/``content`` turns) in the layout above, as ``CHAT_TEMPLATE``
    renders it: an sft record's one exchange gives ``prefix_text`` + ``response_text``."""
    body = "".join(f"<|{turn['role']}|>{turn['content']}{END}" for turn in turns)
    return f"{BOS}{body}{EOS}"


# The layout above in Jinja, as tokenizer_config.json carries it (apply_chat_template, vLLM).
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% elif messages and messages[-1]['role'] == 'assistant' %}{{ '<|eos|>' }}{% endif %}"
)
