"""Local paths and ``s3://`` URIs behind one small vocabulary."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

S3_PREFIX = "s3://"

# Environment variables deltalake's object store understands for S3-compatible stores.
_DELTA_S3_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ALLOW_HTTP",
    "AWS_S3_ALLOW_UNSAFE_RENAME",
)


# ``scheme://user:password@`` anywhere in a text; the password ends at the last ``@`` before the
# host.
_USERINFO_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s]*:)[^/?#\s]*@")
# query parameters that carry a secret, e.g. ``?password=...`` or a presigned URL's signature
_SECRET_QUERY = re.compile(
    r"(?P<head>[?&;](?:password|passwd|pwd|secret|token|access_token|api_key|apikey|sig|signature|"
    r"x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&;#\s]*",
    re.IGNORECASE,
)
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with the password of every URI in it (``postgresql://user:secret@host/db``) and any
    secret query parameter replaced by ``***``: the one way a URI, a log line or an error is
    shown."""
    text = _USERINFO_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}@", text)
    return _SECRET_QUERY.sub(lambda m: f"{m['head']}{REDACTED}", text)


def is_s3(uri: str) -> bool:
    return uri.startswith(S3_PREFIX)


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts if p)])


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    if not is_s3(uri):
        raise ValueError(f"not an s3:// URI: {uri}")
    bucket, _, key = uri[len(S3_PREFIX) :].partition("/")
    return bucket, key


def delta_storage_options(uri: str, env: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """Storage options for deltalake: None for local paths, the AWS_* settings for s3://."""
    if not is_s3(uri):
        return None
    options = {name: env[name] for name in _DELTA_S3_ENV if env.get(name)}
    if "AWS_REGION" not in options:
        options["AWS_REGION"] = options.pop("AWS_DEFAULT_REGION", "us-east-1")
    options.pop("AWS_DEFAULT_REGION", None)
    if options.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        options.setdefault("AWS_ALLOW_HTTP", "true")
    return options
