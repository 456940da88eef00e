"""Conversations as silver stores them, for the gold tests: record_id and messages."""

from __future__ import annotations

import polars as pl

from pipeline_assets.lib.formats import TURNS


def conversations(by_id: dict[str, list[dict]]) -> pl.DataFrame:
    """record_id -> messages, one row each, in the dict's order."""
    return pl.DataFrame(
        {"record_id": list(by_id), "messages": list(by_id.values())},
        schema={"record_id": pl.String, "messages": TURNS},
    )


def turns(*pairs: tuple[str, str]) -> list[dict]:
    """(role, content) pairs as messages."""
    return [{"role": role, "content": content} for role, content in pairs]
