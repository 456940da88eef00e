"""`make dev`, and the Dagster UI it serves as a user uses it, in a real headless Chromium
(Playwright) against its `dagster dev` on loopback: every asset key in the catalog, a partition of
bronze/records materialized from its page through the partition dialog, its run watched in the
runs list until its run page shows Success, and an asset's lineage (its page, then the Lineage
tab's upstream and downstream graphs). Each step leaves a screenshot in test-output/ui/, also when
it fails.

Before the browser, on the same server: the MLflow UI `make dev` serves beside the Dagster UI, the
graph through Dagster's GraphQL API, and a run submitted through it (`DagsterGraphQLClient`), as an
external scheduler or a CI job would submit one, watched until it succeeds. Ctrl-C (SIGINT) stops
both servers when the file is done."""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterRunStatus
from dagster_graphql import DagsterGraphQLClient
from playwright.sync_api import Page, expect, sync_playwright

from pipeline_assets_tests.dagster_dev import (
    DEADLINE_SECONDS,
    ROOT,
    DagsterDev,
    running_dagster_dev,
)

CHROMIUM = shutil.which("chromium")  # where `make test` looks for it, and installs it when missing
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = ROOT / "test-output" / "ui"
UI_TIMEOUT_MS = (
    60_000  # a page, a dialog, a graph layout: seconds normally, more on a loaded 2-core machine
)
# the bronze run (the asset and its checks): under a minute on 2 cores, more when loaded
RUN_TIMEOUT_MS = 240_000

# Every asset key of the README's asset graph (gold/snapshots: the manifests it draws between gold
# and training).
ASSET_KEYS = [
    "bronze/records",
    "bronze/preference_records",
    "bronze/conversations",
    "bronze/quarantine",
    "silver/records",
    "silver/preference_pairs",
    "silver/conversations",
    "silver/rejects",
    "silver/minhash_index",
    "silver/minhash_bands",
    "reference/eval_sets",
    "gold/tokenizer",
    "gold/sequences",
    "gold/snapshots",
    "gold/preference_sequences",
    "gold/preference_snapshots",
    "gold/reference_logps",
    "training/hparam_search",
    "training/checkpoint",
    "training/dpo_checkpoint",
    "evaluation/report",
    "evaluation/dpo_report",
    "registry/model_version",
    "registry/dpo_model_version",
    "ops/pipeline_report",
    "rl/prompt_bank",
    "rl/policy",
    "rl/replay_buffer",
]
# silver/records: what feeds it and what it feeds, one step either way.
UPSTREAM = ["bronze/records", "reference/eval_sets"]
DOWNSTREAM = ["gold/tokenizer", "gold/sequences", "ops/pipeline_report"]


def label(key: str) -> str:
    """How the UI writes an asset key: `silver / records`."""
    return key.replace("/", " / ")


class Steps:
    """Numbered steps, each ending with a full-page screenshot, whether it passed or failed."""

    def __init__(self, page: Page, folder: Path):
        self.page, self.folder, self.count = page, folder, 0

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.count += 1
        try:
            yield
        finally:
            self.page.screenshot(
                path=str(self.folder / f"{self.count:02d}-{name}.png"), full_page=True
            )


RECTS = (
    "els => els.map(e => { const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, "
    "r.height]; })"
)


def drawn_in_group(page: Page, key: str) -> bool:
    """Whether the lineage graph draws `key`: a node named like the key's last part inside the box
    of the group named like its first part (assets are grouped by layer; nodes show only
    their name)."""
    layer, name = key.split("/")
    graph = page.locator("svg")
    groups = (
        graph.locator("foreignObject")
        .filter(has=page.get_by_text(layer, exact=True))
        .evaluate_all(RECTS)
    )
    nodes = graph.get_by_text(name, exact=True).evaluate_all(RECTS)
    return any(
        gx <= x + w / 2 <= gx + gw and gy <= y + h / 2 <= gy + gh
        for x, y, w, h in nodes
        for gx, gy, gw, gh in groups
    )


