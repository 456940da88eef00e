"""The transformer in-process: document masking (dense and FlexAttention), rotary positions, the
loss, parameter and FLOP counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F

from pipeline_assets.trainer import model as model_module
from pipeline_assets.trainer.config import PRESETS, ModelConfig
from pipeline_assets.trainer.model import (
    Transformer,
    count_parameters,
    document_causal_mask,
    document_causal_mask_mod,
    flops_per_token,
    loss_sum_and_count,
)
from pipeline_assets.trainer.parallel import attention_kernel

CONFIG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=32)
FIRST, SECOND, PADDING = 10, 12, 10


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).eval()


def _packed_position_ids() -> torch.Tensor:
    return torch.cat([torch.arange(FIRST), torch.arange(SECOND), torch.arange(PADDING)])[None]


def _random_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(
        1, CONFIG.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed)
    )


def _logits(
    model: Transformer, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, position_ids)[0]


def _assert_differs(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual - expected).abs().max() > 1e-3


def test_attention_stays_within_a_packed_document(model):
    position_ids = _packed_position_ids()
    row = _random_ids(FIRST + SECOND + PADDING, seed=1)
    changed = row.clone()
    changed[0, :FIRST] = (row[0, :FIRST] % (CONFIG.vocab_size - 1)) + 1

    before, after = _logits(model, row, position_ids), _logits(model, changed, position_ids)

    torch.testing.assert_close(after[FIRST:], before[FIRST:])
    _assert_differs(after[:FIRST], before[:FIRST])


def test_a_document_has_the_same_logits_packed_after_another_or_alone(model):
    row = _random_ids(FIRST + SECOND + PADDING, seed=2)
    second = row[:, FIRST : FIRST + SECOND]

    packed = _logits(model, row, _packed_position_ids())[FIRST : FIRST + SECOND]
    alone = _logits(model, second, torch.arange(SECOND)[None])

    torch.testing.assert_close(packed, alone)


def test_logits_depend_on_the_position_ids_given_not_on_the_index_in_the_row():
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    with torch.no_grad():
        model.blocks[0].attention.qkv.weight.normal_(0.0, 0.5)
    ids = _random_ids(SECOND, seed=3)

    contiguous = _logits(model, ids, torch.arange(SECOND)[None])
    spread = _logits(model, ids, (torch.arange(SECOND) * 2)[None])

    torch.testing.assert_close(spread[0], contiguous[0])
    _assert_differs(spread[1:], contiguous[1:])


def test_a_later_token_does_not_change_earlier_logits(model):
    position_ids = _packed_position_ids()
    row = _random_ids(FIRST + SECOND + PADDING, seed=4)
    changed_at = FIRST + 5
    changed = row.clone()
    changed[0, changed_at] = (row[0, changed_at] % (CONFIG.vocab_size - 1)) + 1

    before, after = _logits(model, row, position_ids), _logits(model, changed, position_ids)

    torch.testing.assert_close(after[:changed_at], before[:changed_at])
    _assert_differs(after[changed_at : FIRST + SECOND], before[changed_at : FIRST + SECOND])


def _flex_mask_at_every_pair(position_ids: torch.Tensor) -> torch.Tensor:
    batch, length = position_ids.shape
    return flex_module.create_mask(
        document_causal_mask_mod(position_ids), batch, 1, length, length, device="cpu"
    )


@pytest.mark.parametrize(
    "build", [document_causal_mask, _flex_mask_at_every_pair], ids=["dense", "flex_mask_mod"]
)
def test_document_causal_mask_matches_a_hand_written_matrix(build):
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 0]])
    expected = torch.tensor(
        [
            [
                [1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [0, 0, 0, 1, 0],
                [0, 0, 0, 1, 1],
            ],
            [
                [1, 0, 0, 0, 0],
                [0, 1, 0, 0, 0],
                [0, 1, 1, 0, 0],
                [0, 1, 1, 1, 0],
                [0, 0, 0, 0, 1],
            ],
        ],
        dtype=torch.bool,
    )[:, None]

    mask = build(position_ids)

    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def _packed_rows() -> dict[str, torch.Tensor]:
    """Three full rows of several documents each, a one-token document among them."""
    lengths = [[5, 1, 12, 9, 5], [20, 12], [3, 3, 3, 3, 3, 3, 14]]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    generator = torch.Generator().manual_seed(6)
    return {
        "input_ids": torch.randint(1, CONFIG.vocab_size, position_ids.shape, generator=generator),
        "loss_mask": torch.rand(position_ids.shape, generator=generator) > 0.2,
        "position_ids": position_ids,
    }


def _loss_and_gradients(kernel: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(CONFIG, attention_kernel=kernel)
    rows = _packed_rows()
    loss_sum, count = loss_sum_and_count(model(rows["input_ids"], rows["position_ids"]), **rows)
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), {name: parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_gives_the_dense_masks_loss_and_gradients(monkeypatch):
    # torch refuses FlexAttention's backward on CPU (its fused kernels are CUDA's). Lifting that
    # guard runs flex_attention's own reference forward and backward, which the CUDA kernel
    # implements, on this model's block mask.
    monkeypatch.setattr(flex_module, "_validate_device", lambda query, key, value: None)
    calls = []

    def counted_flex_attention(*args, **kwargs):
        calls.append(1)
        return flex_module.flex_attention(*args, **kwargs)

    monkeypatch.setattr(model_module, "flex_attention", counted_flex_attention)

    dense_loss, dense_gradients = _loss_and_gradients("dense")
    flex_loss, flex_gradients = _loss_and_gradients("flex")

    assert len(calls) == CONFIG.n_layers
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-6, atol=1e-6)
    assert flex_gradients.keys() == dense_gradients.keys()
    for name, gradient in dense_gradients.items():
        torch.testing.assert_close(
            flex_gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}"
        )


@pytest.mark.parametrize(
    ("setting", "device", "head_dim", "expected"),
    [
        ("auto", "cuda", 16, "flex"),
        ("auto", "cuda", 8, "dense"),
        ("auto", "cpu", 64, "dense"),
        ("flex", "cuda", 16, "flex"),
        ("dense", "cuda", 64, "dense"),
    ],
)
def test_attention_kernel_is_flex_only_where_flex_trains(setting, device, head_dim, expected):
    assert attention_kernel(setting, torch.device(device), head_dim) == expected


@pytest.mark.parametrize(("device", "head_dim"), [("cpu", 64), ("cuda", 8)])
def test_flex_where_it_cannot_train_is_refused(device, head_dim):
    with pytest.raises(ValueError, match="--attention flex needs a CUDA device"):
        attention_kernel("flex", torch.device(device), head_dim)


def _loss_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(5)
    input_ids = torch.tensor([[3, 7, 1, 4, 9, 2]])
    loss_mask = torch.tensor([[False, True, True, True, False, True]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    logits = torch.randn(1, 6, 10)
    return logits, input_ids, loss_mask, position_ids


def test_loss_counts_only_masked_in_targets_inside_a_document():
    logits, input_ids, loss_mask, position_ids = _loss_example()

    loss_sum, count = loss_sum_and_count(logits, input_ids, loss_mask, position_ids)

    counted_predictions, counted_targets = [0, 1, 4], [1, 2, 5]
    expected = F.cross_entropy(
        logits[0, counted_predictions], input_ids[0, counted_targets], reduction="sum"
    )
    assert int(count) == 3
    torch.testing.assert_close(loss_sum, expected)


@pytest.mark.parametrize("prediction", [2, 3, 5])
def test_loss_ignores_logits_that_predict_an_uncounted_target(prediction):
    logits, input_ids, loss_mask, position_ids = _loss_example()
    changed = logits.clone()
    changed[0, prediction] += torch.linspace(-3.0, 3.0, 10)

    before, _ = loss_sum_and_count(logits, input_ids, loss_mask, position_ids)
    after, _ = loss_sum_and_count(changed, input_ids, loss_mask, position_ids)

    assert after.item() == before.item()


@pytest.mark.parametrize("prediction", [0, 1, 4])
def test_loss_follows_logits_that_predict_a_counted_target(prediction):
    logits, input_ids, loss_mask, position_ids = _loss_example()
    changed = logits.clone()
    changed[0, prediction] += torch.linspace(-3.0, 3.0, 10)

    before, _ = loss_sum_and_count(logits, input_ids, loss_mask, position_ids)
    after, _ = loss_sum_and_count(changed, input_ids, loss_mask, position_ids)

    assert abs(after.item() - before.item()) > 1e-3


def _manual_parameter_count(config: ModelConfig) -> int:
    per_block = 2 * config.dim + 4 * config.dim**2 + 3 * config.dim * config.ffn_dim
    return config.vocab_size * config.dim + config.n_layers * per_block + config.dim


def test_output_weights_are_the_embedding_and_are_counted_once(model):
    with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))

    assert model.output.weight is model.embedding.weight
    assert count_parameters(model) == _manual_parameter_count(CONFIG)
    assert with_duplicates - count_parameters(model) == CONFIG.vocab_size * CONFIG.dim


def test_flops_per_token_is_six_per_weight_plus_attention_worked_by_hand():
    assert CONFIG.ffn_dim == 128
    weights = 2 * (4 * 32 * 32 + 3 * 32 * 128) + 50 * 32
    assert weights == 34_368

    assert flops_per_token(CONFIG, 32) == 6 * 34_368 + 12 * 2 * 32 * 32 == 230_784


def test_flops_per_token_weights_are_the_models_non_norm_parameters(model):
    norm_parameters = (2 * CONFIG.n_layers + 1) * CONFIG.dim
    attention = 12 * CONFIG.n_layers * CONFIG.dim * 16

    assert (
        flops_per_token(CONFIG, 16) == 6 * (count_parameters(model) - norm_parameters) + attention
    )


def test_flops_per_token_grows_with_sequence_length():
    short, long = flops_per_token(CONFIG, 32), flops_per_token(CONFIG, 64)

    assert long > short
    assert long - short == 12 * CONFIG.n_layers * CONFIG.dim * 32


def _meta_parameter_count(name: str) -> int:
    with torch.device("meta"):
        return count_parameters(Transformer(PRESETS[name]))


def test_base_preset_has_at_least_100m_parameters_and_large_more():
    base, large = _meta_parameter_count("base"), _meta_parameter_count("large")

    assert base >= 100_000_000
    assert large > base
    assert base == _manual_parameter_count(PRESETS["base"])
