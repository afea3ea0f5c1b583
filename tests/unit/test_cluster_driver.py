"""The one virtual-time cluster driver (``data_plane.engines.cluster.Cluster``): pure, no mocks.

The oracle is :class:`_OneHeap`: the cluster the driver's docstring describes, written the slow
way, one event heap popped by (time, kind, push order) and one ``EngineCore.step()`` per step.
The property tests run random clusters (aggregated and disaggregated, hand-offs, releases,
load reports, KV lag, timers, workers added late and drained) through both and compare every
record, counter and hook call, in order. The hooks decide from what they were told (and, where
allowed, from the engines), so a notification delivered out of order changes a decision.
"""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest

from data_plane.engines import Admission, EngineCore, EngineRequest, default_hash_config, load_profile
from data_plane.engines.cluster import Cluster
from data_plane.engines.hooks import HandOff, Hooks, Placement
from data_plane.engines.records import RequestRecord
from schemas.types import RequestPhase, WorkerRole

# ----------------------------------------------------------------------------------------------
# The oracle: one heap
# ----------------------------------------------------------------------------------------------

_KV, _REPORT, _ARRIVAL, _RELEASE, _BEFORE, _BOUNDARY, _AFTER = -2, -1, 0, 1, 1.5, 2, 3


class _OneHeap:
    """The reference cluster, with :class:`Cluster`'s API. A boundary: deliver the step that
    ended (notifications, then releases before the step if asked), its KV events, start the next
    step, then (disaggregated) its hand-offs in token order, then, idle and draining with
    nothing left, the worker is gone."""

    def __init__(self, profile, hooks, *, disaggregated=False, release_after_ms=0.0, release_before_step=False,
                 load_report_ms=None, kv_event_lag_ms=0.0, hash_config=None):
        self.profile, self.hooks, self.hash_config = profile, hooks, hash_config
        self.disaggregated = disaggregated
        self.release_after_ms = None if release_before_step else release_after_ms
        self.release_before_step = release_before_step
        self.load_report_ms, self.lag = load_report_ms, kv_event_lag_ms
        self.heap, self.seq = [], 0
        self.workers, self.index = [], {}
        self.records, self.ordered, self.requests = {}, [], {}
        self.steps, self.last_time, self.completed, self.total, self.now = 0, 0.0, 0, 0, 0.0

    def _push(self, t, kind, payload):
        heapq.heappush(self.heap, (t, kind, self.seq, payload))
        self.seq += 1

    def add_worker(self, wid, role=WorkerRole.AGGREGATED, *, ready_in_ms=0.0):
        core = EngineCore(self.profile, worker_id=wid, role=role, hash_config=self.hash_config)
        w = dict(id=wid, role=role, core=core, busy=False, ready=False, draining=False, gone=False)
        self.index[wid] = len(self.workers)
        self.workers.append(w)
        if ready_in_ms > 0:
            self.schedule(self.now + ready_in_ms, lambda t: self._ready(w, t), before_steps=True)
        else:
            self._ready(w, self.now)
        return core

    def _ready(self, w, t):
        if not w["gone"]:
            w["ready"] = True
            self.hooks.on_ready(w["id"], t)

    def core(self, wid):
        return self.workers[self.index[wid]]["core"]

    def has_work(self):
        return any(w["core"].has_work() for w in self.workers)

    def schedule(self, t, fn, *, before_steps=False):
        self._push(t, _BEFORE if before_steps else _AFTER, ("timer", fn))

    def place(self, wid, req, now):
        w = self.workers[self.index[wid]]
        assert w["ready"] and not w["draining"] and not w["gone"]
        w["core"].add_request(req)
        self.records[req.request_id].worker_id = wid
        if not w["busy"]:
            w["busy"] = True
            self._push(now, _BOUNDARY, (self.index[wid], None))

    def _gone_check(self, w, t):
        core = w["core"]
        if w["draining"] and not w["gone"] and not core.has_work() and not core.scheduler.held:
            w["gone"] = True
            self.hooks.on_gone(w["id"], t)

    def drain(self, wid, now):
        w = self.workers[self.index[wid]]
        if w["gone"]:
            return
        if not w["ready"]:
            w["gone"] = True
            self.hooks.on_gone(wid, now)
            return
        w["draining"] = True
        self._gone_check(w, now)

    def run(self, requests):
        reqs = sorted(requests, key=lambda r: r.arrival_ms or 0.0)
        self.total = len(reqs)
        for r in reqs:
            self._push(r.arrival_ms or 0.0, _ARRIVAL, ("arrival", r))
        if self.load_report_ms is not None:
            first = (reqs[0].arrival_ms or 0.0) if reqs else 0.0
            n = len(self.workers)
            for i in range(n):
                self._push(first + (i + 1) * self.load_report_ms / n, _REPORT, i)
        while self.heap:
            t, kind, _, payload = heapq.heappop(self.heap)
            self.now = t
            if kind == _ARRIVAL:
                r = payload[1]
                rec = RequestRecord(r.request_id, None, r.arrival_ms or 0.0, len(r.prompt), r.max_tokens)
                self.records[r.request_id] = rec
                self.ordered.append(rec)
                self.requests[r.request_id] = r
                p = self.hooks.arrive(r, t)
                if p is not None:
                    self.place(p.worker, p.request, t)
            elif kind in (_BEFORE, _AFTER):
                payload[1](t)
            elif kind == _KV:
                w, events = payload
                self.hooks.on_kv(self.workers[w]["id"], events, t)
            elif kind == _REPORT:
                w = self.workers[payload]
                if w["gone"]:
                    continue
                self.hooks.on_load_report(w["id"], w["core"].stats(), t)
                if self.completed < self.total:
                    self._push(t + self.load_report_ms, _REPORT, payload)
            elif kind == _RELEASE:
                w = self.workers[payload[0]]
                w["core"].release(payload[1])
                if not w["busy"]:
                    if w["core"].has_work():
                        w["busy"] = True
                        self._push(t, _BOUNDARY, (payload[0], None))
                    else:
                        self._gone_check(w, t)
            else:
                self._boundary(t, *payload)
        return self.ordered

    def _boundary(self, t, wi, res):
        w = self.workers[wi]
        core, wid = w["core"], w["id"]
        producer = self.disaggregated and w["role"] is WorkerRole.PREFILL
        handoffs = []
        if res is not None:
            for rid, cached in res.admitted:
                if self.records[rid].handoff_ms is None:
                    self.records[rid].cached_tokens = cached
            for tok in res.tokens:
                rec = self.records[tok.request_id]
                rec.token_times.append(t)
                if producer:
                    handoffs.append(tok)
                    continue
                if tok.index == 0:
                    self.hooks.on_first_token(wid, tok.request_id, t)
                if tok.finished:
                    rec.finished = True
                    self.completed += 1
                    self.hooks.on_complete(wid, tok.request_id, t)
            if w["role"] is WorkerRole.PREFILL:
                for rid in res.finished:
                    if self.release_before_step:
                        core.release(rid)
                    elif self.release_after_ms is not None:
                        self._push(t + self.release_after_ms, _RELEASE, (wi, rid))
            events = core.take_kv_events()
            if events:
                if self.lag > 0:
                    self._push(t + self.lag, _KV, (wi, events))
                else:
                    self.hooks.on_kv(wid, events, t)
            self.last_time = max(self.last_time, t)
        step = core.step()
        if step.num_scheduled:
            self.steps += 1
            self._push(t + step.duration_ms, _BOUNDARY, (wi, step))
        else:
            w["busy"] = False
        for tok in handoffs:
            rec = self.records[tok.request_id]
            rec.prefill_worker_id, rec.handoff_ms = wid, t
            p = self.hooks.hand_off(self.requests[tok.request_id], wid, tok.token_id, t)
            if p is HandOff.FINISHED:
                rec.finished = True
                self.completed += 1
            elif p is not None:
                self.place(p.worker, p.request, t)
        if not w["busy"]:
            self._gone_check(w, t)


