"""Event signatures by owner (schemas/signing.py): who may sign what, and what a verifier refuses."""

from __future__ import annotations

import msgspec
import pytest

from common.log.fold import RecordFold
from common.log.reader import LogRecord
from schemas import EventCodec
from schemas.envelope import EnvelopeFactory
from schemas.events import (
    BlockStored,
    KvTransferCompleted,
    PoolPinned,
    PrefillCompleted,
    RequestAdmitted,
    RequestCompleted,
    RouterConfigChanged,
    RouterKeyRevoked,
    ScalingDecision,
    WorkerDraining,
    WorkerRegistered,
)
from schemas.signing import ADMIN, ROUTER, ForgedEvent, Signer, Verifier, about_of, owner_key, worker_owner
from schemas.types import WorkerRole

MASTER = b"m" * 32
CODEC = EventCodec()


def encoded(payload, key: str | None = None, producer: str = "w0") -> bytes:
    env = EnvelopeFactory(producer, 1, lambda: 1_000).wrap(payload, key=key or payload.key())
    return CODEC.encode(env)


def registered(wid: str = "w0") -> WorkerRegistered:
    return WorkerRegistered(worker_id=wid, role=WorkerRole.DECODE, pool="default", endpoint="http://127.0.0.1:1",
                            block_size=16, hash_algo="sha256")


def stored(wid: str = "w0") -> BlockStored:
    return BlockStored(worker_id=wid, tier="device", block_hashes=[1, 2], block_size=16, hash_algo="sha256")


def worker_signer(wid: str) -> Signer:
    return Signer.identity(worker_owner(wid), owner_key(MASTER, worker_owner(wid)))


def test_a_signed_event_verifies_and_still_decodes_as_it_was():
    v = encoded(registered())
    signed = worker_signer("w0").sign("WorkerRegistered", "w0", v)
    assert len(signed) == len(v) + 38
    Verifier(MASTER).check(signed)
    assert EventCodec(verifier=Verifier(MASTER)).decode(signed) == CODEC.decode(v)


def test_the_native_decoder_reads_a_signed_kv_event():
    from control_plane.index.native import NativePrefixIndex

    signed = worker_signer("w0").sign("BlockStored", "w0", encoded(stored()))
    index = NativePrefixIndex("sha256", 16)
    assert index.apply_bytes(signed, "@kv:0") is not None
    assert index.last_worker() == "w0"


@pytest.mark.parametrize("payload", [registered(), stored(), WorkerDraining(worker_id="w0")])
def test_an_unsigned_worker_event_is_forged(payload):
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).check(encoded(payload))
    assert e.value.reason == "forged:unsigned"


def test_a_worker_cannot_sign_for_another_worker():
    with pytest.raises(PermissionError, match="worker:decode-0"):
        worker_signer("w-evil").sign("WorkerRegistered", "decode-0", encoded(registered("decode-0")))


def test_another_workers_key_does_not_verify():
    other = Signer.identity(worker_owner("decode-0"), owner_key(MASTER, worker_owner("w-evil")))
    forged = other.sign("WorkerRegistered", "decode-0", encoded(registered("decode-0")))
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).check(forged)
    assert e.value.reason == "forged:bad_signature"


def test_a_signature_under_another_master_does_not_verify():
    forged = Signer.master(b"x" * 32).sign("BlockStored", "w0", encoded(stored()))
    with pytest.raises(ForgedEvent, match="not signed by worker:w0"):
        Verifier(MASTER).check(forged)


def test_own_key_about_another_worker_is_refused():
    """Signed by w-evil as its own key, but the payload is about decode-0."""
    v = encoded(WorkerDraining(worker_id="decode-0"), key="w-evil")
    forged = worker_signer("w-evil").sign("WorkerDraining", "w-evil", v)
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).check(forged)
    assert e.value.reason == "forged:key_not_worker"


def test_a_changed_byte_breaks_the_signature():
    signed = bytearray(worker_signer("w0").sign("WorkerRegistered", "w0", encoded(registered())))
    at = bytes(signed).index(b"127.0.0.1")
    signed[at:at + 9] = b"127.0.0.9"
    with pytest.raises(ForgedEvent, match="not signed"):
        Verifier(MASTER).check(bytes(signed))


