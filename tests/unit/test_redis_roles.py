"""The components' Redis users (ops/stack/redis.py) and when a router shares its waiting count
(control_plane/router/shared_gate.py): pure, no Redis."""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from common.stack_settings import REDIS_ROLES, StackSettings
from control_plane.planner.leader import LeaderLease
from control_plane.router.admission import RULE
from control_plane.router.shared_gate import SharedKeyGate, SharedWaiting, waiting_key, waiting_shared
from ops.stack.redis import ROLE_KEYS, role_rules


class _Client:
    """Enough of a Redis client to build the gates and the lease (they only register scripts)."""

    def register_script(self, _src: str) -> None:
        return None


def _allowed(role: str, key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in ROLE_KEYS[role])


def test_every_key_a_component_uses_is_its_own_users_and_no_other_roles() -> None:
    """The keys the routers' gates and the planners' lease name, by the code that names them."""
    gate = SharedKeyGate(_Client())
    lease = LeaderLease(_Client(), "default", "p1")
    router_keys = [*gate._keys("k1"), waiting_key("sy"), waiting_key("chaos-1a2b")]
    planner_keys = [lease.key, lease.token_key]
    assert set(ROLE_KEYS) == set(REDIS_ROLES)
    assert all(_allowed("router", k) and not _allowed("planner", k) for k in router_keys)
    assert all(_allowed("planner", k) and not _allowed("router", k) for k in planner_keys)


def test_a_role_users_rules_reset_it_and_allow_no_administration() -> None:
    rules = role_rules("router", "pw")
    assert rules[:3] == ["reset", "on", ">pw"]
    assert "~switchyard:*:router-waiting" in rules and "~*" not in rules
    assert rules[-1] == "-@dangerous" and "+@all" not in rules


def test_a_role_url_names_its_own_user_and_secret(tmp_path: Path) -> None:
    s = StackSettings(secrets_dir=tmp_path, redis_port=6390)
    url = s.redis_role_url("router")
    assert url == f"redis://sy-router:{s.secret('redis-router')}@127.0.0.1:6390/0" != s.redis_url
    with pytest.raises(ValueError, match="no Redis user for role 'worker'"):
        s.redis_role_url("worker")


def test_the_waiting_count_is_shared_only_with_a_redis_rule_4_and_a_budget() -> None:
    assert RULE >= 4
    assert waiting_shared("redis://r/0", 600.0, RULE)
    assert not waiting_shared("redis://r/0", 0.0, RULE)  # the budget test is off: nothing reads it
    assert not waiting_shared(None, 600.0, RULE)
    assert not waiting_shared("redis://r/0", 600.0, 3)  # rule 3 counts this replica's own alone


def test_a_replica_alone_polls_at_its_idle_interval() -> None:
    w = SharedWaiting(_Client(), replica="a", waiting=lambda: 0)
    assert (w.interval_s, w.idle_interval_s) == (0.025, 0.5)
    assert w.next_interval() == 0.5
    w.peers = 1
    assert w.next_interval() == 0.025
    with pytest.raises(ValueError, match="idle_interval_s"):
        SharedWaiting(_Client(), replica="a", waiting=lambda: 0, live_s=1.0, idle_interval_s=1.0)
    with pytest.raises(ValueError, match="max_count"):
        SharedWaiting(_Client(), replica="a", waiting=lambda: 0, max_count=-1)
