"""Property-based fuzz of the server's OpenAPI schema (schemathesis): no input gives a 5xx.

Excluded, because they block by design until a peer shows up: ``/pause`` (holds every later
generate until ``/resume``) and the weight-transfer endpoints that wait for a trainer
(``/weights/init``, ``/weights/update``, ``/weights/bucket``); their validation is covered by
``test_http_api.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.remote

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

BLOCKING = {"/pause", "/weights/init", "/weights/update", "/weights/bucket"}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    """A server whose work per request is bounded (64-token context, 8 sequences per request), so
    that random but valid requests (max_tokens=10**9, n=100) answer in well under a second."""
    import rollout_engines as roe

    from .conftest import start_thread_server

    engine = roe.create_engine("transformers", model=str(tiny_model), max_model_len=64)
    server = start_thread_server(engine, max_body_bytes=256 * 1024, max_sequences=8)
    yield server
    server.stop()


def test_fuzz_openapi_no_5xx(fuzz_server):
    thread_server = fuzz_server
    import httpx
    from hypothesis import HealthCheck, settings
    from rollout_engines_remote.server import fastapi_app

    raw = fastapi_app(thread_server.app).openapi()
    schema = schemathesis.openapi.from_dict(raw)
    failures: list[str] = []
    counted = {"calls": 0}
    with httpx.Client(base_url=thread_server.url, headers=thread_server.headers, timeout=30) as client:
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path in BLOCKING:
                continue

            @settings(max_examples=20, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @hypothesis.given(case=operation.as_strategy())
            def check(case) -> None:
                kwargs = case.as_transport_kwargs(base_url=thread_server.url)
                kwargs.pop("url", None)
                headers = {**(kwargs.pop("headers", None) or {}), **thread_server.headers}
                method = kwargs.pop("method")
                response = client.request(method, case.formatted_path, headers=headers,
                                          params=kwargs.get("params"), json=kwargs.get("json"),
                                          content=kwargs.get("data") if "json" not in kwargs else None)
                counted["calls"] += 1
                if response.status_code >= 500:
                    failures.append(f"{method} {case.formatted_path} {kwargs.get('json')!r} -> "
                                    f"{response.status_code} {response.text[:300]}")

            check()
        # Leave the engine awake for whoever uses the module's server next.
        client.post("/wake_up", json={})
        client.post("/resume")
    assert counted["calls"] > 50
    assert not failures, "\n".join(failures[:10])
