"""The console in a real browser (Debian's chromium through Playwright) against the real proxy and a
seeded PostgreSQL: sign in, find a session, give feedback and find it stored, open a version card and
roll back (checked in the store and on the upstream); stored `<script>` / `<img onerror>` in a
message, a tool call and a tool result never run and show literally; a tenant key sees its own tenant.
"""

from __future__ import annotations

import re
import time
import uuid

import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.auth import create_key
from proxy.store import db
from proxy.store import tables as t
from tests.browser import chromium
from tests.console_seed import seed

ADMIN_KEY = "admin-test-key"
XSS_USER = '<img src=x onerror="window.__xss=1">'
XSS_TOOL = '<script>window.__xss=2</script><img src=x onerror="window.__xss=3">'
XSS_SAY = "<script>window.__xss=4</script>"


@pytest.fixture
def stack(start_proxy, fake_upstream, own_db):
    url, factory = own_db
    engine = db.make_engine(url)
    seed(engine, sessions=60, tenants=("acme", "globex"), prefix="cs")
    engine.dispose()
    proxy = start_proxy([fake_upstream.url], database_url=url, open_mode=False, tenant="acme")
    assert proxy.versions.ready.wait(30)
    with factory() as s, s.begin():
        _, acme = create_key(s, "acme", name="console test")
        _, globex = create_key(s, "globex", name="console test")
    xss = _xss_session(proxy, acme)
    yield {"proxy": proxy, "factory": factory, "acme": acme, "globex": globex, "xss": xss, "upstream": fake_upstream}


def _xss_session(proxy, key: str) -> str:
    """A session recorded through the chat door whose message, tool call and tool result hold markup."""
    sid = f"xss-{uuid.uuid4().hex[:8]}"
    c = openai.OpenAI(base_url=proxy.v1, api_key=key, max_retries=0, default_headers={"X-ATDP-Session-Id": sid})
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": f'#tool read_file {{"path": "{XSS_USER.replace(chr(34), chr(39))}"}}'}]
    r = c.chat.completions.create(model="fake", messages=messages, tools=tools)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    messages += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": XSS_TOOL},
                 {"role": "user", "content": f"#say {XSS_SAY} {XSS_USER}"}]
    c.chat.completions.create(model="fake", messages=messages, tools=tools)
    proxy.flush()
    return sid


def _sign_in(page, base: str, key: str) -> None:
    page.goto(base + "/ui")
    page.fill("#key", key)
    page.click("#signin button[type=submit]")
    page.wait_for_selector("body[data-ready=sessions]")


def _then(page, name: str, action, timeout: float = 15.0) -> None:
    """Do `action` (a click, a new hash) and wait until the console has drawn page `name` after it.
    Polled from here: the console's CSP forbids eval, which Playwright's wait_for_function needs."""
    renders = "Number(document.body.dataset.renders || 0)"
    before = page.evaluate(renders)
    action()
    deadline = time.monotonic() + timeout
    while not (page.evaluate(renders) > before and page.evaluate("document.body.dataset.ready") == name):
        assert time.monotonic() < deadline, f"page {name} was not drawn within {timeout} s"
        time.sleep(0.02)


def _wait(page, expression: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.02)


