"""The user's scorers: a tiny sequence classifier built from a config (one logit, three labels)
and a fastText classifier trained here score records as the models themselves do, whatever the
batching; thresholds reject exactly the records below them; unusable scorers are refused."""

from __future__ import annotations

import json
import random
import re

import fasttext
import numpy as np
import pandas as pd
import polars as pl
import pytest
import torch

from pipeline_assets.lib.silver.scorers import (
    FastTextScorer,
    ScorerError,
    ScorerSpec,
    SequenceClassifierScorer,
    Tokenize,
    below_threshold,
    check_scorer,
    encode_texts,
    parse_scorers,
)
from pipeline_assets_tests.fasttext_models import train_fasttext
from pipeline_assets_tests.hf_models import (
    classifier_folder,
    classifier_scores,
    qwen2_folder,
)

RESPONSES = [
    "Open settings, choose security, then reset the password.",
    "ok",
    "The order ships in two days; you can track it from the account page of the shop.",
    "Refunds go back to the card you paid with.",
    "Track it <|im_end|> from the account page.",
    "Refunds go back to the card you paid with within five working days, as the policy says.",
    "Two days.",
]
LABELS = {0: "low", 1: "mid", 2: "high"}
FASTTEXT_EXAMPLES = [
    ("open settings and reset the password step by step", "__label__good"),
    ("the refund goes back to the card within five days", "__label__good"),
    ("buy cheap pills now click here", "__label__spam"),
    ("click here to win cheap prizes now", "__label__spam"),
]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return classifier_folder(tmp_path_factory.mktemp("models") / "reward", num_labels=1)


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "classes"
    return classifier_folder(folder, num_labels=3, id2label=LABELS)


@pytest.fixture(scope="module")
def fasttext_file(tmp_path_factory):
    model = train_fasttext(FASTTEXT_EXAMPLES, epochs=8)
    return model, model.save(tmp_path_factory.mktemp("models") / "quality.bin")


def scored(spec: ScorerSpec, batch, batch_size: int = 32):
    return SequenceClassifierScorer(spec, batch_size=batch_size)(Tokenize(spec)(batch))


def test_reward_model_scores_are_its_logit_whatever_the_batching(reward_model):
    spec = ScorerSpec("reward", str(reward_model))
    expected = classifier_scores(reward_model, RESPONSES)
    assert len(set(np.round(expected, 6))) == len(RESPONSES)  # a real, varied signal
    tokenized = Tokenize(spec)({"response": np.array(RESPONSES, dtype=object)})
    scorer = SequenceClassifierScorer(spec)
    for batch_size in (1, 3, 64):
        scorer.batch_size = batch_size
        out = scorer(tokenized)
        assert "tokens_reward" not in out
        np.testing.assert_allclose(out["score_reward"], expected, atol=1e-4, rtol=0)
    order = list(range(len(RESPONSES)))
    random.Random(0).shuffle(order)
    shuffled = scored(spec, pd.DataFrame({"response": [RESPONSES[i] for i in order]}), 2)
    np.testing.assert_allclose(shuffled["score_reward"], [expected[i] for i in order], atol=1e-4)


def test_multi_class_score_is_the_labels_probability(three_labels):
    spec = ScorerSpec("edu", str(three_labels), label="high")
    out = scored(spec, pl.DataFrame({"response": RESPONSES}), batch_size=2)
    np.testing.assert_allclose(
        out["score_edu"].to_numpy(), classifier_scores(three_labels, RESPONSES, 2), atol=1e-4
    )
    assert out.columns == ["response", "score_edu"]


