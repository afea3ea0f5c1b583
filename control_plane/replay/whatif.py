"""Counterfactual replay: the recorded traffic under another router config.

Two answers, because one alone misleads:

* **Re-scored decisions** (static): every recorded decision's inputs are rebuilt exactly as
  ``verify`` does (view at ``index_position``, ledger, request) and ``decide`` runs under the
  alternative config. This says which choices change *given the state the router really had*;
  it cannot say what happens next, because the KV the alternative choices would have created
  is not in the log.
* **Closed-loop simulation**: the recorded requests (arrival times, prompt block hashes,
  prompt and output lengths) run through the one cluster simulator
  (:func:`control_plane.simulation.run_cluster`) once routed by the recorded config and once by
  the alternative. Its router decides through the live router's decision path, with its own
  prefix index fed by the simulated engines' KV events, load reports on the live interval and
  the in-flight ledger folded from what it records. Same hardware model, same requests: the
  TTFT and throughput deltas are the config's.

Avoidable prefill tokens (per decision that computes a prompt): ``(best - chosen) * block_size``
where ``best`` is the longest cached prefix (index overlap or speculative in-flight overlap, in
blocks) among the eligible candidates and ``chosen`` that of the chosen worker: prompt tokens the
chosen worker recomputes although another eligible worker held them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import msgspec
import numpy as np

from control_plane.router import Decision, NoEligibleWorker, RouterConfig, RoutingError
from control_plane.router.inputs import execute
from control_plane.simulation import Topology, run_cluster
from data_plane.engines.profiles import load_profile
from data_plane.engines.request import EngineRequest
from schemas.events import CandidateScore, RequestAdmitted
from schemas.types import RequestPhase


class ChoiceChange(msgspec.Struct, kw_only=True):
    request_id: str
    phase: str
    recorded_worker: str
    alternative_worker: str
    recorded_reason: str
    alternative_reason: str


class SimSide(msgspec.Struct, kw_only=True):
    """Summary of one simulated run (``SimulationResult.summary()`` plus prefill work)."""

    config_version: int
    mode: str
    summary: dict
    prefill_tokens_computed: int
    per_worker: dict[str, int]


class WhatIfReport(msgspec.Struct, kw_only=True):
    range_from: str
    range_to: str
    alternative: dict
    decisions: int = 0
    rescored: int = 0
    changed: int = 0
    errors: int = 0
    per_worker_recorded: dict[str, int] = {}
    per_worker_alternative: dict[str, int] = {}
    #: Prompt tokens the chosen worker recomputed although an eligible one held them.
    avoidable_prefill_tokens_recorded: int = 0
    avoidable_prefill_tokens_alternative: int = 0
    prompt_tokens: int = 0
    examples: list[ChoiceChange] = []
    simulation: dict | None = None
    notes: list[str] = []

    def summary(self) -> dict:
        out = {k: v for k, v in msgspec.to_builtins(self).items() if k not in ("examples", "simulation")}
        out["changed_pct"] = round(100 * self.changed / self.rescored, 3) if self.rescored else 0.0
        if self.simulation:
            out["simulation"] = {k: v for k, v in self.simulation.items() if k != "ttft_ms"}
        return out


def cached_blocks(row: CandidateScore) -> int:
    """Blocks of the prompt a candidate can reuse: the index overlap or the in-flight one."""
    return max(row.overlap_blocks, row.speculative_overlap)


def avoidable_tokens(rows, chosen: str, block_size: int) -> int:
    eligible = [r for r in rows if r.eligible]
    if not eligible:
        return 0
    best = max(cached_blocks(r) for r in eligible)
    mine = next((cached_blocks(r) for r in rows if r.worker_id == chosen), 0)
    return max(best - mine, 0) * block_size


@dataclass
class _SimRequest:
    request_id: str
    arrival_ms: float
    prompt_tokens: int
    hashes: tuple[int, ...]
    output_tokens: int


class WhatIf:
    """Collects re-scored decisions during a walk, then simulates both configs."""

    def __init__(self, alternative: RouterConfig, max_examples: int = 20) -> None:
        self.alt = alternative
        self.max_examples = max_examples
        self.report: WhatIfReport | None = None
        self._rec_counts: Counter = Counter()
        self._alt_counts: Counter = Counter()
        self._examples: list[ChoiceChange] = []
        self._decisions = self._rescored = self._changed = self._errors = 0
        self._avoid_rec = self._avoid_alt = self._prompt = 0
        self._base_configs: Counter = Counter()
        self._base_config_of: dict[int, RouterConfig] = {}
        self._cursors: dict[str, str] = {}

    def on_item(self, item) -> None:
        self._decisions += 1
        r = item.record.routed
        self._base_configs[r.config_version] += 1
        self._base_config_of[r.config_version] = item.config
        self._rec_counts[r.worker_id] += 1
        if item.inputs is None:
            self._errors += 1
            return
        # The alternative's own round-robin cursor, carried from its previous decision of the
        # same router incarnation (the recorded cursor belongs to the recorded config).
        router = f"{item.record.producer}@{item.record.epoch}"
        inputs = msgspec.structs.replace(item.inputs, rr_cursor=self._cursors.get(router))
        try:
            d: Decision = execute(inputs, self.alt, r.rng_seed)
        except (RoutingError, NoEligibleWorker):
            self._errors += 1
            return
        self._rescored += 1
        if d.rr_cursor is not None:
            self._cursors[router] = d.rr_cursor
        self._alt_counts[d.worker_id] += 1
        bs = item.inputs.request.block_size
        if r.phase is not RequestPhase.DECODE:
            self._prompt += item.inputs.request.prompt_tokens
            self._avoid_rec += avoidable_tokens(r.scores, r.worker_id, bs)
            self._avoid_alt += avoidable_tokens(d.scores, d.worker_id, bs)
        if d.worker_id != r.worker_id:
            self._changed += 1
            if len(self._examples) < self.max_examples:
                self._examples.append(ChoiceChange(request_id=r.request_id, phase=r.phase.value,
                                                   recorded_worker=r.worker_id, alternative_worker=d.worker_id,
                                                   recorded_reason=r.reason, alternative_reason=d.reason))

    def finish(self, walk, frm: str, to: str, *, configs, profile: str = "mocker", simulate: bool = True,
               progress=None) -> WhatIfReport:
        rep = WhatIfReport(range_from=frm, range_to=to, alternative=msgspec.to_builtins(self.alt),
                           decisions=self._decisions, rescored=self._rescored, changed=self._changed,
                           errors=self._errors, per_worker_recorded=dict(sorted(self._rec_counts.items())),
                           per_worker_alternative=dict(sorted(self._alt_counts.items())),
                           avoidable_prefill_tokens_recorded=self._avoid_rec,
                           avoidable_prefill_tokens_alternative=self._avoid_alt, prompt_tokens=self._prompt,
                           examples=self._examples)
        if simulate:
            if not self._base_configs:
                rep.notes.append("no decision in range: nothing to simulate")
            else:
                version = self._base_configs.most_common(1)[0][0]
                base = self._base_config_of[version]
                if len(self._base_configs) > 1:
                    rep.notes.append(f"range used config versions {sorted(self._base_configs)}; the baseline "
                                     f"simulation uses v{version}, the most frequent")
                rep.simulation = simulate_both(walk, base, self.alt, profile=profile, progress=progress,
                                               notes=rep.notes)
        self.report = rep
        return rep


# ----------------------------------------------------------------------------------------------
# Closed-loop simulation
# ----------------------------------------------------------------------------------------------


def sim_requests(walk) -> tuple[list[_SimRequest], int]:
    """The recorded requests of the range (admitted by a router that routed something)."""
    adms = sorted(walk.admissions.values(), key=lambda loc: loc.at_ns)
    out: list[_SimRequest] = []
    if not adms:
        return out, 0
    t0 = adms[0].at_ns
    block_size = 0
    for loc in adms:
        a: RequestAdmitted = loc.env.data
        block_size = block_size or a.block_size
        done = walk.completions.get(a.request_id)
        outn = done.env.data.output_tokens if done is not None else a.max_tokens
        out.append(_SimRequest(a.request_id, (loc.at_ns - t0) / 1e6, a.prompt_tokens, tuple(a.block_hashes),
                               max(int(outn), 1)))
    return out, block_size


def simulate_both(walk, base: RouterConfig, alt: RouterConfig, *, profile: str = "mocker", progress=None,
                  notes: list[str] | None = None) -> dict:
    """Run the recorded requests on simulated workers under ``base`` and ``alt``."""
    notes = notes if notes is not None else []
    reqs, block_size = sim_requests(walk)
    workers = sorted(w for w, st in walk.workers.items() if st.role in ("aggregated", "prefill") and st.state != "gone")
    if not reqs or not workers:
        notes.append("simulation skipped: no admitted request or no worker in the rebuilt registry")
        return {}
    roles = {walk.workers[w].role for w in workers}
    if "prefill" in roles:
        notes.append("disaggregated traffic is simulated as aggregated on the prefill workers")
    prof = load_profile(profile)
    caps = [walk.workers[w].device_capacity_blocks for w in workers if walk.workers[w].device_capacity_blocks]
    capacity = min(caps) if caps else prof.num_device_blocks
    prof = prof.replace(block_size=block_size, num_device_blocks=capacity)
    out: dict = {"profile": prof.name, "workers": workers, "device_blocks": capacity, "requests": len(reqs)}
    ttfts = {}
    topology = Topology("recorded workers", aggregated=len(workers))
    for label, cfg in (("baseline", base), ("alternative", alt)):
        ereqs = [EngineRequest(request_id=r.request_id, prompt=_Prompt(r.prompt_tokens, r.request_id),
                               max_tokens=r.output_tokens, arrival_ms=r.arrival_ms,
                               prompt_digests=[h.to_bytes(32, "big") for h in r.hashes]) for r in reqs]
        bar = progress(f"simulating {label}", None) if progress else None
        res = run_cluster(ereqs, topology, cfg, profile=prof, worker_ids=workers)
        if bar is not None:
            bar.close()
        chosen = Counter(rec.worker for rec in res.records)
        computed = sum(len(rec.request.prompt) - rec.cached_tokens for rec in res.records)
        summ = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in res.summary().items()}
        out[label] = msgspec.to_builtins(SimSide(config_version=cfg.version, mode=cfg.mode.value, summary=summ,
                                                 prefill_tokens_computed=computed, per_worker=dict(sorted(chosen.items()))))
        ttfts[label] = [rec.token_times[0] - rec.arrival_ms for rec in res.records if rec.token_times]
    b, a = out["baseline"]["summary"], out["alternative"]["summary"]
    out["delta"] = {k: _delta(b.get(k), a.get(k)) for k in
                    ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "output_tok_s", "reuse", "e2e_p99_ms")}
    out["delta"]["prefill_tokens_computed"] = (out["alternative"]["prefill_tokens_computed"]
                                               - out["baseline"]["prefill_tokens_computed"])
    out["ttft_ms"] = ttfts
    return out


def _delta(b, a):
    if b is None or a is None:
        return None
    return a - b


class _Prompt:
    """Stand-in prompt tokens (the log holds block hashes, not tokens). The engine trusts the
    given digests for the full blocks; these tokens only feed the unhashed tail and are distinct
    per request so unrelated requests never share generated blocks."""

    def __init__(self, n: int, request_id: str) -> None:
        import xxhash

        self.n = n
        self.base = 1000 + xxhash.xxh32_intdigest(request_id.encode()) % 100_000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(range(self.base, self.base + self.n)[i])
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.base + i


def ttft_cdf(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(np.asarray(values, dtype=float))
    return v, np.arange(1, len(v) + 1) / max(len(v), 1)
