"""Exact and near-duplicate removal for one batch, within itself and against the other batches.

The survivor of a duplicate cluster is deterministic: a record another batch already kept (the
earliest such batch, then the smallest ``record_id``), else this batch's smallest ``record_id``.
Batches go through silver in arrival order, so that is the first copy to arrive; a batch re-run
after later ones (it was blocked) yields to the copies they kept. The other batches only
contribute hashes (exact hashes, MinHash signatures and LSH band keys from
``silver/minhash_index``), looked up with polars joins, so memory grows with the batch and with
the matches, not with the history.

The other batches are found through ``silver/minhash_bands``: every kept record's LSH band keys and
the first 60 bits of its exact hash, one row a band, partitioned by band. A batch looks up its own
keys one band at a time (a task a band and slice of batches, on Ray where the batch runs its block
stages: ``search_band`` for the LSH bands, which also finds the records sharing a key within the
batch, ``find_in_band`` for the hashes), and only the entries that share a key come back with their
signatures (``IndexLookup``).

A pair is a near-duplicate only when its responses are near-duplicates too: candidates come from
the LSH over prompt + response, and are verified on both texts' signatures, so different answers
to one long shared prompt (retrieval contexts, several completions of one prompt) all survive.

Every record format dedups on its own text (``RecordFormat.dedup`` and ``answers``: a preference
pair on prompt, chosen and rejected, its answers being chosen and rejected together) and only
against records of its format: its band keys are salted by the format's name (sft's salt is 0, so
indexes written before formats existed stay valid), and exact hashes of different formats hash
different fields. Preference entries also carry the hash of their normalized prompt, indexed as
band PROMPT_BAND, so a batch finds how many pairs earlier batches kept for each of its prompts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import polars as pl
import polars_hash as plh
import pyarrow as pa

from pipeline_assets.lib.formats import SFT, RecordFormat, has_turns, turns_json
from pipeline_assets.lib.silver.minhash import MinHashConfig, jaccard, signatures

SIGNATURE_COLUMNS = (
    "_signature",
    "_response_signature",
)  # with_signatures' columns, dropped by near dedup
HISTORY_SCHEMA = pl.Schema(
    {
        "record_id": pl.String,
        "batch_id": pl.String,
        "exact_hash": pl.String,
        "signature": pl.Binary,
        "response_signature": pl.Binary,  # null in entries written before responses were signed
        "band_keys": pl.List(pl.Int64),
        "lsh_params": pl.String,
        # preference pairs: their normalized prompt's hash; null for other formats
        "prompt_hash": pl.String,
    }
)


ROWS_PER_LOOKUP_TASK = (
    4_000_000  # indexed records a lookup task reads one band of: about 100 MB of keys and ids
)
EXACT_BAND = (
    -1
)  # the band of the exact hash's first 60 bits: exact dedup's candidates come from the same lookup
PROMPT_BAND = (
    -2
)  # the band of a preference pair's prompt hash: the pairs earlier batches kept for a prompt
BAND_SCHEMA = pl.Schema(
    {"band": pl.Int16, "band_key": pl.Int64, "record_id": pl.String, "batch_id": pl.String}
)
ENTRY_IDS = pl.Schema({"record_id": pl.String, "batch_id": pl.String})  # an index entry's name
# (band, band_key) rows a batch looks up, and entries (ENTRY_IDS) found apart (``search_band``) ->
# the other batches' index entries (HISTORY_SCHEMA) holding one of the keys or named
IndexLookup = Callable[[pl.DataFrame, pl.DataFrame | None], pl.DataFrame]


@dataclass(frozen=True)
class LshParams:
    bands: int
    rows: int

    def label(self, config: MinHashConfig) -> str:
        """Names everything that must match for two signatures' band keys to be comparable."""
        return (
            f"perm{config.num_perm}-seed{config.seed}-shingle{config.shingle_words}"
            f"-b{self.bands}-r{self.rows}"
        )


# --- exact --------------------------------------------------------------------------------------


def exact_hashes(frame: pl.DataFrame, fmt: RecordFormat = SFT) -> pl.Series:
    """128 bits of BLAKE3 over the format's normalized dedup text (sft: prompt and response; a
    conversation: its turns, each role and content apart, as ``turns_json`` writes them; a pair
    with earlier turns: those too, ``hash_in_context``): stable across versions and runs."""
    if fmt.turns:
        return frame.select(hash_of(turns_json(fmt.turns)))[:, 0].alias("exact_hash")
    return frame.select(hash_in_context(fmt.context, *fmt.dedup))[:, 0].alias("exact_hash")


