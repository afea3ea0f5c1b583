"""The one wiring function: settings and a sink in, a ready manager out."""

from __future__ import annotations

import numpy as np

from data_plane.kvbm.manager import KvBlockManager
from data_plane.kvbm.settings import KvbmSettings
from data_plane.kvbm.stores.base import BlockStore
from data_plane.kvbm.stores.disk import DiskStore
from data_plane.kvbm.stores.host import HostStore
from common.log.sink import EventSink
from schemas.types import Tier


def build_kvbm(settings: KvbmSettings, sink: EventSink, *,
               host_buffer: np.ndarray | None = None) -> KvBlockManager:
    """Host pool, disk directory and S3 client for the tiers that have a capacity.

    Opening the disk tier removes temporaries of a crashed write; ``s3.create_bucket`` creates a
    missing bucket. The persistent tiers start empty: call ``rebuild`` with what the log claims
    before serving (blocks it does not confirm are deleted there). ``host_buffer`` is the G2
    pool's memory when the caller owns it (see :class:`HostStore`).
    """
    settings.check_backends()
    stores: dict[Tier, BlockStore] = {}
    if settings.host_capacity:
        stores[Tier.HOST] = HostStore(settings.host_capacity, settings.bytes_per_block,
                                      buffer=host_buffer)
    if settings.disk_capacity:
        assert settings.disk_root is not None  # checked by the settings
        stores[Tier.DISK] = DiskStore(settings.disk_root, settings.bytes_per_block,
                                      fsync=settings.fsync)
    if settings.object_capacity:
        # lazy: start-up time: loads boto3, botocore only when called
        from data_plane.kvbm.stores.s3 import S3Store  # boto3 only when G4 is configured

        assert settings.s3 is not None and settings.object_prefix is not None
        stores[Tier.OBJECT] = S3Store.from_settings(settings.s3, settings.object_prefix,
                                                    settings.bytes_per_block)
    return KvBlockManager(settings, sink, stores)
