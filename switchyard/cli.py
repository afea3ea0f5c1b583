"""The ``switchyard`` command. Each subcommand wires its own process; imports stay lazy so
``--help`` is instant and a command never loads what it does not use."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ops.chaos.plan import CHAOS_TTFT_SLO_MS, FAULT_KINDS, PlanConfig, Topology
from control_plane.clikit import fail, setup_logging
from ops.demo.settings import DEMO_DEFAULTS, DEMO_TRACE, WHOLE_TRACE

app = typer.Typer(
    help="Switchyard: an event-sourced control plane for disaggregated LLM inference.\n\n"
    "The Kafka log is the source of truth; every command here either runs a component that "
    "reads/writes that log, or operates the local stack around it.",
    no_args_is_help=True,
    add_completion=False,
)
stack_app = typer.Typer(help="Run the local stack: Kafka (KRaft), PostgreSQL, Redis, Prometheus, SeaweedFS (S3) as "
                             "project-local processes.",
                        no_args_is_help=True)
topics_app = typer.Typer(help="Kafka topics from the catalog (common/log/catalog.py).", no_args_is_help=True)
schemas_app = typer.Typer(help="Event schemas: export the JSON Schema files, check code and files agree.",
                          no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (figures, not tests). Each ends with one RESULT line.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(topics_app, name="topics")
app.add_typer(schemas_app, name="schemas")
app.add_typer(bench_app, name="bench")


def _register_subapps() -> None:
    """Sub-apps that live beside their components (imports stay light: typer only)."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.admin.cli import add_pin_commands, admin_app
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.metrics.cli import metrics_app
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.planner.cli import planner_app
    # lazy: CLI start-up: the command's modules load only when it runs
    from control_plane.replay.cli import replay_app
    # lazy: CLI start-up: the command's modules load only when it runs
    from workloads.cli import workload_app

    app.add_typer(metrics_app, name="metrics")
    app.add_typer(replay_app, name="replay")
    app.add_typer(admin_app, name="admin")
    add_pin_commands(planner_app)
    app.add_typer(planner_app, name="planner")
    app.add_typer(workload_app, name="workload")


_register_subapps()

ServiceOpt = Annotated[Optional[list[str]], typer.Option("--service", "-s", help="Only this service (repeatable): kafka, postgres, redis, prometheus, seaweedfs.")]


# -- stack ------------------------------------------------------------------------------------


BrokersOpt = Annotated[Optional[int], typer.Option(
    "--brokers", min=1, max=9,
    help="Kafka nodes (default 1, or SWITCHYARD_KAFKA_BROKERS). 3: a replicated KRaft cluster on one box, "
         "every node a controller and a broker on SWITCHYARD_KAFKA_PORT + 2i; topics get 3 replicas, "
         "min.insync.replicas 2.")]


def _stack_settings(brokers: int | None = None):
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.stack_settings import StackSettings

    return StackSettings.from_env(**({"kafka_brokers": brokers} if brokers else {}))


@stack_app.command("up")
def stack_up(service: ServiceOpt = None, brokers: BrokersOpt = None) -> None:
    """Start the services that are not running (idempotent), wait until each is really ready,
    and create or update the Kafka topics from the catalog."""
    setup_logging()
    import os

    # lazy: start-up time: loads msgspec, prometheus_client, switchyard_native ... only when called
    from ops.stack import Stack, StackError
    # lazy: start-up time: loads confluent_kafka only when called
    from common.log.admin import apply_topics
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    settings = _stack_settings(brokers)
    stack = Stack(settings)
    try:
        started = stack.up(service)
    except StackError as e:
        fail(str(e))
    for name, new in started.items():
        typer.echo(f"{name:10s} {'started' if new else 'already running'}")
    if not service or "kafka" in service:
        bus = BusSettings.from_env(**({} if "SWITCHYARD_KAFKA_BOOTSTRAP" in os.environ
                                      else {"bootstrap": settings.kafka_bootstrap}))
        changes = apply_topics(bus)
        n = sum(c.action != "unchanged" for c in changes)
        typer.echo(f"topics     {len(changes)} in catalog, {n} created or updated")
        for c in changes:
            if c.action == "warning":
                typer.echo(f"  warning: {c.topic}: {c.detail}")
        if settings.kafka_brokers > 1 and os.environ.get("SWITCHYARD_KAFKA_BROKERS") != str(settings.kafka_brokers):
            typer.echo(f"hint: export SWITCHYARD_KAFKA_BROKERS={settings.kafka_brokers} so that every client "
                       f"bootstraps from all brokers ({settings.kafka_bootstrap})")
    _print_status(stack)


@stack_app.command("down")
def stack_down(service: ServiceOpt = None) -> None:
    """Stop the services (data dirs are kept) and check that no process is left behind."""
    setup_logging()
    # lazy: start-up time: loads msgspec, prometheus_client, switchyard_native ... only when called
    from ops.stack import Stack

    left = Stack(_stack_settings()).down(service)
    if left:
        fail(f"processes still running after stop: {left}")
    typer.echo("stack stopped")


@stack_app.command("signing-key")
def stack_signing_key(
    owner: Annotated[str, typer.Argument(help="worker:<worker id>, role:admin or role:router.")],
    out: Annotated[Path, typer.Option("--out", help="File to write (created 0600; must not exist).")],
) -> None:
    """Write one owner's event-signing key (schemas/signing.py) for a process on a host that
    must not hold the stack's secrets: it sets SWITCHYARD_SIGNING_KEY_FILE to the file and can
    then sign only that owner's events."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings, signing_master, write_private
    # lazy: CLI start-up: the command's modules load only when it runs
    from schemas.signing import ADMIN, ROUTER, owner_key

    if not (owner.startswith("worker:") and len(owner) > 7) and owner not in (ADMIN, ROUTER):
        fail(f"owner {owner!r}: worker:<worker id>, {ADMIN} or {ROUTER}")
    key = owner_key(signing_master(BusSettings.from_env().secrets_dir), owner)
    if not write_private(out, f"{owner}\n{key.hex()}\n"):
        fail(f"{out} exists; not overwritten")
    typer.echo(f"signing key of {owner} written to {out}")


@stack_app.command("status")
def stack_status(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Show which services run, their pids, addresses and data dirs (every Kafka broker)."""
    # lazy: start-up time: loads msgspec, prometheus_client, switchyard_native ... only when called
    from ops.stack import Stack

    stack = Stack(_stack_settings())
    if as_json:
        typer.echo(json.dumps(stack.status(), indent=2))
    else:
        _print_status(stack)


