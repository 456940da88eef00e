"""Decoding from the policy: sampled groups of completions with their behaviour log-probabilities
(the rollouts of the RL overlay's GRPO) and greedy completions (held-out accuracy).

Every prompt of a batch, ``group_size`` times each, is one row; one forward per new token serves all
the rows still running. Rows are right-padded to the longest with the encoder's pad id, and
``position_ids`` restart at 0 on the padding tail, so the model sees each row's tokens as one
document starting at position 0, whatever the other rows hold: a prompt gives the same completion
alone as in a batch. Without a KV cache, each step recomputes the whole prefix, which is cheap for
the short prompts and answers of verifiable tasks.

Behaviour log-probabilities are those of the distribution each token was sampled from: the model's
logits divided by ``temperature``, log-softmaxed. GRPO's importance ratio must compare like with
like, so a learner that samples at a temperature other than 1 must divide its logits by the same
temperature before ``grpo.completion_logps``; at the default temperature 1 they are the model's own
log-probabilities, and ``completion_logps`` of the unscaled logits gives back the same numbers.

Any backend (``trainer.language_model``): the built-in model or the user's Hugging Face model.
Pure torch, no I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline_assets.trainer.language_model import LanguageModel

# Per step: (last logits (A, V) fp32 of the A running rows, their row numbers) -> (tokens (A,),
# logps (A,)).
Chooser = Callable[[torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor]]
Generators = torch.Generator | Sequence[torch.Generator] | None


@dataclass(frozen=True)
class Completion:
    """One sampled completion of prompt ``prompt_index``: its tokens, up to and including the first
    stop token (or ``max_new_tokens`` of them, cut short), and each token's behaviour
    log-probability."""

    prompt_index: int
    token_ids: list[int]
    logps: list[float]


@dataclass(frozen=True)
class CompletionRows:
    """Prompt + completion rows for the learner's forward pass, (N, T) each, right-padded with
    position_ids restarting at 0 on the padding: ``loss_mask`` is set on the completion tokens and
    ``behaviour_logps`` holds each completion token's sampled log-probability there (0 elsewhere),
    in ``grpo.completion_logps``'s alignment (entry t is about token t)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logps: torch.Tensor


def sample_completions(
    model: LanguageModel,
    prompt_ids: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float = 1.0,
    generator: Generators = None,
    *,
    pad_id: int,
) -> list[Completion]:
    """``group_size`` sampled completions of every prompt, prompt by prompt (row
    ``p * group_size + k`` is prompt p's k-th), each token drawn from
    ``softmax(logits / temperature)``.

    ``generator`` is one ``torch.Generator`` for all rows (deterministic for the same batch), or one
    per row, ``len(prompt_ids) * group_size`` of them, so that a row's completion does not depend on
    the rows beside it. Each row draws one uniform per step, by inverse CDF. ``pad_id`` (the
    encoder's) fills a row past its end; no real token attends to it."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if temperature <= 0:
        raise ValueError(
            f"temperature must be positive, got {temperature} (greedy_completions decodes greedily)"
        )
    rows = [prompt for prompt in prompt_ids for _ in range(group_size)]
    choose = _sampler(temperature, generator, len(rows))
    tokens, logps = _decode(model, rows, max_new_tokens, stop_ids, choose, pad_id)
    return [
        Completion(row // group_size, row_tokens, row_logps)
        for row, (row_tokens, row_logps) in enumerate(zip(tokens, logps, strict=True))
    ]


def greedy_completions(
    model: LanguageModel,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    *,
    pad_id: int,
) -> list[list[int]]:
    """The most likely next token, step after step: one completion per prompt, up to and including
    the first stop token (or ``max_new_tokens`` of them)."""
    return _decode(model, prompt_ids, max_new_tokens, stop_ids, _greedy, pad_id)[0]


def completion_rows(
    prompt_ids: list[list[int]], completions: Sequence[Completion], pad_id: int
) -> CompletionRows:
    """Each completion after its prompt, as the tensors a learner feeds the model and
    ``grpo_loss``."""
    sequences = [prompt_ids[c.prompt_index] + c.token_ids for c in completions]
    input_ids, position_ids, _ = right_padded(sequences, pad_id)
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    behaviour_logps = torch.zeros(input_ids.shape, dtype=torch.float32)
    for row, completion in enumerate(completions):
        start = len(prompt_ids[completion.prompt_index])
        end = start + len(completion.token_ids)
        loss_mask[row, start:end] = True
        behaviour_logps[row, start:end] = torch.tensor(completion.logps, dtype=torch.float32)
    return CompletionRows(input_ids, position_ids, loss_mask, behaviour_logps)


def right_padded(
    sequences: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids) (N, T) of the sequences padded with ``pad_id`` to the longest, and
    their lengths (N,). Positions count 0.. along each sequence and again from 0 along its padding,
    which is thus a document of its own (``model.document_ids``)."""
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    width = int(lengths.max())
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    columns = torch.arange(width)[None]
    past_end = columns >= lengths[:, None]
    position_ids = columns - torch.where(past_end, lengths[:, None], 0)
    return input_ids, position_ids, lengths


