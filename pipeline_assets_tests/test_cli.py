"""The headless command against a persistent instance, as a user runs it (its whole story with the
other documented commands: test_documented_commands.py)."""

from __future__ import annotations

import json

from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.conftest import run_cli as _cli


def test_run_with_a_selection_and_a_bad_setting(tmp_path):
    write_landing_file(tmp_path / "landing", "annotate", "a.jsonl", [record(1)])
    selected = _cli(tmp_path, "run", "--select", "key:bronze/quarantine")
    assert selected.returncode == 0, selected.stderr
    assert "runs: 1" in selected.stdout  # the multi-asset runs whole
    unmeasured = _cli(tmp_path, "sizer", "--records", "1000")
    assert (
        unmeasured.returncode == 2
        and "no measured run of silver" in unmeasured.stderr
        and "Traceback" not in unmeasured.stderr
    )
    bad = _cli(tmp_path, "run", PIPELINE_FIELD_MAPPINGS="{not json")
    assert bad.returncode == 2 and "PIPELINE_FIELD_MAPPINGS is not valid JSON" in bad.stderr
    unknown_format = _cli(tmp_path, "run", PIPELINE_SOURCE_FORMATS='{"prefs": "dpo"}')
    assert (
        unknown_format.returncode == 2
        and "PIPELINE_SOURCE_FORMATS names unknown record format(s) dpo" in unknown_format.stderr
    )
    assert "Traceback" not in bad.stderr
    unknown_language = _cli(tmp_path, "run", PIPELINE_LANGUAGES="en,xx")
    assert (
        unknown_language.returncode == 2
        and "PIPELINE_LANGUAGES='en,xx': the language-ID model (lid.176) knows no language xx"
        in unknown_language.stderr
    )
    causal_lm = tmp_path / "causal-lm"
    causal_lm.mkdir()
    (causal_lm / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    scorers = json.dumps([{"name": "edu", "model": str(causal_lm), "min": 2.5}])
    not_a_classifier = _cli(tmp_path, "run", PIPELINE_QUALITY_MODELS=scorers)
    assert (
        not_a_classifier.returncode == 2
        and "PIPELINE_QUALITY_MODELS: " in not_a_classifier.stderr
        and "is not a sequence classifier" in not_a_classifier.stderr
        and "Traceback" not in not_a_classifier.stderr
    )
    (tmp_path / "kuberay.yaml").write_text("imagee: registry.example.com/pipeline-assets:1.4\n")
    misspelt = _cli(tmp_path, "run", PIPELINE_KUBERAY=str(tmp_path / "kuberay.yaml"))
    assert (
        misspelt.returncode == 2
        and "unknown field(s) imagee" in misspelt.stderr
        and "Traceback" not in misspelt.stderr
    )


def test_sample_data_command_is_deterministic(tmp_path):
    """The command in a fresh process writes the same bytes as this process does (no hash seed,
    no clock)."""
    done = _cli(
        tmp_path,
        "sample-data",
        "--records",
        "400",
        "--out",
        str(tmp_path / "command"),
        "--eval-sets-out",
        str(tmp_path / "command-eval"),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lines"] == 400
    write_sample_corpus(tmp_path / "here", records=400, eval_sets_dir=tmp_path / "here-eval")
    outputs = [
        {
            p.relative_to(tmp_path / name): p.read_bytes()
            for p in (tmp_path / name).rglob("*")
            if p.is_file()
        }
        for name in ("command", "here")
    ]
    assert outputs[0] == outputs[1]
    suffixes = {"".join(path.suffixes) for path in outputs[0]}
    assert {".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"} <= suffixes
