"""The text each scorer judges, per record format, and the scorer stages on a conversation block."""

from __future__ import annotations

import polars as pl
import torch

from pipeline_assets.lib.formats import CONVERSATION, PREFERENCE, SFT, TURNS
from pipeline_assets.lib.silver.scorers import ScorerSpec, encode_texts
from pipeline_assets.lib.silver.scoring import scored_text, scorer_stages
from pipeline_assets.lib.stages import run_stages
from pipeline_assets_tests.hf_models import classifier_folder

TURN_LIST = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Reset <|im_end|> my password?"},
    {"role": "assistant", "content": "Open settings, then security."},
]


def _texts(fmt, frame: pl.DataFrame, text: str) -> list[str]:
    return fmt.with_views(frame).select(scored_text(fmt, text)).to_series().to_list()


def test_each_format_gives_its_scorers_the_answer_the_prompt_or_every_turn_after_its_role():
    sft = pl.DataFrame(
        {"system": [None, "Be brief."], "prompt": ["P1", "P2"], "response": ["R1", "R2"]}
    )
    assert _texts(SFT, sft, "response") == ["R1", "R2"]
    assert _texts(SFT, sft, "prompt") == ["P1", "P2"]
    assert _texts(SFT, sft, "conversation") == [
        "user: P1\n\nassistant: R1",
        "system: Be brief.\n\nuser: P2\n\nassistant: R2",
    ]
    chats = pl.DataFrame({"messages": [TURN_LIST]}, schema={"messages": TURNS})
    assert _texts(CONVERSATION, chats, "prompt") == ["Reset <|im_end|> my password?"]
    assert _texts(CONVERSATION, chats, "response") == ["Open settings, then security."]
    assert _texts(CONVERSATION, chats, "conversation") == [
        "system: Be brief.\n\nuser: Reset <|im_end|> my password?\n\n"
        "assistant: Open settings, then security."
    ]
    pairs = pl.DataFrame(
        {
            "system": [None],
            "prompt_messages": [TURN_LIST],
            "prompt": ["And the email?"],
            "chosen": ["Under account."],
            "rejected": ["No."],
        },
        schema_overrides={"prompt_messages": TURNS},
    )
    assert _texts(PREFERENCE, pairs, "conversation") == [
        "system: Be brief.\n\nuser: Reset <|im_end|> my password?\n\nassistant: Open settings, "
        "then security.\n\nuser: And the email?\n\nassistant: Under account."
    ]


def test_a_conversation_scorer_scores_the_whole_conversation_as_the_model_does(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = classifier_folder(tmp_path / "reward", num_labels=1)
    spec = ScorerSpec("whole", str(folder), text="conversation")
    chats = CONVERSATION.with_views(
        pl.DataFrame({"messages": [TURN_LIST] * 2}, schema={"messages": TURNS})
    )
    stages = scorer_stages([spec], CONVERSATION)
    assert [(s.name, s.on_actors) for s in stages] == [
        ("tokenize_whole", False),
        ("score_whole", True),
    ]
    result = run_stages(stages, chats)
    text = _texts(CONVERSATION, chats, "conversation")[0]
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    (ids,) = encode_texts(AutoTokenizer.from_pretrained(folder), [text])
    with torch.no_grad():
        own = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    assert all(abs(score - own) < 1e-4 for score in result.kept["score_whole"])
    assert "tokens_score_whole" not in result.kept.columns


def test_scores_and_verdicts_do_not_depend_on_the_block_size(tmp_path):
    from functools import partial

    from pipeline_assets.lib.stages import run_in_process

    folder = classifier_folder(tmp_path / "reward", num_labels=1)
    responses = [" ".join(["step"] * (i % 9 + 1) + [f"item {i}"]) for i in range(23)]
    frame = pl.DataFrame({"record_id": [str(i) for i in range(23)], "response": responses})
    spec = ScorerSpec("reward", str(folder))
    whole = run_stages(scorer_stages([spec], SFT), frame).kept["score_reward"]
    ordered = whole.sort()
    threshold = float(ordered[11] + ordered[12]) / 2  # between two scores: no rounding flips it
    gated = ScorerSpec("reward", str(folder), min=threshold)
    results = [
        partial(run_in_process, rows_per_block=size)(scorer_stages([gated], SFT), frame)
        for size in (1, 5, 23)
    ]
    for result in results:
        kept = dict(zip(result.kept["record_id"], result.kept["score_reward"]))
        assert all(abs(kept[i] - s) < 1e-4 for i, s in zip(frame["record_id"], whole) if i in kept)
        assert set(result.removed["score_reward"]["record_id"]) == {
            i for i, s in zip(frame["record_id"], whole) if s < threshold
        }
