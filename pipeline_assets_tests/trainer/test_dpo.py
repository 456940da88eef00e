"""DPO on packed pairs: per-document log-probabilities as if each document ran alone, the sigmoid
loss and its metrics worked by hand, and two FSDP2 ranks with uneven pairs giving one process's
gradients."""

from __future__ import annotations

import inspect
import math
import os
import subprocess
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.nn.functional as F

from pipeline_assets.lib.gold.preference_packing import pack_pairs
from pipeline_assets.lib.training.torchrun import torchrun_env, torchrun_executable
from pipeline_assets.trainer.dpo import DEFAULT_BETA, chosen_and_rejected, document_logps, dpo_loss
from pipeline_assets.trainer.model import ATTENTION_KERNELS
from pipeline_assets_tests.trainer.dpo_batches import (
    PAD_ID,
    SEQ_LEN,
    batch_loss,
    batch_of,
    policy_and_reference,
    random_pairs,
    two_rank_rows,
)

# Rows with a padding tail and one exactly full (2 * 8 + 24 + 24 = 64 tokens).
PACKED_SHAPES = [(8, 24, 24), (5, 9, 7), (3, 4, 12), (6, 2, 5), (1, 1, 1), (9, 10, 3), (2, 7, 7)]


def _one_document_per_row(documents: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Unpacked rows: each (prefix, response) alone at the start of its own row,
    padding after it."""
    width = max(len(prefix) + len(response) for prefix, response in documents)
    rows = {"input_ids": [], "loss_mask": [], "position_ids": []}
    for prefix, response in documents:
        length = len(prefix) + len(response)
        rows["input_ids"].append(prefix + response + [PAD_ID] * (width - length))
        rows["loss_mask"].append(
            [False] * len(prefix) + [True] * len(response) + [False] * (width - length)
        )
        rows["position_ids"].append(list(range(length)) + list(range(width - length)))
    return {name: torch.tensor(values) for name, values in rows.items()}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
def test_packed_document_logps_equal_each_document_run_alone(kernel, dtype):
    pairs = random_pairs(PACKED_SHAPES, seed=3)
    rows = pack_pairs(pairs, SEQ_LEN, PAD_ID).rows
    assert (
        rows["document_lengths"].list.sum().max() == SEQ_LEN
        and rows["document_lengths"].list.sum().min() < SEQ_LEN
    )
    model, _ = policy_and_reference(kernel)
    model = model.to(dtype).eval()
    by_id = {pair["pair_id"]: pair for pair in pairs.iter_rows(named=True)}

    with torch.no_grad():
        batch = batch_of(rows)
        packed = document_logps(model(batch["input_ids"], batch["position_ids"]), **batch)
        unpacked = _one_document_per_row(
            [
                (by_id[pair_id]["prefix_ids"], by_id[pair_id][response])
                for pair_id in rows["pair_ids"].explode()
                for response in ("chosen_ids", "rejected_ids")
            ]
        )
        alone = document_logps(model(unpacked["input_ids"], unpacked["position_ids"]), **unpacked)

    assert packed.dtype == dtype and packed.shape == (2 * pairs.height,)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def _tiny_rows() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two rows: documents of 3 and 2 tokens then a tail of 1; documents of 2 and 4
    tokens, no tail."""
    torch.manual_seed(5)
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 1, 2]]),
        "loss_mask": torch.tensor([[0, 1, 1, 0, 1, 0], [0, 1, 0, 0, 1, 1]], dtype=torch.bool),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]),
    }
    return torch.randn(2, 6, 10, dtype=torch.float64), batch


def test_document_logps_sum_each_documents_response_predictions_worked_by_hand():
    logits, batch = _tiny_rows()
    logp = logits.log_softmax(-1)
    ids = batch["input_ids"]

    def predicted(
        row: int, target: int
    ) -> torch.Tensor:  # the logits at target - 1 predict the token at target
        return logp[row, target - 1, ids[row, target]]

    expected = torch.stack(
        [
            predicted(0, 1) + predicted(0, 2),
            predicted(0, 4),
            predicted(1, 1),
            predicted(1, 4) + predicted(1, 5),
        ]
    )  # the tail of row 0 is not a document

    torch.testing.assert_close(document_logps(logits, **batch), expected)


def test_a_document_is_never_predicted_from_the_one_before():
    logits, batch = _tiny_rows()
    across_a_boundary = logits.clone()
    # the logits at a document's last token would predict the next document's first (or nothing)
    across_a_boundary[0, [2, 4, 5]] += torch.linspace(-3.0, 3.0, 10, dtype=logits.dtype)
    across_a_boundary[1, [1, 5]] += torch.linspace(-3.0, 3.0, 10, dtype=logits.dtype)
    within = logits.clone()
    within[0, 0] += torch.linspace(-3.0, 3.0, 10, dtype=logits.dtype)

    torch.testing.assert_close(
        document_logps(across_a_boundary, **batch), document_logps(logits, **batch)
    )
    assert (document_logps(within, **batch) - document_logps(logits, **batch)).abs()[0] > 1e-3


