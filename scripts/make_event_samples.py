"""Write one frozen MessagePack sample per (event type, version) into ``tests/samples/``.

Run once per new type or version::

    uv run python scripts/make_event_samples.py

The samples are test data, not build output: once written they are never regenerated, because
their whole point is to prove that bytes written by an *older* codebase still decode. The script
therefore only writes samples that do not exist yet and keeps the others untouched; ``--force``
rewrites them all (only ever right after adding them, before they are committed).

Values describe one coherent scenario (a 423-token chat request on a Llama-3.1-8B prefill/decode
pool) so the samples double as realistic payload shapes for ``benchmarks/events_codec.py``.
Everything is derived from fixed seeds: event ids, times and hashes are reproducible.
Each sample also gets a ``.json`` rendering (``msgspec.to_builtins`` of the decoded record:
bytes as base64) for people reading the test data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from schemas import events as ev
from schemas.envelope import Envelope, EventCodec
from schemas.types import BlockHash, PoolName, RequestId, RequestPhase, RoutingMode, Tier, WorkerId, WorkerRole

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "tests" / "samples"

# -- the scenario ------------------------------------------------------------------------------

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK_SIZE = 16
HASH_ALGO = "sha256_cbor"
#: Llama-3.1-8B, bf16: 2 (K,V) * 32 layers * 8 KV heads * 128 dims * 2 bytes * 16 tokens.
BYTES_PER_BLOCK = 2 * 32 * 8 * 128 * 2 * BLOCK_SIZE
PREFILL = WorkerId("llama8b-prefill-0")
DECODE = WorkerId("llama8b-decode-3")
PREFILL_POOL = PoolName("llama8b-prefill")
DECODE_POOL = PoolName("llama8b-decode")
REQUEST = RequestId("chatcmpl-5d0f6a3e9b8c4f21a7e2c41b90d3f6aa")
TRANSFER_ID = "xfer-2f6b1c9d04e7"
#: The one transfer of the scenario (27 blocks prefill -> decode): what its started, completed
#: and failed events all say.
TRANSFER = dict(request_id=REQUEST, transfer_id=TRANSFER_ID, src_worker=PREFILL, dst_worker=DECODE,
                blocks=27, bytes=27 * BYTES_PER_BLOCK, backend="UCX")
DECISION_ID = "scale-llama8b-decode-000042"
#: 26 full blocks + 7 tokens; the first 5 blocks (80 tokens) are a cached system prompt.
PROMPT_TOKENS = 26 * BLOCK_SIZE + 7
CACHED_BLOCKS = 5
#: 2025-12-01T00:00:00Z; sample k happens k * 1.5 ms later.
T0_NS = 1_764_547_200_000_000_000


def _token_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128_256) for _ in range(n)]  # Llama-3 vocabulary size


def _chain(tokens: list[int], parent: int | None = None) -> list[BlockHash]:
    """Chained block hashes: each one covers its parent, so they form one prefix chain.

    The shape (uint64 from the last 8 digest bytes, big-endian) is vLLM's; the bytes hashed are
    simplified, since the control plane treats hashes as opaque ids.
    """
    out = []
    for i in range(len(tokens) // BLOCK_SIZE):
        block = tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        prefix = (parent or 0).to_bytes(8, "big")
        digest = hashlib.sha256(prefix + b"".join(t.to_bytes(4, "big") for t in block)).digest()
        parent = int.from_bytes(digest[-8:], "big")
        out.append(BlockHash(parent))
    return out


PROMPT = _token_ids(20251201, PROMPT_TOKENS)
PROMPT_HASHES = _chain(PROMPT)


def _scores() -> list[ev.CandidateScore]:
    """The 8-row score table of the prefill pool: cost = uncached prefill blocks + decode blocks."""
    rows = []
    loads = [
        (0, 40), (1_904, 310), (512, 95), (3_120, 402), (0, 60), (816, 240), (2_048, 12), (64, 7)
    ]
    for i, (queued, decode_blocks) in enumerate(loads):
        overlap = CACHED_BLOCKS if i in (0, 3, 5) else 0
        stale = i == 6
        prefill_blocks = len(PROMPT_HASHES) - overlap + queued / BLOCK_SIZE
        rows.append(
            ev.CandidateScore(
                worker_id=WorkerId(f"llama8b-prefill-{i}"),
                overlap_blocks=overlap,
                overlap_by_tier={"device": overlap} if overlap else {},
                queued_prefill_tokens=queued,
                active_decode_blocks=decode_blocks,
                inflight_requests=queued // 400 + 1,
                stale=stale,
                prefill_blocks=prefill_blocks,
                decode_blocks=float(decode_blocks) / 10,
                cost=None if stale else prefill_blocks + decode_blocks / 10,
                eligible=not stale,
            )
        )
    return rows


BUILDERS: dict[type[ev.Event], Callable[[], ev.Event]] = {
    ev.BlockStored: lambda: ev.BlockStored(
        worker_id=PREFILL,
        tier=Tier.DEVICE,
        block_hashes=PROMPT_HASHES[CACHED_BLOCKS:],
        parent_hash=PROMPT_HASHES[CACHED_BLOCKS - 1],
        block_size=BLOCK_SIZE,
        hash_algo=HASH_ALGO,
        token_ids=PROMPT[CACHED_BLOCKS * BLOCK_SIZE : len(PROMPT_HASHES) * BLOCK_SIZE],
    ),
    ev.BlockRemoved: lambda: ev.BlockRemoved(
        worker_id=PREFILL,
        tier=Tier.DEVICE,
        block_hashes=_chain(_token_ids(7, 4 * BLOCK_SIZE)),
    ),
    ev.BlockMoved: lambda: ev.BlockMoved(
        worker_id=PREFILL,
        block_hashes=_chain(_token_ids(11, 8 * BLOCK_SIZE)),
        from_tier=Tier.DEVICE,
        to_tier=Tier.HOST,
    ),
    ev.AllBlocksCleared: lambda: ev.AllBlocksCleared(worker_id=PREFILL, tier=Tier.DEVICE, dp_rank=1),
    ev.RequestAdmitted: lambda: ev.RequestAdmitted(
        request_id=REQUEST,
        model=MODEL,
        prompt_tokens=PROMPT_TOKENS,
        max_tokens=512,
        stream=True,
        block_hashes=PROMPT_HASHES,
        block_size=BLOCK_SIZE,
        hash_algo=HASH_ALGO,
        endpoint="chat/completions",
    ),
    ev.RequestRouted: lambda: ev.RequestRouted(
        request_id=REQUEST,
        worker_id=PREFILL,
        phase=RequestPhase.PREFILL,
        mode=RoutingMode.KV,
        scores=_scores(),
        reason="lowest cost 25.0 (5/26 prompt blocks cached on device)",
        config_version=7,
        rng_seed=0x5EED_0042,
        index_position={"switchyard.kv:0": 918_273, "switchyard.kv:1": 917_004},
        router_id="router-0",
        admission=ev.AdmissionTerms(budget_ms=1_000.0, predicted_ttft_ms=212.5, worker_id=PREFILL, margin=1.8,
                                    queue_ms=450.0, spent_ms=14.2, loop_lag_ms=6.5, at_s=1_767_225_600.25),
    ),
    ev.PrefillCompleted: lambda: ev.PrefillCompleted(
        request_id=REQUEST,
        worker_id=PREFILL,
        prompt_tokens=PROMPT_TOKENS,
        cached_tokens=CACHED_BLOCKS * BLOCK_SIZE,
        duration_ms=38.4,
        kv_transfer_params={
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(1_204, 1_231)),
            "remote_engine_id": "6c1f0e2a-llama8b-prefill-0",
            "remote_host": "10.0.3.17",
            "remote_port": 5_600,
            "tp_size": 1,
        },
    ),
    ev.FirstToken: lambda: ev.FirstToken(
        request_id=REQUEST,
        worker_id=DECODE,
        ttft_ms=58.9,
    ),
    ev.KvTransferStarted: lambda: ev.KvTransferStarted(
        **TRANSFER,
    ),
    ev.KvTransferCompleted: lambda: ev.KvTransferCompleted(
        **TRANSFER,
        duration_ms=4.7,
    ),
    ev.KvTransferFailed: lambda: ev.KvTransferFailed(
        **TRANSFER,
        duration_ms=5_000.0,
        reason="NIXL_ERR_REMOTE_DISCONNECT: agent llama8b-prefill-0 went away mid-transfer",
        fallback="recompute",
    ),
    ev.RequestCompleted: lambda: ev.RequestCompleted(
        request_id=REQUEST,
        worker_id=DECODE,
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=512,
        cached_tokens=CACHED_BLOCKS * BLOCK_SIZE,
        ttft_ms=61.2,
        itl_mean_ms=11.8,
        itl_p50_ms=11.5,
        itl_p99_ms=19.7,
        e2e_ms=6_105.3,
        finish_reason="length",
    ),
    ev.RequestFailed: lambda: ev.RequestFailed(
        request_id=REQUEST,
        worker_id=DECODE,
        reason="worker llama8b-decode-3 lost: lease expired after 3 missed heartbeats",
        code="worker_lost",
        retried=True,
    ),
    ev.RequestRejected: lambda: ev.RequestRejected(
        request_id=RequestId("chatcmpl-0b7e4d1c2a9f48e6b35d7c0e1f2a3b4c"),
        reason="predicted TTFT 640 ms on the best candidate (llama8b-prefill-0) x 1.80 (recent observed/predicted) "
               "+ 14 ms already spent in the router + 7 ms of its event-loop lag = 1173 ms exceeds the budget of "
               "1000 ms",
        code="ttft_budget",
        http_status=429,
        admission=ev.AdmissionTerms(budget_ms=1_000.0, predicted_ttft_ms=640.0, worker_id=PREFILL, margin=1.8,
                                    queue_ms=900.0, spent_ms=14.2, loop_lag_ms=6.5, at_s=1_767_225_600.25),
    ),
    ev.WorkerRegistered: lambda: ev.WorkerRegistered(
        worker_id=DECODE,
        role=WorkerRole.DECODE,
        pool=DECODE_POOL,
        endpoint="http://10.0.3.21:8000",
        model=MODEL,
        capacity={"device": 26_704, "host": 65_536, "disk": 524_288},
        block_size=BLOCK_SIZE,
        hash_algo=HASH_ALGO,
        transfer=ev.TransferInfo(
            backend="UCX",
            agent_name="llama8b-decode-3",
            agent_metadata=hashlib.sha512(b"nixl-agent:llama8b-decode-3").digest() * 3,
            bytes_per_block=BYTES_PER_BLOCK,
        ),
    ),
    ev.WorkerLoadReportedV1: lambda: ev.WorkerLoadReportedV1(
        worker_id=DECODE,
        running=12,
        waiting=3,
        kv_usage=0.62,
        queued_prefill_tokens=1_804,
        active_decode_blocks=9_870,
    ),
    ev.WorkerLoadReported: lambda: ev.WorkerLoadReported(
        worker_id=DECODE,
        running=14,
        waiting=2,
        tier_usage={"device": 0.71, "host": 0.34, "disk": 0.05},
        queued_prefill_tokens=2_210,
        active_decode_blocks=11_204,
    ),
    ev.WorkerDraining: lambda: ev.WorkerDraining(
        worker_id=DECODE, reason=f"planner decision {DECISION_ID}: scale-down", inflight=9
    ),
    ev.WorkerDeregistered: lambda: ev.WorkerDeregistered(worker_id=DECODE, reason="drained"),
    ev.ScalingDecision: lambda: ev.ScalingDecision(
        pool=DECODE_POOL,
        decision_id=DECISION_ID,
        role=WorkerRole.DECODE,
        from_replicas=4,
        to_replicas=5,
        reason="predicted decode demand 4.6 replicas at ITL target 12 ms (+18% correction)",
        inputs={
            "predicted_rps": 41.7,
            "predicted_isl": 1_840,
            "predicted_osl": 420,
            "itl_target_ms": 12.0,
            "correction_factor": 1.18,
            "profile": "h100-sxm-tp1",
        },
        predictor="arima",
        config_version=7,
        fencing_token=42,
    ),
    ev.ScalingApplied: lambda: ev.ScalingApplied(
        pool=DECODE_POOL, decision_id=DECISION_ID, replicas=5, scaler="kubernetes"
    ),
    ev.RouterConfigChanged: lambda: ev.RouterConfigChanged(
        actor="ops-alice", actor_role="operator", config_version=8,
        config={"version": 8, "mode": "kv", "tier_weights": {"device": 1.0, "host": 0.75, "disk": 0.25, "object": 0.1},
                "temperature": 0.0},
    ),
    ev.PlannerConfigChanged: lambda: ev.PlannerConfigChanged(
        actor="ops-alice", actor_role="operator", config_version=3,
        config={"interval_s": 30, "predictor": "holt_winters"},
    ),
    ev.PoolUpdated: lambda: ev.PoolUpdated(
        actor="ops-alice", actor_role="operator", pool=DECODE_POOL, role=WorkerRole.DECODE, ttft_slo_ms=500.0,
        itl_slo_ms=12.0, min_replicas=2, max_replicas=16, gpus_per_replica=1, gpu_budget=32,
    ),
    ev.PoolPinned: lambda: ev.PoolPinned(actor="ops-alice", actor_role="operator", pool=DECODE_POOL, replicas=6,
                                   reason="holiday traffic"),
    ev.WorkerDrainRequested: lambda: ev.WorkerDrainRequested(actor="ops-bob", actor_role="operator",
                                                       worker_id=WorkerId("llama8b-decode-3"), reason="kernel update"),
    ev.AdminAction: lambda: ev.AdminAction(actor="root", actor_role="admin", action="token_created", target="ci-bot",
                                     details={"role": "viewer"}),
    ev.RouterKeyIssued: lambda: ev.RouterKeyIssued(
        actor="root", actor_role="admin", key_id="5e1f9a2c", name="chat-frontend",
        salt="8c2d4f0b1a9e7d6c5b4a39281706f5e4",
        key_hash="0b5f3c1e9d7a2b4c6e8f0a1b3c5d7e9f1a2b3c4d5e6f708192a3b4c5d6e7f809",
        expires_at_ns=1_767_225_600_000_000_000, rate_per_s=20.0, burst=40, max_concurrent=16,
    ),
    ev.RouterKeyRevoked: lambda: ev.RouterKeyRevoked(actor="root", actor_role="admin", key_id="5e1f9a2c",
                                                     reason="rotated to a new key"),
}
#: The superseded v1 request events (``request_id`` in the payload too): the same scenario.
BUILDERS.update({
    v1: (lambda v1=v1, v2=v2: v1(**msgspec.structs.asdict(BUILDERS[v2]())))
    for v1, v2 in ((ev.RequestAdmittedV1, ev.RequestAdmitted), (ev.RequestRoutedV1, ev.RequestRoutedV2),
                   (ev.PrefillCompletedV1, ev.PrefillCompleted), (ev.KvTransferStartedV1, ev.KvTransferStarted),
                   (ev.KvTransferCompletedV1, ev.KvTransferCompleted), (ev.KvTransferFailedV1, ev.KvTransferFailed),
                   (ev.RequestCompletedV1, ev.RequestCompleted), (ev.RequestFailedV1, ev.RequestFailed),
                   (ev.RequestRejectedV1, ev.RequestRejectedV2))
})
#: The superseded v2 events of the types whose v3 added the budget test's terms: without them.
BUILDERS.update({
    old: (lambda old=old, new=new: old(**{**msgspec.structs.asdict(BUILDERS[new]()), "admission": None}))
    for old, new in ((ev.RequestRoutedV2, ev.RequestRouted), (ev.RequestRejectedV2, ev.RequestRejected))
})

#: Which component produces each stream (envelope ``producer``).
PRODUCERS = {
    "kv": "worker:llama8b-prefill-0",
    "requests": "router-0",
    "workers": "worker:llama8b-decode-3",
    "planner": "planner-0",
    "admin": "admin-api-0",
}


def sample_event_id(cls: type[ev.Event]) -> str:
    """Fixed per (type, version) so regenerating gives identical bytes."""
    return hashlib.sha256(f"switchyard-sample/{cls.TYPE}/v{cls.VERSION}".encode()).hexdigest()[:32]


def sample_envelope(cls: type[ev.Event], index: int) -> Envelope[ev.Event]:
    payload = BUILDERS[cls]()
    corr = REQUEST if payload.STREAM == "requests" else None
    return Envelope(
        event_id=sample_event_id(cls),
        type=cls.TYPE,
        version=cls.VERSION,
        key=payload.key(),
        producer=PRODUCERS[payload.STREAM],
        epoch=3,
        seq=1_000 + index,
        occurred_at_ns=T0_NS + index * 1_500_000,
        correlation_id=corr,
        causation_id=sample_event_id(ev.RequestAdmitted) if cls is ev.RequestRouted else None,
        data=payload,
    )


def sample_name(cls: type[ev.Event]) -> str:
    return f"{cls.TYPE}.v{cls.VERSION}"


def render_json(buf: bytes) -> str:
    """Human-readable form of a sample: the wire map as JSON, in wire field order."""
    doc = msgspec.to_builtins(msgspec.msgpack.decode(buf))
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="overwrite existing samples")
    parser.add_argument("--dir", type=Path, default=SAMPLES_DIR, help="output directory")
    args = parser.parse_args(argv)

    missing = [c.__name__ for c in ev.ALL_EVENT_TYPES if c not in BUILDERS]
    if missing:
        print(f"no sample builder for: {', '.join(missing)}", file=sys.stderr)
        return 1
    codec = EventCodec()
    args.dir.mkdir(parents=True, exist_ok=True)
    for index, cls in enumerate(ev.ALL_EVENT_TYPES):
        name = sample_name(cls)
        target = args.dir / f"{name}.msgpack"
        if target.exists() and not args.force:
            print(f"kept    {target} (frozen; --force to overwrite)")
            continue
        buf = codec.encode(sample_envelope(cls, index))
        codec.decode(buf)  # a sample the current codec cannot read is a bug here, not data
        target.write_bytes(buf)
        (args.dir / f"{name}.json").write_text(render_json(buf), encoding="utf-8", newline="\n")
        print(f"wrote   {target} ({len(buf)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
