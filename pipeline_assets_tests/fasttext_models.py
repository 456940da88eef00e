"""A tiny fastText classifier trained here and written in fastText's ``.bin`` format.

The ``fasttext`` module installed (fasttext-predict) predicts but cannot train, so the model is
fastText's supervised architecture built by hand: the words of a line (and the end-of-line token
``</s>``, which fastText appends) -> the mean of their input vectors -> a linear layer -> softmax.
No word n-grams or subwords (wordNgrams 1, minn = maxn = 0, bucket 0), so a line's input rows are
its known words alone. The file layout follows fastText's sources: ``FastText::saveModel``,
``Args::save``, ``Dictionary::save``, ``DenseMatrix::save``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

EOS = "</s>"
MAGIC, VERSION = 793712314, 12
LOSS_SOFTMAX, MODEL_SUPERVISED = 3, 3


class TinyFastText:
    def __init__(self, words: list[str], labels: list[str], input_rows, output_rows):
        self.words, self.labels = words, labels
        self.index = {word: row for row, word in enumerate(words)}
        self.input = np.asarray(input_rows, dtype=np.float32)
        self.output = np.asarray(output_rows, dtype=np.float32)

    def probabilities(self, line: str) -> np.ndarray:
        """Our own forward pass: every label's probability for one line of text."""
        rows = [self.index[word] for word in [*line.split(), EOS] if word in self.index]
        hidden = self.input[rows].astype(np.float64).mean(axis=0)
        logits = self.output.astype(np.float64) @ hidden
        exp = np.exp(logits - logits.max())
        return exp / exp.sum()

    def save(self, path: Path) -> Path:
        dim = self.input.shape[1]
        args = struct.pack(
            "<12id", dim, 5, 5, 1, 5, 1, LOSS_SOFTMAX, MODEL_SUPERVISED, 0, 0, 0, 100, 1e-4
        )
        entries = [(word, 0) for word in self.words] + [(label, 1) for label in self.labels]
        dictionary = struct.pack(
            "<3i2q", len(entries), len(self.words), len(self.labels), len(entries), -1
        )
        dictionary += b"".join(
            word.encode() + b"\0" + struct.pack("<qb", 1, kind) for word, kind in entries
        )
        with path.open("wb") as out:
            out.write(struct.pack("<2i", MAGIC, VERSION) + args + dictionary)
            out.write(b"\0" + _matrix(self.input) + b"\0" + _matrix(self.output))
        return path


def _matrix(rows: np.ndarray) -> bytes:
    return struct.pack("<2q", *rows.shape) + rows.astype("<f4").tobytes()


def train_fasttext(examples: list[tuple[str, str]], dim: int = 8, epochs: int = 60, seed: int = 0):
    """A TinyFastText trained on (text, label) pairs, labels given with their ``__label__``."""
    import torch  # here: a test that builds its model by hand need not import torch

    torch.manual_seed(seed)
    words = sorted({word for text, _ in examples for word in text.split()}) + [EOS]
    labels = sorted({label for _, label in examples})
    index = {word: row for row, word in enumerate(words)}
    bag = torch.zeros(len(examples), len(words))
    for row, (text, _) in enumerate(examples):
        ids = [index[word] for word in [*text.split(), EOS]]
        bag[row].index_add_(0, torch.tensor(ids), torch.full((len(ids),), 1.0 / len(ids)))
    targets = torch.tensor([labels.index(label) for _, label in examples])
    embedding = torch.nn.Parameter(torch.randn(len(words), dim) * 0.1)
    linear = torch.nn.Parameter(torch.randn(len(labels), dim) * 0.1)
    optimizer = torch.optim.Adam([embedding, linear], lr=0.1)
    for _ in range(epochs):
        loss = torch.nn.functional.cross_entropy(bag @ embedding @ linear.T, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return TinyFastText(words, labels, embedding.detach().numpy(), linear.detach().numpy())
