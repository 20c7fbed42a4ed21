from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from urllib.parse import quote

import boto3
import pytest

from persist.location import Blob, open_blob
from persist.location.testing import BlobConformance


class TestS3Blob(BlobConformance):
    @pytest.fixture(params=["", "base/dir"], ids=["no-prefix", "prefix"])
    async def blob(self, request: pytest.FixtureRequest, s3_endpoint: str) -> AsyncIterator[Blob]:
        bucket = f"persist-test-{uuid.uuid4().hex[:24]}"
        boto3.session.Session().client(
            "s3", endpoint_url=s3_endpoint, region_name="us-east-1"
        ).create_bucket(Bucket=bucket)
        b = open_blob(f"s3://{bucket}/{request.param}?endpoint_url={quote(s3_endpoint, safe='')}")
        yield b
        await b.close()
