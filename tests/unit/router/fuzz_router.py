"""Property-based fuzzing of the live router from its own ``/openapi.json`` (schemathesis):
valid and invalid bodies for every operation, zero 5xx, zero answers the schema does
not describe, and every schema-invalid body refused. The workers are the scripted gRPC
doubles of ``conftest.py``.

``test_router_fuzz.py`` runs this file in a fresh interpreter, as the router runs: a
library built with ``-ffast-math`` loaded earlier in the test process (the CPU attention
kernel) switches the CPU to flush subnormal floats, where hypothesis refuses to generate floats."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

EXAMPLES_PER_OPERATION = 40


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzing_the_published_schema_finds_no_5xx_and_no_violation(router, script, mode):
    schema = schemathesis.openapi.from_url(f"{router.url}/openapi.json")
    statuses: Counter[int] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    if mode == GenerationMode.NEGATIVE:  # only operations with a body can be sent invalid input
        operations = [op for op in operations if op.method.upper() == "POST"]
    for operation in operations:

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case) -> None:
            response = case.call(base_url=router.url, timeout=30)
            statuses[response.status_code] += 1
            # Schema-valid bodies may still be refused (400) for what a schema cannot say:
            # the prompt plus max_tokens over the context, min_tokens above max_tokens.
            case.validate_response(response, excluded_checks=[checks.positive_data_acceptance])

        check()
    print(f"fuzz mode={mode.value} statuses={dict(sorted(statuses.items()))}")
    assert not [s for s in statuses if s >= 500]
