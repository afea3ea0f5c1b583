"""Worker process: the simulated engine, the tiered KV block manager and the NIXL region wired
behind an OpenAI-compatible HTTP API, with every fact it produces on the log.

* :mod:`.settings` - typed settings (built from ``switchyard worker`` options).
* :mod:`.history` - the worker's own past read back from the log (epoch, persistent residency).
* :mod:`.handoff` - pure: staging slots, the ``kv_transfer_params`` both ends exchange.
* :mod:`.transfer` - the NIXL region (host pool + staging) and its notification poller.
* :mod:`.peers` - where a decode worker finds a prefill peer's NIXL metadata (log, side channel).
* :mod:`.service` - request handling (aggregated, prefill+hold, pull+decode), load, drain.
  Its parts: :mod:`.run` (a request in flight, its errors), :mod:`.publisher` (acked
  publishing), :mod:`.staging` (staging slots, holds), :mod:`.pull` (the decode side's READ),
  :mod:`.real_kv` (vLLM's connector moves the KV), :mod:`.peer_fetch` (peers as a KV tier).
* :mod:`.app` - FastAPI routes; :mod:`.wiring` - start-up sequence and main loop.

Imports stay lazy here: ``switchyard --help`` must not load NIXL or FastAPI.
"""
