"""Decoding from a Hugging Face policy (a tiny Qwen2: grouped-query attention, untied output layer)
as from the built-in model: a prompt's completions do not depend on the rows beside it, greedy
decoding is transformers' own greedy ``generate``, behaviour log-probabilities are the model's own
(from logits or from its chunked losses, one completion a row or several packed in one), and a
policy saved in its family's format loads back as the same model."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline_assets.trainer.export import load_exported
from pipeline_assets.trainer.grpo import completion_logps, pack_completions, policy_logps
from pipeline_assets.trainer.hf_model import BACKEND, HuggingFaceLM
from pipeline_assets.trainer.sampling import (
    completion_rows,
    greedy_completions,
    sample_completions,
)

PROMPTS = [[1, 7, 8, 9], [1, 20, 21, 22, 23, 24, 25, 26], [1, 30]]  # lengths 4, 8, 2
MAX_NEW, MAX_POSITIONS = 10, 32
PAD = 63  # not 0: the encoder's pad id, whatever it is, never changes a completion
STOP = {5}


@pytest.fixture(scope="module")
def model() -> HuggingFaceLM:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = HuggingFaceLM(config).eval()
    with torch.no_grad():  # sharper than the random init, so that greedy decoding has no near-ties
        model.lm.lm_head.weight.mul_(30)
    return model


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_prompt_gets_the_same_completions_alone_as_beside_prompts_of_other_lengths(model):
    group_size = 3
    together_greedy = greedy_completions(model, PROMPTS, MAX_NEW, STOP, pad_id=PAD)
    together = sample_completions(
        model,
        PROMPTS,
        group_size,
        MAX_NEW,
        STOP,
        generator=[_seeded(100 + row) for row in range(len(PROMPTS) * group_size)],
        pad_id=PAD,
    )

    for index, prompt in enumerate(PROMPTS):
        assert greedy_completions(model, [prompt], MAX_NEW, STOP, pad_id=PAD) == [
            together_greedy[index]
        ]
        seeds = range(100 + index * group_size, 100 + (index + 1) * group_size)
        alone = sample_completions(
            model,
            [prompt],
            group_size,
            MAX_NEW,
            STOP,
            generator=[_seeded(seed) for seed in seeds],
            pad_id=PAD,
        )
        beside = together[index * group_size : (index + 1) * group_size]
        assert [c.token_ids for c in alone] == [c.token_ids for c in beside]
        for one, other in zip(alone, beside, strict=True):
            assert one.logps == pytest.approx(other.logps, abs=1e-5)
    assert len({tuple(c.token_ids) for c in together}) > len(PROMPTS), "sampling varies"


def test_greedy_decoding_is_transformers_own_greedy_generate(model):
    ours = greedy_completions(model, PROMPTS, MAX_NEW, stop_ids=set(), pad_id=PAD)

    for prompt, completion in zip(PROMPTS, ours, strict=True):
        generated = model.lm.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD,
        )
        assert completion == generated[0, len(prompt) :].tolist()


def test_behaviour_logps_at_temperature_1_are_the_model_s_own_from_logits_or_chunked_losses(
    model,
):
    completions = sample_completions(
        model, PROMPTS, 3, MAX_NEW, stop_ids={5, 6}, generator=_seeded(5), pad_id=PAD
    )
    rows = completion_rows(PROMPTS, completions, pad_id=PAD)

    with torch.no_grad():
        from_logits = completion_logps(
            model(rows.input_ids, rows.position_ids),
            rows.input_ids,
            rows.loss_mask,
            rows.position_ids,
        )
        from_losses = policy_logps(model, rows.input_ids, rows.loss_mask, rows.position_ids)

    mask = rows.loss_mask
    assert mask.sum() == sum(len(c.token_ids) for c in completions)
    torch.testing.assert_close(from_logits[mask], rows.behaviour_logps[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(from_losses, from_logits, rtol=0, atol=1e-5)
    assert (from_losses[~mask] == 0).all()


def test_the_longest_sequence_is_the_model_s_max_position_embeddings(model):
    assert model.max_seq_len == MAX_POSITIONS
    with pytest.raises(ValueError, match=f"max_seq_len {MAX_POSITIONS}"):
        greedy_completions(model, PROMPTS, MAX_POSITIONS, stop_ids=set(), pad_id=PAD)


def test_a_saved_policy_loads_back_as_the_same_hugging_face_model(model, tmp_path):
    files = model.save(tmp_path, {"policy_version": 3})

    loaded, about = load_exported(tmp_path)

    assert isinstance(loaded, HuggingFaceLM) and {"config.json", "pipeline.json"} <= set(files)
    assert about["backend"] == BACKEND and about["policy_version"] == 3
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"
    ]
    ids = torch.tensor([PROMPTS[1]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, positions), model(ids, positions), rtol=0, atol=0)


def test_completions_packed_several_to_a_row_get_the_log_probabilities_they_were_sampled_with(
    model,
):
    completions = sample_completions(
        model, PROMPTS, 2, MAX_NEW, stop_ids={5, 6}, generator=_seeded(8), pad_id=PAD
    )
    packed = pack_completions(
        [PROMPTS[c.prompt_index] for c in completions],
        [c.token_ids for c in completions],
        [c.logps for c in completions],
        torch.zeros(len(completions)),
        seq_len=MAX_POSITIONS,
        pad_id=PAD,
    )
    assert packed.input_ids.shape[0] < len(completions), "documents share rows"

    with torch.no_grad():
        logps = policy_logps(model, packed.input_ids, packed.loss_mask, packed.position_ids)

    mask = packed.loss_mask
    torch.testing.assert_close(logps[mask], packed.behaviour_logps[mask].float(), rtol=0, atol=1e-5)
