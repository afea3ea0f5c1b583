"""Prometheus metrics of one worker, under vLLM's names so existing dashboards work unchanged,
plus ``switchyard_worker_*`` ones for what vLLM does not have (tiers, transfers, holds).

One registry per worker object (no module globals): two workers in one test process never share
counters. Gauges are set from the engine and KVBM at scrape time.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from schemas.types import Tier

#: vLLM's buckets (``vllm/v1/metrics/loggers.py``).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

#: KVBM stats keys of the offloads, as (from tier, to tier).
_OFFLOAD_KEYS = {
    "offloaded_host": ("device", "host"),
    "offloaded_disk": ("device", "disk"),
    "offloaded_object": ("device", "object"),
    "demoted_host_disk": ("host", "disk"),
    "demoted_disk_object": ("disk", "object"),
}


class WorkerMetrics:
    def __init__(self, model: str, worker_id: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        lbl = ("model_name", "engine")
        self._lv = (model, worker_id)
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine's batch.", lbl, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued (engine, or waiting for a KV transfer).",
                             lbl, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of device KV blocks in use (0..1).", lbl,
                              registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      lbl, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", lbl,
                                   registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", lbl, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Request arrival to first token.", lbl,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two output tokens.", lbl,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to last token.", lbl,
                             buckets=E2E_BUCKETS, registry=r)
        self.tier_usage = Gauge("switchyard_worker_tier_usage", "Used fraction of each KV tier.",
                                (*lbl, "tier"), registry=r)
        self.transfers = Counter("switchyard_worker_kv_transfers", "KV pulls by outcome (completed, failed).",
                                 (*lbl, "outcome"), registry=r)
        self.transfer_bytes = Counter("switchyard_worker_kv_transfer_bytes", "KV bytes pulled and verified.", lbl,
                                      registry=r)
        self.holds = Gauge("switchyard_worker_kv_holds", "Handoffs whose blocks this worker holds.", lbl, registry=r)
        self.hold_releases = Counter("switchyard_worker_kv_hold_releases", "Held handoffs freed, by reason.",
                                     (*lbl, "reason"), registry=r)
        self.kvbm_offload = Counter(
            "switchyard_worker_kvbm_offload_blocks",
            "Blocks offloaded down the KV tiers (device -> host: Dynamo's kvbm_offload_blocks_d2h; "
            "host -> disk: _h2d), by from_tier and to_tier.", (*lbl, "from_tier", "to_tier"), registry=r)
        self.kvbm_onboard = Counter(
            "switchyard_worker_kvbm_onboard_blocks",
            "Blocks onboarded up the KV tiers (to_tier device: loaded by the engine instead of "
            "recomputed, Dynamo's kvbm_onboard_blocks_h2d/_d2d; to_tier host: the KVBM's copy up "
            "on the way), by from_tier and to_tier.", (*lbl, "from_tier", "to_tier"), registry=r)
        self.kvbm_onboard_fallback = Counter(
            "switchyard_worker_kvbm_onboard_fallback_blocks",
            "Blocks the engine planned to onboard that did not load (missing, corrupt, I/O error) "
            "and recomputed instead, by reason.", (*lbl, "reason"), registry=r)
        self.kvbm_write_errors = Counter(
            "switchyard_worker_kvbm_write_errors",
            "Block writes a KV tier refused, by tier and reason (full: no space left on the tier's "
            "filesystem; storage: any other I/O error). The block is not reported in that tier.",
            (*lbl, "tier", "reason"), registry=r)
        self.kvbm_admission_refused = Counter(
            "switchyard_worker_kvbm_admission_refused",
            "Blocks a KV tier's admission filter refused (used fewer times than the tier needs, "
            "e.g. 2 for disk): dropped from the tier above instead of written, by tier.",
            (*lbl, "tier"), registry=r)
        self.kvbm_read_errors = Counter(
            "switchyard_worker_kvbm_read_errors",
            "Block reads a KV tier failed with an I/O error, by tier and reason (unavailable: the "
            "object store did not answer; storage: any other). The claim stays; the engine "
            "recomputes those blocks.", (*lbl, "tier", "reason"), registry=r)
        self.kvbm_tier_outages = Counter(
            "switchyard_worker_kvbm_tier_outages",
            "Times a KV tier stopped answering (the first unavailable reply after a success), by "
            "tier. Meanwhile its demotions are dropped and its hits recomputed.",
            (*lbl, "tier"), registry=r)
        self.kvbm_tier_skipped = Counter(
            "switchyard_worker_kvbm_tier_skipped_calls",
            "Calls to an unavailable KV tier not made (its breaker open: failed at once instead of "
            "waiting for the client's timeouts), by tier.", (*lbl, "tier"), registry=r)
        self.kvbm_tier_probes = Counter(
            "switchyard_worker_kvbm_tier_probes",
            "Calls let through to an unavailable KV tier once its backoff was over, to see whether "
            "it answers again, by tier.", (*lbl, "tier"), registry=r)
        #: Totals already counted, per (metric, labels): counters only go up by the difference.
        self._seen: dict[tuple, int] = {}
        self.staging_free = Gauge("switchyard_worker_staging_free_blocks", "Free staging slots of the NIXL region.",
                                  lbl, registry=r)

    def set_kv_moves(self, kvbm_stats: Mapping[str, int], onboarded: Mapping[Tier, int],
                     fallbacks: Mapping[str, int]) -> None:
        """Bring the block-move counters up to the KVBM's and the engine's running totals
        (read at scrape time): offloads device -> host/disk and the demotions below, onboards
        tier -> host (the KVBM's copies up) and tier -> device (the engine's loads), like
        Dynamo's ``kvbm_offload_blocks_d2h`` / ``kvbm_onboard_blocks_h2d``."""
        offloads = {(f, t): kvbm_stats.get(k, 0) for k, (f, t) in _OFFLOAD_KEYS.items()}
        onboards = {(t.value, Tier.DEVICE.value): n for t, n in onboarded.items()}
        for k, n in kvbm_stats.items():
            if k.startswith("onboarded_"):
                onboards[(k.removeprefix("onboarded_"), Tier.HOST.value)] = n
            elif k.startswith("write_errors_"):
                tier, _, reason = k.removeprefix("write_errors_").partition("_")
                self._advance(self.kvbm_write_errors, n, tier, reason)
            elif k.startswith("read_errors_"):
                tier, _, reason = k.removeprefix("read_errors_").partition("_")
                self._advance(self.kvbm_read_errors, n, tier, reason)
            elif k.startswith("unavailable_"):
                self._advance(self.kvbm_tier_outages, n, k.removeprefix("unavailable_"))
            elif k.startswith("skipped_"):
                self._advance(self.kvbm_tier_skipped, n, k.removeprefix("skipped_"))
            elif k.startswith("probes_"):
                self._advance(self.kvbm_tier_probes, n, k.removeprefix("probes_"))
            elif k.endswith("_admission_refused"):
                self._advance(self.kvbm_admission_refused, n, k.removesuffix("_admission_refused"))
        for (f, t), n in offloads.items():
            self._advance(self.kvbm_offload, n, f, t)
        for (f, t), n in onboards.items():
            self._advance(self.kvbm_onboard, n, f, t)
        for reason, n in fallbacks.items():
            self._advance(self.kvbm_onboard_fallback, n, reason)

    def _advance(self, metric, total: int, *extra: str) -> None:
        key = (id(metric), *extra)
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            self.labels(metric, *extra).inc(delta)
            self._seen[key] = total

    def labels(self, metric, *extra: str):
        return metric.labels(*self._lv, *extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)