def test_admin_events_need_the_admin_key_and_a_router_signs_only_its_config():
    router = Signer.identity(ROUTER, owner_key(MASTER, ROUTER))
    admin = Signer.identity(ADMIN, owner_key(MASTER, ADMIN))
    cfg = RouterConfigChanged(actor="router:r0", actor_role="system", config_version=2, config={"version": 2})
    Verifier(MASTER).check(router.sign("RouterConfigChanged", cfg.key(), encoded(cfg, producer="r0")))
    Verifier(MASTER).check(admin.sign("RouterConfigChanged", cfg.key(), encoded(cfg, producer="admin")))
    revoke = RouterKeyRevoked(actor="x", actor_role="admin", key_id="k1")
    with pytest.raises(PermissionError, match="role:admin"):
        router.sign("RouterKeyRevoked", revoke.key(), encoded(revoke))
    # the router's key over an admin event: refused by the verifier as well
    forged = Signer.identity(ADMIN, owner_key(MASTER, ROUTER)).sign("RouterKeyRevoked", revoke.key(), encoded(revoke))
    with pytest.raises(ForgedEvent):
        Verifier(MASTER).check(forged)
    pin = PoolPinned(actor="x", actor_role="admin", pool="default", replicas=2)  # keyed by pool
    Verifier(MASTER).check(admin.sign("PoolPinned", pin.key(), encoded(pin)))


def test_streams_that_are_not_guarded_pass_unsigned():
    dec = ScalingDecision(decision_id="d1", pool="default", role=WorkerRole.DECODE, from_replicas=1, to_replicas=2,
                          reason="x", config_version=1)
    v = encoded(dec, producer="planner")
    assert worker_signer("w0").sign("ScalingDecision", dec.key(), v) == v
    Verifier(MASTER).check(v)


def admitted(rid: str = "r1") -> RequestAdmitted:
    return RequestAdmitted(request_id=rid, model="m", prompt_tokens=3, max_tokens=4, block_size=16, hash_algo="sha256")


ROUTER_SIGNER = Signer.identity(ROUTER, owner_key(MASTER, ROUTER))


def test_request_events_need_a_routers_signature():
    """The forged traffic of issue 36: RequestAdmitted / RequestCompleted written with a worker's
    credential as producer ``demo-router``. Unsigned, or under the worker's own key: forged."""
    v = encoded(admitted(), producer="demo-router")
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).check(v)
    assert e.value.reason == "forged:unsigned"
    with pytest.raises(PermissionError, match="role:router"):
        worker_signer("w0").sign("RequestAdmitted", "r1", v)
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).check(worker_signer("w0").seal(v))
    assert e.value.reason == "forged:bad_signature"
    done = RequestCompleted(request_id="r1", worker_id="w0", prompt_tokens=3, output_tokens=4, ttft_ms=1.0,
                            e2e_ms=2.0)
    with pytest.raises(ForgedEvent):
        Verifier(MASTER).check(worker_signer("w0").seal(encoded(done, producer="demo-router")))
    Verifier(MASTER).check(ROUTER_SIGNER.sign("RequestAdmitted", "r1", v))
    Verifier(MASTER).check(ROUTER_SIGNER.sign("RequestCompleted", "r1", encoded(done, producer="r0")))


def test_a_worker_signs_only_its_own_handoff_facts():
    mine = PrefillCompleted(request_id="r1", worker_id="w0", prompt_tokens=3, duration_ms=1.0)
    Verifier(MASTER).check(worker_signer("w0").sign("PrefillCompleted", "r1", encoded(mine), about_of(mine)))
    # aggregated serving: the router records the prefill it saw
    Verifier(MASTER).check(ROUTER_SIGNER.sign("PrefillCompleted", "r1", encoded(mine, producer="r0"), about_of(mine)))
    pulled = KvTransferCompleted(request_id="r1", transfer_id="t", src_worker="p0", dst_worker="w0", blocks=1,
                                 bytes=1, backend="x", duration_ms=1.0)
    Verifier(MASTER).check(worker_signer("w0").sign("KvTransferCompleted", "r1", encoded(pulled), about_of(pulled)))
    theirs = PrefillCompleted(request_id="r1", worker_id="w1", prompt_tokens=3, duration_ms=1.0)
    with pytest.raises(PermissionError, match="worker:w1"):
        worker_signer("w0").sign("PrefillCompleted", "r1", encoded(theirs), about_of(theirs))
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).check(worker_signer("w0").seal(encoded(theirs)))
    assert e.value.reason == "forged:bad_signature"


def test_bytes_that_are_not_an_envelope_are_left_to_the_codec():
    Verifier(MASTER).check(b"\x00garbage")
    with pytest.raises(Exception, match="not a Switchyard envelope"):
        EventCodec(verifier=Verifier(MASTER)).decode(b"\x00garbage")


def test_a_fold_dead_letters_a_forged_record_and_goes_on():
    codec = EventCodec(verifier=Verifier(MASTER))
    applied, poisoned = [], []
    positions: dict = {}

    def apply(rec):
        applied.append(codec.decode(rec.value).data.worker_id)
        positions[(rec.topic, rec.partition)] = rec.offset + 1

    fold = RecordFold(positions, apply, lambda rec, p: poisoned.append((rec.offset, p.reason)))
    good = worker_signer("w0").sign("WorkerRegistered", "w0", encoded(registered()))
    fold(LogRecord("sy.workers", 0, 0, 0, b"decode-0", encoded(registered("decode-0"))))
    fold(LogRecord("sy.workers", 0, 1, 0, b"w0", good))
    assert applied == ["w0"]
    assert poisoned == [(0, "forged:unsigned")]
    assert positions == {("sy.workers", 0): 2}


