"""One schemathesis loop for every API we fuzz (the admin API, the router's OpenAI API)."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable


def run_schemathesis(schema, checks: list, *, call: Callable | None = None, default_examples: int = 10,
                     **call_kwargs) -> tuple[list[str], collections.Counter]:
    """Every operation of ``schema``, with bodies and parameters valid and invalid by it
    (``SY_SCHEMATHESIS_EXAMPLES`` each, else ``default_examples``), each answer run through
    ``checks``; ``call(response)`` runs on every answer too. Returns (failures, answers seen
    by (method, path, status))."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    examples = int(os.environ.get("SY_SCHEMATHESIS_EXAMPLES", str(default_examples)))
    failures: list[str] = []
    seen: collections.Counter = collections.Counter()
    for op in schema.get_all_operations():
        operation = op.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                r = case.call_and_validate(checks=checks, **call_kwargs)
                if call is not None:
                    call(r)
                seen[(operation.method.upper(), operation.path, r.status_code)] += 1

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode is GenerationMode.NEGATIVE
            except (Exception, BaseExceptionGroup) as e:  # collect, report all at the end
                failures.append(f"{mode.value} {operation.method.upper()} {operation.path}: {str(e)[:1500]}")
    return failures, seen