def wait_for_graph(page: Page, drawn: list[str], absent: list[str]) -> None:
    """Until the lineage graph draws every key of `drawn` and none of `absent` (it lays out and
    zooms to fit after each change), or fail naming what is wrong."""
    deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
    while True:
        missing = [key for key in drawn if not drawn_in_group(page, key)]
        extra = [key for key in absent if drawn_in_group(page, key)]
        if not missing and not extra:
            return
        assert time.monotonic() < deadline, f"the lineage graph lacks {missing} and draws {extra}"
        page.wait_for_timeout(250)


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Iterator[DagsterDev]:
    """One `make dev` for this file's tests (starting one, with its sample corpus, takes half
    a minute)."""
    with (
        pytest.MonkeyPatch.context() as monkeypatch,
        running_dagster_dev(tmp_path_factory.mktemp("dev"), monkeypatch) as server,
    ):
        yield server


def _bronze_holds_the_batch(dev: DagsterDev) -> None:
    records = pl.read_delta(str(dev.home / "lake" / "bronze" / "records"))
    assert records.height == dev.manifest["expected"]["bronze_rows"] > 0
    assert records["batch_id"].unique().to_list() == [dev.batch]


def _answer(url: str, body: bytes | None = None) -> bytes:
    """The first answer of ``url`` (a POST of ``body`` when given) within the deadline."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_make_dev_serves_the_mlflow_ui_and_the_graph_through_graphql(dev):
    """README.md's `make dev`: the MLflow UI and the Dagster UI, whose GraphQL API shows the
    graph, both on loopback."""
    assert _answer(f"http://127.0.0.1:{dev.mlflow_port}/health") == b"OK"
    query = json.dumps({"query": "{ assetNodes { assetKey { path } } }"}).encode()
    nodes = json.loads(_answer(f"{dev.url}/graphql", query))
    keys = {"/".join(n["assetKey"]["path"]) for n in nodes["data"]["assetNodes"]}
    assert {"bronze/records", "registry/model_version", "rl/policy"} <= keys


def test_a_run_submitted_through_graphql_succeeds(dev):
    client = DagsterGraphQLClient("127.0.0.1", port_number=dev.port)
    run_id = client.submit_job_execution(
        "ingest_batch",
        repository_location_name="pipeline_assets",
        tags={"dagster/partition": dev.batch},
    )
    deadline = time.monotonic() + DEADLINE_SECONDS
    while (status := client.get_run_status(run_id)) not in (
        DagsterRunStatus.SUCCESS,
        DagsterRunStatus.FAILURE,
    ):
        assert time.monotonic() < deadline, (
            f"run {run_id} still {status} after {DEADLINE_SECONDS} s"
        )
        time.sleep(0.5)
    assert status == DagsterRunStatus.SUCCESS
    _bronze_holds_the_batch(dev)


@pytest.fixture
def patient_expect() -> Iterator[None]:
    """Playwright's assertions give up after 5 s by default: too soon on a loaded 2-core machine."""
    expect.set_options(timeout=UI_TIMEOUT_MS)
    yield
    expect.set_options(timeout=None)


