"""schemathesis against the gateway's own /openapi.json, over HTTP, on a stack with the
fake engine: every generated request, valid by the schema or not (odd bodies, parameters,
types), gets an answer below 500."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.stack import LocalStack, StackConfig

EXAMPLES = 50  # per operation and mode: the whole run stays well under two minutes


@pytest.fixture(scope="module")
def fake_stack(launch_stack) -> Iterator[LocalStack]:
    config = StackConfig(
        port=free_port(),
        aggregated=True,
        engine="fake",
        kvcache=False,
        facilities=False,
        telemetry=False,
        worker_env={"TOKENYARD_WORKER_FAKE_STEP_S": "0.0005"},
    )
    with launch_stack(config) as stack:
        stack.wait_ready(timeout=120)
        yield stack


def no_5xx(case: schemathesis.Case) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}\n"
        f"{case.as_curl_command()}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_5xx(fake_stack, mode):
    schema = schemathesis.openapi.from_url(f"{fake_stack.gateway_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for operation in operations:
        inputs = len(operation.body) + len(operation.query) + len(operation.path_parameters)
        if mode is GenerationMode.NEGATIVE and not inputs:
            continue  # nothing to get wrong (GET /health)

        # The same examples on every run, so a failure reproduces.
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            no_5xx(case)

        check()