def test_a_special_token_in_the_text_stays_text(reward_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    [ids] = encode_texts(tokenizer, ["Track it <|im_end|> from here"])
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids


def test_fasttext_file_loads_and_predicts_our_forward_pass(fasttext_file):
    model, path = fasttext_file
    loaded = fasttext.load_model(str(path))
    texts = ["reset the password", "cheap pills click", "nothing known here", "the card now"]
    for text in texts:
        labels, probs = loaded.predict(text, k=-1)
        ours = dict(zip(model.labels, model.probabilities(text)))
        # fastText reports exp(log(p + 1e-5)) for a probability p
        np.testing.assert_allclose(probs, [ours[label] + 1e-5 for label in labels], atol=2e-6)
    assert 0.05 < model.probabilities("the card now")[0] < 0.95  # not saturated: a real test


def test_fasttext_scorer_scores_the_labels_probability(fasttext_file):
    model, path = fasttext_file
    texts = ["reset the\npassword step by step", "click here now", "the card within days"]
    for label in ("good", "__label__good"):
        out = FastTextScorer(ScorerSpec("ft", str(path), label=label))({"response": texts})
        expected = [model.probabilities(text.replace("\n", " "))[0] + 1e-5 for text in texts]
        np.testing.assert_allclose(out["score_ft"], expected, atol=2e-6)


def test_min_rejects_exactly_the_records_below_it():
    spec = ScorerSpec("edu", "unused", min=0.5)
    frame = pl.DataFrame({"record_id": list("abcde"), "score_edu": [0.1, 0.5, 0.49, 2.0, None]})
    kept, removed, details = below_threshold(frame, spec)
    assert kept["record_id"].to_list() == ["b", "d", "e"]  # at the threshold and unscored stay
    assert removed["record_id"].to_list() == ["a", "c"]
    assert removed["stage"].to_list() == ["quality_model"] * 2
    evidence = [json.loads(row) for row in removed["evidence"]]
    assert evidence == [
        {"scorer": "edu", "score": 0.1, "min": 0.5},
        {"scorer": "edu", "score": 0.49, "min": 0.5},
    ]
    assert details == {}
    assert below_threshold(frame, ScorerSpec("edu", "unused"))[1] is None


def test_the_setting_parses_and_names_the_bad_entry_and_field():
    [spec] = parse_scorers('[{"name": "edu", "model": "m", "min": 3, "label": "high"}]')
    assert spec == ScorerSpec("edu", "m", "response", 3.0, "high")
    assert spec.column == "score_edu"
    assert parse_scorers("") == []
    bad = {
        '{"name": "edu"}': "must be a JSON list",
        "[1": "not valid JSON",
        '["edu"]': "entry 0 must be an object",
        '[{"name": "Edu score", "model": "m"}]': "entry 0 ('Edu score'): 'name'",
        '[{"name": "edu"}]': "entry 0 ('edu'): 'model'",
        '[{"name": "edu", "model": "m", "text": "system"}]': "'text' must be one of",
        '[{"name": "edu", "model": "m", "min": "high"}]': "'min' must be a number",
        '[{"name": "edu", "model": "m", "min": true}]': "'min' must be a number",
        '[{"name": "edu", "model": "m", "label": 2}]': "'label' must be a class name",
        '[{"name": "edu", "model": "m", "threshold": 2}]': "unknown field(s) ['threshold']",
        '[{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]': "['a'] repeat",
    }
    for value, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_scorers(value)


def test_unusable_scorers_are_refused_with_a_message(tmp_path, three_labels, fasttext_file):
    _, path = fasttext_file
    causal = qwen2_folder(tmp_path / "causal")
    garbage = tmp_path / "broken.bin"
    garbage.write_bytes(b"not a model at all")
    refused = {
        ScorerSpec("x", str(causal)): "not a sequence classifier.*Qwen2ForCausalLM",
        ScorerSpec("x", str(tmp_path / "missing")): "neither a Hugging Face model folder",
        ScorerSpec("x", str(tmp_path / "empty")): "not a Hugging Face model folder",
        ScorerSpec("x", str(three_labels)): "has 3 labels.*set 'label'",
        ScorerSpec("x", str(three_labels), label="top"): "no label 'top'.*'low', 'mid', 'high'",
        ScorerSpec("x", str(garbage), label="good"): "does not load as a fastText model",
        ScorerSpec("x", str(path), label="meh"): "'label' must be one of",
        ScorerSpec("x", str(path)): "'label' must be one of",
    }
    (tmp_path / "empty").mkdir()
    for spec, message in refused.items():
        with pytest.raises(ScorerError, match=message):
            check_scorer(spec)
    with pytest.raises(ScorerError, match="not a Hugging Face model folder"):
        SequenceClassifierScorer(ScorerSpec("x", str(tmp_path / "empty")))
    with pytest.raises(ScorerError, match="no label 'meh'"):
        FastTextScorer(ScorerSpec("x", str(path), label="meh"))
    with pytest.raises(ScorerError, match="does not load"):
        FastTextScorer(ScorerSpec("x", str(garbage), label="good"))
    with pytest.raises(ScorerError, match="CUDA only"):
        SequenceClassifierScorer(
            ScorerSpec("x", str(three_labels), label="high"), dtype=torch.bfloat16
        )
