"""The chunked next-token loss equals the loss of the whole logits, values and gradients, and never
keeps a (tokens x vocabulary) tensor for the backward pass."""

import torch
import torch.nn.functional as F

from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.losses import next_token_losses
from pipeline_assets.trainer.model import Transformer, token_losses

BATCH, LENGTH, DIM, VOCAB = 3, 11, 16, 97  # 3 x 10 = 30 targets: a chunk of 7 does not divide it
CHUNK = 7


def _inputs(bias: bool):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, LENGTH, DIM, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, generator=generator, requires_grad=True)
    offset = torch.randn(VOCAB, generator=generator, requires_grad=True) if bias else None
    input_ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    return hidden, weight, offset, input_ids


def _whole_logits_losses(hidden, weight, bias, input_ids):
    logits = F.linear(hidden, weight, bias)
    return token_losses(logits, input_ids)


def _gradients(losses, *tensors):
    weights = torch.linspace(0.5, 2.0, losses.numel()).view_as(losses)  # every target weighs apart
    return torch.autograd.grad((losses * weights).sum(), [t for t in tensors if t is not None])


def test_chunked_losses_and_gradients_equal_the_whole_logits_with_a_ragged_last_chunk():
    for bias in (False, True):
        hidden, weight, offset, input_ids = _inputs(bias)
        chunked = next_token_losses(hidden, weight, input_ids, offset, chunk_tokens=CHUNK)
        whole = _whole_logits_losses(hidden, weight, offset, input_ids)

        assert chunked.shape == (BATCH, LENGTH - 1) and chunked.dtype == torch.float32
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
        for mine, theirs in zip(
            _gradients(chunked, hidden, weight, offset),
            _gradients(whole, hidden, weight, offset),
            strict=True,
        ):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_no_logits_are_kept_for_backward_only_the_inputs_of_each_chunk():
    hidden, weight, _, input_ids = _inputs(bias=False)
    kept = []

    def keep_shape(tensor):
        kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep_shape, lambda tensor: tensor):
        losses = next_token_losses(hidden, weight, input_ids, chunk_tokens=CHUNK)
    losses.sum().backward()

    assert (VOCAB, DIM) in kept, "the output weight is saved (it is a parameter anyway)"
    assert not [shape for shape in kept if shape[-1] == VOCAB], "no logits are saved"
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep_shape, lambda tensor: tensor):
        _whole_logits_losses(hidden, weight, None, input_ids)
    assert (BATCH * (LENGTH - 1), VOCAB) in kept, "the check sees logits when they are kept"


def test_the_built_in_model_gives_the_same_losses_and_gradients_chunked():
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=32)
    )
    input_ids = torch.randint(0, VOCAB, (2, 13))
    position_ids = torch.cat([torch.arange(6), torch.arange(7)]).repeat(2, 1)

    chunked = model(input_ids, position_ids, next_token_losses=True)
    chunked_gradients = torch.autograd.grad(chunked.sum(), list(model.parameters()))
    whole = token_losses(model(input_ids, position_ids), input_ids)
    whole_gradients = torch.autograd.grad(whole.sum(), list(model.parameters()))

    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(chunked_gradients, whole_gradients, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
