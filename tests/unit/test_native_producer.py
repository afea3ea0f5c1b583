"""The router's native producer writes what the Python codec and signer write: for every event
type and version, ``native/src/emit.rs``'s envelope (``switchyard_native.event_envelope``, the
function ``EventProducer.produce`` writes each record value with) is byte for byte
``EventCodec.encode`` of the same envelope, and signed, ``Signer.sign`` of it; so every reader
and verifier reads the router's records as before. (Producing them to the broker:
``tests/integration/test_native_producer.py`` and the router's integration tests.)"""

from __future__ import annotations

import pytest
import switchyard_native

from common.log.native_producer import native_config
from common.settings import BusSettings
from schemas import EventCodec
from schemas import events as ev
from schemas.signing import Signer, about_of
from tests.unit.test_schemas import BUILDERS, _name, _wrap

CODEC = EventCodec()
MASTER = b"m" * 32


def native_bytes(env, sign_key: bytes | None) -> bytes:
    data, corr = CODEC.encode_payload(env)
    return switchyard_native.event_envelope(env.event_id, env.type, env.version, env.key, env.producer, env.epoch,
                                            env.seq, env.occurred_at_ns, corr, env.causation_id, data, sign_key)


@pytest.mark.parametrize("cls", ev.ALL_EVENT_TYPES, ids=_name)
def test_the_envelope_is_the_codecs_bytes(cls):
    env = _wrap(BUILDERS[cls]())
    assert native_bytes(env, None) == CODEC.encode(env)
    # corr the key (left out of a request event from v2), no corr, no cause, large numbers
    for over in ({"correlation_id": env.key}, {"correlation_id": None, "causation_id": None},
                 {"seq": 2**40, "epoch": 2**41, "occurred_at_ns": 2**62}, {"seq": 0, "epoch": 0}):
        e = _wrap(BUILDERS[cls](), **over)
        assert native_bytes(e, None) == CODEC.encode(e), over


@pytest.mark.parametrize("cls", [c for c in ev.ALL_EVENT_TYPES if c.STREAM in ("requests", "admin")], ids=_name)
def test_a_signed_event_is_the_signers_bytes(cls):
    env = _wrap(BUILDERS[cls]())
    signer = Signer.master(MASTER)
    key = signer.key_for(env.type, env.key, about_of(env.data))
    assert key is not None
    assert native_bytes(env, key) == signer.sign(env.type, env.key, CODEC.encode(env), about_of(env.data))


def test_the_producer_settings_are_the_python_producers():
    conf = dict(native_config(BusSettings(bootstrap="localhost:1", security_protocol="PLAINTEXT"),
                              **{"linger.ms": 2}))
    assert conf["acks"] == "all" and conf["enable.idempotence"] == "true" and conf["linger.ms"] == "2"
    assert conf["compression.type"] == "lz4" and conf["socket.timeout.ms"] == "2000"
    assert conf["retry.backoff.max.ms"] == "250" and "logger" not in conf
