import dataclasses
import math

import polars as pl
import pytest

from pipeline_assets.defs.ops.sizing import _earlier_index_rows, _silver_points
from pipeline_assets.lib.formats import text_chars
from pipeline_assets.lib.ops.cost import Prices
from pipeline_assets.lib.ops.sizing import (
    POINTS,
    Calibration,
    StageFit,
    Target,
    fit_per_materialization,
    fit_stage,
    gpu_tokens_per_second,
    predict,
)


def points(*rows: tuple) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "stage": "s",
                "materializations": n,
                "work": w,
                "wall_seconds": s,
                "history": h[0] if h else 0.0,
            }
            for n, w, s, *h in rows
        ],
        schema=POINTS,
    )


def test_text_chars_counts_prompt_response_and_system_and_nothing_else():
    frame = pl.DataFrame(
        {
            "prompt": ["ab", "héllo"],
            "response": ["c", "xyz"],
            "system": [None, "sys"],
            "source": ["aaaa", "b"],
        }
    )
    assert text_chars(frame) == 2 + 1 + 5 + 3 + 3
    assert text_chars(frame.clear()) == 0


def test_the_fit_recovers_a_fixed_part_and_a_rate():
    fit = fit_stage(
        points(
            (1, 1000, 2 + 0.01 * 1000), (1, 5000, 2 + 0.01 * 5000), (2, 4000, 2 * 2 + 0.01 * 4000)
        )
    )
    assert fit.fixed_seconds == pytest.approx(2.0)
    assert fit.seconds_per_unit == pytest.approx(0.01)
    assert fit.seconds(3, 10_000) == pytest.approx(3 * 2 + 100)


def test_runs_of_one_size_count_once_at_their_median():
    slow_run, fast_run = 30.0, 20.0  # a mean would tilt the line with them
    fit = fit_stage(
        points(
            (1, 1000, 12.0),
            (1, 1000, 12.0),
            (1, 1000, slow_run),
            (1, 5000, 52.0),
            (1, 5000, 52.0),
            (1, 5000, fast_run),
        )
    )
    assert (fit.fixed_seconds, fit.seconds_per_unit) == (pytest.approx(2.0), pytest.approx(0.01))
    assert (fit.points, fit.note) == (2, "fitted on 2 sizes (6 runs)")


def test_one_size_charges_all_the_time_to_the_rate():
    fit = fit_stage(points((1, 1000, 4.0), (1, 1000, 4.0)))
    assert (fit.fixed_seconds, fit.seconds_per_unit) == (0.0, pytest.approx(0.004))
    assert "one size" in fit.note


def test_a_negative_fixed_part_is_refitted_as_a_rate_through_zero():
    fit = fit_stage(
        points((1, 1000, 1.0), (1, 2000, 3.0))
    )  # the line through them crosses zero at -1 s
    assert fit.fixed_seconds == 0.0
    assert fit.seconds_per_unit == pytest.approx((1000 * 1 + 2000 * 3) / (1000**2 + 2000**2))


def test_no_work_at_all_is_an_error():
    with pytest.raises(ValueError, match="no measurement"):
        fit_stage(points((1, 0, 1.0)))


def calibration(**fits: StageFit) -> Calibration:
    linear = StageFit(fixed_seconds=1.0, seconds_per_unit=1e-6, points=2, note="")
    stages = ["bronze", "silver", "gold/tokenizer", "gold/sequences", "training", "evaluation"]
    return Calibration(
        fits={stage: fits.get(stage.replace("/", "_"), linear) for stage in stages},
        avg_chars=500.0,
        silver_keep=0.8,
        tokens_per_char=0.25,
        validation_share=0.02,
        eval_set_tokens=10_000,
        cores=2,
        train_ranks=2,
        train_gpus=0,
        validation_fraction=0.02,
        parameters=1,
    )


