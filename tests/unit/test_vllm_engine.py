"""The vLLM engine adapter without vLLM: import guards, the kv_transfer_params parser, and
``generate``'s request mapping against a stand-in AsyncLLM. The connector is
``test_vllm_connector.py``; real vLLM runs in ``tests/vllm/``."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from data_plane.vllm import connector, engine
from data_plane.vllm.engine import (
    VLLM_MISSING,
    GenerateRequest,
    KvHandoff,
    VllmEngine,
    VllmNotInstalled,
    parse_kv_transfer_params,
)

needs_no_vllm = pytest.mark.skipif(engine.vllm_available(),
                                   reason="checks behaviour when vLLM is absent")


def test_importing_the_package_does_not_import_vllm():
    code = ("import sys, data_plane.vllm.engine, data_plane.vllm.bridge, data_plane.vllm.connector, "
            "data_plane.vllm.tier_server, data_plane.vllm.serving, "
            "data_plane.vllm.kv_events; print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@needs_no_vllm
def test_connector_class_access_says_how_to_install():
    with pytest.raises(VllmNotInstalled) as e:
        connector.SwitchyardKVConnector  # noqa: B018
    assert str(e.value) == VLLM_MISSING
    assert isinstance(e.value, ImportError)


@needs_no_vllm
def test_engine_start_says_how_to_install():
    with pytest.raises(VllmNotInstalled, match="scripts/vllm-env.sh"):
        VllmEngine.from_engine_args(model="facebook/opt-125m")


@needs_no_vllm
async def test_generate_says_how_to_install():
    eng = VllmEngine(async_llm=object())
    with pytest.raises(VllmNotInstalled):
        async for _ in eng.generate(GenerateRequest("r1", prompt=(1, 2, 3), max_tokens=4)):
            pass


def test_unknown_module_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError):
        engine.NoSuchThing  # noqa: B018


# -- kv_transfer_params ----------------------------------------------------------------------


def test_parse_plain_request_is_no_handoff():
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({}) is None
    assert parse_kv_transfer_params({"do_remote_decode": False}) is None


def test_parse_producer_side():
    assert parse_kv_transfer_params({"do_remote_decode": True, "x": 1}) == KvHandoff(
        role="producer", extra={"x": 1})


def test_parse_consumer_side_as_nixl_connector_returns_it():
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [4, 5, 6], "remote_engine_id": "eng-p0",
              "remote_request_id": "cmpl-1", "remote_host": "10.0.0.5", "remote_port": 5600,
              "tp_size": 1}
    assert parse_kv_transfer_params(params) == KvHandoff(
        role="consumer", remote_block_ids=(4, 5, 6), remote_engine_id="eng-p0",
        remote_request_id="cmpl-1", remote_host="10.0.0.5", remote_port=5600, tp_size=1)


def test_parse_consumer_with_per_group_block_ids_keeps_the_first_group():
    h = parse_kv_transfer_params({"do_remote_prefill": True, "remote_block_ids": [[1, 2], [9]],
                                  "remote_engine_id": "e", "remote_host": "h",
                                  "remote_port": 1})
    assert h is not None and h.remote_block_ids == (1, 2)


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True},
    {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e",
     "remote_host": "h"},
    {"do_remote_prefill": True, "do_remote_decode": True, "remote_block_ids": [1],
     "remote_engine_id": "e", "remote_host": "h", "remote_port": 1},
])
def test_parse_half_specified_handoff_raises(params):
    with pytest.raises(ValueError):
        parse_kv_transfer_params(params)


# -- generate() against a stand-in AsyncLLM --------------------------------------------------


class FakeAsyncLLM:
    """Streams RequestOutput-shaped deltas, as AsyncLLM.generate does with DELTA output."""

    def __init__(self, deltas):
        self.deltas = deltas
        self.calls = []

    async def generate(self, prompt, params, request_id, *, priority=0):
        self.calls.append((prompt, params, request_id, priority))
        for i, toks in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            yield SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=list(toks),
                                         finish_reason="length" if last else None)],
                finished=last, num_cached_tokens=16,
                kv_transfer_params={"remote_block_ids": [1]} if last else None)


@pytest.fixture
def fake_vllm(monkeypatch):
    """Minimal stand-ins for the vLLM names generate() uses (restored after the test)."""
    from types import ModuleType

    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    vllm.TokensPrompt = lambda **kw: dict(kw)
    sp = ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = SimpleNamespace(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)


async def test_generate_maps_request_and_streams_indexed_chunks(fake_vllm):
    """Decode worker continuing a prefill: prompt (3 tokens) + output_prefix (1 token) go in as
    the prompt; max_tokens 4 leaves 3 to generate; chunk indexes continue after the prefix."""
    llm = FakeAsyncLLM([[7], [8, 9], []])
    req = GenerateRequest("r1", prompt=(1, 2, 3), max_tokens=4, output_prefix=(6,),
                          kv_transfer_params={"do_remote_prefill": True}, priority=2)
    chunks = [c async for c in VllmEngine(llm).generate(req)]
    (prompt, params, rid, prio), = llm.calls
    assert prompt == {"prompt_token_ids": [1, 2, 3, 6]}
    assert (params.max_tokens, params.output_kind) == (3, "delta")
    assert params.extra_args == {"kv_transfer_params": {"do_remote_prefill": True}}
    assert (rid, prio) == ("r1", 2)
    assert [(c.index, c.token_ids, c.finished) for c in chunks] == [
        (1, (7,), False), (2, (8, 9), False), (4, (), True)]
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].kv_transfer_params == {"remote_block_ids": [1]}


def test_private_tmp_holds_vllm_files_while_running_and_goes_at_exit(tmp_path, monkeypatch):
    import os
    import tempfile

    from data_plane.vllm.serving import PRIVATE_TMP_PREFIX, _PrivateTmp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    # Left by a worker killed -9 (no such pid), and one of a live process (this one's parent).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / f"{PRIVATE_TMP_PREFIX}{dead}-old").mkdir()
    live = tmp_path / f"{PRIVATE_TMP_PREFIX}{os.getppid()}-other"
    live.mkdir()

    tmp = _PrivateTmp()
    path = tmp.enter()
    assert path.parent == tmp_path and path.name.startswith(f"{PRIVATE_TMP_PREFIX}{os.getpid()}-")
    assert os.environ["VLLM_RPC_BASE_PATH"] == os.environ["TMPDIR"] == tempfile.gettempdir() == str(path)
    # vLLM's IPC socket paths (<dir>/<uuid4>) under /tmp stay within the unix socket limit.
    assert len("/tmp/" + path.name) + 1 + 36 <= 107
    assert not (tmp_path / f"{PRIVATE_TMP_PREFIX}{dead}-old").exists() and live.exists()
    (path / "vllm_dist_x").write_text("rendezvous")

    tmp.exit()
    assert not path.exists()
    assert "VLLM_RPC_BASE_PATH" not in os.environ
    assert os.environ["TMPDIR"] == tempfile.gettempdir() == str(tmp_path)
    tmp.exit()  # idempotent
