"""The doctor: does the router's view of the fleet match what the workers hold and how they
were configured? The checks are pure (:func:`diagnose`); :func:`gather` reads the inputs (the
admin store's worker registry, the prefix index folded from the log, each live worker's own
``/debug/state``), and both the console's Doctor page and ``switchyard doctor`` (through
``GET /doctor``) print the same report.

Checks, each mismatch with what to change:

* block size and hash algorithm (+ seed: the wire ``hash_algo`` carries a fingerprint of a
  non-default ``PYTHONHASHSEED``) of every registered worker against the index's;
* tier names a worker registers capacity for, against the tiers the index knows;
* incarnation: the epoch a worker answers with against the newest one in the log (a worker that
  publishes to another topic prefix, or whose registration never reached this log, differs);
* agreement: per worker and tier, the blocks the index holds for it against the blocks it
  reports holding (Jaccard: both / either); below ``min_agreement`` is a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.settings import worker_token
from schemas.types import TIER_ORDER

#: Below this share of blocks in common a worker's index entry counts as drifted. Events in
#: flight between the fold and the worker's answer keep a healthy worker a little under 1.
MIN_AGREEMENT = 0.9


@dataclass(frozen=True)
class Expected:
    block_size: int
    hash_algo: str
    topic_prefix: str
    tiers: tuple[str, ...] = tuple(t.value for t in TIER_ORDER)


@dataclass(frozen=True)
class RegisteredWorker:
    """A worker's newest registration as the log holds it."""

    worker_id: str
    epoch: int
    state: str
    endpoint: str
    block_size: int
    hash_algo: str
    capacity: dict[str, Any]


@dataclass(frozen=True)
class Actual:
    """What a worker answered (``/debug/state``), or why it did not."""

    epoch: int | None = None
    blocks: dict[str, frozenset[int]] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class Mismatch:
    worker_id: str
    check: str
    found: str
    expected: str
    fix: str


@dataclass
class WorkerAgreement:
    worker_id: str
    #: tier -> (in both, index only, worker only)
    tiers: dict[str, tuple[int, int, int]]
    agreement: float | None
    note: str = ""


@dataclass
class DoctorReport:
    expected: Expected
    mismatches: list[Mismatch]
    agreement: list[WorkerAgreement]
    checked_workers: int

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "expected": asdict(self.expected), "checked_workers": self.checked_workers,
                "mismatches": [asdict(m) for m in self.mismatches],
                "agreement": [asdict(a) for a in self.agreement]}


def _jaccard(index: frozenset[int], actual: frozenset[int]) -> tuple[int, int, int]:
    both = len(index & actual)
    return both, len(index) - both, len(actual) - both


