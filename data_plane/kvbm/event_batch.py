"""The events of one KV block manager call, same-kind ones merged: what the manager queues
after each store call and publishes, in order, before the call returns (:mod:`.manager`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from data_plane.kvbm.settings import KvbmSettings
from schemas.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, Event
from schemas.types import BlockHash, Tier


class EventBatch:
    """The events of one public call, same-kind ones merged.

    A block's own events keep their order; events of different blocks may be reordered, which
    no fold can tell apart (residency is per block). So an event joins the nearest earlier event
    of its kind unless an event in between names the same block. An offload burst (host->disk,
    device->host, host->disk, ...) is then a few events, not one per block.

    Stores join whatever their chains: a ``BlockStored`` states a chain (each block's parent is
    the one before it), so a merged store is cut into its chains when the events are built, one
    event per chain, parents first. Evictions run tail first, so a request's blocks arrive
    reversed and come out as one chain.
    """

    #: How many trailing events a new one looks back over for a partner.
    _LOOKBACK = 8

    def __init__(self, s: KvbmSettings) -> None:
        self._s = s
        # [kind, tier_a, tier_b, hashes, {hash: parent} (stores only), set(hashes)]
        self._items: list[list] = []

    def _append(self, kind: str, a: Tier, b: Tier | None, h: BlockHash,
                parent: BlockHash | None = None) -> None:
        items = self._items
        for i in range(len(items) - 1, max(-1, len(items) - 1 - self._LOOKBACK), -1):
            it = items[i]
            if it[0] == "cleared":
                break  # nothing moves across a clear
            if it[0] == kind and it[1] is a and it[2] is b:
                if any(h in later[5] for later in items[i + 1:]):
                    break
                if h in it[5]:
                    if kind == "stored":
                        it[4][h] = parent  # a store is an upsert: the newest parent stands
                    return
                it[3].append(h)
                it[5].add(h)
                if kind == "stored":
                    it[4][h] = parent
                return
        items.append([kind, a, b, [h], {h: parent} if kind == "stored" else None, {h}])

    def removed(self, tier: Tier, h: BlockHash) -> None:
        self._append("removed", tier, None, h)

    def moved(self, src: Tier, dst: Tier, h: BlockHash) -> None:
        self._append("moved", src, dst, h)

    def stored(self, tier: Tier, h: BlockHash, parent: BlockHash | None) -> None:
        self._append("stored", tier, None, h, parent)

    def cleared(self, tier: Tier) -> None:
        self._items.append(["cleared", tier, None, [], None, set()])

    def events(self) -> list[Event]:
        s = self._s
        out: list[Event] = []
        for kind, a, b, hashes, parents, _ in self._items:
            if kind == "removed":
                out.append(BlockRemoved(worker_id=s.worker_id, tier=a, block_hashes=hashes,
                                        dp_rank=s.dp_rank))
            elif kind == "moved":
                out.append(BlockMoved(worker_id=s.worker_id, from_tier=a, to_tier=b,
                                      block_hashes=hashes, dp_rank=s.dp_rank))
            elif kind == "stored":
                for parent, chain in chains(hashes, parents):
                    out.append(BlockStored(worker_id=s.worker_id, tier=a, block_hashes=chain,
                                           parent_hash=parent, block_size=s.block_size,
                                           hash_algo=s.hash_algo, dp_rank=s.dp_rank))
            else:
                out.append(AllBlocksCleared(worker_id=s.worker_id, tier=a, dp_rank=s.dp_rank))
        return out


def chains(hashes: Sequence[BlockHash], parents: Mapping[BlockHash, BlockHash | None]
           ) -> list[tuple[BlockHash | None, list[BlockHash]]]:
    """Cut distinct blocks into chains: ``[(parent of the first, [blocks])]``, every block once,
    a chain after the one holding its parent. Roots (a parent outside the set) go in the order
    they were given; a block with several children continues with the first, the others start
    chains of their own."""
    members = set(hashes)
    children: dict[BlockHash, list[BlockHash]] = {}
    roots: list[BlockHash] = []
    for h in hashes:
        p = parents.get(h)
        if p is not None and p in members and p != h:
            children.setdefault(p, []).append(h)
        else:
            roots.append(h)
    out: list[tuple[BlockHash | None, list[BlockHash]]] = []
    seen: set[BlockHash] = set()
    pending = [(parents.get(r), r) for r in roots]
    pending.reverse()
    while pending:
        parent, h = pending.pop()
        chain: list[BlockHash] = []
        branches: list[tuple[BlockHash, BlockHash]] = []
        while h is not None and h not in seen:
            seen.add(h)
            chain.append(h)
            kids = [k for k in children.get(h, ()) if k not in seen]
            branches.extend((h, k) for k in kids[1:])
            h = kids[0] if kids else None
        if chain:
            out.append((parent, chain))
        pending.extend(reversed(branches))
    # A cycle (impossible for real hashes) leaves blocks unvisited: each is a chain of one.
    out.extend((parents.get(h), [h]) for h in hashes if h not in seen)
    return out