def _decode(
    model: LanguageModel,
    rows: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    choose: Chooser,
    pad_id: int,
) -> tuple[list[list[int]], list[list[float]]]:
    """Extend every row token by token until it emits a stop token or has ``max_new_tokens`` new
    ones: the new tokens and their log-probabilities, per row."""
    _check_lengths(model, rows, max_new_tokens)
    new_tokens: list[list[int]] = [[] for _ in rows]
    new_logps: list[list[float]] = [[] for _ in rows]
    running = list(range(len(rows))) if max_new_tokens > 0 else []
    with _evaluating(model):
        while running:
            running_rows = [rows[row] + new_tokens[row] for row in running]
            logits = _last_logits(model, running_rows, pad_id)
            tokens, logps = choose(logits, running)
            for row, token, logp in zip(running, tokens.tolist(), logps.tolist(), strict=True):
                new_tokens[row].append(token)
                new_logps[row].append(logp)
            running = [
                row
                for row in running
                if new_tokens[row][-1] not in stop_ids and len(new_tokens[row]) < max_new_tokens
            ]
    return new_tokens, new_logps


def _check_lengths(model: LanguageModel, rows: list[list[int]], max_new_tokens: int) -> None:
    if any(not row for row in rows):
        raise ValueError("every prompt needs at least one token")
    longest = max(map(len, rows), default=0) + max_new_tokens
    if longest > model.max_seq_len:
        raise ValueError(
            f"a prompt plus {max_new_tokens} new tokens is {longest} tokens, more than the model's "
            f"max_seq_len {model.max_seq_len}"
        )


@contextlib.contextmanager
def _evaluating(model: LanguageModel) -> Iterator[None]:
    """Eval mode and no autograd while decoding; the model's previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _last_logits(model: LanguageModel, sequences: list[list[int]], pad_id: int) -> torch.Tensor:
    """(N, V) fp32: the logits at each sequence's last token, the next token's distribution."""
    device = model.device
    input_ids, position_ids, lengths = right_padded(sequences, pad_id)
    logits = model(input_ids.to(device), position_ids.to(device))
    return logits[torch.arange(len(sequences), device=device), lengths.to(device) - 1].float()


def _greedy(logits: torch.Tensor, _: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.argmax(dim=-1)
    return tokens, F.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _sampler(temperature: float, generator: Generators, n_rows: int) -> Chooser:
    """Draws by inverse CDF of ``softmax(logits / temperature)``, one uniform per running row and
    step."""
    if isinstance(generator, Sequence) and len(generator) != n_rows:
        raise ValueError(
            f"got {len(generator)} generators for {n_rows} rows; pass one per row, or a single one"
        )

    def choose(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits / temperature, dim=-1)
        cdf = log_probs.double().exp().cumsum(dim=-1)
        targets = _uniforms(generator, rows).to(cdf.device) * cdf[:, -1]
        # right=True: the first token whose cdf exceeds the target, so never one of probability 0.
        tokens = (
            torch.searchsorted(cdf, targets[:, None], right=True)
            .squeeze(-1)
            .clamp(max=cdf.shape[-1] - 1)
        )
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)

    return choose


def _uniforms(generator: Generators, rows: list[int]) -> torch.Tensor:
    """(len(rows),) float64 uniforms in [0, 1): from each row's own generator, or all from one."""
    if isinstance(generator, Sequence):
        return torch.stack([_uniform(generator[row], 1)[0] for row in rows])
    return _uniform(generator, len(rows))


def _uniform(generator: torch.Generator | None, count: int) -> torch.Tensor:
    device = generator.device if generator is not None else None
    return torch.rand(count, generator=generator, dtype=torch.float64, device=device)