def test_a_prediction_follows_each_stages_parallelism():
    prices = Prices(core_hour=0.036, gpu_hour=3.6)
    table, totals = predict(
        calibration(training=StageFit(30.0, 0.0, 2, "")),
        Target(
            records=10_000_000,
            cpu_cores=16,
            gpus=8,
            batch_records=1_000_000,
            epochs=2.0,
            gpu_tokens_per_second=50_000,
        ),
        prices,
    )
    rows = {row["stage"]: row for row in table.iter_rows(named=True)}
    chars = 10_000_000 * 500.0
    tokens = chars * 0.8 * 0.25
    # bronze: 10 batches, 8 side by side (16 cores / 2 per process): 2 rounds of one batch's time
    assert rows["bronze"]["wall_seconds"] == pytest.approx(2 * (1.0 + 1e-6 * chars / 10))
    assert rows["bronze"]["runs_on"] == "8 x 2 cores"
    # silver: the 10 batches one after another
    assert rows["silver"]["wall_seconds"] == pytest.approx(10 * 1.0 + 1e-6 * chars)
    # gold/sequences: a shard per batch, side by side like bronze, on the text silver kept
    assert rows["gold/sequences"]["wall_seconds"] == pytest.approx(
        2 * (1.0 + 1e-6 * chars * 0.8 / 10)
    )
    assert rows["gold/sequences"]["runs_on"] == "8 x 2 cores"
    assert rows["gold/tokenizer"]["work"] == pytest.approx(chars * 0.8 * 0.98)
    # training: two epochs of the training split over 8 GPUs, plus the measured fixed part
    train_tokens = 2 * tokens * 0.98
    assert totals["train_tokens"] == pytest.approx(train_tokens)
    assert rows["training"]["wall_seconds"] == pytest.approx(30.0 + train_tokens / (50_000 * 8))
    assert rows["training"]["gpu_seconds"] == pytest.approx(rows["training"]["wall_seconds"] * 8)
    # evaluation: the candidate and the champion, each on the validation tokens and the eval sets
    assert rows["evaluation"]["work"] == pytest.approx(2 * (tokens * 0.02 + 10_000))
    # ... scored on the 8 GPUs, a forward pass three times as many tokens a second as training's
    assert rows["evaluation"]["wall_seconds"] == pytest.approx(
        1.0 + 2 * (tokens * 0.02 + 10_000) / (3 * 50_000 * 8)
    )
    assert (rows["evaluation"]["runs_on"], rows["evaluation"]["parallelism"]) == (
        "8 GPUs",
        "data parallel",
    )

    assert totals["wall_seconds"] == pytest.approx(sum(r["wall_seconds"] for r in rows.values()))
    assert totals["bottleneck"] == "silver"  # 5,010 s, one batch after another; training 4,930 s
    bronze_cost = rows["bronze"]["wall_seconds"] * 16 * 0.036 / 3600
    assert rows["bronze"]["cost_usd"] == pytest.approx(bronze_cost)
    assert rows["training"]["cost_usd"] == pytest.approx(
        rows["training"]["wall_seconds"] * 8 * 3.6 / 3600
    )
    assert totals["usd_per_million_tokens"] == pytest.approx(totals["cost_usd"] / tokens * 1e6)
    assert table["share_of_wall"].sum() == pytest.approx(1.0)


def test_without_gpus_training_runs_as_measured_and_more_cores_do_not_speed_up_one_process():
    fits = {"training": StageFit(5.0, 1e-3, 2, "")}
    small, _ = predict(
        calibration(**fits),
        Target(records=1000, cpu_cores=2, gpus=0, train_tokens=10_000),
        Prices(),
    )
    big, _ = predict(
        calibration(**fits),
        Target(records=1000, cpu_cores=64, gpus=0, train_tokens=10_000),
        Prices(),
    )
    assert small.filter(pl.col("stage") == "training")["wall_seconds"][0] == pytest.approx(
        5.0 + 1e-3 * 10_000 * 6
    )
    assert small["wall_seconds"].to_list() == pytest.approx(
        big["wall_seconds"].to_list()
    )  # one batch: nothing to spread


def test_first_model_scores_one_model_and_spot_capacity_costs_less():
    one, _ = predict(
        calibration(), Target(records=1000, cpu_cores=2, gpus=0, models_scored=1), Prices()
    )
    two, _ = predict(calibration(), Target(records=1000, cpu_cores=2, gpus=0), Prices())
    assert one.filter(pl.col("stage") == "evaluation")["work"][0] * 2 == pytest.approx(
        two.filter(pl.col("stage") == "evaluation")["work"][0]
    )
    _, spot = predict(
        calibration(), Target(records=1000, cpu_cores=2, gpus=0), Prices(spot_discount=0.6)
    )
    _, on_demand = predict(calibration(), Target(records=1000, cpu_cores=2, gpus=0), Prices())
    assert spot["cost_usd"] == pytest.approx(on_demand["cost_usd"] * 0.4)


