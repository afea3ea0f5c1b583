"""A completion body's prompt of token ids read natively (control_plane/router/prompt.py) is the
same request as the general decode makes of it: the same fields, ids, hashes and worker body, and
for a body either path refuses, the same refusal. In process, no HTTP."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.router import RouterConfig
from control_plane.router.errors import InvalidRequest
from control_plane.router.protocol import CompletionRequest, completion_body, decode_body
from control_plane.router.serving import RouterApp, RouterMetrics
from control_plane.router.limits import RequestLimits, check_generation
from control_plane.router.prompt import PromptIds, block_hashes, encode_json, read_prompt_ids, tokenize_prompt
from control_plane.router.proxy import Router
from control_plane.router.view import RouterView
from control_plane.router.worker_calls import MemoryReply, MemoryWorkerCalls
from common.hashing import HashAlgo, HashConfig, hash_blocks
from common.log.sink import MemorySink
from common.tokenizer import HashTokenizer

VOCAB = 1000
CONFIG = HashConfig(HashAlgo.SHA256, 4)


def _app(config: HashConfig = CONFIG) -> RouterApp:
    router = Router(router_id="r", view=RouterView(config.hash_algo, config.block_size), producer=MemorySink(),
                    config=RouterConfig(), hash_config=config,
                    workers=MemoryWorkerCalls(lambda call: MemoryReply(200, b"")))
    return RouterApp(router=router, tokenizer=HashTokenizer(), metrics=RouterMetrics(), served_model="m",
                     health=lambda: None, limits=RequestLimits(vocab_size=VOCAB))


def _outcome(read, body: bytes):
    """What a route makes of ``body``: its fields, prompt and generation bound, or its refusal."""
    try:
        req = read(body)
        prompt = list(req.prompt) if not isinstance(req.prompt, str) else req.prompt
        fields = {f: getattr(req, f) for f in CompletionRequest.__struct_fields__ if f != "prompt"}
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            check_generation(req.prompt, req.max_tokens, RequestLimits(vocab_size=VOCAB))
        return ("ok", fields, prompt)
    except InvalidRequest as e:
        return ("refused", str(e), e.param, e.code, e.status)


_ID = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB, -1, 2**64, 0]))
_ODD = st.sampled_from(["1.0", "-0", "01", '"7"', "[1]", "true", "1e2", ""])


@st.composite
def _bodies(draw) -> bytes:
    ids = [str(i) for i in draw(st.lists(_ID, max_size=30))]
    if ids and draw(st.integers(0, 3)) == 0:
        ids[draw(st.integers(0, len(ids) - 1))] = draw(_ODD)
    sep = draw(st.sampled_from([",", ", ", " ,\n"]))
    prompt = "[" + sep.join(ids) + "]" if draw(st.integers(0, 7)) else json.dumps(draw(st.text(max_size=5)))
    extra = draw(st.sampled_from(['', ', "max_tokens": 3', ', "max_tokens": "3"', ', "best_of": 2',
                                  ', "unknown": 1', ', "user": "\\ud800"', ', "stream": true', ', "n": 1']))
    text = '{"model": "m", "prompt": ' + prompt + extra + "}"
    return (text if draw(st.integers(0, 15)) else text[:-1]).encode()


@given(_bodies())
@settings(max_examples=400, deadline=None)
def test_the_native_read_is_the_general_decode(body: bytes) -> None:
    """Property: for any body, ``completion_body`` (native prompt read when it can) and
    ``decode_body`` (the general path) give the same request (fields, prompt ids) or the same
    refusal (message, param, code, status), and the vocabulary check agrees."""
    app = _app()
    assert _outcome(lambda b: completion_body(b, app.limits.vocab_size, app.router.hash_config), body) == _outcome(
        lambda b: decode_body(CompletionRequest, b), body)


def test_a_prompt_read_natively_keeps_the_clients_bytes_and_its_hashes() -> None:
    """The worker's body carries the ids as the client wrote them; the hashes are hash_blocks'."""
    app = _app()
    body = b'{"prompt": [5, 6,\n 7, 8, 9], "max_tokens": 2}'
    req = completion_body(body, app.limits.vocab_size, app.router.hash_config)
    assert isinstance(req.prompt, PromptIds) and len(req.prompt) == 5 and req.prompt == [5, 6, 7, 8, 9]
    assert block_hashes(req.prompt, CONFIG) == hash_blocks([5, 6, 7, 8, 9], CONFIG) == req.prompt.hashes
    out = encode_json({"prompt": req.prompt, "max_tokens": 2})
    assert out == b'{"prompt":[5, 6,\n 7, 8, 9],"max_tokens":2}'
    assert msgspec.json.decode(out) == {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2}
    # Another hash configuration than the one it was read under: hashed again, the same way.
    other = HashConfig(HashAlgo.SHA256, 2)
    assert block_hashes(req.prompt, other) == hash_blocks([5, 6, 7, 8, 9], other)


@pytest.mark.parametrize("raw", [b"[1, 1000]", b"[-1]", b"[1.0]", b'["a"]', b'"text"', b"[[1, 2]]"])
def test_other_prompts_are_left_to_the_general_decode(raw: bytes) -> None:
    assert read_prompt_ids(raw, VOCAB, CONFIG) is None


def test_without_a_native_hash_the_general_decode_reads_every_prompt() -> None:
    app = _app(HashConfig(HashAlgo.SHA256_CBOR, 4))
    req = completion_body(b'{"prompt": [1, 2, 3]}', app.limits.vocab_size, app.router.hash_config)
    assert type(req.prompt) is list and req.prompt == [1, 2, 3]


@given(st.text(max_size=200).filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t)))
@settings(max_examples=200, deadline=None)
def test_a_string_prompt_tokenized_natively_is_the_tokenizers_ids(text: str) -> None:
    """Property: ``tokenize_prompt`` (tokenize and hash in one native call) gives the ids of
    ``HashTokenizer.encode_reference``, ``hash_blocks`` of them, and the worker body the
    general encoder writes for that list."""
    tok = HashTokenizer()
    ids = tok.encode_reference(text)
    got = tokenize_prompt(tok, text, CONFIG)
    assert isinstance(got, PromptIds) and len(got) == len(ids) and got == ids
    assert block_hashes(got, CONFIG) == hash_blocks(ids, CONFIG)
    assert encode_json({"prompt": got, "max_tokens": 2}) == msgspec.json.encode({"prompt": ids, "max_tokens": 2})
    limits = RequestLimits(vocab_size=tok.vocab_size)

    def checked(tokens):
        try:
            return check_generation(tokens, 2, limits)
        except InvalidRequest as e:
            return str(e)

    assert checked(got) == checked(ids)


def test_without_a_native_hash_a_string_prompt_is_a_list() -> None:
    tok = HashTokenizer()
    got = tokenize_prompt(tok, "a b, c", HashConfig(HashAlgo.SHA256_CBOR, 4))
    assert type(got) is list and got == tok.encode_reference("a b, c")
