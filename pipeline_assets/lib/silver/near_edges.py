"""Near dedup from its verified pairs (issue 37): tasks turn the candidates' band keys into pairs,
one LSH band each, and verify them on their signatures (``band_edges``); the decision clusters
the pairs it is given (``near_dedup_edges``) and holds no signature.

A pair sharing several bands' keys is verified once, by the task of the first band they share,
so every band's pairs together are exactly those ``dedup.near_dedup`` verifies. The decision
keeps near dedup's rule: a record's cluster is its connected component of verified pairs, led
by the record another batch kept first, else the batch's smallest record id; a removed record's
evidence is its similarity to that survivor, which a pair holds when the two are paired, and is
asked of the signatures' holders (``NearPairs.similarity``) when they are not (a chain).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from pipeline_assets.lib.formats import SFT, RecordFormat
from pipeline_assets.lib.silver.dedup import (
    LshParams,
    ResponseSignatures,
    band_keys,
    cluster_survivors,
    format_salt,
    lsh_of,
    near_evidence,
    node_order,
    signature_matrix,
    similar_enough,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig, jaccard

# a signed node: a batch's record (its batch_id the batch's) or another batch's index entry
SIGNED_SCHEMA = pl.Schema(
    {
        "record_id": pl.String,
        "batch_id": pl.String,
        "signature": pl.Binary,
        "response_signature": pl.Binary,  # null in entries written before responses were signed
    }
)
SIGNED_COLUMNS = ("signature", "response_signature")  # an index entry's, as SIGNED_SCHEMA's
PAIR_SCHEMA = pl.Schema(
    {"record_id": pl.String, "other_id": pl.String, "other_batch_id": pl.String}
)
# a verified pair: record_id is the batch's, the other end the batch's or an entry's
EDGE_SCHEMA = pl.Schema({**PAIR_SCHEMA, "jaccard": pl.Float64, "response_jaccard": pl.Float64})


@dataclass(frozen=True)
class NearPairs:
    """Where near dedup finds its pairs when its input holds no signatures: every band's verified
    pairs (``band_edges``; called once the index lookup has run) and a reader of the similarity
    of pairs (PAIR_SCHEMA) that are not among them."""

    edges: Callable[[], pl.DataFrame]
    similarity: Callable[[pl.DataFrame], pl.DataFrame]


def band_edges(
    nodes: pl.DataFrame,
    band: int,
    batch_id: str,
    config: MinHashConfig = MinHashConfig(),
    fmt: RecordFormat = SFT,
) -> pl.DataFrame:
    """The verified pairs (EDGE_SCHEMA) of ``nodes`` (SIGNED_SCHEMA: the batch ``batch_id``'s
    candidates and the index entries found for them) that share ``band``'s key and no earlier
    band's, one end at least the batch's: one task's share of near dedup's pairs."""
    nodes = nodes.sort(pl.col("batch_id") != batch_id, maintain_order=True)  # the batch's first
    batch_rows = int((nodes["batch_id"] == batch_id).sum())
    sigs = signature_matrix(nodes["signature"], config)
    responses = _responses(nodes, config)
    up_to_band = LshParams(band + 1, lsh_of(config).rows)  # a band's key reads its own rows only
    keys = band_keys(sigs, up_to_band, format_salt(fmt))
    by_key = pl.DataFrame({"node": np.arange(len(nodes)), "band_key": keys[:, band]})
    pairs = (
        by_key.join(by_key, on="band_key", suffix="_other")
        .filter((pl.col("node") < pl.col("node_other")) & (pl.col("node") < batch_rows))
        .select("node", "node_other")
    )
    left, right = pairs["node"].to_numpy(), pairs["node_other"].to_numpy()
    first = ~(keys[left, :band] == keys[right, :band]).any(axis=1)
    left, right = left[first], right[first]
    similarity, response_similarity = (
        jaccard(sigs[left], sigs[right]),
        responses.jaccard(left, right),
    )
    verified = similar_enough(similarity, response_similarity, config.threshold)
    left, right = left[verified], right[verified]
    return pl.DataFrame(
        {
            "record_id": nodes["record_id"].gather(left),
            "other_id": nodes["record_id"].gather(right),
            "other_batch_id": nodes["batch_id"].gather(right),
            "jaccard": similarity[verified],
            "response_jaccard": pl.Series(response_similarity[verified], nan_to_null=True),
        },
        schema=EDGE_SCHEMA,
    )


def pair_similarity(
    nodes: pl.DataFrame, pairs: pl.DataFrame, config: MinHashConfig = MinHashConfig()
) -> pl.DataFrame:
    """``pairs`` (PAIR_SCHEMA, both ends among ``nodes``, SIGNED_SCHEMA) with their estimated
    Jaccard and response Jaccard (null where either response was not signed): EDGE_SCHEMA."""
    named = nodes.with_row_index("node")
    ends = pairs.join(
        named.select("record_id", "node"), on="record_id", how="left", maintain_order="left"
    ).join(
        named.select(other_id="record_id", other_batch_id="batch_id", other_node="node"),
        on=["other_id", "other_batch_id"],
        how="left",
        maintain_order="left",
    )
    if ends["node"].null_count() or ends["other_node"].null_count():
        raise ValueError("a pair names a record whose signatures were not given")
    left, right = ends["node"].to_numpy(), ends["other_node"].to_numpy()
    sigs = signature_matrix(nodes["signature"], config)
    return pairs.with_columns(
        jaccard=pl.Series(jaccard(sigs[left], sigs[right]), dtype=pl.Float64),
        response_jaccard=pl.Series(
            _responses(nodes, config).jaccard(left, right), dtype=pl.Float64, nan_to_null=True
        ),
    ).select(EDGE_SCHEMA.names())


def pairs_in(
    nodes: pl.DataFrame,
    batch_id: str,
    config: MinHashConfig = MinHashConfig(),
    fmt: RecordFormat = SFT,
) -> NearPairs:
    """``NearPairs`` over signed ``nodes`` held here: every band's edges, and their similarity."""
    edges = pl.concat(
        [band_edges(nodes, band, batch_id, config, fmt) for band in range(lsh_of(config).bands)]
    )
    return NearPairs(lambda: edges, lambda pairs: pair_similarity(nodes, pairs, config))