def test_gpus_without_a_gpu_speed_are_refused_when_the_calibration_trained_on_cpu():
    with pytest.raises(ValueError, match="gpu-tokens-per-second"):
        predict(calibration(), Target(records=1000, cpu_cores=2, gpus=4), Prices())


def test_a_gpu_calibration_gives_the_speed_per_gpu():
    gpu = Calibration(
        **{
            **vars(calibration()),
            "train_gpus": 2,
            "fits": {**calibration().fits, "training": StageFit(10.0, 1 / 20_000 / 6, 2, "")},
        }
    )
    table, _ = predict(gpu, Target(records=1000, cpu_cores=2, gpus=8, train_tokens=1e9), Prices())
    per_gpu = 20_000 / 2
    assert table.filter(pl.col("stage") == "training")["wall_seconds"][0] == pytest.approx(
        10.0 + 1e9 / (per_gpu * 8)
    )


def test_assumed_gpu_speed_is_mfu_times_peak_over_flops_per_token():
    assert gpu_tokens_per_second(6e8, 1e15, 0.4) == pytest.approx(0.4 * 1e15 / 6e8)
    assert math.isclose(gpu_tokens_per_second(1.0, 2.0, 0.5), 1.0)


def test_a_bigger_preset_trains_and_is_scored_slower_by_its_flops_per_token():
    fits = {"training": StageFit(5.0, 1e-9, 2, ""), "evaluation": StageFit(1.0, 1e-9, 2, "")}
    tiny = Calibration(**{**vars(calibration(**fits)), "parameters": 1_000_000})
    target = Target(records=1000, cpu_cores=2, gpus=0, train_tokens=10_000)
    as_measured, _ = predict(tiny, target, Prices())
    base, _ = predict(tiny, Target(**{**vars(target), "parameters": 100_000_000}), Prices())
    wall = {
        name: dict(frame.select("stage", "wall_seconds").iter_rows())
        for name, frame in (("tiny", as_measured), ("base", base))
    }
    assert wall["tiny"]["training"] == pytest.approx(5.0 + 1e-9 * 10_000 * 6 * 1e6)
    assert wall["base"]["training"] - 5.0 == pytest.approx(100 * (wall["tiny"]["training"] - 5.0))
    assert wall["base"]["evaluation"] - 1.0 == pytest.approx(
        100 * (wall["tiny"]["evaluation"] - 1.0)
    )


def test_a_measured_gpu_speed_is_scaled_to_the_target_models_flops():
    gpu = Calibration(
        **{
            **vars(calibration()),
            "train_gpus": 1,
            "parameters": 1_000_000,
            "fits": {**calibration().fits, "training": StageFit(0.0, 1e-12, 2, "")},
        }
    )
    table, _ = predict(
        gpu,
        Target(records=1000, cpu_cores=2, gpus=1, train_tokens=1e9, parameters=10_000_000),
        Prices(),
    )
    assert table.filter(pl.col("stage") == "training")["wall_seconds"][0] == pytest.approx(
        1e9 * 6 * 1e7 * 1e-12
    )


def test_silver_fit_has_a_term_for_the_earlier_index_each_batch_reads():
    fixed, per_char, per_row = 2.0, 1e-5, 1e-4
    fit = fit_stage(
        points(
            *[
                (1, chars, fixed + per_char * chars + per_row * rows, rows)
                for chars, rows in [(1e5, 0), (2e5, 1000), (1e5, 3000), (3e5, 5000)]
            ]
        )
    )
    assert (fit.fixed_seconds, fit.seconds_per_unit, fit.seconds_per_history_row) == (
        pytest.approx(fixed),
        pytest.approx(per_char),
        pytest.approx(per_row),
    )
    silver = Calibration(**{**vars(calibration(silver=fit)), "silver_row_keep": 0.5})
    table, _ = predict(
        silver, Target(records=4_000, cpu_cores=2, gpus=0, batch_records=1_000), Prices()
    )
    chars = 4_000 * 500.0
    index_rows_read = 500 * (
        0 + 1 + 2 + 3
    )  # each batch keeps 500 rows and reads every earlier batch's
    assert table.filter(pl.col("stage") == "silver")["wall_seconds"][0] == pytest.approx(
        4 * fixed + per_char * chars + per_row * index_rows_read
    )


