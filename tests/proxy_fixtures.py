"""Fixtures that run the real proxy (uvicorn, in a thread) against real or scripted upstreams."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import select
from starlette.applications import Starlette

from proxy.app import create_app
from proxy.config import Settings
from proxy.doors.response_store import ResponseStore
from proxy.governance.redaction import RedactionConfig, Redactor
from proxy.rollout.swap import Versions
from proxy.state import AppState
from proxy.store import tables as t
from tests.fake_vllm import FakeVLLM, ServerThread


def all_trainable():
    """Policies under which every rewarded session is trainable: no held-out share (the default holds
    10% out for the replay gate). For tests that count what one update trains on."""
    from proxy.governance.policies import Policies
    from proxy.governance.policy import TenantPolicy

    return Policies({"default": TenantPolicy(training_consent=True, eval_holdout=0.0)})


ALL_TRAINABLE_TOML = "[default]\ntraining_consent = true\neval_holdout = 0.0\n"  # the same, as a policy file


@dataclass
class RunningProxy:
    url: str
    state: AppState
    server: ServerThread
    tenant: str
    versions: Versions
    response_store: ResponseStore

    @classmethod
    def of(cls, app: Starlette, server: ServerThread, tenant: str) -> RunningProxy:
        return cls(url=server.url, state=app.state.atdp, server=server, tenant=tenant, versions=app.state.versions,
                   response_store=app.state.response_store)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def flush(self, timeout: float = 30.0) -> None:
        assert self.state.recorder.flush(timeout), "writer did not catch up"

    def steps(self, factory, session_external_id: str | None = None) -> list[t.Step]:
        self.flush()
        with factory() as s:
            q = select(t.Step).where(t.Step.tenant_id == self.tenant)
            if session_external_id:
                q = q.join(t.Session, t.Session.id == t.Step.session_id).where(t.Session.external_id == session_external_id)
            return list(s.scalars(q.order_by(t.Step.started_at)))


_shared_redactor: Redactor | None = None


def shared_redactor(secret: bytes) -> Redactor:
    """One in-process redactor for the test session (building Presidio takes a second)."""
    global _shared_redactor
    if _shared_redactor is None:
        _shared_redactor = Redactor(RedactionConfig(salt=secret))
    return _shared_redactor


def wait_for_db(state: AppState, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while state.factory is None or not state.recorder.db_ok:
        if time.monotonic() > deadline:
            raise RuntimeError("proxy never connected to its database")
        time.sleep(0.02)


@pytest.fixture
def start_proxy(db_url, tmp_path) -> Callable[..., RunningProxy]:
    running: list[RunningProxy] = []

    def start(upstreams: list[str], *, database_url: str | None = None, home: Path | None = None,
              wait_db: bool = True, **overrides) -> RunningProxy:
        tenant = overrides.pop("tenant", None) or f"t-{uuid.uuid4().hex[:8]}"
        home = home or tmp_path / f"home-{len(running)}"
        home.mkdir(parents=True, exist_ok=True)
        # No held-out share either (the default holds 10% of sessions out for the replay gate), unless
        # a test names its own policy file: what a test trains on and counts is every session.
        all_trainable = home / "all-trainable.toml"
        all_trainable.write_text(ALL_TRAINABLE_TOML)
        settings = Settings(home=home, database_url=database_url or db_url, policy_file=all_trainable,
                            upstream_urls=upstreams, open_mode=True, default_tenant=tenant,
                            secret=b"test-secret", admin_key="admin-test-key", writer_mode="thread",
                            # Tests register made-up and temporary checkpoint paths; the roots' own
                            # test (test_versions.py) narrows this.
                            checkpoint_roots=[Path("/")],
                            # Most tests post a checkpoint to exercise what follows a promotion (swaps,
                            # canaries, training rounds) on an install with no evaluation set: gates
                            # off, as an operator would say explicitly. The defaults (gates on, a
                            # held-out share) are tested in test_gates_default.py.
                            gates="off")
        for k, v in overrides.items():
            setattr(settings, k, v)
        # Thread mode shares one in-process redactor across tests (fast); process mode is production's.
        process = settings.writer_mode == "process"
        app = create_app(settings, redactor=None if process else shared_redactor(settings.secret))
        server = ServerThread(app).start()
        state = app.state.atdp
        if wait_db:
            wait_for_db(state)
        rp = RunningProxy.of(app, server, tenant)
        running.append(rp)
        return rp

    yield start
    for rp in running:
        rp.server.stop()


@pytest.fixture
def fake_upstream():
    fake = FakeVLLM()
    with ServerThread(fake) as server:
        fake.url = server.url
        yield fake