def _print_status(stack) -> None:
    for st in stack.status():
        state = f"running pid {st['pid']}" if st["running"] else "stopped"
        extra = f" kafka {st['version']}" if st["service"] == "kafka" else ""
        if len(st.get("brokers", ())) > 1:
            typer.echo(f"{st['service']:10s} {'running' if st['running'] else 'not all running':18s} "
                       f"{len(st['brokers'])} brokers{extra}")
            for b in st["brokers"]:
                bstate = f"running pid {b['pid']}" if b["running"] else "stopped"
                typer.echo(f"  broker {b['node']}  {bstate:18s} {b['address']}")
            for c in st.get("controllers", ()):
                cstate = f"running pid {c['pid']}" if c["running"] else "stopped"
                typer.echo(f"  controller {c['node']}  {cstate:18s} {c['address']}")
            continue
        typer.echo(f"{st['service']:10s} {state:18s} {st['address']}{extra}")


# -- topics -----------------------------------------------------------------------------------


@topics_app.command("apply")
def topics_apply() -> None:
    """Create missing topics and update configs of existing ones (never deletes, never shrinks)."""
    setup_logging()
    # lazy: start-up time: loads confluent_kafka only when called
    from common.log.admin import apply_topics
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    for c in apply_topics(BusSettings.from_env()):
        typer.echo(f"{c.topic:28s} {c.action:20s} {c.detail}")


@topics_app.command("check-acks")
def topics_check_acks(ledgers: Annotated[list[Path], typer.Argument(help="Ack ledger files (*.acks.jsonl).")]) -> None:
    """Check the log against producers' ack ledgers (SWITCHYARD_ACK_LEDGER_DIR): every
    acknowledged event on the log once, no sequence gap a failed delivery does not explain.
    Exits 1 when a promise is broken."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.acks import check_acks, load_ledger
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.reader import KafkaLogReader
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    entries = [e for path in ledgers for e in load_ledger(path)]
    with KafkaLogReader(BusSettings.from_env().bootstrap) as reader:
        report = check_acks(reader, entries)
    typer.echo(report.summary())
    for e in report.missing[:10]:
        typer.echo(f"  missing {e.event_id} {e.topic}:{e.partition}@{e.offset} {e.producer} epoch {e.epoch} seq {e.seq}")
    for g in report.gaps[:10]:
        typer.echo(f"  gap {g.topic}:{g.partition} {g.producer} epoch {g.epoch} seqs {g.first}..{g.last}")
    for i, where in list(report.duplicates.items())[:10]:
        typer.echo(f"  duplicate {i} at {', '.join(f'{t}:{p}@{o}' for t, p, o in where)}")
    if not report.ok:
        raise typer.Exit(1)


@topics_app.command("list")
def topics_list() -> None:
    """Print the catalog: topic, partitions, key, retention, cleanup policy."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.log.catalog import Catalog
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    for topic, spec in Catalog(BusSettings.from_env().topic_prefix).all_topics().items():
        ret = "forever" if spec.retention_ms < 0 else f"{spec.retention_ms // 86_400_000}d"
        typer.echo(f"{topic:20s} p={spec.partitions:<2d} key={spec.key:14s} retention={ret:8s} "
                   f"{spec.cleanup_policy:8s} {spec.description}")


# -- schemas ----------------------------------------------------------------------------------


