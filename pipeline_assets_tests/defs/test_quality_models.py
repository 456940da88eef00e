"""Silver's models through materialize(): the language filter on text in several languages, a
Hugging Face reward model and a fastText classifier as the user's scorers (PIPELINE_QUALITY_MODELS),
their thresholds, and the reward model's verdict on preference pairs; in the step's process and on
a local Ray."""

from __future__ import annotations

import json
import statistics

import fasttext
import polars as pl
import pytest
from dagster import materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.policies import SilverPolicy
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.resources.engine import RayEngine, local_ray_options
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.quality_models import QualityModelsResource
from pipeline_assets_tests.conftest import write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import register
from pipeline_assets_tests.fasttext_models import train_fasttext
from pipeline_assets_tests.hf_models import classifier_folder, classifier_scores

ANSWERS = {
    "en": [
        "Open the settings page, choose security and press the button that resets your password.",
        "The parcel leaves our warehouse within two working days and you can follow it online.",
        "Refunds are paid back to the card you used, usually within five working days.",
        "You can change the delivery address until the order has been handed to the courier.",
        "Our support team answers every message in the order it arrives, weekends included.",
        "The warranty covers repairs for two years when the device was used as intended.",
        "To cancel the plan, open your account, select billing and follow the short steps.",
        "Invoices are sent by email on the first day of each month as a printable document.",
    ],
    "de": [
        "Öffnen Sie die Einstellungen, wählen Sie Sicherheit und setzen Sie das Passwort zurück.",
        "Das Paket verlässt unser Lager innerhalb von zwei Werktagen und ist online verfolgbar.",
        "Die Rückerstattung geht auf die Karte, mit der Sie bezahlt haben, meist in fünf Tagen.",
        "Sie können die Lieferadresse ändern, bis die Bestellung dem Kurier übergeben wurde.",
    ],
    "fr": [
        "Ouvrez les paramètres, choisissez la sécurité puis réinitialisez votre mot de passe.",
        "Le colis quitte notre entrepôt sous deux jours ouvrés et vous pouvez le suivre en ligne.",
        "Le remboursement est versé sur la carte utilisée, en général sous cinq jours ouvrés.",
    ],
    "es": [
        "Abra la configuración, elija seguridad y restablezca su contraseña con el botón.",
        "El paquete sale de nuestro almacén en dos días hábiles y puede seguirlo en línea.",
        "El reembolso se devuelve a la tarjeta que usó, normalmente en cinco días hábiles.",
    ],
}
TOO_SHORT = "ok"  # the quality rules reject it before any model sees it
PAIRS = [
    (
        f"Pair question {i}: how do I reset my password on the account page?",
        ANSWERS["en"][i],
        ANSWERS["en"][(i + 3) % 8],
    )
    for i in range(8)
]
FASTTEXT_EXAMPLES = [
    ("open the settings page and reset your password", "__label__helpful"),
    ("refunds are paid back to the card within five days", "__label__helpful"),
    ("buy cheap pills now click here to win", "__label__spam"),
    ("click here now to win cheap prizes today", "__label__spam"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("scorers")
    reward = classifier_folder(root / "reward", num_labels=1)
    helpful = train_fasttext(FASTTEXT_EXAMPLES, epochs=8).save(root / "helpful.bin")
    return reward, helpful


def test_languages_and_the_users_scorers_judge_silver_records_and_pairs(
    models, instance, resources, landing_dir, tmp_path
):
    reward, helpful = models
    kept_languages = ANSWERS["en"] + ANSWERS["de"]
    threshold = statistics.median(classifier_scores(reward, kept_languages))
    margin = 0.0
    scorers = [
        {"name": "reward", "model": str(reward), "min": threshold, "margin": margin},
        {"name": "helpful", "model": str(helpful), "label": "helpful"},
    ]
    rows = [
        {
            "id": f"{language}{i}",
            "prompt": f"Question {language} {i}: how does it work?",
            "response": a,
        }
        for language, answers in ANSWERS.items()
        for i, a in enumerate(answers)
    ]
    rows.append({"id": "short", "prompt": "Say something short, please.", "response": TOO_SHORT})
    write_landing_file(landing_dir, "support", "part-0.jsonl", rows)
    pairs = [
        {"id": f"p{i}", "prompt": p, "chosen": c, "rejected": r}
        for i, (p, c, r) in enumerate(PAIRS)
    ]
    write_landing_file(landing_dir, "prefs", "part-0.jsonl", pairs)
    landing = LandingResource(uri=str(landing_dir), source_formats={"prefs": "preference"})
    run_with = {
        **resources,
        "landing": landing,
        "silver_policy": SilverPolicy(languages=["de", "en"]),
        "quality_models": QualityModelsResource(models=json.dumps(scorers)),
    }
    batch = register(instance, run_with)
    result = materialize(
        [eval_sets, bronze, silver], partition_key=batch, instance=instance, resources=run_with
    )
    assert result.success
    lake = resources["lake"]
    records, every_reject = lake.read("silver", "records"), lake.read("silver", "rejects")
    rejects = every_reject.filter(pl.col("source") == "support")

    # the language: every record labelled, the languages not kept rejected with their evidence
    assert set(records["language"]) == {"en", "de"} and (records["language_score"] > 0.5).all()
    by_language = rejects.filter(pl.col("stage") == "language")
    assert sorted(by_language["response"]) == sorted(ANSWERS["fr"] + ANSWERS["es"])
    evidence = [json.loads(e) for e in by_language["evidence"]]
    assert {e["language"] for e in evidence} == {"fr", "es"}
    assert all(e["keep"] == ["de", "en"] and e["score"] >= 0.5 for e in evidence)

    # the reward model: its own score of silver's text, and min rejects exactly those below it
    judged = (
        records["response"].to_list()
        + rejects.filter(pl.col("stage") == "quality_model")["response"].to_list()
    )
    assert sorted(judged) == sorted(kept_languages)
    stored = dict(zip(records["response"], records["score_reward"]))
    own = dict(zip(kept_languages, classifier_scores(reward, kept_languages)))
    assert all(abs(stored[text] - own[text]) < 1e-4 for text in stored)
    below = {text for text, score in own.items() if score < threshold}
    assert set(rejects.filter(pl.col("stage") == "quality_model")["response"]) == below
    model_evidence = [
        json.loads(e) for e in rejects.filter(pl.col("stage") == "quality_model")["evidence"]
    ]
    assert all(
        e["scorer"] == "reward" and e["score"] < e["min"] == threshold for e in model_evidence
    )

    # fastText: the label's probability, as the model gives it for the record's text
    classifier = fasttext.load_model(str(helpful))
    for text, score in zip(records["response"], records["score_helpful"]):
        labels, probabilities = classifier.predict(text, k=-1, threshold=0.0)
        assert abs(score - dict(zip(labels, probabilities))["__label__helpful"]) < 1e-6

    # cheap stages first: the record the quality rules rejected was never given to a model
    assert rejects.filter(pl.col("response") == TOO_SHORT)["stage"].to_list() == [
        "quality:min_words"
    ]
    metadata = result.asset_materializations_for_node("silver")[0].metadata
    stages = {row.data["stage"]: row.data for row in metadata["stages"].value.records}
    assert stages["score_reward"]["rows_in"] == len(kept_languages)
    assert metadata["language_mix"].value == {"en": 8, "de": 4, "fr": 3, "es": 3}
    identities = metadata["quality_models"].value
    assert [i["name"] for i in identities] == ["language", "reward", "helpful"]
    assert all(len(i["sha256"]) == 64 for i in identities)

    # preference pairs: both answers scored; min judges the chosen answer, and a pair whose
    # rejected answer is ahead by more than the margin is rejected
    pairs_kept = lake.read("silver", "preference_pairs")
    pair_rejects = every_reject.filter(pl.col("source") == "prefs")
    chosen = classifier_scores(reward, [c for _, c, _ in PAIRS])
    rejected = classifier_scores(reward, [r for _, _, r in PAIRS])
    below_min = {PAIRS[i][0] for i in range(len(PAIRS)) if chosen[i] < threshold}
    disagree = {
        PAIRS[i][0]
        for i in range(len(PAIRS))
        if rejected[i] - chosen[i] > margin and PAIRS[i][0] not in below_min
    }
    by_stage = dict(pair_rejects.group_by("stage").agg("prompt").iter_rows())
    assert set(by_stage.get("quality_model", [])) == below_min
    assert set(by_stage.get("reward_disagrees", [])) == disagree
    assert disagree and pairs_kept.height, "the seeded model disagrees with some pairs, not all"
    assert (pairs_kept["score_reward_rejected"] - pairs_kept["score_reward"] <= margin).all()

    # a local Ray (what a batch of PIPELINE_RAY_MIN_ROWS rows starts): the same batch, the same
    # verdicts, the same scores within fp32 rounding, the models on its actor pool
    on_ray = {
        **run_with,
        "lake": LakeResource(uri=str(tmp_path / "ray-lake")),
        "ray_engine": RayEngine(home=str(tmp_path / "ray-home"), min_rows=1),
    }
    # Ray keeps one auth mode and token a process, read at its first use: this pytest worker may
    # have run the two-node cluster (auth off) or another home's Ray before, where a step process
    # only ever starts its own home's. Set this home's, then have Ray read them again.
    from ray._private.authentication_test_utils import reset_auth_token_state

    local_ray_options(tmp_path / "ray-home")
    reset_auth_token_state()
    ray_batch = register(instance, on_ray)
    ray_result = materialize(
        [eval_sets, bronze, silver], partition_key=ray_batch, instance=instance, resources=on_ray
    )
    assert ray_result.success
    ray_metadata = ray_result.asset_materializations_for_node("silver")[0].metadata
    assert ray_metadata["scorers"].value["reward"]["ran_on"].startswith("Ray, 1 node(s)")
    # the actor pool ran each model stage, its model loaded once an actor; here, no pool
    for name in ("reward", "helpful"):
        pooled = ray_metadata["scorers"].value[name]
        assert pooled["actors"] == pooled["model_loads"] == 1, name
        assert metadata["scorers"].value[name]["actors"] == 0, name
    for table in ("records", "preference_pairs", "rejects"):
        here, there = (
            by_line(lake_of["lake"].read("silver", table)) for lake_of in (run_with, on_ray)
        )
        scores = [c for c in here.columns if c.startswith("score_") and c in SCORED]
        scores += ["evidence"] if table == "rejects" else []  # a model's evidence holds its score
        assert here.drop(scores).equals(there.drop(scores)), table
        for column in scores:
            if column == "evidence":
                assert_same_evidence(here[column], there[column])
            else:
                assert (here[column] - there[column]).abs().max() < 1e-4, (table, column)


def assert_same_evidence(here: pl.Series, there: pl.Series) -> None:
    """Rejects' evidence alike, a model's scores in it within fp32 rounding (the actor pool batches
    the records otherwise than one process does)."""
    for mine, theirs in zip(here, there, strict=True):
        assert _alike(json.loads(mine or "null"), json.loads(theirs or "null")), (mine, theirs)


def _alike(mine, theirs) -> bool:
    if isinstance(mine, float) and isinstance(theirs, float):
        return abs(mine - theirs) < 1e-4
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return mine.keys() == theirs.keys() and all(_alike(mine[k], theirs[k]) for k in mine)
    if isinstance(mine, list) and isinstance(theirs, list):
        return len(mine) == len(theirs) and all(map(_alike, mine, theirs))
    return mine == theirs


SCORED = {"score_reward", "score_reward_rejected", "score_helpful"}


def by_line(frame: pl.DataFrame) -> pl.DataFrame:
    """A table's rows by where they came from, without what names the run (batch, times, ids)."""
    run_columns = ["batch_id", "ingested_at", "record_id", "cluster_id", "duplicate_of"]
    return frame.drop(run_columns, strict=False).sort("source", "source_line")