# ----------------------------------------------------------------------------------------------
# Hooks that decide from what they are told, and log it all
# ----------------------------------------------------------------------------------------------


class _Scripted(Hooks):
    """Least-loaded placement from notifications (in flight, last report, KV events seen) and,
    where the driver allows, the engines; a periodic tick that reads every engine, adds a late
    worker and drains one; every call logged."""

    def __init__(self, *, entry_role, decode_style, read_engines, ticks, rng_seed, late_worker, drain):
        self.entry_role, self.decode_style, self.read_engines = entry_role, decode_style, read_engines
        self.ticks, self.late_worker, self.drain = ticks, late_worker, drain
        self.rng = random.Random(rng_seed)
        self.log: list[tuple] = []
        self.inflight, self.kv_seen, self.running, self.usable, self.pending = {}, {}, {}, {}, []
        self.cluster = None
        self.roles = {}
        self.end = 0.0
        self.tick_count = 0

    def attach(self, cluster, workers, end):
        self.cluster, self.end = cluster, end
        for wid, role in workers:
            self.roles[wid] = role
            cluster.add_worker(wid, role)
        if self.ticks:
            cluster.schedule(self.ticks, self.tick)
            cluster.schedule(self.ticks / 3, self.peek, before_steps=True)

    def _pick(self, role, now):
        best = None
        for wid, r in self.roles.items():
            if r is not role or not self.usable.get(wid):
                continue
            load = self.inflight.get(wid, 0) + self.running.get(wid, 0) + self.kv_seen.get(wid, 0) % 3
            if self.read_engines:
                st = self.cluster.core(wid).stats()
                load += st.waiting + st.free_blocks % 2
            if best is None or load < best[0]:
                best = (load, wid)
        return None if best is None else best[1]

    def _placement(self, request, role, now):
        wid = self._pick(role, now)
        if wid is None:
            self.pending.append((request, role))
            return None
        self.inflight[wid] = self.inflight.get(wid, 0) + 1
        self.log.append(("place", request.request_id, wid, now))
        return Placement(wid, request)

    def arrive(self, request, now):
        self.log.append(("arrive", request.request_id, now))
        if self.entry_role is WorkerRole.PREFILL and self.decode_style == "continue":
            request = dataclasses.replace(request, max_tokens=1, phase=RequestPhase.PREFILL)
        return self._placement(request, self.entry_role, now)

    def hand_off(self, request, worker, token, now):
        self.log.append(("hand_off", request.request_id, worker, token, now))
        self.inflight[worker] -= 1
        if self.decode_style == "continue":
            if request.max_tokens < 2:
                return HandOff.FINISHED  # its one token came from the prefill worker
            request = dataclasses.replace(request, output_prefix=(token,), phase=RequestPhase.DECODE)
        return self._placement(request, WorkerRole.DECODE, now)

    def on_first_token(self, worker, request_id, t):
        self.log.append(("first", worker, request_id, t))

    def on_complete(self, worker, request_id, t):
        self.log.append(("done", worker, request_id, t))
        self.inflight[worker] -= 1

    def on_kv(self, worker, events, t):
        self.log.append(("kv", worker, t, repr(events)))
        self.kv_seen[worker] = self.kv_seen.get(worker, 0) + len(events)

    def on_load_report(self, worker, stats, t):
        self.log.append(("report", worker, t, repr(stats)))
        self.running[worker] = stats.running + stats.waiting

    def on_ready(self, worker, t):
        self.log.append(("ready", worker, t))
        self.usable[worker] = True
        waiting, self.pending = self.pending, []
        for request, role in waiting:
            p = self._placement(request, role, t)
            if p is not None:
                self.cluster.place(p.worker, p.request, t)

    def on_gone(self, worker, t):
        self.log.append(("gone", worker, t))

    def peek(self, t):
        """A before-steps timer: the engines as they are before the instant's steps."""
        self.log.append(("peek", t, tuple(repr(self.cluster.core(w).stats()) for w in self.roles)))

    def tick(self, t):
        self.tick_count += 1
        self.log.append(("tick", t, tuple(repr(self.cluster.core(w).stats()) for w in self.roles)))
        if self.tick_count == 1 and self.late_worker:
            wid = f"late-{self.entry_role.value}"
            self.roles[wid] = self.entry_role
            self.cluster.add_worker(wid, self.entry_role, ready_in_ms=self.ticks / 2)
        usable = [w for w, r in self.roles.items() if r is self.entry_role and self.usable.get(w)]
        if self.tick_count == 2 and self.drain and len(usable) > 1:  # one stays: nothing waits forever
            wid = usable[0]
            self.usable[wid] = False
            self.log.append(("drain", wid, t))
            self.cluster.drain(wid, t)
        if (t < self.end or self.cluster.has_work()) and self.tick_count < 50:
            self.cluster.schedule(t + self.ticks, self.tick)


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def _profile(**overrides):
    """A tiny vLLM-semantics profile: small pools and budgets so preemption and waiting happen."""
    base = dict(block_size=4, num_device_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                admission=Admission.CHUNK, reuse_uncached_first=False)
    base.update(overrides)
    return load_profile("mocker").replace(name="tiny", **base)


