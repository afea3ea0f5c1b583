"""Storage adapters of the KVBM tiers. ``S3Store`` lives in :mod:`.s3` (imports boto3)."""

from data_plane.kvbm.stores.base import BlockStore, Buffer
from data_plane.kvbm.stores.disk import DiskStore
from data_plane.kvbm.stores.host import HostStore
from data_plane.kvbm.stores.memory import MemoryStore

__all__ = ["BlockStore", "Buffer", "DiskStore", "HostStore", "MemoryStore"]
