"""The stack's Kafka layouts as configs: one combined node, or brokers beside dedicated
controllers (ops/stack/kafka.py). No JVM is started here; the cluster itself is
exercised by tests/integration/test_cluster_failover.py and the chaos test."""

from __future__ import annotations

from pathlib import Path

from common.stack_settings import StackSettings
from ops.stack.kafka import CONTROLLER_ID_BASE, BROKER_SESSION_TIMEOUT_MS, KafkaService


def _props(node) -> dict[str, str]:
    return dict(line.split("=", 1) for line in node.config_lines())


def _service(tmp_path: Path, brokers: int, **settings) -> KafkaService:
    secrets = tmp_path / "secrets"
    return KafkaService(StackSettings(state_dir=tmp_path / "stack", secrets_dir=secrets, kafka_port=30000,
                                      kafka_brokers=brokers, **settings))


def test_one_broker_is_one_combined_node(tmp_path: Path) -> None:
    [node] = _service(tmp_path, 1).nodes
    p = _props(node)
    assert p["process.roles"] == "broker,controller"
    assert p["controller.quorum.voters"] == "1@127.0.0.1:30001"
    assert p["listeners"] == "SASL_SSL://127.0.0.1:30000,CONTROLLER://127.0.0.1:30001"
    assert "broker.session.timeout.ms" not in p


def test_a_cluster_runs_its_brokers_beside_three_dedicated_controllers(tmp_path: Path) -> None:
    """Three brokers on 30000, 30002, 30004 (ids 1..3); controllers 101..103 on the ports after
    them: killing a broker never takes the active controller with it."""
    kafka = _service(tmp_path, 3)
    brokers = [n for n in kafka.nodes if n.role == "broker"]
    controllers = [n for n in kafka.nodes if n.role == "controller"]
    assert [(n.node_id, n.port) for n in brokers] == [(1, 30000), (2, 30002), (3, 30004)]
    assert [(n.node_id, n.port) for n in controllers] == [(101, 30001), (102, 30003), (103, 30005)]
    voters = "101@127.0.0.1:30001,102@127.0.0.1:30003,103@127.0.0.1:30005"
    for n in brokers:
        p = _props(n)
        assert p["process.roles"] == "broker"
        assert p["controller.quorum.voters"] == voters
        assert p["listeners"] == f"SASL_SSL://127.0.0.1:{n.port}"
        assert p["broker.heartbeat.interval.ms"] == "250"
        assert p["ssl.keystore.type"] == "PKCS12"
    for n in controllers:
        p = _props(n)
        assert p["process.roles"] == "controller"
        assert p["controller.quorum.voters"] == voters
        assert p["listeners"] == f"CONTROLLER://127.0.0.1:{n.port}"
        assert p["listener.security.protocol.map"] == "CONTROLLER:SASL_PLAINTEXT"
        assert p["broker.session.timeout.ms"] == str(BROKER_SESSION_TIMEOUT_MS)
        # A controller serves no client listener: no inter-broker or TLS settings.
        assert not any(k.startswith(("inter.broker", "advertised", "ssl.")) for k in p)
        assert p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2"
    assert kafka.node(2) is brokers[1] and kafka.node(CONTROLLER_ID_BASE) is controllers[0]


def test_two_brokers_have_two_controllers(tmp_path: Path) -> None:
    kafka = _service(tmp_path, 2)
    assert [n.role for n in kafka.nodes] == ["broker", "broker", "controller", "controller"]


def test_a_broker_without_c2_serves_tls_with_chacha20_and_one_with_c2_leaves_the_choice(tmp_path: Path) -> None:
    """A C1-only JVM (the stack's default) has no AES-GCM intrinsics: its TLS listener offers
    ChaCha20-Poly1305 only. With C2 the suite is the client's choice (AES-GCM, intrinsified)."""
    [c1] = _service(tmp_path, 1).nodes
    assert _props(c1)["ssl.cipher.suites"] == "TLS_CHACHA20_POLY1305_SHA256"
    [c2] = _service(tmp_path, 1, kafka_jvm_opts="").nodes
    assert "ssl.cipher.suites" not in _props(c2)
    [plain] = _service(tmp_path, 1, kafka_tls=False).nodes
    assert not any(k.startswith("ssl.") for k in _props(plain))
