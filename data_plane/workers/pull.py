"""The decode side of a handoff: pull the prefill's held blocks by NIXL READ into staging,
verify them against the prompt's hashes, notify the holder.

``KvTransferStarted`` -> ``KvTransferCompleted``; any failure is ``KvTransferFailed(fallback=
"recompute")`` and the caller prefills the prompt itself: the request still completes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from data_plane.transfer import TransferError, TransferResult, TransferTimeout, encode_done
from data_plane.workers.handoff import DecodeHandoff, mismatch
from data_plane.workers.metrics import WorkerMetrics
from data_plane.workers.peers import PeerDirectory
from data_plane.workers.settings import WorkerSettings
from data_plane.workers.transfer import TransferPlane
from common.hashing import HashConfig, hash_blocks
from schemas.events import Event, KvTransferCompleted, KvTransferFailed, KvTransferStarted

log = logging.getLogger(__name__)

#: The ``backend`` our own NIXL transfers record.
BACKEND = "UCX"


class PullHost(Protocol):
    """What the decode pull uses of its worker: identity, parts, staging slots, publisher, and
    the counters it keeps (``pulling`` is also counted as waiting in the load report)."""

    s: WorkerSettings
    worker_id: str
    block_size: int
    hash_config: HashConfig
    plane: TransferPlane
    peers: PeerDirectory
    metrics: WorkerMetrics
    stats: dict[str, int]
    clock: Callable[[], float]
    pulling: int
    last_pull_error: str

    def publish(self, payload: Event, correlation_id: str | None = None) -> None: ...

    async def publish_acked(self, payload: Event, correlation_id: str | None = None) -> None: ...

    async def staging(self, n: int) -> tuple[list[int] | None, float]: ...

    def free_slots(self, slots: list[int]) -> None: ...


async def pull(w: PullHost, request_id: str, h: DecodeHandoff, prompt: list[int]) -> bool:
    """Pull the handoff's blocks into staging, verify them, notify the holder. True when the
    prompt's KV arrived; False (after ``KvTransferFailed``) when it must be recomputed."""
    n = h.blocks
    nbytes = n * w.plane.bytes_per_block
    common = dict(request_id=request_id, transfer_id=uuid.uuid4().hex, src_worker=h.engine_id,
                  dst_worker=w.worker_id, blocks=n, backend=BACKEND)
    w.publish(KvTransferStarted(**common, bytes=nbytes), correlation_id=request_id)
    t0 = time.monotonic()
    n_prompt_blocks = len(prompt) // w.block_size
    prompt_hashes = hash_blocks(prompt[: min(n, n_prompt_blocks) * w.block_size], w.hash_config)
    reason = mismatch(h, prompt_hashes, block_size=w.block_size, bytes_per_block=w.plane.bytes_per_block)
    if reason is None and n > n_prompt_blocks:
        reason = f"{n} blocks offered for a prompt of {n_prompt_blocks} full blocks"
    local: list[int] | None = None
    result: TransferResult | None = None
    w.pulling += 1
    try:
        if reason is None:
            local, waited = await w.staging(n)
            if local is None:
                reason = (f"no free staging slots ({n} needed, {w.plane.slots.free_count} free "
                          f"after waiting {waited * 1e3:.0f} ms)")
        if reason is None:
            assert local is not None
            job = asyncio.ensure_future(asyncio.to_thread(pull_blocking, w, h, local))
            try:
                result = await asyncio.shield(job)
            except asyncio.CancelledError:
                # The client left; the READ may still be landing in our slots: free them
                # only once it is over.
                slots, local = local, None
                job.add_done_callback(lambda _f: w.free_slots(slots))
                w.publish(KvTransferFailed(**common, duration_ms=(time.monotonic() - t0) * 1e3,
                                           reason="request cancelled", fallback="failed"),
                          correlation_id=request_id)
                raise
            except TransferTimeout as e:
                # NIXL may still write into these slots: never reuse them.
                w.stats["quarantined_slots"] += len(local)
                local = None
                reason = f"TransferTimeout: {e}"
            except (TransferError, OSError) as e:
                reason = f"{type(e).__name__}: {e}"
            except Exception as e:  # the request must still complete: recompute
                log.exception("pull of %s failed unexpectedly", request_id)
                reason = f"{type(e).__name__}: {e}"
    finally:
        w.pulling -= 1
        if local is not None:
            w.free_slots(local)
    duration_ms = (time.monotonic() - t0) * 1e3
    m = w.metrics
    if reason is None:
        assert result is not None
        w.stats["pulls_ok"] += 1
        w.stats["blocks_verified"] += n
        m.labels(m.transfers, "completed").inc()
        m.labels(m.transfer_bytes).inc(nbytes)
        await w.publish_acked(KvTransferCompleted(**common, bytes=nbytes, duration_ms=duration_ms),
                              correlation_id=request_id)
        log.info("pulled %d blocks (%d bytes) of %s from %s in %.1f ms (READ %.2f GB/s)", n, nbytes,
                 request_id, h.engine_id, duration_ms, result.gbps)
        return True
    w.stats["pulls_failed"] += 1
    w.last_pull_error = reason
    m.labels(m.transfers, "failed").inc()
    await w.publish_acked(KvTransferFailed(**common, duration_ms=duration_ms, reason=reason,
                                           fallback="recompute"), correlation_id=request_id)
    log.warning("pull of %s from %s failed (%s): recomputing the prompt", request_id, h.engine_id, reason)
    return False


def pull_blocking(w: PullHost, h: DecodeHandoff, local: list[int]) -> TransferResult:
    """Metadata, READ, verify, notify. Runs in a thread."""
    ho = h.handoff
    if not ho.readable(w.clock(), w.s.lease_margin_s):
        raise TransferError(f"the holder's lease ends at {ho.expires_at:.3f}: too late to start a READ")
    md = w.peers.lookup(ho.agent_name, h.remote_host, h.remote_port, w.s.transfer_timeout_s)
    result = w.plane.read(md, ho.block_ids, local, w.s.transfer_timeout_s)
    bad = w.plane.corrupt(local, h.block_hashes)
    try:
        # Done either way: we will not read these blocks again, so the holder may free them.
        w.plane.notify(ho.agent_name, encode_done(ho.request_id))
    except TransferError as e:
        log.warning("done notification to %s failed (its lease will free the blocks): %s",
                    ho.agent_name, e)
    if bad:
        raise TransferError(f"{len(bad)} of {h.blocks} blocks failed verification "
                            f"(first: block {bad[0]})")
    return result
