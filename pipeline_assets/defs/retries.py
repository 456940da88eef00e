"""Retries for stages that can fail for a moment: object-store reads and writes, SQLite locks.

A failure that would repeat (bad input, a missing upstream) is raised as
``Failure(allow_retries=False)`` in those stages, so it is reported at once instead of retried.
"""

from dagster import Backoff, Failure, RetryPolicy

from pipeline_assets.resources.settings import Settings

# Three tries more, 10 s, 20 s, 40 s apart by default (PIPELINE_RETRY_DELAY_SECONDS): long enough
# for a throttled S3 or a busy SQLite writer; a real error (a bad file, a failed contract) fails the
# same way each time and is then reported.
TRANSIENT = RetryPolicy(
    max_retries=3, delay=Settings.from_env().retry_delay_seconds, backoff=Backoff.EXPONENTIAL
)

# How a step says it stopped because its process was asked to (not retried); headless stops on it.
STOPPED_BY_A_SIGNAL = "stopped by a signal"


def refusal(description: str) -> Failure:
    """A failure that would repeat the same way (a missing upstream, bad input): reported at once,
    never retried; retries are for transient faults."""
    return Failure(description=description, allow_retries=False)
