"""Sampling and greedy decoding: determinism under a seeded generator, behaviour log-probabilities
equal to a separate forward pass over prompt + completion, stop tokens, greedy as argmax step by
step, and a prompt's completion independent of the other prompts in its batch."""

from __future__ import annotations

import pytest
import torch

from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.grpo import completion_logps
from pipeline_assets.trainer.model import Transformer
from pipeline_assets.trainer.sampling import (
    completion_rows,
    greedy_completions,
    right_padded,
    sample_completions,
)

CONFIG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=32)
PROMPTS = [[1, 7, 8, 9], [1, 20, 21, 22, 23, 24, 25, 26], [1, 30]]  # lengths 4, 8, 2
MAX_NEW = 10
NO_STOP: set[int] = set()
PAD = 0  # the built-in chat format's <|pad|>


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    with (
        torch.no_grad()
    ):  # sharper than the N(0, 0.02) init, so that greedy decoding has no near-ties
        model.embedding.weight.mul_(20)
    return model


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_seeded_generator_makes_sampling_deterministic(model):
    first = sample_completions(
        model,
        PROMPTS,
        group_size=4,
        max_new_tokens=MAX_NEW,
        stop_ids=NO_STOP,
        generator=_seeded(3),
        pad_id=PAD,
    )
    again = sample_completions(
        model,
        PROMPTS,
        group_size=4,
        max_new_tokens=MAX_NEW,
        stop_ids=NO_STOP,
        generator=_seeded(3),
        pad_id=PAD,
    )
    other = sample_completions(
        model,
        PROMPTS,
        group_size=4,
        max_new_tokens=MAX_NEW,
        stop_ids=NO_STOP,
        generator=_seeded(4),
        pad_id=PAD,
    )

    assert first == again
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    assert [c.prompt_index for c in first] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(len(c.token_ids) == len(c.logps) == MAX_NEW for c in first)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logps_equal_a_full_forward_pass_over_prompt_and_completion(model, temperature):
    completions = sample_completions(
        model,
        PROMPTS,
        group_size=3,
        max_new_tokens=MAX_NEW,
        stop_ids={5, 6},
        temperature=temperature,
        generator=_seeded(5),
        pad_id=PAD,
    )
    rows = completion_rows(PROMPTS, completions, pad_id=PAD)

    with torch.no_grad():
        logits = model(rows.input_ids, rows.position_ids)
        logps = completion_logps(
            logits / temperature, rows.input_ids, rows.loss_mask, rows.position_ids
        )

    assert rows.loss_mask.sum() == sum(len(c.token_ids) for c in completions)
    torch.testing.assert_close(
        logps[rows.loss_mask], rows.behaviour_logps[rows.loss_mask], rtol=0, atol=1e-5
    )
    assert (rows.behaviour_logps[~rows.loss_mask] == 0).all()


def test_the_recorded_logps_are_gathered_by_hand_at_the_sampled_tokens(model):
    completion = sample_completions(
        model,
        PROMPTS[:1],
        group_size=1,
        max_new_tokens=MAX_NEW,
        stop_ids=NO_STOP,
        generator=_seeded(6),
        pad_id=PAD,
    )[0]
    row = torch.tensor([PROMPTS[0] + completion.token_ids])

    with torch.no_grad():
        log_softmax = torch.log_softmax(
            model(row, torch.arange(row.shape[1])[None])[0].double(), dim=-1
        )

    start = len(PROMPTS[0])
    by_hand = [log_softmax[t - 1, row[0, t]].item() for t in range(start, row.shape[1])]
    assert completion.logps == pytest.approx(by_hand, abs=1e-5)