def test_each_silver_run_read_the_index_of_the_other_batches_before_it():
    newest_first = [
        {"partition": "b1", "silver_rows": 7},
        {"partition": "b2", "silver_rows": 20},
        {"partition": "b1", "silver_rows": 10},
    ]  # b1, then b2, then b1 again
    assert _earlier_index_rows(newest_first) == {2: 0, 1: 10, 0: 20}


def test_the_tokenizer_sample_and_the_evaluation_sample_cap_their_stages_work():
    capped = dataclasses.replace(calibration(), tokenizer_sample_chars=1e8, eval_max_tokens=2e6)
    target = Target(records=10_000_000, cpu_cores=16, gpus=0, train_tokens=10_000)
    rows = {row["stage"]: row for row in predict(capped, target, Prices())[0].iter_rows(named=True)}
    uncapped = {
        row["stage"]: row
        for row in predict(calibration(), target, Prices())[0].iter_rows(named=True)
    }
    assert uncapped["gold/tokenizer"]["work"] == pytest.approx(10_000_000 * 500.0 * 0.8 * 0.98)
    assert rows["gold/tokenizer"]["work"] == 1e8
    assert rows["evaluation"]["work"] == pytest.approx(2 * (2e6 + 10_000))
    assert uncapped["evaluation"]["work"] == pytest.approx(
        2 * (10_000_000 * 500.0 * 0.8 * 0.25 * 0.02 + 10_000)
    )


def test_silvers_block_stages_spread_over_the_cluster_when_a_batch_runs_them_on_ray():
    own, blocks = StageFit(2.0, 1e-6, 2, ""), StageFit(0.0, 4e-6, 2, "")
    spread = Calibration(**{**vars(calibration(silver=own)), "silver_blocks": blocks})
    chars = 4_000_000 * 500.0  # 4 batches of 1,000,000 records
    target = Target(records=4_000_000, cpu_cores=64, gpus=0, batch_records=1_000_000)
    on_ray, _ = predict(spread, target, Prices())
    silver = on_ray.filter(pl.col("stage") == "silver").row(0, named=True)
    assert silver["wall_seconds"] == pytest.approx(4 * 2.0 + 1e-6 * chars + 4e-6 * chars / 64)
    assert silver["runs_on"] == "2 + 64 on Ray"
    assert silver["cpu_core_seconds"] == pytest.approx((4 * 2.0 + 1e-6 * chars) * 2 + 4e-6 * chars)
    in_process, _ = predict(spread, Target(**{**vars(target), "ray_min_rows": 2_000_000}), Prices())
    assert in_process.filter(pl.col("stage") == "silver")["wall_seconds"][0] == pytest.approx(
        4 * 2.0 + 5e-6 * chars
    )


def _run(partition: str, chars: float, wall: float, *blocks: float, **more) -> dict:
    """A silver materialization's metadata: its characters and wall seconds, its block stages'
    wall and task seconds where they were timed, and ``more``."""
    timed = dict(zip(("block_wall_seconds", "block_stage_seconds"), blocks, strict=False))
    return {"partition": partition, "input_chars": chars, "wall_seconds": wall, **timed, **more}


def test_silver_is_fitted_on_its_own_part_and_its_block_stages_apart():
    newest_first = [
        _run("b2", 200.0, 9.0, 5.0, 8.0),
        _run("b1", 100.0, 6.0, 4.0, 7.0),
        _run("b1", 100.0, 5.0),  # recorded before block stages were timed
    ]
    points = _silver_points(newest_first, "input_chars")
    own = [(p["work"], p["wall_seconds"]) for p in points if p["stage"] == "silver"]
    blocks = [(p["work"], p["wall_seconds"]) for p in points if p["stage"] != "silver"]
    assert own == [(200.0, 4.0), (100.0, 2.0)] and blocks == [(200.0, 8.0), (100.0, 7.0)]
    untimed = _silver_points(newest_first[2:], "input_chars")
    assert [(p["stage"], p["wall_seconds"]) for p in untimed] == [("silver", 5.0)]