def test_admin_finds_a_session_gives_feedback_and_rolls_back(stack):
    proxy, factory = stack["proxy"], stack["factory"]
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        _sign_in(page, proxy.url, ADMIN_KEY)
        assert page.text_content("#who") == "admin (all tenants)"
        # The key is in this tab's session storage, never in the URL or local storage.
        assert ADMIN_KEY not in page.url
        assert page.evaluate("sessionStorage.getItem('atdp.key')") == ADMIN_KEY
        assert page.evaluate("localStorage.length") == 0

        # Filter: tenant globex, client codex; every row matches; then page forward and back.
        page.fill("#filters input[name=tenant]", "globex")
        page.fill("#filters input[name=client]", "codex")
        _then(page, "sessions", lambda: page.click("#filters button[type=submit]"))
        assert "client=codex" in page.url
        rows = page.locator("#sessions tbody tr")
        assert rows.count() > 0
        for i in range(rows.count()):
            cells = rows.nth(i).locator("td").all_text_contents()
            assert cells[1] == "globex" and cells[2] == "codex"
        _then(page, "sessions", lambda: page.evaluate("location.hash = '#/sessions'"))
        first_page = page.locator("#sessions tbody tr td:first-child").all_text_contents()
        assert len(first_page) == 50  # 60 seeded + the XSS session, 50 a page
        _then(page, "sessions", lambda: page.click("#next-page"))
        second_page = page.locator("#sessions tbody tr td:first-child").all_text_contents()
        assert len(second_page) == 11 and not set(first_page) & set(second_page)
        _then(page, "sessions", lambda: page.click("#prev-page"))
        assert page.locator("#sessions tbody tr td:first-child").all_text_contents() == first_page

        # A seeded session (every 7th had an e-mail redacted): its timeline.
        target = "cs-000007"
        _then(page, "session", lambda: page.click(f"text={target}"))
        assert page.locator(".timeline > li").count() == 2, (page.text_content("#app"), errors)
        step1 = page.locator("#step-1")
        assert "EMAIL_ADDRESS" in step1.locator(".redaction").text_content()
        assert step1.locator("pre mark.redacted").first.text_content() == "EMAIL_ADDRESS"  # where, not what
        assert "version" in step1.locator("header").text_content()
        assert page.locator("#step-2 .tool-result").first.is_visible()
        assert "eligible" in step1.locator(".eligibility").text_content()

        # Feedback: a thumbs up on the session, then a score with a comment on step 2.
        rows_js = "document.querySelectorAll('#feedback-list tbody tr').length"
        seeded = page.evaluate(rows_js)  # the seed gave most sessions a reward already
        page.click("#fb-up")
        _wait(page, f"{rows_js} === {seeded + 1}")
        page.select_option("#fb-scope", label="step #2")
        page.fill("#fb-score", "0.25")
        page.fill("#fb-comment", "good tool use")
        page.click("#fb-send")
        _wait(page, f"{rows_js} === {seeded + 2}")
        with factory() as s:
            session = s.scalars(select(t.Session).where(t.Session.external_id == target)).one()
            rows = s.scalars(select(t.Feedback).where(t.Feedback.session_id == session.id, t.Feedback.source == "human",
                                                      t.Feedback.posted_by == "admin")
                             .order_by(t.Feedback.created_at)).all()
            assert [(r.reward, r.step_id is None, r.comment) for r in rows] == [(1.0, True, None), (0.25, False, "good tool use")]
            audited = s.scalars(select(t.AuditEvent).where(t.AuditEvent.action == "feedback.create",
                                                           t.AuditEvent.target.in_([r.id for r in rows]))).all()
            assert len(audited) == 2
        # A score outside the tenant's range is refused by the API, and the page says so.
        page.fill("#fb-score", "7")
        page.click("#fb-send")
        page.wait_for_selector("#fb-status .error")
        assert "outside this tenant's range" in page.text_content("#fb-status")

        # Versions: the lineage tree, v2's card, roll it back with a typed confirmation.
        _then(page, "versions", lambda: page.click("#nav >> text=Versions"))
        tree = page.text_content("#versions .tree")
        assert all(name in tree for name in ("base", "v1", "v2", "v3"))
        _then(page, "version", lambda: page.click("#versions .tree a >> text=v2"))
        assert page.text_content("#version-status") == "serving"
        assert "v1" in page.text_content("#rollback-note")
        page.click("#rollback-open")
        assert page.is_disabled("#rollback-confirm")
        page.fill("#rollback-confirm-name", "v1")  # the wrong name keeps it disabled
        assert page.is_disabled("#rollback-confirm")
        page.fill("#rollback-confirm-name", "v2")
        page.click("#rollback-confirm")
        page.wait_for_selector("#rollback-result:has-text('Done')", timeout=30000)
        assert "v1 is serving" in page.text_content("#rollback-result")
        with factory() as s:
            status = dict(s.execute(select(t.ModelVersion.name, t.ModelVersion.status)).all())
            assert status["v2"] == "rolled_back" and status["v1"] == "serving"
            assert s.scalar(select(t.AuditEvent.id).where(t.AuditEvent.actor == "admin",
                                                          t.AuditEvent.action.like("version.%"))) is not None
        assert stack["upstream"].weights == "v1" and stack["upstream"].version == "v1"

        # Promote v2 again (the operator override), with a reason: audited with who and why.
        # The card redraws itself after the rollback.
        _wait(page, "document.querySelector('#version-status')?.textContent === 'rolled_back'")
        page.click("#promote-open")
        page.fill("#promote-reason", "rollback was a drill")
        page.fill("#promote-confirm-name", "v2")
        page.click("#promote-confirm")
        page.wait_for_selector("#promote-result:has-text('Done')", timeout=30000)
        assert "v2 is serving" in page.text_content("#promote-result")
        with factory() as s:
            status = dict(s.execute(select(t.ModelVersion.name, t.ModelVersion.status)).all())
            assert status["v2"] == "serving" and status["v1"] == "retired"
            override = s.scalars(select(t.AuditEvent).where(t.AuditEvent.action == "version.promote_override")).one()
            assert override.actor == "admin" and override.details.get("reason") == "rollback was a drill"
        assert stack["upstream"].weights == "v2"

        # Diagnosis links to example sessions; the learning chart draws a point per version.
        _then(page, "diagnosis", lambda: page.click("#nav >> text=Diagnosis"))
        example = page.locator(".examples a").first
        example_id = example.text_content()
        _then(page, "session", example.click)
        assert example_id in page.text_content("#session h1")
        _then(page, "learning", lambda: page.click("#nav >> text=Learning"))
        assert page.locator("#learning-chart circle.dot.reward").count() >= 3  # base, v1, v2 (+ legend)
        assert page.locator("#learning-chart circle.dot.held-out").count() >= 3
        assert errors == []


