"""No credentials in log lines (#13): HTTP clients log the URLs they call."""

from __future__ import annotations

import logging

import httpx

from proxy import logs


def test_httpx_request_lines_lose_userinfo_and_query(caplog):
    logs.install()
    caplog.set_level(logging.INFO, logger="httpx")
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json={})))
    client.get("http://trainer:s3cret-pw@engine.internal:8000/v1/models?token=abc123tok#frag")
    client.close()
    assert "HTTP Request: GET http://engine.internal:8000/v1/models" in caplog.text
    for secret in ("s3cret-pw", "trainer:", "abc123tok", "frag"):
        assert secret not in caplog.text


def test_any_logger_through_the_root_handlers(caplog):
    handler = logging.StreamHandler()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        logs.install()
        assert logs._FILTER in handler.filters
        record = logging.LogRecord("atdp.x", logging.WARNING, __file__, 1, "replica %s failed: %s", (
            "https://u:p4ss@h:1/v1?api_key=k3y", "ConnectError"), None)
        for f in handler.filters:
            f.filter(record)
        assert record.getMessage() == "replica https://h:1/v1 failed: ConnectError"
    finally:
        root.removeHandler(handler)


def test_text_without_urls_is_left_alone():
    text = "step 01a2 refused (DataError); 3 of 4 written: ok"
    assert logs.strip_url_credentials(text) == text
    assert logs.strip_url_credentials("postgresql://postgres:pw@127.0.0.1:5432/atdp") == "postgresql://127.0.0.1:5432/atdp"