def hash_of(*columns: str | pl.Expr) -> pl.Expr:
    """128 bits of BLAKE3 over the columns joined by \\x1f (a control character normalization
    removes)."""
    return plh.concat_str(*columns, separator="\x1f").chash.blake3().str.slice(0, 32)


def hash_in_context(context: str | None, *columns: str | pl.Expr) -> pl.Expr:
    """``hash_of(columns)``, after the row's earlier turns in ``context`` (as ``turns_json``, so no
    content can pass for a turn boundary) when it has any: a record without earlier turns hashes as
    it did before formats had context."""
    if context is None:
        return hash_of(*columns)
    in_context = hash_of(turns_json(context), *columns)
    return pl.when(has_turns(context)).then(in_context).otherwise(hash_of(*columns))


_ROW = "_position_in_batch"


def exact_dedup(
    batch: pl.DataFrame, history: pl.LazyFrame | None
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Drop records whose exact_hash another batch kept, or that repeat one in this batch. A stage
    function (``lib.stages``): rejected rows add duplicate_of, jaccard and evidence."""
    hashed = batch if "exact_hash" in batch.columns else batch.with_columns(exact_hashes(batch))
    kept_elsewhere = _earliest_by_hash(history, hashed["exact_hash"])
    hashes = hashed["exact_hash"]
    # only a record sharing its hash with another, or with an earlier batch's, can be removed
    shared = hashes.is_duplicated() | hashes.is_in(kept_elsewhere["exact_hash"].implode())
    copies = hashed.filter(shared)
    survivor = (
        copies.sort("record_id")
        .group_by("exact_hash", maintain_order=True)
        .agg(first_in_batch=pl.col("record_id").first())
    )
    judged = (
        copies.with_columns(pl.Series(_ROW, np.flatnonzero(shared.to_numpy())))
        .join(kept_elsewhere, on="exact_hash", how="left")
        .join(survivor, on="exact_hash", how="left")
        .with_columns(
            duplicate_of=pl.coalesce(
                "kept_record_id",
                pl.when(pl.col("record_id") != pl.col("first_in_batch")).then("first_in_batch"),
            )
        )
    )
    rejected = judged.filter(pl.col("duplicate_of").is_not_null()).with_columns(
        jaccard=pl.lit(1.0),
        evidence=pl.struct(
            duplicate_of="duplicate_of",
            duplicate_of_batch=pl.coalesce("kept_batch_id", "batch_id"),
            exact_hash="exact_hash",
        ).struct.json_encode(),
    )
    keep = np.ones(hashed.height, dtype=bool)
    keep[rejected[_ROW].to_numpy()] = False
    columns = hashed.columns
    return (
        hashed.filter(pl.Series(keep)),
        rejected.select(*columns, "duplicate_of", "jaccard", "evidence"),
        {"against_other_batches": int(rejected["kept_record_id"].is_not_null().sum())},
    )


def _earliest_by_hash(history: pl.LazyFrame | None, hashes: pl.Series) -> pl.DataFrame:
    schema = {"exact_hash": pl.String, "kept_record_id": pl.String, "kept_batch_id": pl.String}
    if history is None:
        return pl.DataFrame(schema=schema)
    return (
        history.filter(pl.col("exact_hash").is_in(hashes.unique().implode()))
        .sort("batch_id", "record_id")
        .group_by("exact_hash", maintain_order=True)
        .agg(kept_record_id=pl.col("record_id").first(), kept_batch_id=pl.col("batch_id").first())
        .collect()
    )


# --- near ---------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def lsh_params(threshold: float, num_perm: int, false_positive_weight: float = 0.5) -> LshParams:
    """Bands x rows minimizing the weighted false positive and false negative probability mass.

    A pair of similarity s becomes a candidate with probability 1 - (1 - s^r)^b.
    """
    best, best_error = LshParams(1, num_perm), float("inf")
    below, above = np.linspace(0.0, threshold, 512), np.linspace(threshold, 1.0, 512)
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            false_positive = np.trapezoid(1 - (1 - below**rows) ** bands, below)
            false_negative = np.trapezoid((1 - above**rows) ** bands, above)
            error = (
                false_positive_weight * false_positive
                + (1 - false_positive_weight) * false_negative
            )
            if error < best_error:
                best, best_error = LshParams(bands, rows), error
    return best


def lsh_of(config: MinHashConfig) -> LshParams:
    """``lsh_params`` of a config's settings."""
    return lsh_params(config.threshold, config.num_perm, config.lsh_false_positive_weight)


def band_keys(sigs: np.ndarray, params: LshParams, salt: int = 0) -> np.ndarray:
    """One 64-bit key per (text, band): a polynomial hash of the band's ``rows`` values, from
    ``salt``."""
    by_band = sigs[:, : params.bands * params.rows].reshape(len(sigs), params.bands, params.rows)
    keys = np.full((len(sigs), params.bands), salt, dtype=np.uint64)
    multiplier = np.uint64(0x9E3779B97F4A7C15)
    for row in range(params.rows):  # every band's row at once: whole signature rows stay in cache
        keys *= multiplier
        keys += by_band[:, :, row]
    return keys.view(np.int64)  # Delta has no unsigned integers


def near_dedup(
    batch: pl.DataFrame,
    history: pl.LazyFrame | None,
    config: MinHashConfig = MinHashConfig(),
    fmt: RecordFormat = SFT,
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """MinHash + LSH near-duplicate removal. A stage function (``lib.stages``): rejected rows add
    duplicate_of, jaccard and evidence.

    ``batch`` needs record_id, batch_id and the format's dedup text; ``history`` is the index of the
    other batches (HISTORY_SCHEMA). Rows keep ``cluster_id``: their cluster's survivor.
    """
    params = lsh_of(config)
    if SIGNATURE_COLUMNS[0] not in batch.columns:
        batch = with_signatures(batch, config, fmt)
    sigs, response_sigs = (signature_matrix(batch[name], config) for name in SIGNATURE_COLUMNS)
    batch = batch.drop(SIGNATURE_COLUMNS)
    keys = band_keys(sigs, params, format_salt(fmt))
    matched = _history_matches(history, keys, params, config)
    matched_sigs = signature_matrix(matched["signature"], config)
    all_sigs = np.vstack([sigs, matched_sigs])
    all_responses = ResponseSignatures(
        np.vstack([response_sigs, signature_matrix(matched["response_signature"], config)]),
        np.concatenate(
            [
                np.ones(batch.height, dtype=bool),
                matched["response_signature"].is_not_null().to_numpy(),
            ]
        ),
    )
    all_keys = np.vstack([keys, band_keys(matched_sigs, params, format_salt(fmt))])
    left, right = _verified_pairs(all_sigs, all_responses, all_keys, batch.height, config.threshold)
    node_ids = pl.concat([batch["record_id"], matched["record_id"]])
    node_batches = pl.concat([batch["batch_id"], matched["batch_id"]])
    yields = np.repeat(
        np.array([1, 0], dtype=np.int8), [batch.height, matched.height]
    )  # this batch's copies yield to records others kept
    survivors = cluster_survivors(left, right, node_order(yields, node_batches, node_ids))

    survivor_of = survivors[: batch.height]
    cluster_ids = node_ids.gather(survivor_of)
    judged = batch.with_columns(
        cluster_id=cluster_ids,
        jaccard=pl.Series(jaccard(sigs, all_sigs[survivor_of]), dtype=pl.Float64),
        response_jaccard=pl.Series(
            all_responses.jaccard(np.arange(batch.height), survivor_of),
            dtype=pl.Float64,
            nan_to_null=True,
        ),
        duplicate_of=pl.when(pl.Series(survivor_of != np.arange(batch.height)))
        .then(cluster_ids)
        .otherwise(None),
        duplicate_of_batch=node_batches.gather(survivor_of),
    )
    rejected = judged.filter(pl.col("duplicate_of").is_not_null()).with_columns(
        evidence=near_evidence(),
    )
    kept = judged.filter(pl.col("duplicate_of").is_null())
    details = {
        "candidate_pairs_verified": len(left),
        "against_other_batches": int(rejected["duplicate_of_batch"].ne(rejected["batch_id"]).sum()),
        "clusters_with_duplicates": judged.filter(
            pl.col("cluster_id").is_in(rejected["cluster_id"].implode())
        )["cluster_id"].n_unique(),
        "lsh": params.label(config),
    }
    columns = [*batch.columns, "cluster_id"]
    return (
        kept.select(columns),
        rejected.select(*columns, "duplicate_of", "jaccard", "evidence"),
        details,
    )


def near_evidence() -> pl.Expr:
    """A near duplicate's evidence, as JSON: its cluster's survivor and that record's batch, their
    estimated Jaccard and response Jaccard, its cluster."""
    return pl.struct(
        duplicate_of="duplicate_of",
        duplicate_of_batch="duplicate_of_batch",
        jaccard=pl.col("jaccard").round(4),
        response_jaccard=pl.col("response_jaccard").round(4),
        cluster_id="cluster_id",
    ).struct.json_encode()


def index_entries(
    batch: pl.DataFrame, config: MinHashConfig = MinHashConfig(), fmt: RecordFormat = SFT
) -> pl.DataFrame:
    """The index entries (HISTORY_SCHEMA) of ``batch``'s rows: record_id, batch_id, exact_hash, its
    signatures (computed when it has none) and, for preference pairs, prompt_hash."""
    params = lsh_of(config)
    if SIGNATURE_COLUMNS[0] not in batch.columns:
        batch = with_signatures(batch, config, fmt)
    sigs, response_sigs = (signature_matrix(batch[name], config) for name in SIGNATURE_COLUMNS)
    keys = band_keys(sigs, params, format_salt(fmt))
    return _index_rows(batch, sigs, response_sigs, keys, params.label(config))


def format_salt(fmt: RecordFormat) -> int:
    """Where a format's band keys start: 0 for sft, else 64 bits of its name's hash."""
    if fmt is SFT:
        return 0
    return int.from_bytes(hashlib.blake2b(fmt.name.encode(), digest_size=8).digest(), "little")


def with_signatures(
    frame: pl.DataFrame, config: MinHashConfig = MinHashConfig(), fmt: RecordFormat = SFT
) -> pl.DataFrame:
    """``frame`` plus its rows' MinHash signatures (the format's dedup text, and its answers alone)
    as little-endian bytes: computed block by block, before near dedup looks across the batch."""
    sigs = signatures(joined_text(frame, fmt.dedup), config)
    response_sigs = signatures(joined_text(frame, fmt.answers), config)
    return frame.with_columns(
        signature_series(name, matrix)
        for name, matrix in zip(SIGNATURE_COLUMNS, (sigs, response_sigs), strict=True)
    )


def signature_series(name: str, sigs: np.ndarray) -> pl.Series:
    """Signatures as stored: each row's values as little-endian uint32 bytes (one Arrow buffer
    shared, not a bytes object a row)."""
    rows = np.ascontiguousarray(sigs, dtype="<u4")
    width = pa.binary(rows.itemsize * rows.shape[1])
    stored = pa.FixedSizeBinaryArray.from_buffers(width, len(rows), [None, pa.py_buffer(rows)])
    return pl.Series(name, pl.from_arrow(stored), dtype=pl.Binary)


def joined_text(frame: pl.DataFrame, columns: tuple[str, ...]) -> list[str]:
    """Each row's ``columns`` joined by newlines: the text its MinHash signature is taken over."""
    return (
        frame.select(pl.concat_str([pl.col(name) for name in columns], separator="\n"))
        .to_series()
        .to_list()
    )


def _history_matches(
    history: pl.LazyFrame | None, keys: np.ndarray, params: LshParams, config: MinHashConfig
) -> pl.DataFrame:
    """Other batches' records sharing at least one band key with this batch, with their
    signatures."""
    columns = ["record_id", "batch_id", "signature", "response_signature"]
    empty = pl.DataFrame(schema={name: HISTORY_SCHEMA[name] for name in columns})
    if history is None:
        return empty
    wanted = pl.DataFrame(
        {
            "band": np.tile(np.arange(params.bands, dtype=np.int32), len(keys)),
            "band_key": keys.ravel(),
        }
    ).unique()
    refuse_other_settings(
        history.select(pl.col("lsh_params").unique()).collect()["lsh_params"].to_list(), config
    )
    matched_ids = (
        history.select("record_id", "band_keys")
        .with_columns(band=pl.int_ranges(0, pl.col("band_keys").list.len(), dtype=pl.Int32))
        .explode("band_keys", "band")
        .rename({"band_keys": "band_key"})
        .join(wanted.lazy(), on=["band", "band_key"], how="semi")
        .select("record_id")
        .unique()
        .collect(engine="streaming")
    )
    if matched_ids.is_empty():
        return empty
    if "response_signature" not in history.collect_schema():
        history = history.with_columns(response_signature=pl.lit(None, dtype=pl.Binary))
    return (
        history.filter(pl.col("record_id").is_in(matched_ids["record_id"].implode()))
        .select(columns)
        .sort("batch_id", "record_id")
        .collect()
    )


def refuse_other_settings(built_with: list[str], config: MinHashConfig) -> None:
    """Band keys are comparable only between signatures made with the same MinHash and LSH
    settings."""
    label = lsh_of(config).label(config)
    if set(built_with) - {label}:
        raise ValueError(
            f"silver/minhash_index holds entries built with {sorted(set(built_with) - {label})}, "
            f"not {label}: MinHash settings changed; rebuild silver from the first batch"
        )


# --- the index, partitioned by band -----------------------------------------------------------


def band_entries(index: pl.DataFrame) -> pl.DataFrame:
    """Index entries as ``silver/minhash_bands`` rows: one a record for its exact hash, one a band,
    and one for a preference pair's prompt hash."""
    exact = index.select(
        "record_id",
        "batch_id",
        band=pl.lit(EXACT_BAND, pl.Int16),
        band_key=_exact_key("exact_hash"),
    )
    lsh = index.select(
        "record_id",
        "batch_id",
        band_key="band_keys",
        band=pl.int_ranges(0, pl.col("band_keys").list.len(), dtype=pl.Int16),
    ).explode("band_key", "band")
    prompts = (
        [
            index.filter(pl.col("prompt_hash").is_not_null()).select(
                "record_id",
                "batch_id",
                band=pl.lit(PROMPT_BAND, pl.Int16),
                band_key=_exact_key("prompt_hash"),
            )
        ]
        if "prompt_hash" in index.columns
        else []
    )
    return (
        pl.concat([exact, lsh, *prompts], how="diagonal_relaxed")
        .select(BAND_SCHEMA.names())
        .cast(dict(BAND_SCHEMA))
    )


STAGED_BAND_PREFIX = "band_key_"


def staged_band_column(band: int) -> str:
    """The column of a batch's staged keys that holds one LSH band's keys."""
    return f"{STAGED_BAND_PREFIX}{band:02d}"


def staged_band_key(band: int) -> pl.Expr:
    """One band's key of a record, from its staged keys: its LSH band's column, or for EXACT_BAND
    its exact hash's first 60 bits."""
    return _exact_key("exact_hash") if band == EXACT_BAND else pl.col(staged_band_column(band))


def band_numbers(lsh_bands: int) -> list[int]:
    """Every band of ``silver/minhash_bands``: the exact band, the ``lsh_bands`` LSH bands, the
    prompt band."""
    return [EXACT_BAND, *range(lsh_bands), PROMPT_BAND]


def band_columns(band: int) -> list[str]:
    """The columns of the index that ``band_rows`` reads for ``band``."""
    key = {EXACT_BAND: "exact_hash", PROMPT_BAND: "prompt_hash"}.get(band, "band_keys")
    return ["record_id", "batch_id", key]


def band_rows(index: pl.LazyFrame, band: int) -> pl.LazyFrame:
    """One band's rows of ``band_entries(index)``: what a task a band writes. It reads only
    ``band_columns(band)``, so a scan of the index reads no more."""
    index = index.select(band_columns(band))
    if band == EXACT_BAND:
        key = _exact_key("exact_hash")
    elif band == PROMPT_BAND:
        index, key = index.filter(pl.col("prompt_hash").is_not_null()), _exact_key("prompt_hash")
    else:
        key = pl.col("band_keys").list.get(band)
    return index.select(
        band=pl.lit(band, pl.Int16), band_key=key, record_id="record_id", batch_id="batch_id"
    ).cast(dict(BAND_SCHEMA))


def wanted_keys(
    batch: pl.DataFrame,
    config: MinHashConfig = MinHashConfig(),
    fmt: RecordFormat = SFT,
    lsh: bool = True,
    exact: bool = True,
) -> pl.DataFrame:
    """The (band, band_key) rows ``batch`` (with exact_hash and its signatures) looks up; a
    preference batch also looks up its pairs' prompts and their pairs labelled the other way
    (``flipped_hash``). Without ``lsh``, only the hashes' bands: the LSH bands were searched
    apart (``search_band``); without ``exact``, not the exact hash either: it was searched as
    one more band."""
    lsh_keys = [_lsh_keys(batch, config, fmt)] if lsh else []
    hashes = [
        *([(EXACT_BAND, "exact_hash")] if exact else []),
        (EXACT_BAND, "flipped_hash"),
        (PROMPT_BAND, "prompt_hash"),
    ]
    looked_up = [
        batch.select(band=pl.lit(band, pl.Int16), band_key=_exact_key(column))
        for band, column in hashes
        if column in batch.columns
    ]
    empty = pl.DataFrame(schema={"band": pl.Int16, "band_key": pl.Int64})
    return pl.concat([empty, *looked_up, *lsh_keys]).unique()


def _lsh_keys(batch: pl.DataFrame, config: MinHashConfig, fmt: RecordFormat) -> pl.DataFrame:
    params = lsh_of(config)
    keys = band_keys(
        signature_matrix(batch[SIGNATURE_COLUMNS[0]], config), params, format_salt(fmt)
    )
    return pl.DataFrame(
        {
            "band": np.tile(np.arange(params.bands, dtype=np.int16), len(keys)),
            "band_key": keys.ravel(),
        }
    )


def entries_holding(
    entries: pl.DataFrame, wanted: pl.DataFrame, also: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The index ``entries`` holding one of the ``wanted`` (band, band_key) rows, or named in
    ``also`` (ENTRY_IDS): of one lookup over several formats' keys, the entries a lookup of one
    format's keys would find."""
    holding = (
        band_entries(entries)
        .join(wanted, on=["band", "band_key"], how="semi")
        .select("record_id", "batch_id")
    )
    if also is not None:
        holding = pl.concat([holding, also.select(holding.columns)])
    return entries.join(
        holding.unique(), on=["record_id", "batch_id"], how="semi", maintain_order="left"
    )


def find_in_band(bands: pl.LazyFrame, band: int, keys: pl.Series) -> pl.DataFrame:
    """(record_id, batch_id) of the entries of ``band`` in ``bands`` that hold one of ``keys``: one
    task's work, on some partitions of ``silver/minhash_bands``."""
    return (
        _holding(bands.filter(pl.col("band") == band), keys.unique())
        .select("record_id", "batch_id")
        .collect()
    )


def _holding(bands: pl.LazyFrame, keys: pl.Series) -> pl.LazyFrame:
    """The rows of ``bands`` whose band_key is one of ``keys`` (distinct): a semi join, which
    polars runs in half the time of an ``is_in`` filter over a band's rows."""
    return bands.join(keys.rename("band_key").to_frame().lazy(), on="band_key", how="semi")


@dataclass(frozen=True)
class BandMatches:
    """What the searches of a batch's band keys found (``search_band``), for one format."""

    candidates: pl.Series  # record ids: near dedup's candidates
    entries: pl.DataFrame  # ENTRY_IDS: the other batches' entries sharing a key with them
    keys: int  # the distinct keys looked up in the other batches' entries
    # record ids: exact dedup's candidates, where EXACT_BAND was searched too (none: it was not)
    exact_candidates: pl.Series | None = None

    @classmethod
    def joined(cls, found: Sequence[BandMatches], exact: bool = False) -> BandMatches:
        """The searches of every band, joined; with ``exact``, EXACT_BAND's among them (a batch
        without records has none)."""
        exact_found = [f.exact_candidates for f in found if f.exact_candidates is not None]
        return cls(
            _distinct_ids(f.candidates for f in found),
            pl.concat([pl.DataFrame(schema=ENTRY_IDS), *(f.entries for f in found)]).unique(),
            sum(f.keys for f in found),
            _distinct_ids(exact_found) if exact or exact_found else None,
        )

    def every_candidate(self) -> pl.Series:
        """The record ids of near and exact dedup's candidates: every record either can remove."""
        exact = [] if self.exact_candidates is None else [self.exact_candidates]
        return _distinct_ids([self.candidates, *exact])


def _distinct_ids(ids) -> pl.Series:
    return pl.concat([pl.Series("record_id", [], pl.String), *ids]).unique().sort()


def search_band(
    keys: pl.DataFrame,
    band: int,
    within: bool,
    bands: pl.LazyFrame | None = None,
) -> BandMatches:
    """One band of a batch's records that reached dedup (``keys``: record_id, exact_hash,
    band_key): with ``within``, the records sharing their key with another of them; with ``bands``
    (``silver/minhash_bands`` rows of some other batches), the records holding a key an entry of
    the band holds, and those entries. Over every LSH band, these are near dedup's candidates: the
    records sharing a band key with another record that reaches it or with an index entry. Of
    EXACT_BAND, they are exact dedup's candidates (``exact_candidates``): every record whose hash
    another record of the batch holds, or an entry may hold (a key is 60 of its 128 bits).

    Of the records with one exact hash, only the one exact dedup keeps in the batch (the smallest
    record id) is searched within an LSH band: the others are removed before near dedup, and hold
    the same band keys (the same text), so they would only make their survivor a candidate."""
    key = pl.col("band_key")
    shared = keys.head(0)
    if within and band == EXACT_BAND:
        shared = keys.filter(pl.col("exact_hash").is_duplicated())
    elif within:  # a hash's copies hold one key: all of them are among the keys held twice
        shared = keys.filter(key.is_duplicated() & key.is_not_null())
        first = pl.col("record_id") == pl.col("record_id").min().over("exact_hash")
        shared = shared.filter(first).filter(key.is_duplicated())
    if bands is None:
        return _matches(band, shared["record_id"], pl.DataFrame(schema=ENTRY_IDS), 0)
    distinct = keys["band_key"].drop_nulls().unique()
    found = (
        _holding(bands.filter(pl.col("band") == band), distinct)
        .select("record_id", "batch_id", "band_key")
        .collect()
    )
    holding = keys.filter(key.is_in(found["band_key"].implode()))
    return _matches(
        band,
        pl.concat([shared["record_id"], holding["record_id"]]).unique(),
        found.select("record_id", "batch_id").unique().cast(dict(ENTRY_IDS)),
        distinct.len(),
    )


def _matches(band: int, records: pl.Series, entries: pl.DataFrame, keys: int) -> BandMatches:
    """One band's search: its records are exact dedup's candidates for EXACT_BAND, else near's."""
    if band == EXACT_BAND:
        return BandMatches(records.head(0), entries, keys, records)
    return BandMatches(records, entries, keys)


def lookup_in(index: pl.LazyFrame | None) -> IndexLookup | None:
    """An ``IndexLookup`` over index entries held here (a whole index in memory: for tests and small
    runs)."""
    if index is None:
        return None
    entries = index.collect()
    bands = band_entries(entries).lazy()

    def look_up(wanted: pl.DataFrame, also: pl.DataFrame | None = None) -> pl.DataFrame:
        found = pl.concat(
            [
                pl.DataFrame(schema=ENTRY_IDS),
                *(
                    find_in_band(bands, band, keys["band_key"])
                    for (band,), keys in wanted.group_by("band")
                ),
                *([] if also is None else [also]),
            ],
            how="vertical",
        )
        return entries.filter(pl.col("record_id").is_in(found["record_id"].implode()))

    return look_up


def _exact_key(column: str) -> pl.Expr:
    return (
        pl.col(column).str.slice(0, 15).str.to_integer(base=16).cast(pl.Int64)
    )  # 60 bits: no sign to mind


def signature_matrix(stored: pl.Series, config: MinHashConfig) -> np.ndarray:
    """Stored signatures (little-endian uint32 bytes) back to a (rows, num_perm) matrix; a null (a
    signature never stored) becomes a row of zeros."""
    matrix = np.zeros((len(stored), config.num_perm), dtype="<u4")
    known = stored.drop_nulls()
    if (known.bin.size() != matrix.itemsize * config.num_perm).any():
        raise ValueError(f"a stored signature is not {config.num_perm} uint32 values")
    values = known.to_arrow().cast(pa.large_binary())  # one buffer, the values end to end
    _, offsets, data = values.buffers()
    start = int(np.frombuffer(offsets, dtype=np.int64)[values.offset]) if len(values) else 0
    matrix[stored.is_not_null().to_numpy()] = np.frombuffer(
        data, dtype="<u4", count=len(values) * config.num_perm, offset=start
    ).reshape(-1, config.num_perm)
    return matrix


@dataclass(frozen=True)
class ResponseSignatures:
    sigs: np.ndarray
    known: np.ndarray  # False for index entries written before responses were signed

    def jaccard(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """Estimated response Jaccard of paired nodes; NaN where either signature is unknown."""
        return np.where(
            self.known[left] & self.known[right], jaccard(self.sigs[left], self.sigs[right]), np.nan
        )


def _verified_pairs(
    sigs: np.ndarray, responses: ResponseSignatures, keys: np.ndarray, n_new: int, threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs sharing a band key, at least one of them new, whose estimated Jaccard reaches the
    threshold on prompt + response and on the response alone (where both responses were signed).

    Nodes 0..n_new-1 are this batch's rows, the rest the matched records of other batches.
    """
    table = pl.DataFrame(
        {
            "node": np.repeat(np.arange(len(sigs)), keys.shape[1]),
            "band": np.tile(np.arange(keys.shape[1]), len(sigs)),
            "band_key": keys.ravel(),
        }
    )
    candidates = (
        table.join(table, on=["band", "band_key"], suffix="_other")
        .filter((pl.col("node") < pl.col("node_other")) & (pl.col("node") < n_new))
        .select("node", "node_other")
        .unique()
    )
    left, right = candidates["node"].to_numpy(), candidates["node_other"].to_numpy()
    keep = similar_enough(
        jaccard(sigs[left], sigs[right]), responses.jaccard(left, right), threshold
    )
    return left[keep], right[keep]


def similar_enough(
    similarity: np.ndarray, response_similarity: np.ndarray, threshold: float
) -> np.ndarray:
    """Which candidate pairs are near-duplicates: their estimated Jaccard on the dedup text, and
    on the responses alone where both were signed (else NaN), reach ``threshold``."""
    return (similarity >= threshold) & (
        np.isnan(response_similarity) | (response_similarity >= threshold)
    )


def node_order(yields: np.ndarray, batches: pl.Series, ids: pl.Series) -> np.ndarray:
    """Nodes from the first to survive its cluster to the last: by (yields, batch, record id)."""
    nodes = pl.DataFrame({"yields": yields, "batch": batches, "id": ids}).with_row_index("node")
    return nodes.sort("yields", "batch", "id", maintain_order=True)["node"].to_numpy()


def cluster_survivors(left: np.ndarray, right: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Connected components of the verified pairs (``left[k]``, ``right[k]``); every node maps to
    its component's node that comes first in ``order`` (every node, first to last)."""
    from scipy.sparse import coo_array  # scipy comes with datasketch, which near dedup has loaded
    from scipy.sparse.csgraph import connected_components

    n_nodes = len(order)
    graph = coo_array(
        (np.ones(len(left), dtype=np.int8), (left.astype(np.int64), right.astype(np.int64))),
        shape=(n_nodes, n_nodes),
    )
    _, component = connected_components(graph, directed=False)
    rank = np.empty(n_nodes, dtype=np.int64)
    rank[order] = np.arange(n_nodes)
    best_rank = np.full(component.max(initial=-1) + 1, n_nodes, dtype=np.int64)
    np.minimum.at(best_rank, component, rank)
    return order[best_rank[component]]


def _index_rows(
    batch: pl.DataFrame, sigs: np.ndarray, response_sigs: np.ndarray, keys: np.ndarray, label: str
) -> pl.DataFrame:
    prompt_hash = (
        batch["prompt_hash"]
        if "prompt_hash" in batch.columns
        else pl.Series([None] * batch.height, dtype=pl.String)
    )
    return pl.DataFrame(
        {
            "record_id": batch["record_id"],
            "batch_id": batch["batch_id"],
            "exact_hash": batch["exact_hash"],
            "signature": signature_series("signature", sigs),
            "response_signature": signature_series("response_signature", response_sigs),
            "band_keys": pl.Series(keys).cast(pl.List(pl.Int64)),
            "lsh_params": label,
            "prompt_hash": prompt_hash,
        },
        schema=HISTORY_SCHEMA,
    )
