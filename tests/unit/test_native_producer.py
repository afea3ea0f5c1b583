"""The router's native producer writes what the Python codec and signer write: for every event
type and version, ``native/src/emit.rs``'s envelope (``switchyard_native.event_envelope``, the
function ``EventProducer.produce`` writes each record value with) is byte for byte
``EventCodec.encode`` of the same envelope, and signed, ``Signer.sign`` of it; so every reader
and verifier reads the router's records as before. (Producing them to the broker:
``tests/integration/test_native_producer.py`` and the router's integration tests.)"""

from __future__ import annotations

import logging
import time

import pytest
import switchyard_native

from common.log.native_producer import NativeEventProducer, log_level, native_config
from common.net import free_port
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


def test_librdkafkas_warnings_reach_the_python_logger_and_statistics_are_kept(caplog):
    """No broker listens at the bootstrap address: librdkafka's connection errors come back as
    ``switchyard.rdkafka`` records, served with the delivery reports (here by ``poll``), not
    written to stderr; its statistics reports arrive when asked for (the events bench reads the
    produce requests from them)."""
    bus = BusSettings(bootstrap=f"127.0.0.1:{free_port()}", security_protocol="PLAINTEXT")
    p = NativeEventProducer(bus, "router-log-test", ack_ledger=False, **{"statistics.interval.ms": 50})
    caplog.set_level(logging.WARNING, logger="switchyard.rdkafka")
    deadline = time.monotonic() + 30
    while not [r for r in caplog.records if r.name == "switchyard.rdkafka"] and time.monotonic() < deadline:
        p.poll()
        time.sleep(0.05)
    [first, *_] = [r for r in caplog.records if r.name == "switchyard.rdkafka"]
    assert first.levelno >= logging.WARNING and first.getMessage().startswith("router-log-test ")
    assert "127.0.0.1" in first.getMessage()
    while p.statistics()[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    n, stats = p.statistics()
    assert n >= 1 and stats["type"] == "producer" and stats["msg_cnt"] == 0
    p.close(1)


@pytest.mark.parametrize(("syslog", "level"), [(0, logging.CRITICAL), (2, logging.CRITICAL), (3, logging.ERROR),
                                                (4, logging.WARNING), (6, logging.INFO), (7, logging.DEBUG)])
def test_librdkafka_levels_are_the_logging_modules(syslog, level):
    assert log_level(syslog) == level