def test_chosen_and_rejected_are_documents_two_k_and_two_k_plus_one():
    chosen, rejected = chosen_and_rejected(torch.tensor([1.0, 2.0, 3.0, 4.0]))

    assert chosen.tolist() == [1.0, 3.0] and rejected.tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="even number"):
        chosen_and_rejected(torch.tensor([1.0, 2.0, 3.0]))


def test_loss_worked_by_hand():
    policy_chosen, policy_rejected = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    reference_chosen, reference_rejected = torch.tensor([-1.5, -2.0]), torch.tensor([-2.0, -2.0])

    loss, metrics = dpo_loss(
        policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=0.5
    )

    # pair 0: rewards 0.5 * 0.5 = 0.25 and 0.5 * -1 = -0.5, margin 0.75,
    # loss log(1 + e^-0.75) = 0.386871
    # pair 1: rewards 0.5 * 0 = 0 and 0.5 * 1 = 0.5, margin -0.5, loss log(1 + e^0.5) = 0.974077
    assert loss.item() == pytest.approx((0.38687100611489994 + 0.9740769841801067) / 2, rel=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.125)
    assert metrics["rewards/rejected"].item() == pytest.approx(0.0)
    assert metrics["rewards/margins"].item() == pytest.approx(0.125)
    assert metrics["rewards/accuracies"].item() == 0.5
    assert int(metrics["pairs"]) == 2


def test_at_policy_equal_to_reference_the_loss_is_log_2_and_no_pair_is_won():
    logps = torch.tensor([-12.5, -3.0, -40.25])

    loss, metrics = dpo_loss(logps, logps + 1.0, logps, logps + 1.0)

    assert loss.item() == pytest.approx(math.log(2))
    assert [
        metrics[name].item() for name in ("rewards/chosen", "rewards/rejected", "rewards/margins")
    ] == [0, 0, 0]
    assert metrics["rewards/accuracies"].item() == 0.0  # a tie is no win


def test_the_default_beta_is_0_1_and_used_by_the_loss():
    pair = [torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([0.0]), torch.tensor([0.0])]

    loss, _ = dpo_loss(*pair)

    assert (
        DEFAULT_BETA == 0.1
        and inspect.signature(dpo_loss).parameters["beta"].default == DEFAULT_BETA
    )
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(0.1)).item())


def test_a_rank_scales_its_pair_sum_by_world_size_over_global_pairs():
    pair = [torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.0])]
    alone, _ = dpo_loss(*pair)

    shared, _ = dpo_loss(*pair, global_pairs=torch.tensor(4), world_size=2)

    assert shared.item() == pytest.approx(alone.item() * 2 / 4)
    with pytest.raises(ValueError, match="pass global_pairs"):
        dpo_loss(*pair, world_size=2)


def test_no_local_pairs_give_a_zero_loss_and_zero_metrics():
    empty = torch.zeros(0, requires_grad=True)

    loss, metrics = dpo_loss(empty, empty, empty, empty, global_pairs=3, world_size=2)
    loss.backward()

    assert loss.item() == 0.0 and int(metrics["pairs"]) == 0
    assert all(metrics[name].item() == 0.0 for name in metrics)


def _single_process_gradients(
    rows: pl.DataFrame, per_rank_mean: bool = False
) -> tuple[float, dict]:
    """The reference: one process, the whole global batch. per_rank_mean: the wrong normalisation,
    each row's mean loss averaged, to show the test tells them apart."""
    policy, reference = policy_and_reference()
    if per_rank_mean:
        losses = [
            batch_loss(policy, reference, batch_of(rows[k : k + 1]))[0] for k in range(rows.height)
        ]
        loss = torch.stack(losses).mean()
    else:
        loss, _ = batch_loss(policy, reference, batch_of(rows))
    loss.backward()
    return loss.item(), {name: parameter.grad for name, parameter in policy.named_parameters()}


def test_two_fsdp_ranks_with_3_and_1_pairs_give_the_single_process_gradients(tmp_path):
    out = tmp_path / "dpo_gradients.pt"
    probe = Path(__file__).with_name("dpo_gradient_probe.py")
    command = [*torchrun_executable(), "--standalone", "--nproc-per-node=2", str(probe), str(out)]
    environment = {
        **{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
        **torchrun_env(1),
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stdout + done.stderr
    sharded = torch.load(out, weights_only=True)

    rows = two_rank_rows()
    loss, gradients = _single_process_gradients(rows)
    _, per_rank_mean_gradients = _single_process_gradients(rows, per_rank_mean=True)

    assert sharded["pairs_per_rank"] == [3, 1]
    assert sharded["loss"].item() == pytest.approx(loss, rel=1e-5)
    assert sharded["gradients"].keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(
            sharded["gradients"][name], gradient, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}"
        )
    difference = max(
        (per_rank_mean_gradients[name] - gradient).abs().max().item()
        for name, gradient in gradients.items()
    )
    assert difference > 1e-4, (
        "per-rank means would pass too: the batch cannot tell the normalisations apart"
    )