def test_sampling_stops_at_the_first_stop_token_and_keeps_it(model):
    def per_row_generators() -> list[
        torch.Generator
    ]:  # a row's draws then do not depend on when others stop
        return [_seeded(7 + row) for row in range(len(PROMPTS) * 2)]

    unstopped = sample_completions(
        model,
        PROMPTS,
        group_size=2,
        max_new_tokens=MAX_NEW,
        stop_ids=NO_STOP,
        generator=per_row_generators(),
        pad_id=PAD,
    )
    stop_ids = {unstopped[0].token_ids[3], 49}

    stopped = sample_completions(
        model,
        PROMPTS,
        group_size=2,
        max_new_tokens=MAX_NEW,
        stop_ids=stop_ids,
        generator=per_row_generators(),
        pad_id=PAD,
    )

    for full, cut in zip(unstopped, stopped, strict=True):
        ends = [t for t, token in enumerate(full.token_ids) if token in stop_ids]
        expected = full.token_ids[: ends[0] + 1] if ends else full.token_ids
        assert cut.token_ids == expected
        assert cut.logps == pytest.approx(full.logps[: len(expected)], abs=1e-5)
    assert len(stopped[0].token_ids) <= 4 and stopped[0].token_ids[-1] in stop_ids
    assert any(
        len(c.token_ids) < MAX_NEW for c in stopped[1:]
    )  # other rows stopped too, at other steps


def test_greedy_is_the_argmax_step_by_step(model):
    completions = greedy_completions(
        model, PROMPTS, max_new_tokens=MAX_NEW, stop_ids={5}, pad_id=PAD
    )

    for prompt, completion in zip(PROMPTS, completions, strict=True):
        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(MAX_NEW):
                logits = model(torch.tensor([sequence]), torch.arange(len(sequence))[None])
                sequence.append(int(logits[0, -1].argmax()))
                if sequence[-1] == 5:
                    break
        assert completion == sequence[len(prompt) :]


def test_a_prompt_gets_the_same_completions_alone_as_beside_prompts_of_other_lengths(model):
    group_size = 3
    together_greedy = greedy_completions(
        model, PROMPTS, max_new_tokens=MAX_NEW, stop_ids={5}, pad_id=PAD
    )
    together = sample_completions(
        model,
        PROMPTS,
        group_size,
        MAX_NEW,
        stop_ids={5},
        generator=[_seeded(100 + row) for row in range(len(PROMPTS) * group_size)],
        pad_id=PAD,
    )

    for index, prompt in enumerate(PROMPTS):
        assert greedy_completions(
            model, [prompt], max_new_tokens=MAX_NEW, stop_ids={5}, pad_id=PAD
        ) == [together_greedy[index]]
        seeds = range(100 + index * group_size, 100 + (index + 1) * group_size)
        alone = sample_completions(
            model,
            [prompt],
            group_size,
            MAX_NEW,
            stop_ids={5},
            generator=[_seeded(seed) for seed in seeds],
            pad_id=PAD,
        )
        beside = together[index * group_size : (index + 1) * group_size]
        assert [c.token_ids for c in alone] == [c.token_ids for c in beside]
        for one, other in zip(alone, beside, strict=True):
            assert one.logps == pytest.approx(other.logps, abs=1e-5)


def test_right_padding_restarts_positions_so_the_padding_is_a_document_of_its_own():
    input_ids, position_ids, lengths = right_padded([[4, 5, 6], [7]], pad_id=9)

    assert input_ids.tolist() == [[4, 5, 6], [7, 9, 9]], "the encoder's pad id fills the tail"
    assert position_ids.tolist() == [[0, 1, 2], [0, 0, 1]]
    assert lengths.tolist() == [3, 1]


def test_decoding_restores_the_training_mode_and_refuses_what_the_model_cannot_hold(model):
    model.train()
    greedy_completions(model, PROMPTS, max_new_tokens=2, stop_ids=NO_STOP, pad_id=PAD)
    assert model.training
    model.eval()

    with pytest.raises(ValueError, match="max_seq_len"):
        greedy_completions(
            model, PROMPTS, max_new_tokens=CONFIG.max_seq_len, stop_ids=NO_STOP, pad_id=PAD
        )
    with pytest.raises(ValueError, match="one per row"):
        sample_completions(model, PROMPTS, 2, MAX_NEW, NO_STOP, generator=[_seeded(0)], pad_id=PAD)
    with pytest.raises(ValueError, match="temperature"):
        sample_completions(model, PROMPTS, 2, MAX_NEW, NO_STOP, temperature=0.0, pad_id=PAD)
