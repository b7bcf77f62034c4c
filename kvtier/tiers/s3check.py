"""The S3 tier's start-up check: can this process reach the bucket with the credentials
it has? Run once, before the tier serves anything (rule: check resources early).

Invariant: every failure is a ``TierError`` whose message names the setting to change
(``<setting>.bucket``, ``.endpoint_url``, ``.region``) and what to do. Credentials and
exception texts that can quote requests are never put in a message.
"""

from __future__ import annotations

from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from kvtier.tiers.base import TierError
from kvtier.tiers.s3io import describe, status


def check_bucket(probe: Any, bucket: str, *, setting: str, endpoint_url: str | None) -> None:
    """HEAD ``bucket`` with the boto3 client ``probe``; raise ``TierError`` if that fails."""
    s, where = setting, endpoint_url or "AWS S3"
    try:
        probe.head_bucket(Bucket=bucket)
        return
    except NoCredentialsError:
        msg = (
            f"{s}: no AWS credentials found; provide them through the standard chain "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials "
            "or an instance role)"
        )
    except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError):
        msg = f"{s}.endpoint_url: cannot reach {where}; start the endpoint or fix the URL"
    except ClientError as e:
        msg = {
            404: f"{s}.bucket: bucket {bucket!r} does not exist at {where}; "
            "create it or fix the name",
            403: f"{s}.bucket: access to bucket {bucket!r} at {where} was denied "
            "(HTTP 403); check the credentials in the standard AWS chain and that they "
            "may read, write and list this bucket",
            301: f"{s}.region: bucket {bucket!r} is in another region; set region to it",
        }.get(
            status(e),
            f"{s}: {where} answered {describe(e)} for bucket {bucket!r}; "
            "check endpoint_url, region and path_style",
        )
    except BotoCoreError as e:
        msg = f"{s}.endpoint_url: talking to {where} failed ({describe(e)}); check the URL"
    raise TierError(msg)