def _req(rid, prompt, max_tokens=1, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt=list(prompt), max_tokens=max_tokens, **kw)


def _case(seed):
    """A random cluster and workload; arrivals and timers often land on the same instants."""
    rng = random.Random(seed)
    disagg = rng.random() < 0.5
    bs = rng.choice([2, 4])
    prof = _profile(block_size=bs, num_device_blocks=rng.choice([24, 48, 200]) * (4 // bs),
                    max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([16, 32, 128]),
                    admission=rng.choice([Admission.CHUNK, Admission.WHOLE_PROMPT]),
                    reuse_uncached_first=rng.random() < 0.5)
    if disagg:
        workers = [(f"p{i}", WorkerRole.PREFILL) for i in range(rng.choice([1, 2]))] + \
                  [(f"d{i}", WorkerRole.DECODE) for i in range(rng.choice([1, 2, 3]))]
    else:
        workers = [(f"w{i}", WorkerRole.AGGREGATED) for i in range(rng.choice([1, 2, 3]))]
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(1, 24))] for _ in range(3)]
    cap = prof.num_device_blocks * bs
    reqs, t = [], 0.0
    for i in range(rng.randrange(4, 16)):
        if rng.random() < 0.6:
            t += rng.choice([0.0, 1.0, 7.5, 30.0, 120.0])
        prompt = rng.choice(prefixes)[: rng.randrange(1, 24)]
        prompt += [rng.randrange(500) for _ in range(rng.randrange(0, 20))]
        max_tokens = rng.choice([1, 2, 5, 30, 90])
        prompt = prompt[: max(1, cap // 2 - max_tokens)] or [1]
        if len(prompt) + max_tokens > cap // 2:
            max_tokens = max(1, cap // 2 - len(prompt))
        reqs.append(_req(f"q{seed}-{i}", prompt, max_tokens=max_tokens, arrival_ms=t))
    opts = dict(
        disaggregated=disagg,
        release_after_ms=rng.choice([0.0, 0.0, 2.5, 40.0]),
        release_before_step=disagg and rng.random() < 0.3,
        load_report_ms=rng.choice([None, 7.5, 50.0]),
        kv_event_lag_ms=rng.choice([0.0, 0.0, 1.0, 25.0]),
    )
    ticks = rng.choice([0.0, 30.0, 60.0])  # timers on arrival-time multiples: ties
    hooks = dict(entry_role=WorkerRole.PREFILL if disagg else WorkerRole.AGGREGATED,
                 decode_style=rng.choice(["same", "continue"]), read_engines=rng.random() < 0.5, ticks=ticks,
                 rng_seed=seed, late_worker=bool(ticks) and opts["load_report_ms"] is None and rng.random() < 0.6,
                 drain=bool(ticks) and rng.random() < 0.5)
    return prof, workers, reqs, opts, hooks


def _run(cls, prof, workers, reqs, opts, hooks_kw, **extra):
    hooks = _Scripted(**hooks_kw)
    cluster = cls(prof, hooks, hash_config=default_hash_config(prof.block_size), **opts, **extra)
    hooks.attach(cluster, workers, max(r.arrival_ms for r in reqs))
    records = cluster.run(reqs)
    return hooks, cluster, records


def _same(a, b):
    (ha, ca, ra), (hb, cb, rb) = a, b
    assert [r.request_id for r in ra] == [r.request_id for r in rb]
    for x, y in zip(ra, rb):
        assert (x.worker_id, x.cached_tokens, x.finished, x.prefill_worker_id, x.handoff_ms) == \
               (y.worker_id, y.cached_tokens, y.finished, y.prefill_worker_id, y.handoff_ms), x.request_id
        assert list(x.token_times) == list(y.token_times), x.request_id
    assert (ca.steps, ca.last_time) == (cb.steps, cb.last_time)
    assert ha.log == hb.log


# ----------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(80))
def test_driver_equals_the_one_heap_loop(seed):
    """Property: on random clusters the driver (coalesced or step by step) gives the one-heap
    loop's records, step count and hook calls, call for call, in order."""
    prof, workers, reqs, opts, hooks_kw = _case(seed)
    ref = _run(_OneHeap, prof, workers, reqs, opts, hooks_kw)
    _same(_run(Cluster, prof, workers, reqs, opts, hooks_kw), ref)
    _same(_run(Cluster, prof, workers, reqs, opts, hooks_kw, coalesce=False), ref)


@pytest.mark.parametrize("seed", range(20))
def test_driver_equals_the_one_heap_loop_at_exact_ties(seed):
    """The same with every request twinned (same prompt and length, same arrival, another id):
    twin steps end at the same instants on different workers, so hand-offs, notifications and
    wake-ups tie and only the push order (what scheduled them, back in time) decides."""
    prof, workers, reqs, opts, hooks_kw = _case(5000 + seed)
    twins = []
    for r in reqs:
        twins += [r, _req(r.request_id + "-twin", list(r.prompt), max_tokens=r.max_tokens, arrival_ms=r.arrival_ms)]
    ref = _run(_OneHeap, prof, workers, twins, opts, hooks_kw)
    _same(_run(Cluster, prof, workers, twins, opts, hooks_kw), ref)


def test_the_random_clusters_exercise_every_feature():
    """The property above is not vacuous: over its seeds there are hand-offs, releases that wake a
    worker, lagged KV deliveries, reports, ticks, late workers becoming ready, and drained workers
    going away."""
    seen: dict[str, int] = {}
    for seed in range(80):
        hooks, _, records = _run(Cluster, *_case(seed))
        for entry in hooks.log:
            seen[entry[0]] = seen.get(entry[0], 0) + 1
        seen["handed_off"] = seen.get("handed_off", 0) + sum(r.handoff_ms is not None for r in records)
    for kind in ("arrive", "hand_off", "first", "done", "kv", "report", "ready", "gone", "tick", "peek", "drain"):
        assert seen.get(kind, 0) > 0, kind


# ----------------------------------------------------------------------------------------------
# Worked examples
# ----------------------------------------------------------------------------------------------


class _ToFirst(Hooks):
    """Arrivals to the first ready worker of ``entry``, hand-offs to ``decode``; logs notifications."""

    def __init__(self, entry, decode=None):
        self.entry, self.decode, self.log = entry, decode, []

    def arrive(self, request, now):
        return Placement(self.entry, request)

    def hand_off(self, request, worker, token, now):
        self.log.append(("hand_off", request.request_id, worker, now))
        return Placement(self.decode, request)

    def on_complete(self, worker, request_id, t):
        self.log.append(("done", worker, request_id, t))

    def on_load_report(self, worker, stats, t):
        self.log.append(("report", worker, t))

    def on_gone(self, worker, t):
        self.log.append(("gone", worker, t))


def test_hand_off_at_the_prefill_steps_end_and_blocks_freed_then():
    """Prefill worker, 8 blocks of 4 tokens: A (20 tokens) takes 5 blocks; its prompt is one
    step (budget 32), whose end is the hand-off: the decode worker gets A then (its first step
    starts at that instant), and the prefill worker frees A's 5 blocks at that instant too, so B
    (16 tokens = 4 blocks, arriving during A's step) runs right after, not later."""
    prof = _profile(num_device_blocks=8)
    hooks = _ToFirst("p", "d")
    c = Cluster(prof, hooks, hash_config=default_hash_config(4), disaggregated=True)
    p = c.add_worker("p", WorkerRole.PREFILL)
    c.add_worker("d", WorkerRole.DECODE)
    a, b = c.run([_req("A", range(20), max_tokens=4, arrival_ms=0.0), _req("B", range(100, 116), arrival_ms=1.0)])
    handoff = a.token_times[0]
    assert a.handoff_ms == handoff and a.prefill_worker_id == "p" and a.worker_id == "d"
    assert hooks.log[0] == ("hand_off", "A", "p", handoff)
    assert len(a.token_times) == 1 + 4  # the prefill token, then the decode worker's 4
    assert a.token_times[1] > handoff
    assert b.token_times[0] == pytest.approx(handoff + prof.timing.prefill_ms(16))
    assert p.pool.num_free_blocks == 8


def test_late_worker_takes_nothing_before_it_is_ready_and_a_drained_one_goes():
    """Worker w0 from the start; w1 added by a timer at 50 ms with a 100 ms start-up: placing on
    it before 150 ms is refused; after, it serves. Draining w0 at 400 ms: it finishes what it
    has, then it is gone (on_gone), and nothing more can go to it."""
    prof = _profile()

    class Late(_ToFirst):
        def arrive(self, request, now):
            return Placement("w1" if now >= 150.0 else "w0", request)

        def on_ready(self, worker, t):
            self.log.append(("ready", worker, t))

    hooks = Late("w0")
    c = Cluster(prof, hooks, hash_config=default_hash_config(4))
    c.add_worker("w0")
    c.schedule(50.0, lambda t: c.add_worker("w1", ready_in_ms=100.0))
    c.schedule(400.0, lambda t: c.drain("w0", t))
    reqs = [_req(f"r{i}", range(i, i + 10), max_tokens=30, arrival_ms=80.0 * i) for i in range(8)]
    records = c.run(reqs)
    assert [r.worker_id for r in records] == ["w0", "w0", "w1", "w1", "w1", "w1", "w1", "w1"]
    assert ("ready", "w1", 150.0) in hooks.log
    gone = [e for e in hooks.log if e[0] == "gone"]
    assert gone == [("gone", "w0", gone[0][2])] and gone[0][2] >= 400.0
    last_w0 = max(r.token_times[-1] for r in records if r.worker_id == "w0")
    assert gone[0][2] == (last_w0 if last_w0 > 400.0 else 400.0)

    early = Cluster(prof, Late("w0"), hash_config=default_hash_config(4))
    early.add_worker("w0")
    early.add_worker("w1", ready_in_ms=1e9)
    with pytest.raises(ValueError, match="not ready"):
        early.run([_req("x", range(5), arrival_ms=200.0)])


def test_load_reports_run_while_a_request_is_unfinished():
    """Two workers reporting every 100 ms, staggered: worker i first at 0 + (i + 1) * 100 / 2
    (50, 100), then every 100 ms while a request is unfinished; each worker's last report is
    its first one after the last completion (it was scheduled while one was running)."""
    prof = _profile()
    hooks = _ToFirst("w0")
    c = Cluster(prof, hooks, hash_config=default_hash_config(4), load_report_ms=100.0)
    c.add_worker("w0")
    c.add_worker("w1")
    (rec,) = c.run([_req("A", range(10), max_tokens=60, arrival_ms=0.0)])
    end = rec.token_times[-1]
    for w, first in (("w0", 50.0), ("w1", 100.0)):
        times = [e[2] for e in hooks.log if e[0] == "report" and e[1] == w]
        assert times[0] == first and all(b - a == pytest.approx(100.0) for a, b in zip(times, times[1:]))
        assert times[-2] <= end < times[-1]
