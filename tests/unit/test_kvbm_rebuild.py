"""The restart plan of one persistent tier (``data_plane.kvbm.rebuild.plan_tier``): pure, no stores."""

from __future__ import annotations

from data_plane.kvbm.rebuild import plan_tier
from schemas.types import BlockHash, Tier

SIZE = 100


def _h(i: int) -> BlockHash:
    return BlockHash(i)


def test_claims_sorted_by_what_the_store_holds_and_the_read_back_says() -> None:
    """Claims 1..5: 1 and 2 verify, 3 is absent, 4 has the wrong size (no read), 5 fails the
    read-back. Only 1, 2 and 5 are read."""
    present = {_h(1): SIZE, _h(2): SIZE, _h(4): SIZE - 1, _h(5): SIZE}
    reads: list[BlockHash] = []

    def check(h: BlockHash) -> str:
        reads.append(h)
        return "corrupt" if h == _h(5) else "ok"

    p = plan_tier(Tier.DISK, [_h(i) for i in range(1, 6)], present, SIZE, 10, check, False)
    assert (p.ok, p.missing, p.corrupt, p.excess, p.adopt, p.orphans) == (
        [_h(1), _h(2)], [_h(3)], [_h(4), _h(5)], [], [], [])
    assert reads == [_h(1), _h(2), _h(5)]


def test_over_capacity_drops_the_least_recent_and_orphans_fill_only_the_room_left() -> None:
    """Capacity 3, claims 1..4 all verify: 1 (least recent) is excess, no room for orphans.
    Capacity 5: room 1, so of orphans 7 and 8 (hash order) 7 is adopted, 8 deleted."""
    claims = [_h(i) for i in range(1, 5)]
    present = {h: SIZE for h in [*claims, _h(8), _h(7)]}
    full = plan_tier(Tier.DISK, claims, present, SIZE, 3, lambda h: "ok", True)
    assert (full.ok, full.excess, full.adopt, full.orphans) == (claims[1:], [_h(1)], [], [_h(7), _h(8)])
    room = plan_tier(Tier.DISK, claims, present, SIZE, 5, lambda h: "ok", True)
    assert (room.ok, room.excess, room.adopt, room.orphans) == (claims, [], [_h(7)], [_h(8)])


def test_a_tier_not_managed_here_has_every_claim_missing() -> None:
    p = plan_tier(Tier.OBJECT, [_h(1), _h(2)], None, SIZE, 0, lambda h: "ok", True)
    assert (p.ok, p.missing, p.corrupt, p.excess, p.adopt, p.orphans) == ([], [_h(1), _h(2)], [], [], [], [])
