"""vLLM integration: its KV cache events translated into ours, and an engine adapter.

* :mod:`data_plane.vllm.kv_events`: pure decoding of vLLM's KV event batches (every wire form
  we know of) and translation into :mod:`schemas.events` payloads. No I/O.
* :mod:`data_plane.vllm.bridge`: :class:`~data_plane.vllm.bridge.KvEventBridge`, the ZMQ
  subscriber that feeds a running vLLM's events into an :class:`~common.log.sink.EventSink`,
  with gap detection, replay and resync.
* :mod:`data_plane.vllm.engine`: the AsyncLLM wrapper and KV connector skeleton. vLLM is an
  optional extra (CUDA only); nothing here imports it at module import time.
"""
