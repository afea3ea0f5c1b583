"""Contract tests of ``schemas/``: codec round trips, frozen samples, JSON Schema files, errors.

The stored samples under ``tests/samples/`` are bytes written by an earlier codebase; these tests
prove the current one still reads them. They are never regenerated to make a test pass.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from schemas import events as ev
from schemas import jsonschema as schema_files
from schemas.envelope import Envelope, EventCodec
from schemas.errors import (
    MalformedEvent,
    SchemaError,
    UnknownEventType,
    UnsupportedSchemaVersion,
)
from schemas.types import (
    MAX_WORKER_ID_LEN,
    BlockHash,
    CacheGroup,
    PoolName,
    RequestId,
    RequestPhase,
    RoutingMode,
    Tier,
    WorkerId,
    WorkerRole,
)

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "samples"
SCHEMA_DIR = schema_files.DEFAULT_DIR
SAMPLE_FILES = sorted(SAMPLES_DIR.glob("*.msgpack"))
CODEC = EventCodec()  # stateless after construction; sharing it keeps parametrized tests fast


def _name(cls: type[ev.Event]) -> str:
    return f"{cls.TYPE}.v{cls.VERSION}"


# -- builders: every optional field set to a non-default value, so a round trip covers it ------

W = WorkerId("w-1")
R = RequestId("req-1")
S = TypeVar("S", bound=msgspec.Struct)


#: What the three KvTransfer* events share.
TRANSFER_FIELDS: dict[str, Any] = {"request_id": R, "transfer_id": "x-1", "src_worker": W,
                                   "dst_worker": WorkerId("w-2"), "blocks": 3, "bytes": 3 * 2**21, "backend": "UCX",
                                   "purpose": "peer_fetch"}


#: What v1 and v2 of WorkerLoadReported share (v2 only replaced ``kv_usage``).
LOAD_FIELDS: dict[str, Any] = {"worker_id": W, "running": 2, "waiting": 1, "queued_prefill_tokens": 32,
                               "active_decode_blocks": 7}


#: A CandidateScore (the score rows of RequestRouted).
SCORE_FIELDS: dict[str, Any] = {
    "worker_id": W,
    "overlap_blocks": 2,
    "overlap_by_tier": {"device": 1, "host": 1},
    "queued_prefill_tokens": 64,
    "active_decode_blocks": 9,
    "inflight_requests": 3,
    "stale": True,
    "prefill_blocks": 4.0,
    "decode_blocks": 0.9,
    "cost": 4.9,
    "probability": 0.25,
    "eligible": False,
    "speculative_overlap": 3,
    "excluded": "draining",
    "kv_capacity_blocks": 16384,
    "peer_from": "w-9",
    "predicted_ttft_ms": 88.5,
}

#: Per struct, one instance's fields: every optional one set to a non-default value.
SAMPLE_FIELDS: dict[type[msgspec.Struct], dict[str, Any]] = {
    ev.BlockStored: {
        "worker_id": W,
        "tier": Tier.HOST,
        "block_hashes": [BlockHash(2**64 - 1), BlockHash(7)],
        "parent_hash": BlockHash(3),
        "block_size": 4,
        "token_counts": [4, 4],
        "hash_algo": "xxh3_64:1337",
        "cache_group": CacheGroup.SLIDING_WINDOW,
        "lora_id": 2,
        "lora_name": "sql-adapter",
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "dp_rank": 1,
        "source_tier": Tier.DISK,
    },
    ev.BlockRemoved: {
        "worker_id": W,
        "tier": Tier.DISK,
        "block_hashes": [BlockHash(11)],
        "cache_group": CacheGroup.MAMBA,
        "dp_rank": 2,
    },
    ev.BlockMoved: {
        "worker_id": W,
        "block_hashes": [BlockHash(11), BlockHash(12)],
        "from_tier": Tier.HOST,
        "to_tier": Tier.OBJECT,
        "cache_group": CacheGroup.OTHER,
        "dp_rank": 3,
    },
    ev.AllBlocksCleared: {"worker_id": W, "tier": Tier.DEVICE, "dp_rank": 1},
    ev.RequestAdmitted: {
        "request_id": R,
        "model": "m",
        "prompt_tokens": 40,
        "max_tokens": 8,
        "stream": True,
        "block_hashes": [BlockHash(1), BlockHash(2)],
        "block_size": 16,
        "hash_algo": "sha256_cbor",
        "endpoint": "chat/completions",
        "priority": 5,
        "client_request_id": "client-1",
    },
    ev.CandidateScore: SCORE_FIELDS,
    ev.RequestRouted: {
        "request_id": R,
        "worker_id": W,
        "phase": RequestPhase.DECODE,
        "mode": RoutingMode.KV,
        "scores": [ev.CandidateScore(**SCORE_FIELDS),
                   ev.CandidateScore(**{**SCORE_FIELDS, "worker_id": WorkerId("w-2")})],
        "reason": "lowest cost",
        "config_version": 3,
        "rng_seed": 99,
        "index_position": {"switchyard.kv:0": 10},
        "router_id": "router-1",
        "attempt": 1,
        "rr_cursor": "w-2",
        "guards": ["capacity"],
        "expected_output_tokens": 256,
        "view_state": "EXACT",
        "excluded_workers": ["w-7"],
        "decided_at_s": 1795980000.25,
        "queued_ms": 12.5,
        "inflight_prefill_tokens": 0,
        "inflight_blocks": 40,
        "inflight_ttl_s": 600.0,
        "predicted_ttft_ms": 412.5,
        "ttft_model": ev.TtftModel(base_ms=30.0, step_ms=1.5, ms_per_token=0.02, ms_per_token_ctx=1e-6,
                                   chunk_tokens=1024, samples=12, pool_samples=40, queue_done_tokens=512),
        "ttft_models": {"w-2": ev.TtftModel(base_ms=12.0, samples=3, pool_samples=40)},
        "admission": ev.AdmissionTerms(budget_ms=1000.0, predicted_ttft_ms=412.5, worker_id="w-2", margin=1.5,
                                       queue_ms=300.0, spent_ms=20.0, loop_lag_ms=5.0, idle=True, at_s=1795980000.25),
        "paired_worker_id": "w-3",
        "pairs": [ev.PairScore(W, WorkerId("w-3"), 412.5, 25.0, 18.0, 40.0, 495.5)],
        "decode_scores": [ev.CandidateScore(**{**SCORE_FIELDS, "worker_id": WorkerId("w-3")})],
        "session": "conv-1",
        "session_worker": "w-2",
    },
    ev.PrefillCompleted: {
        "request_id": R,
        "worker_id": W,
        "prompt_tokens": 40,
        "cached_tokens": 16,
        "duration_ms": 12.5,
        "kv_transfer_params": {"remote_host": "10.0.0.1", "remote_port": 5600, "expiry_s": 30.0,
                               "do_remote_decode": True, "remote_block_ids": [1, 2, 3], "remote_engine_id": None},
    },
    ev.FirstToken: {"request_id": R, "worker_id": W, "ttft_ms": 42.5},
    ev.KvTransferStarted: TRANSFER_FIELDS,
    ev.KvTransferCompleted: {**TRANSFER_FIELDS, "duration_ms": 1.5},
    ev.KvTransferFailed: {**TRANSFER_FIELDS, "duration_ms": 50.0, "reason": "timeout", "fallback": "recompute"},
    ev.RequestCompleted: {
        "request_id": R,
        "worker_id": W,
        "prompt_tokens": 40,
        "output_tokens": 8,
        "cached_tokens": 16,
        "ttft_ms": 20.0,
        "itl_mean_ms": 10.5,
        "itl_p50_ms": 10.0,
        "itl_p99_ms": 15.0,
        "e2e_ms": 100.0,
        "finish_reason": "stop",
    },
    ev.RequestFailed: {
        "request_id": R,
        "worker_id": W,
        "reason": "worker lost",
        "code": "worker_lost",
        "tokens_sent": 2,
        "retried": True,
    },
    ev.RequestRejected: {"request_id": R, "reason": "busy", "code": "overloaded", "http_status": 503,
                         "admission": ev.AdmissionTerms(budget_ms=500.0, predicted_ttft_ms=900.0, worker_id="w-1",
                                                        margin=2.0, queue_ms=700.0, spent_ms=1.5, loop_lag_ms=0.5, idle=True,
                                                        at_s=1795980000.5)},
    ev.WorkerRegistered: {
        "worker_id": W,
        "role": WorkerRole.PREFILL,
        "pool": PoolName("p"),
        "endpoint": "http://w-1:8000",
        "model": "m",
        "capacity": {"device": 100, "host": 400},
        "block_size": 16,
        "hash_algo": "sha256_cbor",
        "transfer": ev.TransferInfo(backend="LIBFABRIC", agent_name="w-1", agent_metadata=b"\x00\xffmeta",
                                    bytes_per_block=2**21),
    },
    ev.WorkerLoadReportedV1: {**LOAD_FIELDS, "kv_usage": 0.5},
    ev.WorkerLoadReported: {**LOAD_FIELDS, "tier_usage": {"device": 0.5, "host": 0.25}},
    ev.WorkerDraining: {"worker_id": W, "reason": "scale-down", "inflight": 4},
    ev.WorkerDeregistered: {"worker_id": W, "reason": "drained"},
    ev.ScalingDecision: {
        "pool": PoolName("p"),
        "decision_id": "d-1",
        "role": WorkerRole.DECODE,
        "from_replicas": 2,
        "to_replicas": 3,
        "reason": "load",
        "inputs": {"predicted_rps": 10.5, "isl": 1000, "profile": "h100"},
        "predictor": "arima",
        "config_version": 4,
        "fencing_token": 9,
        "forecast_rate": 12.5,
        "forecast_horizon_s": 65.0,
        "headroom": 0.12,
        "startup_allowance_s": 30.0,
        "binding": "itl",
    },
    ev.ScalingApplied: {
        "pool": PoolName("p"),
        "decision_id": "d-1",
        "replicas": 3,
        "success": False,
        "error": "quota exceeded",
        "scaler": "kubernetes",
    },
    ev.RouterConfigChanged: {
        "actor": "a",
        "actor_role": "operator",
        "config_version": 2,
        "config": {"mode": "kv", "temperature": 0.5},
    },
    ev.PlannerConfigChanged: {
        "actor": "a",
        "actor_role": "operator",
        "config_version": 2,
        "config": {"interval_s": 30},
    },
    ev.PoolUpdated: {
        "actor": "a",
        "actor_role": "operator",
        "pool": PoolName("p"),
        "role": WorkerRole.DECODE,
        "ttft_slo_ms": 500.0,
        "itl_slo_ms": 10.0,
        "min_replicas": 1,
        "max_replicas": 8,
        "gpus_per_replica": 2,
        "gpu_budget": 16,
    },
    ev.PoolPinned: {"actor": "a", "actor_role": "operator", "pool": PoolName("p"), "replicas": 4, "reason": "test"},
    ev.WorkerDrainRequested: {"actor": "a", "actor_role": "operator", "worker_id": WorkerId("w"), "reason": "r"},
    ev.AdminAction: {
        "actor": "a",
        "actor_role": "admin",
        "action": "token_created",
        "target": "t",
        "details": {"role": "viewer"},
    },
    ev.RouterKeyIssued: {
        "actor": "root",
        "actor_role": "admin",
        "key_id": "0a1b2c3d",
        "name": "k",
        "salt": "00" * 16,
        "key_hash": "ab" * 32,
        "expires_at_ns": 1_800_000_000_000_000_000,
        "rate_per_s": 5.0,
        "burst": 10,
        "max_concurrent": 4,
        "session_from_user": True,
    },
    ev.RouterKeyRevoked: {"actor": "root", "actor_role": "admin", "key_id": "0a1b2c3d", "reason": "leaked"},
}
#: The superseded request events (v1: ``request_id`` in the payload too) have the same fields.
SAMPLE_FIELDS.update({v1: SAMPLE_FIELDS[v2] for v1, v2 in (
    (ev.RequestAdmittedV1, ev.RequestAdmitted), (ev.RequestRoutedV1, ev.RequestRouted),
    (ev.PrefillCompletedV1, ev.PrefillCompleted), (ev.KvTransferStartedV1, ev.KvTransferStarted),
    (ev.KvTransferCompletedV1, ev.KvTransferCompleted), (ev.KvTransferFailedV1, ev.KvTransferFailed),
    (ev.RequestCompletedV1, ev.RequestCompleted), (ev.RequestFailedV1, ev.RequestFailed),
    (ev.RequestRejectedV1, ev.RequestRejected))})
#: The superseded v2 of the events whose v3 added the budget test's terms (the classes share
#: the current fields, as the v1 ones do).
SAMPLE_FIELDS.update({v2: SAMPLE_FIELDS[v3] for v2, v3 in (
    (ev.RequestRoutedV2, ev.RequestRouted), (ev.RequestRejectedV2, ev.RequestRejected))})


def build(cls: type[S], **overrides: Any) -> S:
    """An instance of ``cls`` from its :data:`SAMPLE_FIELDS` (a fresh copy), with ``overrides``."""
    return cls(**{**copy.deepcopy(SAMPLE_FIELDS[cls]), **overrides})


#: One builder per registered payload type.
BUILDERS: dict[type[ev.Event], Callable[..., ev.Event]] = {
    cls: functools.partial(build, cls) for cls in SAMPLE_FIELDS if issubclass(cls, ev.Event)
}


def _wrap(payload: ev.Event, **overrides: Any) -> Envelope[ev.Event]:
    return Envelope(
        **{
            "event_id": "0" * 31 + "1",
            "type": payload.TYPE,
            "version": payload.VERSION,
            "key": payload.key(),
            "producer": "test",
            "epoch": 2,
            "seq": 17,
            "occurred_at_ns": 1_700_000_000_000_000_000,
            "correlation_id": "corr-1",
            "causation_id": "cause-1",
            "data": payload,
            **overrides,
        }
    )


def _raw_envelope(**overrides: Any) -> bytes:
    """Envelope bytes built from plain builtins, for records no struct would let us build."""
    doc = msgspec.to_builtins(_wrap(build(ev.BlockStored)))
    doc.update(overrides)
    return msgspec.msgpack.encode(doc)


def _is_latest(cls: type[ev.Event]) -> bool:
    return CODEC.latest_version(cls.TYPE) == cls.VERSION


# -- round trips ------------------------------------------------------------------------------


def test_every_registered_type_has_a_builder():
    assert [c.__name__ for c in ev.ALL_EVENT_TYPES if c not in BUILDERS] == []


@pytest.mark.parametrize("cls", ev.ALL_EVENT_TYPES, ids=_name)
def test_builder_sets_every_optional_field(cls):
    """A field left at its default is omitted on the wire, so the round trip would not cover it."""
    payload = BUILDERS[cls]()
    left_default = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            continue
        if getattr(payload, f.name) == default:
            left_default.append(f.name)
    assert left_default == []


@pytest.mark.parametrize("cls", [c for c in ev.ALL_EVENT_TYPES if _is_latest(c)], ids=_name)
def test_latest_version_round_trips_exactly(cls):
    env = _wrap(BUILDERS[cls]())
    buf = CODEC.encode(env)
    decoded = CODEC.decode(buf)
    assert decoded == env
    assert type(decoded.data) is cls
    assert CODEC.encode(decoded) == buf


@pytest.mark.parametrize("cls", [c for c in ev.ALL_EVENT_TYPES if not _is_latest(c)], ids=_name)
def test_superseded_version_decodes_as_latest(cls):
    env = _wrap(BUILDERS[cls]())
    decoded = CODEC.decode(CODEC.encode(env))
    latest = CODEC.latest_version(cls.TYPE)
    assert decoded.version == latest
    assert type(decoded.data) is CODEC.payload_type(cls.TYPE, latest)
    # Envelope metadata is carried over untouched; only type version and payload change.
    assert msgspec.structs.replace(decoded, version=cls.VERSION, data=env.data) == env


def test_worker_load_reported_v1_upcasts_kv_usage_to_device_tier():
    """v1 kv_usage=0.5 becomes v2 tier_usage={"device": 0.5}; the other fields carry over."""
    decoded = CODEC.decode(CODEC.encode(_wrap(build(ev.WorkerLoadReportedV1, kv_usage=0.5))))
    assert decoded.data == build(ev.WorkerLoadReported, tier_usage={"device": 0.5})


@pytest.mark.parametrize("cls", [c for c in ev.ALL_EVENT_TYPES if c.KEY_FIELD is not None], ids=_name)
def test_request_id_is_on_the_wire_once_as_the_key(cls):
    """v2 request events: neither the payload's ``request_id`` nor a ``corr`` equal to the key is
    written; decoding reads both back from the key."""
    env = _wrap(BUILDERS[cls](), correlation_id=R)
    buf = CODEC.encode(env)
    doc = msgspec.msgpack.decode(buf)
    assert "request_id" not in doc["data"] and "corr" not in doc and doc["key"] == R
    assert buf.count(R.encode()) == 1
    latest = CODEC.latest_version(cls.TYPE)
    if cls.VERSION == latest:
        assert CODEC.decode(buf) == env
    else:  # a superseded version (v2 of RequestRouted, RequestRejected): read as the latest
        decoded = CODEC.decode(buf)
        assert decoded.version == latest
        assert decoded.data == CODEC.payload_type(cls.TYPE, latest)(**msgspec.structs.asdict(env.data))


@pytest.mark.parametrize("cls", [c for c in ev.ALL_EVENT_TYPES if c.KEY_FIELD is None and c.STREAM == "requests"],
                         ids=_name)
def test_v1_request_event_upcasts_keeping_its_request_id_and_corr(cls):
    v1 = BUILDERS[cls]()
    doc = msgspec.msgpack.decode(CODEC.encode(_wrap(v1)))
    assert doc["data"]["request_id"] == R and doc["corr"] == "corr-1"
    decoded = CODEC.decode(CODEC.encode(_wrap(v1)))
    latest = CODEC.latest_version(cls.TYPE)
    assert decoded.version == latest and decoded.correlation_id == "corr-1"
    assert decoded.data == CODEC.payload_type(cls.TYPE, latest)(**msgspec.structs.asdict(v1))


def test_a_request_event_naming_another_request_than_its_key_is_refused():
    with pytest.raises(ValueError, match="not the envelope's key"):
        CODEC.encode(_wrap(build(ev.RequestCompleted), key="other"))
    doc = msgspec.to_builtins(_wrap(build(ev.RequestCompleted)))
    doc["data"]["request_id"], doc["key"] = R, "other"  # a writer that put both, differing
    with pytest.raises(MalformedEvent, match="is not its key"):
        CODEC.decode(msgspec.msgpack.encode(doc))
    v1 = msgspec.to_builtins(_wrap(build(ev.RequestCompletedV1)))
    v1["key"] = "other"
    with pytest.raises(MalformedEvent, match="is not its key"):
        CODEC.decode(msgspec.msgpack.encode(v1))


# -- stored samples ---------------------------------------------------------------------------


def test_samples_exist():
    assert SAMPLE_FILES, f"no samples in {SAMPLES_DIR}; run scripts/make_event_samples.py"


@pytest.mark.parametrize("cls", ev.ALL_EVENT_TYPES, ids=_name)
def test_every_registered_type_has_a_sample_and_a_schema_file(cls):
    """Adding a type or version without its sample and schema document fails here."""
    assert (SAMPLES_DIR / f"{_name(cls)}.msgpack").is_file(), (
        "run: uv run python scripts/make_event_samples.py"
    )
    assert (SAMPLES_DIR / f"{_name(cls)}.json").is_file()
    assert (SCHEMA_DIR / f"{_name(cls)}.json").is_file(), "run: uv run python -m schemas.jsonschema"


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_stored_sample_decodes_to_latest_version(path):
    buf = path.read_bytes()
    raw = CODEC.peek(buf)
    assert f"{raw.type}.v{raw.version}" == path.stem
    decoded = CODEC.decode(buf)
    assert decoded.type == raw.type
    assert decoded.version == CODEC.latest_version(raw.type)
    assert type(decoded.data) is CODEC.payload_type(raw.type, decoded.version)
    assert decoded.event_id == raw.event_id
    assert decoded.key == decoded.data.key()


def test_stored_worker_load_reported_v1_sample_upcasts():
    buf = (SAMPLES_DIR / "WorkerLoadReported.v1.msgpack").read_bytes()
    kv_usage = msgspec.msgpack.decode(buf)["data"]["kv_usage"]
    decoded = CODEC.decode(buf)
    assert isinstance(decoded.data, ev.WorkerLoadReported)
    assert decoded.data.tier_usage == {"device": kv_usage}


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_sample_json_rendering_matches_its_bytes(path):
    """The .json beside each sample is for reading; it must show what the bytes hold."""
    from_bytes = msgspec.to_builtins(msgspec.msgpack.decode(path.read_bytes()))
    assert json.loads(path.with_suffix(".json").read_text(encoding="utf-8")) == from_bytes


# -- JSON Schema documents --------------------------------------------------------------------


def _validator(file_name: str) -> Draft202012Validator:
    schema = json.loads((SCHEMA_DIR / file_name).read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_sample_validates_against_its_json_schema(path):
    """The JSON form of a record (bytes as base64, as msgspec.to_builtins gives) is what the
    documents describe: the envelope against envelope.v1.json, ``data`` against its type's file."""
    doc = msgspec.to_builtins(msgspec.msgpack.decode(path.read_bytes()))
    _validator(schema_files.ENVELOPE_FILE).validate(doc)
    payload = _validator(f"{doc['type']}.v{doc['v']}.json")
    assert payload.schema["x-switchyard-type"] == doc["type"]
    assert payload.schema["x-switchyard-version"] == doc["v"]
    assert payload.schema["$id"] == f"switchyard/{doc['type']}/v{doc['v']}"
    payload.validate(doc["data"])