def test_stored_markup_is_shown_literally_and_never_runs(stack):
    proxy = stack["proxy"]
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        _sign_in(page, proxy.url, ADMIN_KEY)
        _then(page, "session", lambda: page.evaluate(f"location.hash = '#/session/acme/{stack['xss']}'"))
        time.sleep(0.5)  # an onerror handler would have fired by now
        assert page.evaluate("window.__xss") is None
        assert page.locator("#session img").count() == 0 and page.locator("#session script").count() == 0
        text = page.text_content("#session")
        assert XSS_TOOL in text  # the tool result, literally
        assert XSS_SAY in text  # the user's message and the model's echo of it
        assert "onerror=" in text  # the tool call's arguments
        assert errors == []
    r = httpx.get(proxy.url + "/ui", timeout=5)
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp


def test_a_tenant_key_sees_only_its_tenant(stack):
    proxy = stack["proxy"]
    with chromium() as browser:
        page = browser.new_page()
        page.goto(proxy.url + "/ui")
        page.fill("#key", "atdp-not-a-key")
        page.click("#signin button[type=submit]")
        page.wait_for_selector("#signin .error")
        assert "not valid" in page.text_content("#signin .error")
        assert page.evaluate("sessionStorage.getItem('atdp.key')") is None

        _sign_in(page, proxy.url, stack["globex"])
        assert page.text_content("#who") == "tenant globex"
        assert page.locator("#filters input[name=tenant]").count() == 0
        assert not page.is_visible("#nav >> text=Versions")
        seen: set[str] = set()
        while True:
            seen |= set(page.locator("#sessions tbody tr td:nth-child(2)").all_text_contents())
            if page.locator("#next-page").count() == 0:
                break
            _then(page, "sessions", lambda: page.click("#next-page"))
        assert seen == {"globex"}
        # Another tenant's session by its URL: not found, nothing shown.
        _then(page, "session", lambda: page.evaluate(f"location.hash = '#/session/acme/{stack['xss']}'"))
        assert re.search(r"404", page.text_content("#app .error"))
        # Versions are the admin's; the learning chart is the tenant's own.
        _then(page, "versions", lambda: page.evaluate("location.hash = '#/versions'"))
        assert "admin key" in page.text_content("#app")
        _then(page, "learning", lambda: page.evaluate("location.hash = '#/learning'"))
        assert "tenant globex" in page.text_content("#learning")
