"""Schemathesis against the running ingress's own OpenAPI document.

Every operation gets schema-valid and schema-violating cases (fixed seed).
Pass: no 5xx at all, and every 4xx is an OpenAI-style error object. Failures
are collected rather than raised inside Hypothesis so one bad endpoint shows
all its cases at once and no time goes into shrinking.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import ADMIN_TOKEN, deploy_app, null_config

CASES_PER_OPERATION_AND_MODE = 150
MIN_CASES = 1000


@pytest.fixture(scope="module")
def fuzz_app(serve_session):
    deploy_app(null_config("fuzz", num_tokens=4), name="fuzz", route_prefix="/fuzz")
    base = serve_session["base"] + "/fuzz"
    yield {"base": base, "schema": schemathesis.openapi.from_url(base + "/openapi.json")}
    from ray import serve

    serve.delete("fuzz")  # the session's Ray has 8 CPUs for every module's apps


def _openai_error(body: bytes) -> str | None:
    """None when the body is {"error": {"message": str, "type": str, ...}}; else what is wrong."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:120]!r}"
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return f"no error object: {str(doc)[:120]}"
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"error object without message/type: {err}"
    return None


def test_generated_requests_never_get_5xx_and_4xx_are_openai_errors(fuzz_app):
    schema = fuzz_app["schema"]
    operations = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= paths, paths

    seen: list[tuple[str, int]] = []
    bad: list[str] = []
    # half the cases carry the admin token so admin routes are exercised past 401
    headers_by_turn = [{}, {"Authorization": f"Bearer {ADMIN_TOKEN}"}]

    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=CASES_PER_OPERATION_AND_MODE, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                headers = headers_by_turn[len(seen) % 2]
                if isinstance(case.body, dict) and "model" in case.body and len(seen) % 3:
                    # random model names stop at 404; most cases should reach the deeper checks
                    case.body["model"] = "fuzz"
                r = case.call(base_url=fuzz_app["base"], headers=headers, timeout=30)
                seen.append((op.label, r.status_code))
                where = f"{op.label} [{mode.value}] -> {r.status_code}"
                if r.status_code >= 500:
                    bad.append(f"{where}: {r.content[:200]!r} (body sent: {str(case.body)[:200]})")
                elif r.status_code >= 400:
                    problem = _openai_error(r.content)
                    if problem:
                        bad.append(f"{where}: {problem}")

            try:
                run()
            except Unsatisfiable:
                # an operation with no inputs has no schema-violating variant
                assert mode is GenerationMode.NEGATIVE, op.label

    assert not bad, f"{len(bad)} bad responses of {len(seen)}:\n" + "\n".join(bad[:20])
    assert len(seen) >= MIN_CASES, f"only {len(seen)} cases generated"
    codes = {c for _, c in seen}
    print({c: sum(1 for _, x in seen if x == c) for c in sorted(codes)})
    # the run must have reached both the success path and the validation path
    assert 200 in codes and 400 in codes, codes