def test_json_schema_rejects_a_wrong_field_type():
    """The documents are not vacuous: a string block_size fails BlockStored.v1.json."""
    doc = msgspec.to_builtins(msgspec.msgpack.decode(_raw_envelope()))
    doc["data"]["block_size"] = "16"
    errors = list(_validator("BlockStored.v1.json").iter_errors(doc["data"]))
    assert [list(e.path) for e in errors] == [["block_size"]]


def test_committed_schema_files_match_the_structs():
    assert schema_files.check(SCHEMA_DIR) == []


def test_superseded_schema_is_marked_deprecated():
    v1 = json.loads((SCHEMA_DIR / "WorkerLoadReported.v1.json").read_text(encoding="utf-8"))
    assert v1["deprecated"] is True
    assert v1["x-switchyard-superseded-by"] == 2
    assert v1["x-switchyard-stream"] == "workers"


def test_render_all_is_deterministic_and_sorted():
    first = schema_files.render_all()
    assert first == schema_files.render_all()
    for text in first.values():
        assert text.endswith("}\n")
        canonical = json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False)
        assert text == canonical + "\n"


def test_check_reports_missing_extra_and_differing_files(tmp_path):
    assert schema_files.write_all(tmp_path) == sorted(schema_files.render_all())
    assert schema_files.check(tmp_path) == []
    (tmp_path / "BlockStored.v1.json").unlink()
    (tmp_path / "BlockRemoved.v1.json").write_text("{}\n", encoding="utf-8")
    (tmp_path / "BlockExploded.v1.json").write_text("{}\n", encoding="utf-8")
    problems = schema_files.check(tmp_path)
    assert [p.split(":")[0] for p in problems] == ["differs", "missing", "extra"]
    assert "BlockRemoved.v1.json" in problems[0]
    assert "BlockStored.v1.json" in problems[1]
    assert "BlockExploded.v1.json" in problems[2]
    assert schema_files.write_all(tmp_path) == ["BlockRemoved.v1.json", "BlockStored.v1.json"]


