import msgspec

from data_plane.workers.real_kv import event_params
from schemas.events import PrefillCompleted


def test_vllm_params_fit_prefill_completed_and_round_trip():
    """vLLM's kv_transfer_params (per-group block ids, nested objects) become a payload the
    schema accepts: a decoder that validates reads it back (an unvalidated one on the encode
    side would have put an undecodable record on the log)."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4, 5]],
              "remote_engine_id": "e1", "remote_request_id": "r1", "remote_host": "127.0.0.1",
              "remote_port": 5600, "tp_size": 1, "extra": {"a": 1}, "switchyard_worker_id": "vp-0"}
    ev = PrefillCompleted(request_id="r1", worker_id="vp-0", prompt_tokens=100, duration_ms=1.0,
                          kv_transfer_params=event_params(params))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(ev), type=PrefillCompleted)
    assert back.kv_transfer_params["remote_block_ids"] == [3, 4, 5]
    assert back.kv_transfer_params["extra"] == '{"a": 1}'
    assert back.kv_transfer_params["remote_port"] == 5600
    raw = PrefillCompleted(request_id="r1", worker_id="vp-0", prompt_tokens=100, duration_ms=1.0,
                           kv_transfer_params=params)
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=PrefillCompleted)
    except msgspec.ValidationError:
        pass
    else:
        raise AssertionError("the unsanitised params should not validate")
