"""Who may say what on the log (issue 14, item 1; schemas/signing.py), against the real broker:
a process holding the worker credential cannot register, drain or fill the index as another
worker, and the router's credential (which may write ``admin`` for its own config record)
cannot issue an API key. Each forgery is dead-lettered with its reason and changes nothing."""

from __future__ import annotations

import pytest

from control_plane.router.keys import KeyTable
from control_plane.router.stream import RouterViewProcessor
from control_plane.router.view import RouterView
from control_plane.streaming import StreamFollower
from common.log.catalog import Catalog
from common.log.kafka import EventProducer
from common.settings import BusSettings
from schemas import EventCodec
from schemas.envelope import EnvelopeFactory
from schemas.events import BlockStored, RouterKeyIssued, WorkerDraining, WorkerRegistered
from tests.support.deadletters import dead_letters

pytestmark = [pytest.mark.kafka]

ALGO, BS = "sha256_cbor", 16


def _as(bus: BusSettings, role: str) -> BusSettings:
    return BusSettings.from_env({}, role=role, bootstrap=bus.bootstrap, topic_prefix=bus.topic_prefix,
                                secrets_dir=bus.secrets_dir)


def _registered(wid: str, endpoint: str) -> WorkerRegistered:
    return WorkerRegistered(worker_id=wid, role="decode", pool="default", endpoint=endpoint,
                            capacity={"device": 100}, block_size=BS, hash_algo=ALGO)


def test_an_honest_client_cannot_sign_as_another_owner(bus: BusSettings) -> None:
    evil = EventProducer(_as(bus, "worker"), "w-evil")
    with pytest.raises(PermissionError, match="worker:decode-0"):
        evil.publish(_registered("decode-0", "http://127.0.0.1:18999"))
    router = EventProducer(_as(bus, "router"), "r-evil")
    with pytest.raises(PermissionError, match="role:admin"):
        router.publish(RouterKeyIssued(actor="r-evil", actor_role="admin", key_id="k-evil", name="evil",
                                       salt="00", key_hash="00"))


async def test_forged_worker_events_are_dead_lettered_and_change_nothing(bus: BusSettings) -> None:
    honest = EventProducer(_as(bus, "worker"), "decode-0")
    honest.publish(_registered("decode-0", "http://127.0.0.1:18100"))
    assert honest.flush(20) == 0

    # The attacker holds the worker credential (so the broker takes its writes) and its own key.
    evil_bus = _as(bus, "worker")
    evil = EventProducer(evil_bus, "w-evil")
    codec = EventCodec()
    topic = Catalog(bus.topic_prefix).topic("workers")
    factory = EnvelopeFactory("decode-0", 10**15, lambda: 1)

    def raw(payload, key: str) -> bytes:
        return codec.encode(factory.wrap(payload, key=key))

    hijack = raw(_registered("decode-0", "http://127.0.0.1:18999"), "decode-0")
    evil.produce_raw(topic, hijack, b"decode-0")  # unsigned
    signer = evil_bus.signer("w-evil")  # w-evil's own key over decode-0's registration
    evil.produce_raw(topic, signer.seal(hijack), b"decode-0")
    drain = raw(WorkerDraining(worker_id="decode-0"), "w-evil")  # keyed as itself, about decode-0
    evil.produce_raw(topic, signer.sign("WorkerDraining", "w-evil", drain), b"w-evil")
    kv = Catalog(bus.topic_prefix).topic("kv")
    evil.produce_raw(kv, raw(BlockStored(worker_id="decode-0", tier="device", block_hashes=list(range(1000)),
                                         block_size=BS, hash_algo=ALGO), "decode-0"), b"decode-0")
    assert evil.flush(20) == 0

    view = RouterView(ALGO, BS)
    proc = RouterViewProcessor(bus, "r-owners", view, snapshot_every_s=3600)
    await proc.start()
    try:
        await proc.sync(60)
        assert proc.dead_lettered == 4
        w = view.workers["decode-0"]
        assert (w.endpoint, w.state) == ("http://127.0.0.1:18100", "ready")
        assert not view.matches(list(range(1000)))
    finally:
        await proc.stop()
    reasons = sorted(d.reason for d in dead_letters(bus))
    assert reasons == ["forged:bad_signature", "forged:key_not_worker", "forged:unsigned", "forged:unsigned"]


def test_the_router_credential_cannot_issue_an_api_key(bus: BusSettings) -> None:
    """The router principal may write ``admin`` (its config record); a key it writes there
    is not the admin API's and no router folds it."""
    router_bus = _as(bus, "router")
    p = EventProducer(router_bus, "r-evil")
    admin_topic = Catalog(bus.topic_prefix).topic("admin")
    issued = RouterKeyIssued(actor="r-evil", actor_role="admin", key_id="k-evil", name="evil", salt="00",
                             key_hash="00")
    value = EventCodec().encode(EnvelopeFactory("admin", 1, lambda: 1).wrap(issued, key=issued.key()))
    p.produce_raw(admin_topic, router_bus.signer("r-evil").seal(value), issued.key().encode())
    honest = EventProducer(_as(bus, "admin"), "admin-api")
    honest.publish(RouterKeyIssued(actor="ops", actor_role="admin", key_id="k-good", name="good", salt="00",
                                   key_hash="00"))
    assert p.flush(20) == 0 and honest.flush(20) == 0

    table = KeyTable()
    follower = StreamFollower(bus, ["admin"], "keys-probe", table.apply).start()
    try:
        follower.wait_caught_up(30)
        with follower.lock:
            assert sorted(table.keys) == ["k-good"]
    finally:
        follower.stop()
    assert [d.reason for d in dead_letters(bus)] == ["forged:bad_signature"]
