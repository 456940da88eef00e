"""Language identification: the packaged lid.176 model labels text in seven languages, a keep list
removes exactly the others with their evidence, and labels do not depend on how records are cut
into blocks or on the format whose text is judged."""

from __future__ import annotations

import json

import polars as pl
import pytest

from pipeline_assets.lib.formats import CONVERSATION, PREFERENCE
from pipeline_assets.lib.silver.language import (
    REJECT_REASON,
    identify_languages,
    language_stage,
    predict_languages,
)
from pipeline_assets.lib.stages import run_in_process, run_stages

TEXTS = {
    "en": "The library closes the file when the block ends, even if an exception is raised.\n"
    "You should use it whenever a resource must be released at a known point.",
    "de": "Die Bibliothek schließt die Datei am Ende des Blocks, auch wenn eine Ausnahme "
    "auftritt.\nMan sollte sie immer verwenden, wenn eine Ressource freigegeben werden muss.",
    "fr": "La bibliothèque ferme le fichier à la fin du bloc, même si une exception est levée.\n"
    "Il faut l'utiliser chaque fois qu'une ressource doit être libérée.",
    "es": "La biblioteca cierra el archivo cuando termina el bloque, incluso si se produce una "
    "excepción.\nDebes usarla siempre que un recurso tenga que liberarse.",
    "ru": "Библиотека закрывает файл в конце блока, даже если возникло исключение.\n"
    "Её нужно использовать всякий раз, когда ресурс должен быть освобождён.",
    "zh": "即使发生异常，该库也会在代码块结束时关闭文件。\n"
    "每当需要在确定的时刻释放资源时，都应该使用它。",
    "ja": "例外が発生した場合でも、ライブラリはブロックの終わりでファイルを閉じます。\n"
    "リソースを決まった時点で解放する必要があるときは、いつでもこれを使ってください。",
}


def sft_block(languages: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "record_id": [f"r{i}" for i in range(len(languages))],
            "prompt": ["How do I close a file?"] * len(languages),
            "response": [TEXTS[language] for language in languages],
        },
        schema={"record_id": pl.String, "prompt": pl.String, "response": pl.String},
    )


def test_each_language_is_labelled_with_a_probability():
    labelled, removed, details = identify_languages(sft_block(list(TEXTS)))
    assert labelled["language"].to_list() == list(TEXTS)
    assert all(0 < score <= 1 for score in labelled["language_score"])
    assert labelled["language_score"].min() > 0.5, labelled.select("language", "language_score")
    assert removed.height == 0
    assert details == {"language_mix": {language: 1 for language in TEXTS}}


def test_newlines_do_not_reach_the_model():
    # fastText refuses a text with a newline: predicting it whole would raise
    with pytest.raises(ValueError, match="one line at a time"):
        predict_languages([TEXTS["en"]])
    assert identify_languages(sft_block(["en"]))[0]["language"].item() == "en"


def test_a_keep_list_removes_exactly_the_other_languages_with_their_evidence():
    block = sft_block([*TEXTS, "en", "fr"])
    result = run_stages([language_stage(keep=frozenset({"en", "de"}))], block)
    kept, removed = result.kept, result.removed["language"]
    assert kept["record_id"].to_list() == ["r0", "r1", "r7"]
    assert removed["record_id"].to_list() == ["r2", "r3", "r4", "r5", "r6", "r8"]
    assert set(removed["stage"]) == {REJECT_REASON}
    for row in removed.iter_rows(named=True):
        evidence = json.loads(row["evidence"])
        assert evidence == {
            "language": row["language"],
            "score": row["language_score"],
            "keep": ["de", "en"],
        }
    assert [json.loads(e)["language"] for e in removed["evidence"]] == [
        "fr", "es", "ru", "zh", "ja", "fr"
    ]  # fmt: skip
    counters = result.counters["language"]
    assert counters["rows_in"] == block.height == counters["kept"] + counters["rejected"]
    assert (counters["kept"], counters["rejected"]) == (3, 6)
    assert counters["language_mix"]["en"] == 2 and counters["language_mix"]["fr"] == 2


def test_an_empty_block_gives_typed_empty_frames():
    result = run_stages([language_stage(keep=frozenset({"en"}))], sft_block([]))
    assert result.kept.height == 0 and result.removed["language"].height == 0
    assert result.kept.schema["language"] == pl.String
    assert result.kept.schema["language_score"] == pl.Float64
    assert result.counters["language"]["language_mix"] == {}


def test_a_record_without_text_is_refused_by_name():
    block = pl.DataFrame({"response": ["Hello there, how are you today?", None]})
    with pytest.raises(ValueError, match="1 record.*'response'"):
        identify_languages(block)


def test_conversations_are_judged_on_their_assistant_turns():
    def conversation(user: str, answer: str) -> list[dict]:
        return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]

    block = CONVERSATION.with_views(
        pl.DataFrame(
            {
                "record_id": ["c0", "c1"],
                # the user's English question does not decide the language of the answer
                "messages": [
                    conversation("How do I close a file?", TEXTS["de"]),
                    conversation("How do I close a file?", TEXTS["en"]),
                ],
            }
        )
    )
    kept, removed, _ = identify_languages(block, frozenset({"de"}), CONVERSATION.judged)
    assert kept["record_id"].to_list() == ["c0"]
    assert removed["language"].to_list() == ["en"]


def test_preference_pairs_are_judged_on_their_chosen_answer():
    block = pl.DataFrame(
        {
            "record_id": ["p0", "p1"],
            "prompt": ["How do I close a file?"] * 2,
            "chosen": [TEXTS["es"], TEXTS["en"]],
            "rejected": [TEXTS["en"], TEXTS["es"]],
        }
    )
    labelled, _, _ = identify_languages(block, text=PREFERENCE.judged)
    assert labelled["language"].to_list() == ["es", "en"]


def test_labels_do_not_depend_on_the_block_size():
    block = sft_block([*TEXTS, *reversed(TEXTS), "ru", "en", "ja"])
    whole = run_in_process([language_stage()], block, rows_per_block=block.height)
    for rows_per_block in (1, 3, 7):
        cut = run_in_process([language_stage()], block, rows_per_block)
        assert cut.kept.equals(whole.kept)
        assert (
            cut.counters["language"]["language_mix"] == whole.counters["language"]["language_mix"]
        )
