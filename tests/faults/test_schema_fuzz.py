"""schemathesis over the OpenAPI description, against a running gateway: no 5xx, no hang."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.faults.cluster import Cluster


@pytest.fixture(scope="module")
def fuzz_cluster() -> Iterator[Cluster]:
    c = Cluster.create(1, 1, ["--time-scale", "0.01"], gateway_env={"PREFIXGATE_DEFAULT_MAX_TOKENS": "4"})
    c.start()
    try:
        yield c
    finally:
        assert c.stop() == 0


def test_no_server_errors(fuzz_cluster: Cluster) -> None:
    schema = schemathesis.openapi.from_url(fuzz_cluster.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 6
    statuses: list[int] = []

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case: schemathesis.Case) -> None:  # type: ignore[type-arg]
            body = case.body
            limit = body.get("max_tokens") if isinstance(body, dict) else None
            if isinstance(body, dict) and isinstance(limit, int):
                body["max_tokens"] = min(limit, 8)  # keep generation short
            response = case.call_and_validate(checks=[not_a_server_error], timeout=30)
            statuses.append(response.status_code)

        run()
    # The fuzzing reached both the happy path and the validation errors.
    assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses), statuses
    assert all(s < 500 for s in statuses)
