"""Tiered KV block manager (KVBM) of one worker: G2 host DRAM, G3 local disk, G4 object storage
below the engine's G1 device pool, in the spirit of NVIDIA Dynamo's KVBM.

* :mod:`.residency` and :mod:`.policy` decide (pure); :mod:`.manager` executes against the
  :mod:`.stores` and reports every residency change as an event (merged per call by
  :mod:`.event_batch`; its answers are :mod:`.results`); :mod:`.projection` folds past
  events back into claimed residency for a restart and :mod:`.rebuild` sorts those claims
  against the stores (pure); :mod:`.content` and :mod:`.frame` make every block verifiable.
* Blocking API (thread-safe); :class:`AsyncKvbm` for asyncio callers.
"""

from data_plane.kvbm.offload_filter import ADMIT_ALL, AdmissionConfig, AdmissionFilter
from data_plane.kvbm.aio import AsyncKvbm
from data_plane.kvbm.bootstrap import build_kvbm
from data_plane.kvbm.content import expected_bytes, verify
from data_plane.kvbm.errors import (
    BlockMissing,
    CapacityExceeded,
    CorruptBlock,
    KvbmConfigError,
    KvbmError,
    StorageError,
)
from data_plane.kvbm.manager import KvBlockManager
from data_plane.kvbm.policy import EvictionPolicy, LfuPolicy, LruPolicy
from data_plane.kvbm.projection import claimed_persistent, fold_residency
from data_plane.kvbm.residency import Admission, Op, OpKind, Residency
from data_plane.kvbm.results import OnboardedBlock, OnboardResult, RebuildReport
from data_plane.kvbm.settings import KvbmSettings, S3Settings

__all__ = [
    "ADMIT_ALL",
    "Admission",
    "AdmissionConfig",
    "AdmissionFilter",
    "AsyncKvbm",
    "BlockMissing",
    "CapacityExceeded",
    "CorruptBlock",
    "EvictionPolicy",
    "KvBlockManager",
    "KvbmConfigError",
    "KvbmError",
    "KvbmSettings",
    "LfuPolicy",
    "LruPolicy",
    "OnboardResult",
    "OnboardedBlock",
    "Op",
    "OpKind",
    "RebuildReport",
    "Residency",
    "S3Settings",
    "StorageError",
    "build_kvbm",
    "claimed_persistent",
    "expected_bytes",
    "fold_residency",
    "verify",
]