# -- decode errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("buf", "error", "fragments"),
    [
        pytest.param(
            _raw_envelope(type="BlockExploded"),
            UnknownEventType,
            ["'BlockExploded'", "v1"],
            id="unknown-type",
        ),
        pytest.param(
            _raw_envelope(v=2),
            UnsupportedSchemaVersion,
            ["BlockStored v2", "(v1)"],
            id="newer-version",
        ),
        pytest.param(
            _raw_envelope(v=0),
            UnsupportedSchemaVersion,
            ["BlockStored v0", "not a registered version"],
            id="unregistered-older-version",
        ),
        pytest.param(
            b"\xc1\x00garbage\xff", MalformedEvent, ["not a Switchyard envelope"], id="garbage"
        ),
        pytest.param(
            msgspec.msgpack.encode([1, 2, 3]),
            MalformedEvent,
            ["not a Switchyard envelope"],
            id="not-a-map",
        ),
        pytest.param(
            _raw_envelope(
                data={**msgspec.to_builtins(build(ev.BlockStored)), "block_size": "sixteen"}
            ),
            MalformedEvent,
            ["BlockStored v1", "block_size"],
            id="wrong-field-type",
        ),
    ],
)
def test_bad_record_raises_named_schema_error(buf, error, fragments):
    with pytest.raises(error) as info:
        CODEC.decode(buf)
    assert isinstance(info.value, SchemaError)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("make", [
    lambda wid: build(ev.WorkerLoadReported, worker_id=wid),
    lambda wid: build(ev.RequestRouted, worker_id=wid),
    lambda wid: build(ev.KvTransferStarted, src_worker=wid),
])
def test_worker_id_longer_than_the_limit_is_malformed(make):
    """Refused by the codec, so every consumer dead-letters it alike (none stalls on it later,
    e.g. on the admin store's varchar(256) columns); the limit itself still decodes."""
    assert CODEC.decode(CODEC.encode(_wrap(make("w" * MAX_WORKER_ID_LEN)))).data == make("w" * MAX_WORKER_ID_LEN)
    with pytest.raises(MalformedEvent, match=f"of {MAX_WORKER_ID_LEN + 1} characters"):
        CODEC.decode(CODEC.encode(_wrap(make("w" * (MAX_WORKER_ID_LEN + 1)))))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nan_or_infinite_float_is_malformed(bad: float):
    """msgpack carries NaN and infinities; no duration, cost or rate is one. Found in a float
    field at the top, in an optional one, or in a nested row, the event is refused."""
    done = ev.RequestCompleted(request_id="r", worker_id="w", prompt_tokens=1, output_tokens=1, ttft_ms=bad,
                               e2e_ms=1.0)
    with pytest.raises(MalformedEvent, match="RequestCompleted v2 ttft_ms is not a finite number"):
        CODEC.decode(CODEC.encode(_wrap(done)))
    routed = ev.RequestRouted(request_id="r", worker_id="w", mode=RoutingMode.KV, config_version=1, rng_seed=0,
                              scores=[ev.CandidateScore(worker_id="w"), ev.CandidateScore(worker_id="v", cost=bad)])
    with pytest.raises(MalformedEvent, match=r"scores\[1\]\.cost is not a finite number"):
        CODEC.decode(CODEC.encode(_wrap(routed)))
    fine = msgspec.structs.replace(routed, scores=[ev.CandidateScore(worker_id="v", cost=1e300)], inflight_ttl_s=None)
    assert CODEC.decode(CODEC.encode(_wrap(fine))).data == fine


