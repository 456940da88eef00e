"""Text normalization for silver: Unicode form, control characters, whitespace.

Vectorized polars expressions; every step can be switched off. Newlines survive whitespace
collapsing (line structure matters to the quality rules), runs of blank lines do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from pipeline_assets.lib.formats import TURNS, all_text_fields

# C0 and C1 controls except tab and newline (\r is folded into \n below).
_CONTROL = r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"


@dataclass(frozen=True)
class NormalizeConfig:
    unicode_form: str | None = "NFC"  # NFC, NFKC, NFD, NFKD, or None to leave as is
    strip_control: bool = True
    collapse_whitespace: bool = True


def normalize_text(expr: pl.Expr, config: NormalizeConfig = NormalizeConfig()) -> pl.Expr:
    if config.unicode_form:
        expr = expr.str.normalize(config.unicode_form)
    expr = expr.str.replace_all("\r\n?", "\n")
    if config.strip_control:
        expr = expr.str.replace_all(_CONTROL, "")
    if config.collapse_whitespace:
        expr = (
            expr.str.replace_all(r"[^\S\n]+", " ")  # runs of spaces and tabs
            .str.replace_all(r" ?\n ?", "\n")
            .str.replace_all(r"\n{3,}", "\n\n")
            .str.strip_chars()
        )
    return expr


def normalize_records(
    frame: pl.DataFrame, config: NormalizeConfig = NormalizeConfig()
) -> tuple[pl.DataFrame, None, dict]:
    """Normalize the text columns and the content of every turn of a column of turns, removing
    nothing (a stage function: ``lib.stages``); its details say how many values each column had
    changed (a conversation counts once, however many of its turns changed)."""
    present = [c for c in all_text_fields() if c in frame.columns]  # a frame holds one format's
    turns = [c for c, dtype in frame.schema.items() if dtype == TURNS]
    normalized = frame.with_columns(
        *(normalize_text(pl.col(c), config) for c in present),
        *(_normalized_turns(c, config) for c in turns),
    )
    changed = {
        f"{column}_changed": int((normalized[column] != frame[column]).sum() or 0)
        for column in (*present, *turns)
    }
    return normalized, None, changed


def _normalized_turns(column: str, config: NormalizeConfig) -> pl.Expr:
    content = normalize_text(pl.field("content"), config)
    return pl.col(column).list.eval(pl.element().struct.with_fields(content))
