"""The user's scorers as silver stages: after the heuristics and the language, each scorer adds
``score_<name>`` to the records that are left, and its ``min`` rejects those below it.

A Hugging Face scorer is two stages: ``tokenize_<name>`` (CPU, a block task) and ``score_<name>``
(the model: ``on_actors``, so on Ray it runs on an actor pool, a GPU an actor where the cluster has
them). A fastText scorer is one model stage. Models and tokenizers are loaded once a process (an
actor keeps its process) and kept.

Preference pairs: a scorer judging the response scores both answers (``score_<name>`` of chosen,
``score_<name>_rejected``); with ``margin`` set, a pair whose rejected answer outscores its chosen
by more than it is rejected as ``reward_disagrees``.

The text a scorer judges, per record format: ``response`` the format's judged answer (a
conversation's assistant turns); ``prompt`` the prompt (a conversation's first user turn);
``conversation`` every turn as plain text, each after its role (``user: ...``), so a special
token's spelling in user text is only text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import polars as pl

from pipeline_assets.lib.formats import PREFERENCE, RecordFormat
from pipeline_assets.lib.silver.scorers import (
    REJECT_REASON,
    FastTextScorer,
    ScorerSpec,
    SequenceClassifierScorer,
    below_threshold,
    encode_texts,
    is_fasttext,
)
from pipeline_assets.lib.stages import Stage

DISAGREES_REASON = "reward_disagrees"
SCORING_BATCH = 32  # records a forward pass: sorted by length, so padding stays small


def scorer_stages(specs: Sequence[ScorerSpec], fmt: RecordFormat) -> list[Stage]:
    """Every tokenizing stage first (block tasks), then every model stage (the actor pool)."""
    sides = {spec.name: _sides(spec, fmt) for spec in specs}
    tokenize = [
        Stage(
            f"tokenize_{spec.name}",
            functools.partial(tokenize_block, spec=spec, texts=sides[spec.name]),
        )
        for spec in specs
        if not is_fasttext(spec)
    ]
    score = [
        Stage(
            f"score_{spec.name}",
            functools.partial(score_block, spec=spec, texts=sides[spec.name]),
            REJECT_REASON,
            on_actors=True,
        )
        for spec in specs
    ]
    disagree = [
        Stage(
            f"disagrees_{spec.name}",
            functools.partial(reward_disagrees, spec=spec),
            DISAGREES_REASON,
            on_actors=True,
        )
        for spec in specs
        if spec.margin is not None and len(sides[spec.name]) == 2
    ]
    return [*tokenize, *score, *disagree]


def _sides(spec: ScorerSpec, fmt: RecordFormat) -> dict[str, pl.Expr]:
    """Score column -> the text it scores: one, or a pair's two answers."""
    if spec.text == "response" and fmt is PREFERENCE:
        return {
            spec.column: pl.col("chosen"),
            f"{spec.column}_rejected": pl.col("rejected"),
        }
    return {spec.column: scored_text(fmt, spec.text)}


def scored_text(fmt: RecordFormat, text: str) -> pl.Expr:
    if text == "response":
        return pl.col(fmt.judged)
    if fmt.turns:
        return pl.col("first_user_turn" if text == "prompt" else "conversation").fill_null("")
    if text == "prompt":
        return pl.col("prompt")
    return pl.concat_str(
        pl.concat_str(pl.lit("system: "), pl.col("system"), pl.lit("\n\n")).fill_null(""),
        *([_labelled_context(fmt.context)] if fmt.context else []),
        pl.lit("user: "),
        pl.col("prompt"),
        pl.lit("\n\nassistant: "),
        pl.col(fmt.judged),
    )


def _labelled_context(column: str) -> pl.Expr:
    turn = pl.element()
    labelled = pl.col(column).list.eval(
        pl.concat_str(
            turn.struct.field("role"), pl.lit(": "), turn.struct.field("content"), pl.lit("\n\n")
        )
    )
    return labelled.list.join("").fill_null("")


def tokenize_block(
    block: pl.DataFrame, spec: ScorerSpec, texts: dict[str, pl.Expr]
) -> tuple[pl.DataFrame, None, dict]:
    tokenizer = _tokenizer(spec.model)
    encoded = {
        _tokens(column): pl.Series(
            encode_texts(tokenizer, block.select(text).to_series().to_list()),
            dtype=pl.List(pl.Int64),
        )
        for column, text in texts.items()
    }
    return block.with_columns(**encoded), None, {}


def score_block(
    block: pl.DataFrame, spec: ScorerSpec, texts: dict[str, pl.Expr]
) -> tuple[pl.DataFrame, pl.DataFrame | None, dict]:
    loads = _scorer.cache_info().misses
    scorer = _scorer(spec)
    loaded = _scorer.cache_info().misses - loads  # 1 where this process had to load it
    scores = {
        column: (
            scorer.score_texts(block.select(text).to_series().to_list())
            if is_fasttext(spec)
            else scorer.score_ids(block[_tokens(column)].to_list())
        )
        for column, text in texts.items()
    }
    scored = block.with_columns(
        pl.Series(column, values, dtype=pl.Float64) for column, values in scores.items()
    ).drop([_tokens(column) for column in texts], strict=False)
    kept, removed, _ = below_threshold(scored, spec)
    return kept, removed, {"model_loads": loaded}


def reward_disagrees(
    block: pl.DataFrame, spec: ScorerSpec
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Pairs whose rejected answer scores more than ``spec.margin`` above their chosen answer."""
    chosen, rejected = pl.col(spec.column), pl.col(f"{spec.column}_rejected")
    disagrees = (rejected - chosen) > spec.margin
    removed = block.filter(disagrees).with_columns(
        evidence=pl.struct(
            scorer=pl.lit(spec.name), chosen=chosen, rejected=rejected, margin=pl.lit(spec.margin)
        ).struct.json_encode()
    )
    return block.filter(~disagrees), removed, {}


def _tokens(column: str) -> str:
    return f"tokens_{column}"


@functools.cache
def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@functools.cache
def _scorer(spec: ScorerSpec) -> FastTextScorer | SequenceClassifierScorer:
    """The scorer's model, loaded once a process: on a GPU in bf16 where this process has one."""
    if is_fasttext(spec):
        return FastTextScorer(spec)
    import torch

    if torch.cuda.is_available():
        return SequenceClassifierScorer(spec, SCORING_BATCH, "cuda", torch.bfloat16)
    return SequenceClassifierScorer(spec, SCORING_BATCH)