@given(sign=st.integers(0, 1), mantissa=st.integers(0, 2**52 - 1), prefix=st.binary(max_size=8))
def test_every_non_finite_msgpack_float_matches_the_pre_check(sign: int, mantissa: int, prefix: bytes):
    """decode walks a payload's float fields only where ``_NON_FINITE`` matches its bytes: every
    msgpack float64 or float32 that is a NaN or an infinity (every exponent bit set; any sign,
    any mantissa) must match, wherever it stands; a finite value next to it changes nothing."""
    import struct

    from schemas.envelope import _NON_FINITE

    b64 = (sign << 63 | 0x7FF << 52 | mantissa).to_bytes(8, "big")
    b32 = (sign << 31 | 0xFF << 23 | mantissa >> 29).to_bytes(4, "big")
    assert not math.isfinite(struct.unpack(">d", b64)[0]) and not math.isfinite(struct.unpack(">f", b32)[0])
    for packed in (b"\xcb" + b64, b"\xca" + b32):
        assert _NON_FINITE.search(prefix + packed) is not None
    assert _NON_FINITE.search(msgspec.msgpack.encode([prefix, 1.5, struct.unpack(">d", b64)[0]])) is not None
    assert _NON_FINITE.search(msgspec.msgpack.encode([1.5, 1e300, -2.0**-1074])) is None


