"""schemathesis against the app's own OpenAPI schema: for every operation, a bounded number of
generated requests (derandomized, so a run is reproducible) must get no 5xx and no response
that breaks the schema (status documented, content type, body schema, documented headers).
The app runs with its lifespan (real Redis) inside schemathesis's ASGI client."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hyp_settings
from schemathesis.checks import not_a_server_error
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from dtq.api import create_app
from dtq.config import Settings
from support.api import api_settings

EXAMPLES_PER_OPERATION = 30

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.mark.timeout(120)
def test_generated_requests_get_no_5xx_and_conform_to_the_schema(settings: Settings) -> None:
    app = create_app(api_settings(settings))
    failures: list[str] = []
    operations = 0
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        for result in schema.get_all_operations():
            operation = result.ok()
            operations += 1

            @given(case=operation.as_strategy())
            @hyp_settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def exercise(case: schemathesis.Case) -> None:
                case.call_and_validate(checks=CHECKS)

            try:
                exercise()
            except (Exception, BaseExceptionGroup) as exc:  # schemathesis's FailureGroup
                failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    finally:
        shutdown_lifespans()
    assert operations >= 20, f"only {operations} operations in the schema"
    assert not failures, "\n\n".join(failures)
