"""Redaction of the secrets a URI can carry, wherever a URI is shown."""

from __future__ import annotations

import pytest

from pipeline_assets.lib.uris import redact


@pytest.mark.parametrize(
    "shown, expected",
    [
        (
            "postgresql://mlflow:s3cr%40t@db.internal:5432/mlflow",
            "postgresql://mlflow:***@db.internal:5432/mlflow",
        ),
        ("https://alice:pa:ss@tracking.example.com/", "https://alice:***@tracking.example.com/"),
        (
            "API request to https://u:p4ss@host/api/2.0/mlflow/runs/get failed",
            "API request to https://u:***@host/api/2.0/mlflow/runs/get failed",
        ),
        ("mysql://root:pw@h/db and https://x:y@z/", "mysql://root:***@h/db and https://x:***@z/"),
        ("https://h/a?X-Amz-Signature=abc&x=1", "https://h/a?X-Amz-Signature=***&x=1"),
        ("postgresql://h/db?user=u&password=pw", "postgresql://h/db?user=u&password=***"),
    ],
)
def test_passwords_and_secret_parameters_are_redacted(shown, expected):
    assert redact(shown) == expected


@pytest.mark.parametrize(
    "shown",
    [
        "sqlite:////home/u/.pipeline/mlflow.db",
        "s3://bucket/lake/silver/records",
        "https://user@host/path",
        "http://127.0.0.1:5000/#/experiments/1/runs/abc",
        "/tmp/a:b@c",
        "no uri here: just text",
    ],
)
def test_uris_without_a_secret_are_shown_as_they_are(shown):
    assert redact(shown) == shown
