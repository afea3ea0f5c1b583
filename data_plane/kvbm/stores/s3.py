"""G4: object storage through the S3 API (boto3), against any S3-compatible endpoint.

One object per block, key ``<prefix><hash as 16 hex digits>.kvb``, body a :mod:`frame`. The prefix
normally ends in the worker id, so a shared bucket keeps each worker's blocks apart (each worker
reports and rebuilds only its own). A successful PUT is durable by the S3 contract, so the manager
reports the block once ``put`` returns. boto3 clients are thread-safe; the store holds one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from data_plane.kvbm import frame
from data_plane.kvbm.errors import StorageError
from data_plane.kvbm.stores.base import Buffer, block_name, driver_errors, parse_block_name
from schemas.types import BlockHash, Tier

if TYPE_CHECKING:
    from data_plane.kvbm.settings import S3Settings

logger = logging.getLogger(__name__)

_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
#: What boto3 raises: the service's answer (ClientError) or the transport's (BotoCoreError).
_DRIVER = (ClientError, BotoCoreError)


def _code(e: BaseException) -> str | None:
    """The service's error code (None for a transport error)."""
    return e.response.get("Error", {}).get("Code") if isinstance(e, ClientError) else None


def _absent(e: BaseException) -> bool:
    """The service said the bucket or key does not exist."""
    return _code(e) in _MISSING_CODES


#: Replies that mean "not now" rather than "no": the service is down, overloaded or throttling.
_UNAVAILABLE_CODES = frozenset({"ServiceUnavailable", "SlowDown", "InternalError", "RequestTimeout",
                                "Throttling", "ThrottlingException", "RequestLimitExceeded"})


def unavailable(e: BaseException) -> bool:
    """The endpoint did not answer (no connection, a timeout, a dropped connection) or answered
    that it cannot serve now (a 5xx or a throttling code), after botocore's own retries."""
    if isinstance(e, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return _code(e) in _UNAVAILABLE_CODES or status >= 500
    return False


def make_client(s3: S3Settings) -> Any:
    """A boto3 S3 client for ``s3`` (explicit credentials when given, else boto3's chain)."""
    config = Config(
        connect_timeout=s3.connect_timeout_s,
        read_timeout=s3.read_timeout_s,
        retries={"max_attempts": s3.max_attempts, "mode": "standard"},
        max_pool_connections=s3.max_pool_connections,
        s3={"addressing_style": s3.addressing_style},
    )
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        region_name=s3.region,
        aws_access_key_id=s3.access_key_id,
        aws_secret_access_key=s3.secret_access_key,
        config=config,
    )


class S3Store:
    tier = Tier.OBJECT

    def __init__(self, client: Any, bucket: str, prefix: str, bytes_per_block: int) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.bytes_per_block = bytes_per_block

    @classmethod
    def from_settings(cls, s3: S3Settings, prefix: str, bytes_per_block: int) -> S3Store:
        store = cls(make_client(s3), s3.bucket, prefix, bytes_per_block)
        if s3.create_bucket:
            store.ensure_bucket(s3.region)
        return store

    def ensure_bucket(self, region: str = "us-east-1") -> None:
        """Create the bucket if it does not exist (for local endpoints; production buckets are
        provisioned outside the worker)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except _DRIVER as e:
            if not _absent(e):
                raise StorageError(f"bucket {self.bucket}: {e}") from e
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self.client.create_bucket(**kwargs)
        except _DRIVER as e:
            if _code(e) != "BucketAlreadyOwnedByYou":
                raise StorageError(f"creating bucket {self.bucket}: {e}") from e

    def key_of(self, block_hash: BlockHash) -> str:
        return f"{self.prefix}{block_name(block_hash)}"

    def put(self, block_hash: BlockHash, data: Buffer) -> None:
        with driver_errors(f"PUT block {block_hash:016x}", _DRIVER, is_unavailable=unavailable):
            self.client.put_object(Bucket=self.bucket, Key=self.key_of(block_hash),
                                   Body=frame.encode(block_hash, data))

    def get(self, block_hash: BlockHash) -> memoryview:
        key = self.key_of(block_hash)
        with driver_errors(f"GET block {block_hash:016x}", _DRIVER, is_unavailable=unavailable,
                           is_missing=_absent, missing=f"block {block_hash:016x}: no object {key}"):
            blob = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return frame.decode(block_hash, blob, self.bytes_per_block)

    def delete(self, block_hash: BlockHash) -> None:
        with driver_errors(f"DELETE block {block_hash:016x}", _DRIVER, is_unavailable=unavailable):
            self.client.delete_object(Bucket=self.bucket, Key=self.key_of(block_hash))

    def scan(self) -> dict[BlockHash, int]:
        found: dict[BlockHash, int] = {}
        with driver_errors(f"listing s3://{self.bucket}/{self.prefix}", _DRIVER,
                           is_unavailable=unavailable):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    h = parse_block_name(obj["Key"][len(self.prefix):])
                    if h is not None:
                        found[h] = int(obj["Size"])
        return found

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            logger.debug("closing S3 client failed", exc_info=True)