def test_the_signature_is_the_last_field_of_the_map():
    signed = worker_signer("w0").sign("WorkerRegistered", "w0", encoded(registered()))
    doc = msgspec.msgpack.decode(signed)
    assert list(doc)[-1] == "sig" and len(doc["sig"]) == 32


def test_each_principal_signs_as_its_own_owner(tmp_path):
    from common.settings import BusSettings, signing_master

    def settings(role=None, **kw):
        return BusSettings.from_env({}, role=role, secrets_dir=tmp_path, **kw)

    verifier = settings().verifier()
    value = encoded(registered("w1"))
    verifier.check(settings("worker").signer("w1").sign("WorkerRegistered", "w1", value))
    with pytest.raises(PermissionError):
        settings("worker").signer("w2").sign("WorkerRegistered", "w1", value)
    with pytest.raises(PermissionError):
        settings("admin").signer("admin").sign("WorkerRegistered", "w1", value)
    verifier.check(settings().signer("tool").sign("WorkerRegistered", "w1", value))  # the super user
    # A key file: one owner's key, for a host without the stack's secrets.
    key_file = tmp_path / "w1.key"
    key_file.write_text(f"worker:w1\n{owner_key(signing_master(tmp_path), 'worker:w1').hex()}\n")
    keyed = settings("worker", signing_key_file=key_file)
    verifier.check(keyed.signer("anything").sign("WorkerRegistered", "w1", value))
    with pytest.raises(PermissionError):
        keyed.signer("w1").sign("BlockStored", "w2", encoded(stored("w2")))


@pytest.mark.parametrize("sig", [b"\x00", b"\xa1x", b"\x90", b"\xc3"])
def test_a_sig_field_that_is_not_bytes_is_a_bad_signature(sig):
    """An unsigned worker event given a last field ``"sig"`` of another type (an int, a string,
    an array, a bool) is forged, not passed on unverified as bytes the probe cannot read."""
    raw = encoded(stored())
    forged = bytes((raw[0] + 1,)) + raw[1:] + b"\xa3sig" + sig
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).check(forged)
    assert e.value.reason == "forged:bad_signature"
    assert not Verifier(MASTER).native().verified(forged)


# -- snapshots ---------------------------------------------------------------------------------

def _role(owner: str) -> Signer:
    return Signer.identity(owner, owner_key(MASTER, owner))


@pytest.mark.parametrize("key, owner", [("router-view:sha256:16", ROUTER), ("load-view:v2:1:1:10", "role:planner"),
                                        ("metrics:demo:sha256:16", "role:processor")])
def test_a_snapshot_is_signed_by_the_role_owning_its_key(key, owner):
    data = b"\x00view bytes" * 100
    stored = _role(owner).sign_snapshot(key, data)
    assert Verifier(MASTER).open_snapshot(key, stored) == data
    assert Verifier(MASTER).open_snapshot(key, Signer.master(MASTER).sign_snapshot(key, data)) == data
    for other in {ROUTER, "role:planner", "role:processor", ADMIN, worker_owner("w0")} - {owner}:
        with pytest.raises(PermissionError):
            _role(other).sign_snapshot(key, data)


@pytest.mark.parametrize("forge, reason", [
    (lambda key, data: data, "forged:unsigned"),                                           # as stored before
    (lambda key, data: _role("role:processor").seal_snapshot(key, data), "forged:bad_signature"),  # its own key
    (lambda key, data: _role(ROUTER).sign_snapshot("router-view:sha256:32", data), "forged:bad_signature"),  # other key
    (lambda key, data: _role(ROUTER).sign_snapshot(key, data)[:-1] + b"X", "forged:bad_signature"),  # a changed byte
    (lambda key, data: b"SYSNAP1\x00" + b"short", "forged:unsigned"),
])
def test_a_forged_snapshot_is_refused(forge, reason):
    key = "router-view:sha256:16"
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).open_snapshot(key, forge(key, b"a forged view"))
    assert e.value.reason == reason


def test_a_snapshot_key_no_role_owns_is_refused():
    with pytest.raises(ForgedEvent) as e:
        Verifier(MASTER).open_snapshot("mine:1", b"x")
    assert e.value.reason == "forged:no_owner"
    with pytest.raises(PermissionError):
        Signer.master(MASTER).sign_snapshot("mine:1", b"x")
