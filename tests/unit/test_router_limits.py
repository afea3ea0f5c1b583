"""The router's input bounds (control_plane/router/limits.py): pure, no HTTP."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from control_plane.router.errors import InvalidRequest
from control_plane.router.limits import RequestLimits, check_client_id, check_generation, new_request_id


def _limits(**overrides) -> RequestLimits:
    return RequestLimits(**{"context_tokens": 100, "max_output_tokens": 20, "vocab_size": 50,
                            "default_max_tokens": 16, **overrides})


def test_a_prompt_within_every_bound_runs_with_its_max_tokens_or_the_default() -> None:
    """80 prompt tokens + 20 = 100 = the context: fits exactly. No max_tokens: the default 16."""
    assert check_generation([0, 49] * 40, 20, _limits()) == 20
    assert check_generation([1, 2, 3], None, _limits()) == 16


@pytest.mark.parametrize(("tokens", "max_tokens", "code", "param"), [
    ([], 5, "empty_prompt", "prompt"),
    ([1], 0, "invalid_value", "max_tokens"),
    ([1], -1, "invalid_value", "max_tokens"),
    ([1], 21, "max_tokens_exceeded", "max_tokens"),
    ([1, 50], 5, "invalid_token_id", "prompt"),  # the vocabulary is [0, 50)
    ([-1, 1], 5, "invalid_token_id", "prompt"),
    ([1, 2**64], 5, "invalid_token_id", "prompt"),
    ([1] * 81, 20, "context_length_exceeded", "max_tokens"),  # 81 + 20 = 101 > 100: shorten the output
    ([1] * 100, 1, "context_length_exceeded", "prompt"),  # the prompt alone fills the context
])
def test_a_request_outside_a_bound_is_refused_naming_the_parameter(tokens, max_tokens, code, param) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_generation(tokens, max_tokens, _limits())
    assert (refused.value.code, refused.value.param, refused.value.status) == (code, param, 400)


def test_the_parameter_named_is_the_one_the_client_sent() -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_generation([1], -1, _limits(), "max_completion_tokens")
    assert refused.value.param == "max_completion_tokens" and "max_completion_tokens" in str(refused.value)


@pytest.mark.parametrize("overrides", [{"context_tokens": 0}, {"vocab_size": True},
                                       {"default_max_tokens": 21}, {"max_output_tokens": 100}])
def test_inconsistent_limits_are_refused_at_start_up(overrides) -> None:
    with pytest.raises(ValueError):
        _limits(**overrides)


def test_a_client_id_is_printable_ascii_of_bounded_length() -> None:
    lim = _limits(max_client_id_chars=8)
    assert check_client_id("job-7 a", lim) == "job-7 a" and check_client_id(None, lim) is None
    for bad in ("a\nb", "é", "x" * 9, 5):
        with pytest.raises(InvalidRequest):
            check_client_id(bad, lim)


def test_server_ids_are_fresh_and_openai_shaped() -> None:
    ids = {new_request_id("completions") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("cmpl-") for i in ids)
    assert new_request_id("chat").startswith("chatcmpl-")


@given(st.lists(st.one_of(st.integers(-3, 53), st.integers(), st.booleans()), min_size=1, max_size=40))
def test_the_vocabulary_check_refuses_exactly_the_ids_min_and_max_find(tokens: list) -> None:
    """The one-pass check in C gives the verdict and the message of the rule it replaces: the
    smallest id if it is negative, else the largest if it is past the vocabulary."""
    low, high = min(tokens), max(tokens)
    bad = low if low < 0 else high if high >= 50 else None
    try:
        check_generation(tokens, 1, _limits(context_tokens=10_000))
    except InvalidRequest as e:
        assert (e.code, str(e)) == ("invalid_token_id", f"token id {bad} is outside the model's vocabulary [0, 50)")
    else:
        assert bad is None
