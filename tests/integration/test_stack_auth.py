"""The stack's services refuse a client without their credential (issue 14: "a client without
Kafka credentials is refused"; the database escalation needs the password).

Against the running test stack: a Kafka client without SASL, and one with a wrong password, can
neither read the topic list nor write a forged registration; PostgreSQL refuses a connection
without the password; Redis refuses commands without its ACL user, and the default user is off.
"""

from __future__ import annotations

import uuid

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient

from control_plane.admin.db.session import make_engine
from common.stack_settings import StackSettings
from common.log.catalog import Catalog
from common.settings import BusSettings

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.redis]


def _forge(conf: dict, topic: str) -> list[str]:
    """Try to write a record; the delivery errors (one per record) or [] if it was written."""
    errors: list[str] = []
    p = Producer({**conf, "message.timeout.ms": 5000, "socket.timeout.ms": 3000, "logger": None})
    p.produce(topic, value=b'{"forged": true}', key=b"decode-0",
              on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
    left = p.flush(15)
    return errors + ["undelivered"] * left


def test_kafka_refuses_clients_without_the_stack_credential(bus: BusSettings) -> None:
    topic = Catalog(bus.topic_prefix).topic("workers")
    bare = {"bootstrap.servers": bus.bootstrap}
    wrong = {**bus.client_conf(), "sasl.password": "not-" + uuid.uuid4().hex}
    for conf in (bare, wrong):
        with pytest.raises(KafkaException):
            AdminClient({**conf, "socket.timeout.ms": 3000}).list_topics(timeout=5)
        assert _forge(conf, topic), "a record was written without the stack's credential"
    # The stack's own credential works: what is refused above is the credential, not the broker.
    assert AdminClient(bus.client_conf()).list_topics(timeout=10).topics


def test_postgres_refuses_a_connection_without_the_password(stack_settings: StackSettings) -> None:
    bare = sa.create_engine(stack_settings.postgres_url)  # no passfile: what any local user has
    with pytest.raises(sa.exc.OperationalError, match="password"):
        with bare.connect():
            pass
    bare.dispose()
    with make_engine(stack_settings.postgres_url).connect() as c:
        assert c.execute(sa.text("SELECT current_user")).scalar() == "switchyard"


def test_redis_refuses_commands_without_its_acl_user(stack_settings: StackSettings) -> None:
    s = stack_settings
    for client in (redis.Redis(host=s.host, port=s.redis_port, socket_timeout=5),
                   redis.Redis(host=s.host, port=s.redis_port, username="default", password=s.secret("redis"),
                               socket_timeout=5)):
        with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
            client.set("sy-forged", "1")
        client.close()
    ok = redis.Redis.from_url(s.redis_url, socket_timeout=5)
    assert ok.ping()
    ok.close()


def test_kafka_refuses_a_client_without_tls_or_one_that_does_not_trust_the_stack_ca(bus: BusSettings,
                                                                                     tmp_path) -> None:
    from ops.stack.tls import ensure_kafka_tls

    assert bus.client_conf()["security.protocol"] == "SASL_SSL"
    no_tls = BusSettings(bootstrap=bus.bootstrap, security_protocol="SASL_PLAINTEXT").client_conf()
    stranger_ca = ensure_kafka_tls(tmp_path / "elsewhere").ca_file  # a CA the brokers' cert is not from
    for conf in (no_tls, {**bus.client_conf(), "ssl.ca.location": str(stranger_ca)}):
        with pytest.raises(KafkaException):
            AdminClient({**conf, "socket.timeout.ms": 3000, "logger": None}).list_topics(timeout=5)
        assert _forge(conf, Catalog(bus.topic_prefix).topic("workers"))


def test_each_component_redis_user_touches_only_its_own_keys(stack_settings: StackSettings) -> None:
    """The routers' user writes the routers' keys and not the planners' lease; the planners'
    user the reverse (ops/stack/redis.py ``ROLE_KEYS``): a planner's credential cannot write the
    waiting count every router's admission reads (rule 4), nor a key's limits."""
    s = stack_settings
    router = redis.Redis.from_url(s.redis_role_url("router"), socket_timeout=5)
    planner = redis.Redis.from_url(s.redis_role_url("planner"), socket_timeout=5)
    admin = redis.Redis.from_url(s.redis_url, socket_timeout=5)
    waiting, slots, lease = "switchyard:t-auth:router-waiting", "switchyard:router-key:{t-auth}:slots", \
        "switchyard:planner:t-auth:leader"
    try:
        assert router.hset(waiting, "r1", "0:0") == 1 and router.zadd(slots, {"s": 1}) == 1
        assert planner.set(lease, "p1", px=5000)
        for client, key, write in ((planner, waiting, lambda c: c.hset(waiting, "fake", "999999:0")),
                                   (planner, slots, lambda c: c.zadd(slots, {"fake": 1})),
                                   (router, lease, lambda c: c.set(lease, "r1")),
                                   (router, "other", lambda c: c.set("other", "1"))):
            with pytest.raises(redis.exceptions.NoPermissionError):
                write(client)
        with pytest.raises(redis.exceptions.NoPermissionError):  # not the server's administration
            router.execute_command("CONFIG", "GET", "dir")
        assert admin.hgetall(waiting) == {b"r1": b"0:0"}
    finally:
        admin.delete(waiting, slots, lease)
        for c in (router, planner, admin):
            c.close()


def test_security_checks_redis_probes_are_refused(stack_settings: StackSettings) -> None:
    """``security-check``'s Redis probes (ops/security/probes_redis.py) against the stack: the
    planner's credential on the routers' keys and the router's on the lease get NOPERM; a
    router's waiting count over the bound or in the future is not counted by the routers' reader."""
    import dataclasses

    from ops.security.probe import REFUSED, Targets
    from ops.security.probes_redis import run

    s = stack_settings
    t = Targets(router_url=None, admin_url=None, kafka_bootstrap="", postgres_url="", redis_url=s.redis_url, pids=[],
                topic_prefix="t-redis-probe", redis_router_url=s.redis_role_url("router"),
                redis_planner_url=s.redis_role_url("planner"))
    probes = run(t)
    assert len(probes) == 5 and all(p.verdict == REFUSED for p in probes), probes
    # With the super user's credential in the planner's place, the first probe sees the hole.
    assert run(dataclasses.replace(t, redis_planner_url=s.redis_url))[0].verdict == "accepted"
