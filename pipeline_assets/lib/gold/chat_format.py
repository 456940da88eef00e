"""The chat format and its special tokens, defined once for gold, the trainer and evaluation.

A record becomes one sequence::

    <|bos|>[<|system|>SYSTEM<|end|>]<|user|>PROMPT<|end|><|assistant|>RESPONSE<|end|><|eos|>

Everything up to and including ``<|assistant|>`` is the prefix (context, no loss); the response
with its closing ``<|end|><|eos|>`` is what the model is trained to produce. Pure Python: no
Dagster, no torch.
"""

from __future__ import annotations

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