def test_silvers_index_lookup_is_fitted_on_its_tasks_and_spread_a_band_and_slice_a_task():
    lookup = StageFit(0.0, 1e-6, 2, "")  # a core second per million index rows searched
    spread = Calibration(
        **{
            **vars(calibration(silver=StageFit(2.0, 0.0, 2, ""))),
            "silver_lookup": lookup,
            "lookup_bands": 17,
        }
    )
    target = Target(records=12_000_000, cpu_cores=20, gpus=0, batch_records=4_000_000)
    silver = (
        predict(spread, target, Prices())[0].filter(pl.col("stage") == "silver").row(0, named=True)
    )
    # batch 2 searches 4M rows (one slice: 17 tasks), batch 3 8M rows (two slices: 34 tasks
    # on 20 cores)
    assert silver["wall_seconds"] == pytest.approx(3 * 2.0 + 4.0 / 17 + 8.0 / 20)
    assert silver["cpu_core_seconds"] == pytest.approx(3 * 2.0 * 2 + 4.0 + 8.0)
    in_process = predict(spread, Target(**{**vars(target), "ray_min_rows": 5_000_000}), Prices())[0]
    assert in_process.filter(pl.col("stage") == "silver")["wall_seconds"][0] == pytest.approx(
        3 * 2.0 + 4.0 + 8.0
    )


def test_silvers_own_part_leaves_out_the_wait_on_its_lookup_tasks_fitted_on_the_rows_searched():
    newest_first = [
        _run(
            "b2",
            200.0,
            9.0,
            5.0,
            8.0,
            silver_rows=30,
            index_lookup_task_seconds=1.5,
            index_lookup_wait_seconds=1.0,
        ),
        _run(
            "b1",
            100.0,
            6.0,
            4.0,
            7.0,
            silver_rows=40,
            index_lookup_task_seconds=0.5,
            index_lookup_wait_seconds=0.5,
        ),
        _run(
            "b0", 100.0, 5.0, 1.0, 2.0, silver_rows=40
        ),  # recorded before the lookup's tasks were timed
    ]
    points = _silver_points(newest_first, "input_chars")
    by_stage = {
        stage: [(p["work"], p["wall_seconds"], p["history"]) for p in points if p["stage"] == stage]
        for stage in {p["stage"] for p in points}
    }
    assert by_stage["silver"] == [(200.0, 3.0, 0.0), (100.0, 1.5, 0.0)], (
        "less the blocks' and the lookup's wait; b0 untimed"
    )
    assert by_stage["silver/index lookup"] == [(80.0, 1.5, 0.0), (40.0, 0.5, 0.0)], (
        "b2 searched b1's and b0's rows, b1 b0's"
    )


def test_silvers_decision_is_fitted_apart_on_its_own_seconds_and_added_to_every_batch():
    """The step's residual (its wall less the tasks it waited on) hides the decision's per-record
    rate in its spread at a calibration's sizes; the decision's own seconds show it."""
    newest_first = [
        _run("b2", 200.0, 9.0, 5.0, 8.0, decide_seconds=1.5),
        _run("b1", 100.0, 6.0, 3.0, 7.0, decide_seconds=1.0),
        _run("b1", 100.0, 5.0, 3.0, 6.0),  # recorded before the decision was timed
    ]
    points = _silver_points(newest_first, "input_chars")
    by_stage = {
        stage: [(p["work"], p["wall_seconds"]) for p in points if p["stage"] == stage]
        for stage in ("silver", "silver/decision")
    }
    assert by_stage == {
        "silver": [(200.0, 2.5), (100.0, 2.0)],
        "silver/decision": [(200.0, 1.5), (100.0, 1.0)],
    }
    decision = fit_stage(pl.DataFrame([p for p in points if p["stage"] == "silver/decision"]))
    assert decision.fixed_seconds == pytest.approx(0.5)
    assert decision.seconds_per_unit == pytest.approx(0.005)
    rest = fit_per_materialization(
        pl.DataFrame([p for p in points if p["stage"] == "silver"]), "a batch"
    )
    assert (rest.fixed_seconds, rest.seconds_per_unit) == (2.25, 0.0)  # the runs' median

    own = StageFit(2.0, 0.0, 2, "")
    fitted = Calibration(
        **{**vars(calibration(silver=own)), "silver_decision": StageFit(0.5, 1e-6, 2, "")}
    )
    target = Target(records=4_000_000, cpu_cores=64, gpus=0, batch_records=1_000_000)
    silver = (
        predict(fitted, target, Prices())[0].filter(pl.col("stage") == "silver").row(0, named=True)
    )
    chars = 4_000_000 * 500.0
    assert silver["wall_seconds"] == pytest.approx(4 * (2.0 + 0.5) + 1e-6 * chars)
    without = predict(calibration(silver=own), target, Prices())[0]
    assert without.filter(pl.col("stage") == "silver")["wall_seconds"][0] == pytest.approx(4 * 2.0)
