"""The console's server side without a browser: its static files and their headers, the read routes
it added (`whoami`, `learning`), the listing's client and version filters, keyset pages over a seeded
store, tenant scoping, bad input, and the OpenAPI document."""

from __future__ import annotations

import httpx
import pytest

from proxy.auth import create_key
from proxy.store import db
from tests.console_seed import seed

ADMIN = {"authorization": "Bearer admin-test-key"}


@pytest.fixture
def seeded(start_proxy, fake_upstream, own_db):
    url, factory = own_db
    engine = db.make_engine(url)
    seed(engine, sessions=90, tenants=("acme", "globex"), prefix="ca")
    engine.dispose()
    proxy = start_proxy([fake_upstream.url], database_url=url, open_mode=False, tenant="acme")
    with factory() as s, s.begin():
        _, acme = create_key(s, "acme")
    return proxy, {"authorization": f"Bearer {acme}"}


def test_static_files_carry_a_strict_policy_and_nothing_else_is_served(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url], wait_db=False)
    for path, kind in (("/ui", "text/html"), ("/ui/app.js", "text/javascript"),
                       ("/ui/console.css", "text/css")):
        r = httpx.get(proxy.url + path, timeout=5)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"
    assert b'<script type="module" src="/ui/app.js">' in httpx.get(proxy.url + "/ui", timeout=5).content
    assert httpx.get(proxy.url + "/ui/", timeout=5, follow_redirects=True).url.path == "/ui"
    for path in ("/ui/nope.js", "/ui/..%2Fapp.py", "/ui/%2e%2e%2fopenapi.py", "/ui/routes.py", "/ui/a/b"):
        r = httpx.get(proxy.url + path, timeout=5)
        assert r.status_code == 404 and r.json()["error"]["message"], path
    # The console reads its data through the API: no page embeds a key or a stored string.
    js = b"".join(httpx.get(proxy.url + f"/ui/{n}", timeout=5).content
                  for n in ("app.js", "api.js", "dom.js", "sessions.js", "feedback.js", "versions.js", "insights.js"))
    assert b"innerHTML" not in js and b"localStorage" not in js and b"eval(" not in js


def test_whoami_names_the_key(seeded):
    proxy, acme = seeded
    assert httpx.get(proxy.url + "/atdp/v1/whoami", headers=ADMIN).json()["admin"] is True
    me = httpx.get(proxy.url + "/atdp/v1/whoami", headers=acme).json()
    assert me["admin"] is False and me["tenant"] == "acme" and me["key_id"]
    assert httpx.get(proxy.url + "/atdp/v1/whoami").status_code == 401
    assert httpx.get(proxy.url + "/atdp/v1/whoami", headers={"authorization": "Bearer atdp-wrong"}).status_code == 401


def test_listing_filters_by_client_and_version_and_pages_by_keyset(seeded):
    proxy, acme = seeded
    url = proxy.url + "/atdp/v1/sessions"
    codex = httpx.get(url, params={"client": "codex", "limit": 500}, headers=ADMIN).json()["data"]
    assert len(codex) == 30 and {x["client"] for x in codex} == {"codex"}
    v1 = httpx.get(url, params={"version": "v1", "limit": 500}, headers=ADMIN).json()["data"]
    assert len(v1) == 30
    v1_ids = {x["id"] for x in v1}
    detail = httpx.get(url + "/" + next(iter(v1_ids)), headers=ADMIN).json()
    assert {st["model_version"] for st in detail["steps"]} == {"v1"}
    assert httpx.get(url, params={"version": "v9"}, headers=ADMIN).json()["data"] == []
    both = httpx.get(url, params={"version": "v2", "client": "hermes", "tenant": "globex", "limit": 500},
                     headers=ADMIN).json()["data"]
    assert both and all(x["client"] == "hermes" and x["tenant"] == "globex" for x in both)
    # Pages of 20, newest first, no overlap, every session once.
    seen, cursor = [], None
    while True:
        page = httpx.get(url, params={"limit": 20, **({"cursor": cursor} if cursor else {})}, headers=ADMIN).json()
        seen += [x["started_at"] for x in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 90 and seen == sorted(seen, reverse=True)
    # A tenant key sees its own sessions, whatever it asks for.
    mine = httpx.get(url, params={"limit": 500, "tenant": "globex"}, headers=acme).json()["data"]
    assert len(mine) == 45 and {x["tenant"] for x in mine} == {"acme"}
    for bad in ({"client": "a\x00b"}, {"version": "x" * 65}, {"clients": "codex"}):
        r = httpx.get(url, params=bad, headers=ADMIN)
        assert r.status_code == 422, bad


def test_learning_is_reward_and_held_out_score_per_version(seeded):
    proxy, acme = seeded
    url = proxy.url + "/atdp/v1/learning"
    everyone = httpx.get(url, headers=ADMIN).json()
    assert everyone["tenant"] is None
    rows = {v["name"]: v for v in everyone["data"]}
    assert list(rows) == ["base", "v1", "v2", "v3"]  # oldest first
    assert [rows[n]["sessions"] for n in ("base", "v1", "v2", "v3")] == [30, 30, 30, 0]
    # The seed's rewards rise with the version (means 0.15, 0.35, 0.55 plus a spread), 4 in 5 rewarded.
    assert rows["base"]["mean_reward"] < rows["v1"]["mean_reward"] < rows["v2"]["mean_reward"]
    assert all(rows[n]["rewarded_sessions"] == 24 and rows[n]["reward_se"] > 0 for n in ("base", "v1", "v2"))
    assert rows["base"]["held_out"] is None and rows["v3"]["mean_reward"] is None
    assert rows["v2"]["held_out"] == {"state": "passed", "n": 64, "candidate_mean": 0.55, "serving_mean": 0.41,
                                      "diff_mean": 0.14, "ci_low": 0.09, "ci_high": 0.19}
    assert rows["v3"]["held_out"]["state"] == "failed"
    # A tenant key: its own sessions' rewards; another tenant is a 403; unknown parameters a 422.
    own = httpx.get(url, headers=acme).json()
    assert own["tenant"] == "acme" and sum(v["sessions"] for v in own["data"]) == 45
    assert httpx.get(url, params={"tenant": "globex"}, headers=acme).status_code == 403
    assert httpx.get(url, params={"tenant": "acme"}, headers=acme).status_code == 200
    narrowed = httpx.get(url, params={"tenant": "globex"}, headers=ADMIN).json()
    assert narrowed["tenant"] == "globex" and sum(v["sessions"] for v in narrowed["data"]) == 45
    assert httpx.get(url, params={"since": "x"}, headers=ADMIN).status_code == 422
    assert httpx.get(url, params={"tenant": "a\x01"}, headers=ADMIN).status_code == 400
    assert httpx.get(url).status_code == 401


def test_openapi_documents_the_console_routes(start_proxy, fake_upstream):
    proxy = start_proxy([fake_upstream.url], wait_db=False)
    paths = httpx.get(proxy.url + "/openapi.json", timeout=5).json()["paths"]
    assert {"/ui", "/ui/{name}", "/atdp/v1/whoami", "/atdp/v1/learning"} <= set(paths)
    listing = {p["name"] for p in paths["/atdp/v1/sessions"]["get"]["parameters"]}
    assert {"client", "version"} <= listing