def test_the_ui_shows_the_graph_materializes_a_partition_and_shows_lineage(
    dev, tmp_path, patient_expect
):
    if CHROMIUM is None:
        pytest.fail(
            "chromium is not on PATH: "
            "`make test` installs Debian's chromium (apt-get install chromium)"
        )
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={
                "width": 1600,
                "height": 2200,
            },  # the catalog lists every asset without scrolling
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            steps = Steps(page, SHOTS)

            with steps.step("catalog"):
                page.goto(f"{dev.url}/assets")
                # A fresh instance greets a first visitor with Dagster's community dialog: skip it.
                expect(page.get_by_text("Join the Dagster community")).to_be_visible()
                page.get_by_role("button", name="Skip").click()
                expect(page.get_by_text("Join the Dagster community")).to_be_hidden()
                for key in ASSET_KEYS:
                    link = page.get_by_role("link", name=label(key))
                    expect(link).to_be_visible()
                    expect(link.locator("span").first).to_have_text(label(key))

            with steps.step("bronze-records"):
                page.get_by_role("link", name=label("bronze/records")).click()
                expect(page).to_have_url(f"{dev.url}/assets/bronze/records")
                page.get_by_role("button", name="Materialize…").click()
                # bronze's four tables are one multi-asset: the UI says all will be written.
                dialog = page.get_by_role("dialog")
                expect(dialog.get_by_text("Additional assets will be materialized")).to_be_visible()
                expect(dialog.get_by_text(label("bronze/quarantine"))).to_be_visible()
                expect(dialog.get_by_text(label("bronze/preference_records"))).to_be_visible()
                expect(dialog.get_by_text(label("bronze/conversations"))).to_be_visible()

            with steps.step("partition-dialog"):
                dialog.get_by_role("button", name="Confirm").click()
                expect(page.get_by_text("Launch runs to materialize 4 assets")).to_be_visible()
                page.get_by_text("Select a partition or create one").click()
                page.get_by_placeholder("Filter partitions").fill(dev.batch)
                page.get_by_title(dev.batch, exact=True).click()
                page.get_by_text(
                    "Launch runs to materialize 4 assets"
                ).click()  # closes the partition list
                expect(page.get_by_text("1 partition", exact=True)).to_be_visible()

            with steps.step("run-launched"):
                page.get_by_role("button", name="Launch 1 run").click()
                toast = page.get_by_text(re.compile(r"^Launched run [0-9a-f]{8}$"))
                expect(toast).to_be_visible()
                short_id = toast.inner_text().split()[-1]
                # The toast's own View link lives 4 s; the runs list does not go away.
                page.get_by_role("navigation").get_by_text("Runs", exact=True).click()
                page.get_by_role("link", name=short_id).click()
                expect(page).to_have_url(re.compile(rf"/runs/{short_id}[0-9a-f-]{{28}}$"))
                expect(page.get_by_text(f"partition: {dev.batch}")).to_be_visible()
                run_url = page.url

            # While the run executes: the lineage of silver/records, on its page.
            with steps.step("silver-records-overview"):
                page.goto(f"{dev.url}/assets/silver/records")
                for heading, keys in (
                    ("Upstream assets", UPSTREAM),
                    ("Downstream assets", DOWNSTREAM),
                ):
                    other = (
                        "Downstream assets" if heading == "Upstream assets" else "Upstream assets"
                    )
                    column = (
                        page.locator("div")
                        .filter(has=page.get_by_text(heading, exact=True))
                        .filter(has_not=page.get_by_text(other, exact=True))
                    )
                    for key in keys:
                        expect(column.get_by_role("link", name=label(key))).to_be_visible()

            with steps.step("silver-records-lineage-upstream"):
                page.get_by_role("tab", name="Lineage").click()
                page.get_by_role("button", name="Upstream").click()
                expect(page).to_have_url(
                    re.compile(r"/assets/silver/records\?view=lineage&lineageScope=upstream$")
                )
                wait_for_graph(page, drawn=["silver/records", *UPSTREAM], absent=DOWNSTREAM)

            with steps.step("silver-records-lineage-downstream"):
                page.get_by_role("button", name="Downstream").click()
                expect(page).to_have_url(
                    re.compile(r"/assets/silver/records\?view=lineage&lineageScope=downstream$")
                )
                wait_for_graph(page, drawn=["silver/records", *DOWNSTREAM], absent=UPSTREAM)

            with steps.step("run-success"):
                # Watched from the runs list (refreshed every 15 s): a run page redraws its live
                # timeline all the time, which takes most of a core from the run on a
                # 2-core machine.
                page.get_by_role("navigation").get_by_text("Runs", exact=True).click()
                outcome = page.get_by_text(
                    re.compile(r"^(Success|Failure|Canceled)$")
                )  # a run's status tag
                run_link = page.get_by_role("link", name=short_id)
                row = (
                    page.locator("div").filter(has=run_link).filter(has=outcome).last
                )  # the innermost: its row
                expect(row).to_be_visible(timeout=RUN_TIMEOUT_MS)
                run_link.click()
                expect(page).to_have_url(run_url)
                expect(outcome).to_be_visible()
                assert outcome.inner_text() == "Success", (
                    f"the run page shows {outcome.inner_text()}"
                )
        finally:
            browser.close()

    _bronze_holds_the_batch(dev)