@schemas_app.command("export")
def schemas_export() -> None:
    """Write schemas/json/*.json from the payload types (after a deliberate schema change)."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from schemas.jsonschema import write_all

    written = write_all()
    typer.echo(f"wrote {len(written)} schema files")


@schemas_app.command("check")
def schemas_check() -> None:
    """Fail if schemas/json/ and the Python payload types disagree (run in CI)."""
    # lazy: CLI start-up: the command's modules load only when it runs
    from schemas.jsonschema import check

    problems = check()
    for p in problems:
        typer.echo(p, err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo("schema files match the payload types")


# -- router -----------------------------------------------------------------------------------


@app.command("router")
def router_cmd(
    port: Annotated[int, typer.Option(help="HTTP port of the OpenAI-compatible API.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    router_id: Annotated[Optional[str], typer.Option(help="Replica id (names its consumer group).")] = None,
    mode: Annotated[str, typer.Option(help="kv | round_robin | random | least_loaded")] = "kv",
    config: Annotated[Optional[Path], typer.Option(help="RouterConfig as JSON or TOML (weights, temperature...).")] = None,
    block_size: Annotated[int, typer.Option(help="Engine KV block size in tokens.")] = 64,
    hash_algo: Annotated[str, typer.Option(help="Prefix hash: sha256 | sha256_cbor | xxhash | xxhash_cbor.")] = "sha256",
    tokenizer: Annotated[str, typer.Option(help="'hash' (shipped) or 'hf:/path/tokenizer.json'.")] = "hash",
    snapshot_every: Annotated[float, typer.Option(help="Seconds between index checkpoints.")] = 5.0,
    busy_prefill_tokens: Annotated[int, typer.Option(help="Admission: pending prefill tokens at which a worker is busy (0: no limit).")] = 65536,
    queue_max: Annotated[int, typer.Option(help="Admission: requests that may wait at the router before 429.")] = 1024,
    queue_timeout: Annotated[float, typer.Option(help="Admission: seconds a request may wait before 503.")] = 60.0,
    max_body_bytes: Annotated[Optional[int], typer.Option(help="Largest request body (413 beyond).")] = None,
    context_tokens: Annotated[Optional[int], typer.Option(help="Model context: prompt + max_tokens must fit.")] = None,
    max_output_tokens: Annotated[Optional[int], typer.Option(help="Largest max_tokens one request may ask for.")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Token ids must be below this (the model's vocabulary).")] = None,
    worker_networks: Annotated[Optional[str], typer.Option(
        help="Comma list of networks or host names workers' endpoints may be in (default: loopback).")] = None,
    auth: Annotated[bool, typer.Option(
        "--auth/--no-auth", envvar="SWITCHYARD_ROUTER_AUTH",
        help="API keys on the generation routes (issued by the admin API: POST /router-keys). --no-auth (or "
             "SWITCHYARD_ROUTER_AUTH=0) lets anyone who reaches the port send prompts: logged loudly.")] = True,
    key_limits: Annotated[Optional[str], typer.Option(
        envvar="SWITCHYARD_ROUTER_KEY_LIMITS",
        help="shared | local: count each API key's rate and concurrency in Redis for every replica (default; "
             "a call Redis does not answer is counted by this replica alone, see "
             "switchyard_router_key_gate_fallbacks_total) or in this process only.")] = None,
    redis_url: Annotated[Optional[str], typer.Option(
        envvar="SWITCHYARD_REDIS_URL", help="Redis of the shared key limits (default: the local stack's).")] = None,
    max_connections: Annotated[int, typer.Option(help="Requests served at once (503 beyond; idle connections do not count).")] = 1024,
    request_timeout: Annotated[float, typer.Option(
        help="Seconds a connection has to send a request's headers (closed beyond).")] = 10.0,
    body_timeout: Annotated[float, typer.Option(help="Seconds a request has to send its body (408 beyond).")] = 30.0,
    events_linger_ms: Annotated[Optional[int], typer.Option(
        envvar="SWITCHYARD_ROUTER_EVENTS_LINGER_MS",
        help="linger.ms of the router's event producer (longer batches more of its request events; beyond "
             "the workers' prefill time a request's events land after theirs). Default: RouterSettings.events_linger_ms.")] = None,
    view_fetch_wait_ms: Annotated[Optional[int], typer.Option(
        envvar="SWITCHYARD_ROUTER_VIEW_FETCH_WAIT_MS",
        help="Longest the broker holds the view's fetch to fill it (fewer fetches per routed request, for "
             "up to that much staler index; 0: a fetch per record batch). Default: RouterSettings.view_fetch_wait_ms.")] = None,
) -> None:
    """Run a router replica: folds the kv and workers topics into its prefix index (from the
    newest snapshot plus the log tail) and the admin stream's API keys into its key table,
    decides KV-aware routes, records every decision, and proxies OpenAI requests (each with a
    valid key, within its limits) to the chosen workers."""
    setup_logging()
    # lazy: start-up time: loads msgspec, switchyard_native, xxhash only when called
    from control_plane.router.admission import AdmissionConfig
    # lazy: start-up time: loads confluent_kafka, msgspec, switchyard_native ... only when called
    from control_plane.router.wiring import RouterSettings, run_router
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.connection_limits import ConnectionLimits
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    kw: dict = {"router_id": router_id} if router_id else {}
    # Unset: RouterSettings' own defaults (one place for them).
    kw |= {k: v for k, v in (("events_linger_ms", events_linger_ms), ("view_fetch_wait_ms", view_fetch_wait_ms))
           if v is not None}
    if worker_networks:
        kw["worker_networks"] = tuple(n.strip() for n in worker_networks.split(",") if n.strip())
    bounds = {k: v for k, v in (("max_body_bytes", max_body_bytes), ("context_tokens", context_tokens),
                                ("max_output_tokens", max_output_tokens), ("vocab_size", vocab_size)) if v is not None}
    if body_timeout != 30.0:
        bounds["body_timeout_s"] = body_timeout
    if bounds:
        # lazy: start-up time: loads msgspec, switchyard_native, xxhash only when called
        from control_plane.router.limits import RequestLimits

        kw["limits"] = RequestLimits(**bounds)
    admission = AdmissionConfig(busy_prefill_tokens=busy_prefill_tokens, queue_max=queue_max,
                                queue_timeout_s=queue_timeout)
    run_router(RouterSettings(host=host, port=port, mode=mode, config_file=config, block_size=block_size,
                              hash_algo=hash_algo, tokenizer=tokenizer, snapshot_every_s=snapshot_every,
                              admission=admission, auth=auth, key_limits=key_limits,
                              redis_url=redis_url or _stack_redis_url(key_limits),
                              connections=ConnectionLimits(max_connections=max_connections,
                                                           request_timeout_s=request_timeout),
                              **kw),
               BusSettings.from_env(role="router"))


def _stack_redis_url(key_limits: str | None) -> str | None:
    """The local stack's Redis URL as the routers' own ACL user (confined to the routers' keys),
    unless the key limits are local (no Redis needed)."""
    if key_limits == "local":
        return None
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.stack_settings import StackSettings

    return StackSettings.from_env().redis_role_url("router")


# -- worker -----------------------------------------------------------------------------------


@app.command("worker")
def worker(
    worker_id: Annotated[str, typer.Option("--worker-id", help="Stable id across restarts (producer id, log key).")],
    role: Annotated[str, typer.Option(help="prefill | decode | aggregated: what it registers as.")] = "aggregated",
    pool: Annotated[str, typer.Option(help="Pool the planner scales it in.")] = "default",
    host: Annotated[str, typer.Option(help="HTTP bind address (published in WorkerRegistered).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port; 0 picks a free one (see the READY line).")] = 8100,
    profile: Annotated[str, typer.Option(help="Engine profile: mocker, h100_llama3_8b, or a TOML path.")] = "mocker",
    speedup: Annotated[float, typer.Option(help="Engine time runs this many times faster than the hardware.")] = 1.0,
    block_size: Annotated[Optional[int], typer.Option(help="Override the profile's tokens per block.")] = None,
    device_blocks: Annotated[Optional[int], typer.Option(help="Override the profile's device KV blocks.")] = None,
    model: Annotated[str, typer.Option(help="Model name served and registered.")] = "switchyard-sim",
    data_dir: Annotated[Path, typer.Option(help="Worker data directory (disk tier under kvbm/g3).")] = Path("worker-data"),
    host_blocks: Annotated[int, typer.Option(help="Host DRAM tier (G2) capacity in blocks.")] = 0,
    disk_blocks: Annotated[int, typer.Option(help="Disk tier (G3) capacity in blocks.")] = 0,
    disk_admission_min_uses: Annotated[int, typer.Option(
        help="Uses a block needs before it is written to disk below the host tier (1: every block).")] = 2,
    object_blocks: Annotated[Optional[int], typer.Option(help="Object tier (G4) quota in blocks; default 1,000,000 with --s3-bucket, else 0.")] = None,
    s3_endpoint: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint URL of the object tier.")] = None,
    s3_bucket: Annotated[Optional[str], typer.Option(help="Bucket of the object tier.")] = None,
    s3_credentials_file: Annotated[Optional[Path], typer.Option(
        help="AWS shared credentials file whose default profile signs the object tier's requests "
             "(the local stack's: .stack/secrets/s3-credentials); default: boto3's usual chain.")] = None,
    bytes_per_block: Annotated[int, typer.Option(help="Bytes of one KV block in every tier and on the wire.")] = 16384,
    transfer_blocks: Annotated[int, typer.Option(help="Staging slots of the NIXL region for handoffs (0: as many as the device blocks).")] = 0,
    lease_s: Annotated[float, typer.Option(help="Prefill: seconds a handoff's blocks stay held unread.")] = 30.0,
    transfer_timeout_s: Annotated[float, typer.Option(help="Deadline of one KV pull (metadata + READ).")] = 10.0,
    ack_timeout_s: Annotated[float, typer.Option(help="Longest wait for the log to acknowledge an event a response reveals (a handoff, a transfer outcome) before answering 503.")] = 10.0,
    load_interval: Annotated[float, typer.Option("--load-interval", help="Seconds between load reports.")] = 1.0,
    drain_timeout_s: Annotated[float, typer.Option(help="SIGTERM: max wait for in-flight work.")] = 30.0,
    engine: Annotated[str, typer.Option(help="sim (simulated engine) | vllm (real vLLM, in-process AsyncLLM).")] = "sim",
    vllm_model: Annotated[Optional[str], typer.Option(help="vLLM: HF model directory (default: the repo's tiny Llama).")] = None,
    vllm_load_format: Annotated[str, typer.Option(help="vLLM: dummy (random weights, no download) | auto.")] = "dummy",
    vllm_dtype: Annotated[str, typer.Option(help="vLLM: dtype.")] = "float32",
    vllm_block_size: Annotated[int, typer.Option(help="vLLM: tokens per KV block (CPU build: multiple of 32).")] = 32,
    vllm_max_model_len: Annotated[int, typer.Option(help="vLLM: max prompt + output tokens.")] = 2048,
    vllm_hash_algo: Annotated[str, typer.Option(help="vLLM: prefix-caching hash (the router must match).")] = "sha256",
    vllm_kv_connector: Annotated[Optional[str], typer.Option(help="vLLM: 'nixl' for prefill/decode over vLLM's NixlConnector, 'switchyard' for our KVBM tiers under vLLM (with --host-blocks).")] = None,
    vllm_kv_buffer_device: Annotated[str, typer.Option(help="vLLM NixlConnector buffers: cpu (CPU build) | cuda.")] = "cpu",
    vllm_cpu_kvcache_gib: Annotated[int, typer.Option(help="vLLM CPU build: GiB of KV cache.")] = 1,
    vllm_gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="vLLM on GPU hosts.")] = None,
    vllm_ucx_net_devices: Annotated[str, typer.Option(help="UCX_NET_DEVICES for NIXL ('' leaves UCX's default).")] = "lo",
    vllm_args: Annotated[Optional[str], typer.Option(help="Extra AsyncEngineArgs as a JSON object.")] = None,
    open_generation: Annotated[bool, typer.Option(
        "--open-generation", help="Benchmarks only: /v1/completions and /v1/models need no bearer, so a third-party "
                                  "router that cannot send this worker's bearer can front it (bench peers).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one worker: an engine (simulated by default, or a real vLLM with --engine vllm) +
    tiered KV block manager + NIXL region behind an OpenAI-compatible API, publishing its KV,
    request and lifecycle events to the log.

    A restart with the same --worker-id and --data-dir takes a new epoch, verifies the disk and
    object blocks the log says it holds, and reports its memory tiers empty.

    SIGTERM drains: /health turns 503, in-flight requests finish, then exit 0."""
    setup_logging(verbose)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    import json as _json

    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from data_plane.vllm.serving import TINY_MODEL_DIR, VllmEngineSettings
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from data_plane.workers.settings import WorkerConfigError, WorkerSettings
    # lazy: start-up time: loads confluent_kafka, httpx, msgspec ... only when called
    from data_plane.workers.wiring import run_worker
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.settings import BusSettings

    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(role, "kv_both")
    try:
        s3_key_id, s3_secret = _s3_credentials(s3_credentials_file) if s3_credentials_file else (None, None)
        vllm_settings = VllmEngineSettings(
            model=vllm_model or str(TINY_MODEL_DIR), load_format=vllm_load_format, dtype=vllm_dtype,
            block_size=vllm_block_size, max_model_len=vllm_max_model_len, hash_algo=vllm_hash_algo,
            kv_connector=vllm_kv_connector, kv_role=kv_role, kv_buffer_device=vllm_kv_buffer_device,
            cpu_kvcache_gib=vllm_cpu_kvcache_gib, gpu_memory_utilization=vllm_gpu_memory_utilization,
            ucx_net_devices=vllm_ucx_net_devices or None, extra_args=_json.loads(vllm_args) if vllm_args else {})
        settings = WorkerSettings(
            engine=engine, vllm=vllm_settings,
            worker_id=worker_id, role=role, pool=pool, host=host, port=port, profile=profile,
            speedup=speedup, block_size=block_size, device_blocks=device_blocks, model=model,
            open_generation=open_generation,
            data_dir=data_dir, host_blocks=host_blocks, disk_blocks=disk_blocks,
            disk_admission_min_uses=disk_admission_min_uses, object_blocks=object_blocks, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket,
            s3_access_key_id=s3_key_id, s3_secret_access_key=s3_secret,
            bytes_per_block=bytes_per_block, transfer_blocks=transfer_blocks, lease_s=lease_s,
            transfer_timeout_s=transfer_timeout_s, ack_timeout_s=ack_timeout_s, load_interval_s=load_interval,
            drain_timeout_s=drain_timeout_s)
    except (WorkerConfigError, ValueError) as e:
        fail(str(e), 2)
    # lazy: start-up time: loads msgspec, numpy, xxhash only when called
    from data_plane.kvbm.errors import StorageError

    try:
        code = run_worker(settings, BusSettings.from_env(role="worker"))
    except StorageError as e:  # a tier's backend refused it (a wrong S3 key, an unwritable data dir)
        fail(f"worker {worker_id}: a KV tier's storage failed: {e}")
    raise typer.Exit(code)


def _s3_credentials(path: Path) -> tuple[str, str]:
    """The access key id and secret key of an AWS shared credentials file's [default] profile."""
    import configparser

    parser = configparser.ConfigParser()
    try:
        with open(path) as f:
            parser.read_file(f)
        return parser["default"]["aws_access_key_id"], parser["default"]["aws_secret_access_key"]
    except (OSError, configparser.Error, KeyError) as e:
        raise ValueError(f"--s3-credentials-file {path}: no [default] aws_access_key_id and "
                         f"aws_secret_access_key ({type(e).__name__}: {e})") from None


# -- the whole system ---------------------------------------------------------------------------


@app.command("up")
def up_cmd(
    demo: Annotated[bool, typer.Option("--demo", help="Also replay a trace slice through the router and report.")] = True,
    trace: Annotated[Optional[Path], typer.Option(help="Mooncake-format trace (default: the slice shipped in traces/).")] = None,
    limit: Annotated[int, typer.Option(help="Requests of the trace to replay.")] = DEMO_DEFAULTS.limit,
    rate: Annotated[float, typer.Option(help="Arrival speed-up over the trace timestamps.")] = DEMO_DEFAULTS.rate,
    max_output: Annotated[int, typer.Option(help="Cap output tokens per request.")] = DEMO_DEFAULTS.max_output,
    speedup: Annotated[float, typer.Option(help="Engine speed-up over the mocker profile's real time (1 = model speed).")] = DEMO_DEFAULTS.speedup,
    prefill: Annotated[int, typer.Option(help="Prefill workers.")] = DEMO_DEFAULTS.prefill_workers,
    decode: Annotated[int, typer.Option(help="Decode workers.")] = DEMO_DEFAULTS.decode_workers,
    stop: Annotated[bool, typer.Option("--stop", help="Stop everything after the report.")] = DEMO_DEFAULTS.stop_after,
    engine: Annotated[str, typer.Option(help="sim (default) | vllm: real vLLM workers from .venv-vllm (NixlConnector P/D).")] = DEMO_DEFAULTS.engine,
    workload: Annotated[Optional[str], typer.Option(
        help="Replay a generated workload instead of the shipped slice: chat | agentic | rag | long-context | mixed "
             "(docs/workloads.md).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of --workload.")] = 1,
) -> None:
    """Bring the whole system up on this box: the stack (Kafka, PostgreSQL, Redis, Prometheus, SeaweedFS),
    the metrics processor, the router, the admin API, the planner and simulated prefill/decode
    workers; then replay a time-compressed trace slice through the router with a progress bar
    and print a summary plus a PNG report. `switchyard down` stops everything."""
    setup_logging()
    logging.getLogger().setLevel(logging.WARNING)
    # lazy: CLI start-up: the command's modules load only when it runs
    from ops.demo.settings import DemoSettings
    # lazy: start-up time: loads httpx, msgspec, prometheus_client ... only when called
    from ops.demo.up import run_demo
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.stack_settings import StackSettings

    if workload is not None:
        if trace is not None:
            fail("give --trace or --workload, not both", 2)
        # lazy: start-up time: loads httpx, msgspec, prometheus_client ... only when called
        from ops.demo.up import workload_trace

        try:
            trace = workload_trace(workload, seed, limit, StackSettings.from_env().state_dir)
        except (ValueError, RuntimeError) as e:
            fail(str(e), 2)
        typer.echo(f"workload {workload}:{seed}: {trace}")
    trace = trace or DEMO_TRACE
    if not trace.exists():
        fail(f"trace {trace} not found (give --trace)")
    try:
        run_demo(DemoSettings(trace=trace, limit=limit if demo else 0, rate=rate, max_output=max_output, speedup=speedup,
                              prefill_workers=prefill, decode_workers=decode, stop_after=stop, engine=engine,
                              with_admin=any(g.name == "admin" for g in app.registered_groups),
                              with_planner=any(g.name == "planner" for g in app.registered_groups)),
                 StackSettings.from_env(), echo=typer.echo)
    except RuntimeError as e:
        fail(str(e))


@app.command("down")
def down_cmd(keep_stack: Annotated[bool, typer.Option(help="Stop Switchyard's processes but keep the stack.")] = False) -> None:
    """Stop everything `switchyard up` started (workers drain first), then the stack."""
    setup_logging()
    # lazy: start-up time: loads httpx, msgspec, prometheus_client ... only when called
    from ops.demo.up import stop_demo
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.stack_settings import StackSettings

    stop_demo(StackSettings.from_env(), echo=typer.echo, stack=not keep_stack)


@app.command("security-check")
def security_check_cmd(
    router_url: Annotated[Optional[str], typer.Option(help="Router (default: the one `switchyard up` started).")] = None,
    admin_url: Annotated[Optional[str], typer.Option(help="Admin API (default: the one `switchyard up` started).")] = None,
    strict: Annotated[bool, typer.Option(help="Exit 1 if any attack went through or any server error.")] = False,
) -> None:
    """Probe the running system as an attacker on this box would: bad client input, mutations
    without a credential, unauthenticated Kafka/PostgreSQL/Redis/S3, listeners off loopback."""
    import dataclasses

    # lazy: start-up time: loads httpx only when called
    from ops.security.check import demo_targets, report, run, summary
    # lazy: CLI start-up: the command's modules load only when it runs
    from common.stack_settings import StackSettings

    t = demo_targets(StackSettings.from_env())
    t = dataclasses.replace(t, router_url=router_url or t.router_url, admin_url=admin_url or t.admin_url)
    probes = run(t)
    typer.echo(report(probes))
    s = summary(probes)
    if strict and (s["attacks_refused"] < s["attacks_tried"] or s["server_errors"] or s["nonloopback_listeners"]):
        raise typer.Exit(1)


def _console_commands() -> None:
    # lazy: CLI start-up: the command's modules load only when it runs
    from ops.demo.console_cli import console_check_cmd, doctor_cmd

    app.command("doctor")(doctor_cmd)
    app.command("console-check")(console_check_cmd)


_console_commands()


# -- load -------------------------------------------------------------------------------------


@app.command("loadgen")
def loadgen_cmd(
    trace: Annotated[Path, typer.Option(help="Mooncake-format trace (jsonl with hash_ids).")],
    url: Annotated[str, typer.Option(help="Router base URL.")] = "http://127.0.0.1:8000",
    rate: Annotated[float, typer.Option(help="Arrival speed-up over the trace's timestamps (2 = twice as fast).")] = 1.0,
    limit: Annotated[Optional[int], typer.Option(help="Only the first N lines.")] = None,
    max_output: Annotated[Optional[int], typer.Option(help="Cap output tokens per request.")] = None,
    block_size: Annotated[int, typer.Option(help="Engine block size (for prompt synthesis).")] = 64,
    png: Annotated[Optional[Path], typer.Option(help="Write a PNG report here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="SWITCHYARD_API_KEY", help="Router API key (sk-sy_...; `switchyard admin issue-router-key`).")] = None,
) -> None:
    """Replay a trace through the router's OpenAI API at its arrival times (compressed by
    --rate), streaming, with a progress bar; print TTFT/ITL percentiles, throughput and the
    prefix hit rate against the trace's ideal."""
    import asyncio

    # lazy: start-up time: loads httpx, msgspec, numpy ... only when called
    from ops.demo.loadgen import format_summary, plot, run_trace

    s = asyncio.run(run_trace(url, trace, limit=limit, speedup=rate, max_output=max_output, block_size=block_size,
                              progress=not as_json, api_key=api_key))
    if png:
        plot(s, png)
    if as_json:
        typer.echo(json.dumps({k: v for k, v in s.items() if k != "results"}, indent=2))
    else:
        typer.echo(format_summary(s))
    if s["completed"] == 0:
        raise typer.Exit(1)


# -- faults -----------------------------------------------------------------------------------


@app.command("chaos")
def chaos_cmd(
    report: Annotated[Path, typer.Option("--report", help="Directory of report.json, timeline.png, logs and ack ledgers.")] = Path(".stack/chaos"),
    seed: Annotated[int, typer.Option(help="Seed of the fault times, order and targets (same seed, same plan).")] = PlanConfig.seed,
    duration: Annotated[float, typer.Option(help="Seconds of load, overload phase included (recoveries that overrun their gap extend it).")] = PlanConfig.duration_s,
    brokers: Annotated[int, typer.Option(min=3, max=9, help="Kafka nodes of the private KRaft cluster (3 survives the loss of one).")] = Topology.brokers,
    faults: Annotated[str, typer.Option(help=f"Comma list of {', '.join(FAULT_KINDS)} ('all': every one).")] = "all",
    in_order: Annotated[bool, typer.Option("--in-order", help="Inject in the order given, evenly spaced (default: seeded order and times).")] = PlanConfig.in_order,
    rate: Annotated[float, typer.Option(help="Requests per second (open loop, Poisson arrivals).")] = 4.0,
    overload_s: Annotated[float, typer.Option(help="Seconds of the overload phase at the end (0: none).")] = PlanConfig.overload_s,
    overload_factor: Annotated[float, typer.Option(help="Arrival rate multiplier during the overload phase.")] = PlanConfig.overload_factor,
    gap: Annotated[float, typer.Option(help="Least seconds between two faults.")] = PlanConfig.gap_s,
    routers: Annotated[int, typer.Option(min=1, help="Router replicas.")] = Topology.routers,
    prefill: Annotated[int, typer.Option(min=1, help="Prefill workers.")] = Topology.prefill,
    decode: Annotated[int, typer.Option(min=1, help="Decode workers.")] = Topology.decode,
    planners: Annotated[int, typer.Option(min=0, help="Planner replicas sharing one Redis lease (planner_kill needs 2).")] = Topology.planners,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the state dir (Kafka data, worker disks) under --report.")] = False,
    ttft_slo_ms: Annotated[float, typer.Option(min=0, help="The routers' TTFT budget (RouterConfig.ttft_slo_ms, ms; 0: off).")] = CHAOS_TTFT_SLO_MS,
    max_loop_lag_ms: Annotated[float, typer.Option(min=0, help="The routers' event-loop lag limit (RouterConfig.max_loop_lag_ms, ms; 0: off).")] = 0.0,
) -> None:
    """Fault injection under load on a private system: a KRaft cluster, routers, disaggregated
    simulated workers, the metrics processor and the planner, on free ports. Each fault once
    (kill -9 / SIGSTOP), each component restarted and awaited, then an overload phase; then the
    log is checked against every producer's ack ledger, every router's view against the oracle
    fold and every admitted request for an end with a reason. Ends with one RESULT line; exits 1
    if a must-be-zero figure is not 0."""
    setup_logging()
    for noisy in ("httpx", "faust", "aiokafka", "mode"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for probe in ("switchyard.stack.rdkafka", "switchyard.chaos.rdkafka"):  # brokers down on purpose
        logging.getLogger(probe).setLevel(logging.CRITICAL)
    import signal

    # lazy: CLI start-up: the command's modules load only when it runs
    from ops.chaos.errors import ChaosError
    # lazy: CLI start-up: the command's modules load only when it runs
    from ops.chaos.plan import parse_faults
    # lazy: start-up time: loads confluent_kafka, httpx, msgspec ... only when called
    from ops.chaos.run import ChaosSettings, run_chaos

    def _terminated(signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        raise SystemExit(128 + signum)  # unwinds through run_chaos: everything it started is stopped

    signal.signal(signal.SIGTERM, _terminated)

    try:
        plan = PlanConfig(seed=seed, duration_s=duration, faults=parse_faults(faults), in_order=in_order,
                          gap_s=gap, overload_s=overload_s, overload_factor=overload_factor)
    except ValueError as e:
        fail(str(e), 2)
    if "planner_kill" in plan.faults and planners < 2:
        fail("planner_kill needs --planners 2 or more (a standby to take the lease)", 2)
    topology = Topology(brokers=brokers, routers=routers, prefill=prefill, decode=decode, planners=planners)
    settings = ChaosSettings(plan=plan, report_dir=report.resolve(), rate=rate, topology=topology, keep=keep,
                             ttft_slo_ms=ttft_slo_ms, max_loop_lag_ms=max_loop_lag_ms)
    try:
        result = run_chaos(settings, echo=typer.echo)
    except ChaosError as e:
        fail(str(e))
    for line in result.summary():
        typer.echo(line)
    typer.echo(f"report     {settings.report_dir / 'report.json'}, {settings.report_dir / 'timeline.png'}")
    typer.echo(result.result_line())
    if not result.ok:
        raise typer.Exit(1)


# -- benchmarks -------------------------------------------------------------------------------


@bench_app.command("events")
def bench_events(
    n: Annotated[int, typer.Option(help="Events per type for the in-process codec run.")] = 100_000,
    e2e: Annotated[int, typer.Option(help="Events for the produce-to-consume run through the broker.")] = 100_000,
) -> None:
    """Encode/decode throughput per event type, and produce->consume throughput and latency
    through the local broker (run `switchyard stack up` first)."""
    logging.basicConfig(level=logging.WARNING)
    # lazy: start-up time: loads confluent_kafka, msgspec, xxhash only when called
    from benchmarks.events_bench import main

    main(codec_n=n, e2e_n=e2e)


TRACE_DEFAULT = str(WHOLE_TRACE)
TraceOpt = Annotated[Path, typer.Option(help="Mooncake-format trace (jsonl with hash_ids).")]


@bench_app.command("index")
def bench_index(trace: TraceOpt = Path(TRACE_DEFAULT),
                limit: Annotated[Optional[int], typer.Option(help="Only the first N requests.")] = None,
                scale: Annotated[bool, typer.Option(help="Growth on a generated stream (workers x entries points).")] = False,
                points: Annotated[Optional[str], typer.Option(help="With --scale: WORKERSxENTRIES,... e.g. 64x1e6,8192x1e7.")] = None) -> None:
    """Our (native) prefix index vs Dynamo's RadixTree (ai-dynamo-runtime, bench group) on the
    same store/remove events and queries derived from the trace, both from wire bytes; with
    --scale, the native index's growth curve on a generated stream."""
    # lazy: start-up time: loads httpx, msgspec, prometheus_client ... only when called
    from benchmarks.index_bench import main as run

    if scale:
        run(["--scale"] + (["--points", points] if points else []))
        return
    run([str(trace)] + (["--limit", str(limit)] if limit else []))


@bench_app.command("router")
def bench_router(n: Annotated[int, typer.Option(help="Sequential HTTP requests per side.")] = 400,
                 restart: Annotated[bool, typer.Option(help="Also a router restart with 1M blocks to EXACT.")] = True,
                 ) -> None:
    """Decision latency at 8/64/256 workers for 4K and 32K prompts beside Dynamo's find_matches
    (bench group), the HTTP overhead of the router and of nginx in front of an instant worker,
    and a router restart with 1M blocks (needs `switchyard stack up`)."""
    logging.basicConfig(level=logging.WARNING)
    # lazy: start-up time: loads confluent_kafka, httpx, msgspec ... only when called
    from benchmarks.router_bench import main as run

    run(n, restart=restart)


@bench_app.command("peers")
def bench_peers(sides: Annotated[Optional[list[str]], typer.Option("--side", help="Only this side (repeatable; direct always runs): direct, ours, smg, sglang, vllmrouter, vllmrouter_rr, dynamo, nginx, pyfloor.")] = None,
                rounds: Annotated[int, typer.Option(help="Runs per side; the sides' order rotates between rounds.")] = 3,
                n: Annotated[int, typer.Option(help="Sequential requests per run.")] = 200,
                concurrent: Annotated[int, typer.Option(help="Requests per run at 32 and at 128 clients.")] = 600,
                limit: Annotated[int, typer.Option(help="Trace requests per routing-quality run.")] = 100,
                quality: Annotated[bool, typer.Option(help="Also the routing-quality runs (trace slice at 1x and 2x the demo's rate).")] = True,
                http: Annotated[bool, typer.Option(help="The HTTP runs (overhead, CPU, req/s); --no-http: routing quality only.")] = True,
                offset: Annotated[int, typer.Option(help="Routing quality on the demo trace's requests offset .. offset+limit (0: its head).")] = 0,
                rate: Annotated[Optional[list[float]], typer.Option("--rate", help="Arrival rate of the routing-quality runs (repeatable; default the demo's and 2x).")] = None,
                profile: Annotated[bool, typer.Option("--profile", help="Instead: where one request's CPU goes in our router, by stage (py-spy), with the broker's share and the floors.")] = False,
                ) -> None:
    """Ours beside smg, sglang-router, vllm-router, Dynamo's frontend and nginx, in front of the
    same simulated workers with the same string prompts: overhead, CPU per request, req/s at 32
    and 128 clients, routing quality (needs `switchyard stack up` and `bash scripts/peers-env.sh`)."""
    logging.basicConfig(level=logging.WARNING)
    if profile:
        # lazy: start-up time: loads aiohttp, confluent_kafka, httpx ... only when called
        from benchmarks.peers_profile import main as run_profile

        run_profile(n=n)
        return
    # lazy: start-up time: loads aiohttp, confluent_kafka, httpx ... only when called
    from benchmarks.peers_bench import SIDES, main as run

    run(sides or SIDES, rounds=rounds, n=n, concurrent=concurrent, limit=limit, quality=quality, http=http,
        offset=offset, rates=rate)


@bench_app.command("transfer")
def bench_transfer() -> None:
    """NIXL DRAM->DRAM READ between two processes vs a single-process memcpy."""
    # lazy: start-up time: loads msgspec, numpy only when called
    from benchmarks.transfer_bench import main as run

    run([])


@bench_app.command("engine")
def bench_engine(trace: TraceOpt = Path(TRACE_DEFAULT),
                 limit: Annotated[Optional[int], typer.Option(help="Only the first N trace lines.")] = None) -> None:
    """Our simulated engine (mocker profile) vs Dynamo's mocker on the trace: 4 aggregated
    workers, round robin, 1x arrivals. Needs the bench group: `uv run --group bench ...`."""
    # lazy: start-up time: loads httpx, msgspec, numpy ... only when called
    from benchmarks.engine_bench import main as run

    run(trace, limit)


TuneOpt = Annotated[str, typer.Option(
    help="Tune cases, family:seed,... (all:N = every family with seed N); '' with --score '': no tune/score "
         "phase (docs/workloads.md).")]
ScoreOpt = Annotated[str, typer.Option(help="Score cases (seeds disjoint from the tune cases).")]


def _cases(tune: str, score: str):
    """The --tune / --score options as case tuples (None, None when both are empty)."""
    if not tune and not score:
        return None, None
    # lazy: start-up time: loads msgspec, numpy, switchyard_native ... only when called
    from workloads.sets import check_apart, parse_cases

    try:
        t, s = parse_cases(tune), parse_cases(score)
        check_apart(t, s)
    except ValueError as e:
        fail(str(e), 2)
    return t, s


@bench_app.command("routing")
def bench_routing(trace: TraceOpt = Path(TRACE_DEFAULT),
                  limit: Annotated[Optional[int], typer.Option(help="Only the first N trace lines.")] = None,
                  tune: TuneOpt = "all:1", score: ScoreOpt = "all:2",
                  cost: Annotated[str, typer.Option(help="Our kv cost: blocks or ttft (RouterConfig.cost).")] = "blocks",
                  rate_scale: Annotated[str, typer.Option(
                      help="Load of the tune and score cases, x each family's default rate; several, "
                           "e.g. 2,1.5,1: each tuned and scored, and the RESULT adds the worst over them.")] = "2",
                  ) -> None:
    """The whole trace in virtual time through our routing decision and simulated engines, kv vs
    round_robin, 8 aggregated and 4P+4D, beside Dynamo's mocker (kv_router vs round_robin); both
    sides' prefill_load_scale picked on the tune cases and scored on the score cases first.
    Needs the bench group: `uv run --group bench ...`."""
    # lazy: start-up time: loads httpx, msgspec, numpy ... only when called
    from benchmarks.routing_bench import main as run
    # lazy: start-up time (the router package loads the decision and its native core)
    from control_plane.router import RouterConfig, RouterConfigError

    t, s = _cases(tune, score)
    try:
        config = RouterConfig(cost=cost)  # type: ignore[arg-type]
    except RouterConfigError as e:
        fail(str(e), 2)
    try:
        scales = tuple(float(x) for x in rate_scale.split(","))
    except ValueError:
        fail(f"--rate-scale {rate_scale!r}: expected numbers separated by commas", 2)
    run(trace, limit, tune=t, score=s, config=config, case_rate_scale=scales)


@bench_app.command("tiers")
def bench_tiers(trace: TraceOpt = Path(TRACE_DEFAULT),
                limit: Annotated[Optional[int], typer.Option(help="Only the first N trace lines.")] = None,
                dynamo: Annotated[bool, typer.Option(help="Also run Dynamo's mocker kv_router (bench group).")] = True,
                tune: TuneOpt = "all:1", score: ScoreOpt = "all:2") -> None:
    """What KV tiers buy: 8 aggregated workers in virtual time, device only / +host / +host+disk
    with onboarding, our kv routing, beside Dynamo's mocker kv_router at its default and an
    unbounded device cache; both sides' prefill_load_scale picked on the tune cases and scored on
    the score cases first. Needs the bench group: `uv run --group bench ...`."""
    # lazy: start-up time: loads httpx, msgspec, numpy ... only when called
    from benchmarks.tiers_bench import main as run

    t, s = _cases(tune, score)
    run(trace, limit, dynamo=dynamo, tune=t, score=s)


@bench_app.command("e2e")
def bench_e2e(trace: Annotated[Path, typer.Option(help="Mooncake-format trace (default: the demo's slice).")] = DEMO_TRACE,
              limit: Annotated[int, typer.Option(help="Requests of the trace.")] = DEMO_DEFAULTS.limit,
              rate: Annotated[float, typer.Option(help="Arrival speed-up.")] = DEMO_DEFAULTS.rate,
              repeats: Annotated[int, typer.Option(help="Rounds; the modes' order alternates.")] = 1) -> None:
    """The full stack (broker, router, disaggregated simulated workers) with kv vs round_robin
    routing on the same trace slice: TTFT, ITL, throughput, hit rate vs the ideal (needs the stack)."""
    logging.basicConfig(level=logging.WARNING)
    # lazy: start-up time: loads confluent_kafka, httpx, msgspec ... only when called
    from benchmarks.e2e_bench import main as run

    run(trace, limit, rate, repeats=repeats)


@bench_app.command("vllm")
def bench_vllm(trace: TraceOpt = Path(TRACE_DEFAULT),
               limit: Annotated[int, typer.Option(help="Requests of the trace (aggregated runs).")] = 400,
               max_output: Annotated[int, typer.Option(help="Output tokens per request.")] = 4,
               disagg_limit: Annotated[int, typer.Option(help="Requests of the disaggregated pass.")] = 60) -> None:
    """Real vLLM workers (.venv-vllm) behind the router on the trace, tokens per hash id: vLLM's
    prefix-hit rate and TTFT with kv vs round_robin routing, predicted vs vLLM-reported cached
    tokens, then one disaggregated pass over vLLM's NixlConnector (needs the stack)."""
    logging.basicConfig(level=logging.WARNING)
    # lazy: start-up time: loads confluent_kafka, httpx, msgspec ... only when called
    from benchmarks.vllm_bench import main as run

    run(trace, limit, max_output, disagg_limit=disagg_limit)


@bench_app.command("planner")
def bench_planner(trace: TraceOpt = Path(TRACE_DEFAULT),
                  fast: Annotated[bool, typer.Option(help="The smoke run: one short tune and score case.")] = False,
                  dynamo: Annotated[bool, typer.Option(help="Run Dynamo's planner beside ours.")] = True,
                  case: Annotated[str, typer.Option(help="Score one case alone, family:seed:shape "
                                                         "(e.g. chat:2:burst): no tuning, constant load or trace.")] = "") -> None:
    """Ours and Dynamo's planner, each tuned on the workloads' tune set, scored on the score set,
    the constant load and the trace in bursts (simulated workers, virtual time), against the best
    static split under each side's routing and the perfect-foresight oracle."""
    # lazy: start-up time: loads httpx, msgspec, numpy ... only when called
    from benchmarks.planner_bench import case_kwargs, fast_kwargs, main as run

    if fast:
        run(None, **fast_kwargs(), dynamo=dynamo)
    elif case:
        run(None, **case_kwargs(case), dynamo=dynamo)
    else:
        run(trace, dynamo=dynamo)


@bench_app.command("replay")
def bench_replay() -> None:
    """Events replayed per second from the broker (and a file export) into the index and load
    view, and time to reconstruct state 1M events deep (generates the log once)."""
    # lazy: start-up time: loads confluent_kafka, msgspec, switchyard_native ... only when called
    from benchmarks.replay_bench import main as run

    run([])


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