def diagnose(expected: Expected, workers: list[RegisteredWorker], index: dict[str, dict[str, frozenset[int]]],
             actual: dict[str, Actual], min_agreement: float = MIN_AGREEMENT) -> DoctorReport:
    """The report. ``index``: worker -> tier -> hashes the router's index holds; ``actual``:
    worker -> what it answered (workers absent from it were not asked: not ready)."""
    out: list[Mismatch] = []
    agree: list[WorkerAgreement] = []
    for w in sorted(workers, key=lambda w: w.worker_id):
        if w.state in ("gone", "unregistered"):
            continue
        if w.block_size and w.block_size != expected.block_size:
            out.append(Mismatch(w.worker_id, "block_size", str(w.block_size), str(expected.block_size),
                                f"restart {w.worker_id} with --block-size {expected.block_size} (or run every router with "
                                f"--block-size {w.block_size} and the admin API with SWITCHYARD_ADMIN_BLOCK_SIZE="
                                f"{w.block_size}): the index drops every KV event of another block size"))
        if w.hash_algo and w.hash_algo != expected.hash_algo:
            out.append(Mismatch(w.worker_id, "hash_algo", w.hash_algo, expected.hash_algo,
                                f"run {w.worker_id}'s engine with --prefix-caching-hash-algo "
                                f"{expected.hash_algo.split('@')[0]} and the same PYTHONHASHSEED as the router "
                                "(a '@' suffix is the fingerprint of a non-default seed), or run the routers with --hash-algo and the "
                                "admin API with SWITCHYARD_ADMIN_HASH_ALGO set to the worker's: its hashes never match"))
        unknown = sorted(set(w.capacity) - set(expected.tiers))
        if unknown:
            out.append(Mismatch(w.worker_id, "tier_names", ", ".join(unknown), ", ".join(expected.tiers),
                                f"rename {w.worker_id}'s tiers to the index's ({', '.join(expected.tiers)}): blocks "
                                "in a tier the index does not know are never counted"))
        a = actual.get(w.worker_id)
        if a is None:
            continue
        if a.error:
            out.append(Mismatch(w.worker_id, "reachable", a.error, f"{w.endpoint} answering",
                                f"check that {w.worker_id} runs at {w.endpoint}, or drain it (POST /workers/{w.worker_id}/drain)"))
            continue
        if a.epoch is not None and a.epoch != w.epoch:
            out.append(Mismatch(w.worker_id, "topic_prefix", f"epoch {a.epoch} answering",
                                f"epoch {w.epoch} in topic prefix {expected.topic_prefix!r}",
                                f"start {w.worker_id} with SWITCHYARD_TOPIC_PREFIX={expected.topic_prefix} (the "
                                "incarnation it runs never registered in this log)"))
            continue
        held = index.get(w.worker_id, {})
        tiers = {}
        both = either = 0
        for tier in sorted(set(held) | set(a.blocks)):
            b, i_only, a_only = _jaccard(held.get(tier, frozenset()), a.blocks.get(tier, frozenset()))
            tiers[tier] = (b, i_only, a_only)
            both += b
            either += b + i_only + a_only
        score = 1.0 if either == 0 else both / either
        agree.append(WorkerAgreement(w.worker_id, tiers, score))
        if score < min_agreement:
            out.append(Mismatch(w.worker_id, "index_agreement", f"{score:.0%} of blocks in common",
                                f">= {min_agreement:.0%}",
                                f"the router's index has drifted from {w.worker_id}'s cache: check the worker's KV "
                                "event publishing (dead-letter topic, producer errors in its log) and the "
                                "router's consumer lag; restarting the worker re-registers and clears its entry"))
    return DoctorReport(expected=expected, mismatches=out, agreement=agree, checked_workers=len(agree))


def actual_from_debug_state(body: dict[str, Any]) -> Actual:
    """A worker's ``/debug/state``: device hashes plus its other tiers."""
    blocks = {"device": frozenset(int(h) for h in body.get("device_cached", []))}
    for tier, hs in (body.get("tiers") or {}).items():
        blocks[tier] = frozenset(int(h) for h in hs)
    return Actual(epoch=body.get("epoch"), blocks={t: b for t, b in blocks.items() if b})


def index_residency(view) -> dict[str, dict[str, frozenset[int]]]:
    """worker -> tier -> hashes of the index (all dp ranks of a worker together)."""
    out: dict[str, dict[str, frozenset[int]]] = {}
    for (wid, _rank, tier), hashes in view.index.as_dict()["residency"].items():
        d = out.setdefault(wid, {})
        d[tier] = d.get(tier, frozenset()) | hashes
    return out


def gather(workers: list[RegisteredWorker], live, fetch: Callable[[RegisteredWorker], Actual]):
    """The index's residency, then each ready worker's answer (the index first: blocks a worker
    stores after the fold are the small drift ``MIN_AGREEMENT`` allows)."""
    with live.read() as view:
        index = index_residency(view)
        expected_algo, expected_bs = view.hash_algo, view.block_size
    ready = [w for w in workers if w.state == "ready"]
    if not ready:
        return index, {}, expected_algo, expected_bs
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(ready), 16)) as pool:  # one slow worker must not add up
        actual = dict(zip((w.worker_id for w in ready), pool.map(fetch, ready)))
    return index, actual, expected_algo, expected_bs


def http_fetcher(secret: str, timeout_s: float = 3.0) -> Callable[[RegisteredWorker], Actual]:
    """Reads each worker's ``/debug/state`` with that worker's own bearer, derived from the
    cluster's worker ``secret`` (:func:`common.settings.worker_token`)."""
    import httpx

    def fetch(w: RegisteredWorker) -> Actual:
        try:
            r = httpx.get(f"{w.endpoint.rstrip('/')}/debug/state", timeout=timeout_s,
                          headers={"Authorization": f"Bearer {worker_token(secret, w.worker_id)}"})
        except httpx.HTTPError as e:
            return Actual(error=f"{type(e).__name__}: {e}"[:200])
        if r.status_code != 200:
            return Actual(error=f"/debug/state answered {r.status_code}")
        return actual_from_debug_state(r.json())

    return fetch