def near_dedup_edges(
    batch: pl.DataFrame,
    history: pl.LazyFrame | None,
    pairs: NearPairs,
    config: MinHashConfig = MinHashConfig(),
    fmt: RecordFormat = SFT,
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """``dedup.near_dedup`` of ``batch`` (record_id and batch_id, no signatures) from its verified
    pairs: the same kept and removed rows and counters. Pairs naming a record ``batch`` does not
    hold (removed by a stage before) are left out. ``history`` is not read: the pairs hold what
    near dedup reads of the other batches."""
    del history
    batch_id = batch["batch_id"][0] if batch.height else ""
    ids = batch["record_id"].implode()
    edges = pairs.edges().filter(
        pl.col("record_id").is_in(ids)
        & ((pl.col("other_batch_id") != batch_id) | pl.col("other_id").is_in(ids))
    )
    new_ends = edges.filter(pl.col("other_batch_id") == batch_id)["other_id"]
    paired = batch["record_id"].is_in(pl.concat([edges["record_id"], new_ends]).implode())
    positions = np.flatnonzero(paired.to_numpy())  # only records in a pair can be removed
    entries = (
        edges.filter(pl.col("other_batch_id") != batch_id)
        .select(record_id="other_id", batch_id="other_batch_id")
        .unique()
        .sort("batch_id", "record_id")
    )
    nodes = pl.concat([batch[positions].select("record_id", "batch_id"), entries])
    numbered = nodes.with_row_index("node")
    left = _nodes_of(edges, numbered, "record_id", pl.lit(batch_id))
    right = _nodes_of(edges, numbered, "other_id", pl.col("other_batch_id"))
    yields = np.repeat(np.array([1, 0], dtype=np.int8), [len(positions), entries.height])
    order = node_order(yields, nodes["batch_id"], nodes["record_id"])
    survivor_of = cluster_survivors(left, right, order)[: len(positions)]
    led = survivor_of != np.arange(len(positions))  # by another record: removed
    removed = positions[led]
    judged = batch[removed].hstack(
        nodes[survivor_of[led]].select(cluster_id="record_id", duplicate_of_batch="batch_id")
    )
    rejected = _with_similarity(
        judged.with_columns(duplicate_of="cluster_id"), edges, pairs
    ).with_columns(
        evidence=near_evidence(),
    )
    keep = np.ones(batch.height, dtype=bool)
    keep[removed] = False
    details = {
        "candidate_pairs_verified": edges.height,
        "against_other_batches": int(rejected["duplicate_of_batch"].ne(rejected["batch_id"]).sum()),
        "clusters_with_duplicates": rejected["cluster_id"].n_unique(),
        "lsh": lsh_of(config).label(config),
    }
    columns = [*batch.columns, "cluster_id"]
    return (
        batch.filter(pl.Series(keep)).with_columns(cluster_id="record_id").select(columns),
        rejected.select(*columns, "duplicate_of", "jaccard", "evidence"),
        details,
    )


def _nodes_of(edges: pl.DataFrame, nodes: pl.DataFrame, id_column: str, batch: pl.Expr):
    """The node number of each edge's end named by ``id_column`` (and ``batch``)."""
    return (
        edges.select(record_id=pl.col(id_column), batch_id=batch)
        .join(nodes, on=["record_id", "batch_id"], how="left", maintain_order="left")["node"]
        .to_numpy()
    )


def _with_similarity(removed: pl.DataFrame, edges: pl.DataFrame, pairs: NearPairs) -> pl.DataFrame:
    """Removed records with their similarity to their cluster's survivor: a verified pair's (in
    either direction), else asked of ``pairs.similarity``."""
    if removed.is_empty():
        return removed.with_columns(
            jaccard=pl.lit(None, pl.Float64), response_jaccard=pl.lit(None, pl.Float64)
        )
    to_survivor = removed.select(
        "record_id", other_id="cluster_id", other_batch_id="duplicate_of_batch"
    )
    new = edges.filter(pl.col("other_batch_id") == removed["batch_id"].first())
    either_way = pl.concat(
        [
            edges,
            new.select(
                record_id="other_id",
                other_id="record_id",
                other_batch_id=pl.lit(removed["batch_id"].first(), pl.String),
                jaccard="jaccard",
                response_jaccard="response_jaccard",
            ),
        ]
    ).unique(subset=PAIR_SCHEMA.names())
    known = to_survivor.join(either_way, on=PAIR_SCHEMA.names(), how="inner")
    unpaired = to_survivor.join(known, on=PAIR_SCHEMA.names(), how="anti")
    asked = pairs.similarity(unpaired) if unpaired.height else unpaired.head(0)
    similarity = pl.concat([known, asked], how="diagonal_relaxed")
    return removed.join(
        similarity.select("record_id", "jaccard", "response_jaccard"),
        on="record_id",
        how="left",
        maintain_order="left",
    )


def _responses(nodes: pl.DataFrame, config: MinHashConfig) -> ResponseSignatures:
    return ResponseSignatures(
        signature_matrix(nodes["response_signature"], config),
        nodes["response_signature"].is_not_null().to_numpy(),
    )
