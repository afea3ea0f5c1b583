"""Hash ids for prompts built from named segments of text.

A generated prompt is a list of segments ``(key, tokens)``: a shared system prompt, a retrieved
document, this session's third user message... Equal keys mean equal text. The prompt is cut
into 512-token blocks (a Mooncake trace's hash-id granularity); a block's content is the list
of segment pieces it covers, and its hash id is given by its parent block's id and that
content. Two prompts therefore get the same hash ids exactly as far as their token prefixes
agree, block for block, and a block a segment only partly fills (a conversation's last block)
gets a new id once more text is appended to it, as a real chained prefix hash would.

Ids are numbered in the order blocks are first seen, so the same generation gives the same
ids.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from data_plane.engines.trace import MOONCAKE_BLOCK_SIZE

Segment = tuple[Hashable, int]


class BlockSpace:
    """Allocates hash ids for segment lists (one space per generated trace)."""

    def __init__(self, block_size: int = MOONCAKE_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def hash_ids(self, segments: Sequence[Segment]) -> list[int]:
        bs = self.block_size
        out: list[int] = []
        parent = -1
        pieces: list[tuple[Hashable, int, int]] = []
        room = bs
        for key, n in segments:
            off = 0
            while off < n:
                take = min(room, n - off)
                pieces.append((key, off, take))
                off += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    out.append(parent)
                    pieces, room = [], bs
        if pieces:
            out.append(self._id(parent, pieces))
        return out

    def _id(self, parent: int, pieces: list[tuple[Hashable, int, int]]) -> int:
        key = (parent, tuple(pieces))
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got

    def __len__(self) -> int:
        return len(self._ids)