def test_schema_errors_have_distinct_reasons():
    """Adapters dead-letter on ``reason``; each kind must be distinguishable."""
    reasons = {cls.reason for cls in (MalformedEvent, UnknownEventType, UnsupportedSchemaVersion)}
    assert len(reasons) == 3


# -- property ---------------------------------------------------------------------------------

_uint64 = st.integers(min_value=0, max_value=2**64 - 1)
_int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)

_block_stored = st.builds(
    ev.BlockStored,
    worker_id=st.text(max_size=MAX_WORKER_ID_LEN),
    tier=st.sampled_from(Tier),
    block_hashes=st.lists(_uint64, max_size=64),
    parent_hash=st.none() | _uint64,
    block_size=_int64,
    token_counts=st.lists(_int64, max_size=64),
    hash_algo=st.text(),
    cache_group=st.sampled_from(CacheGroup),
    lora_id=st.none() | _int64,
    lora_name=st.none() | st.text(),
    token_ids=st.lists(_int64, max_size=256),
    dp_rank=_int64,
)


@given(_block_stored)
def test_random_block_stored_round_trips_exactly(payload):
    buf = CODEC.encode(_wrap(payload))
    decoded = CODEC.decode(buf)
    assert decoded.data == payload
    assert CODEC.encode(decoded) == buf
