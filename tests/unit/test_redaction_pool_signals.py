"""Redaction workers outlive SIGTERM to the process group: their owner (the writer) stops them after
it has drained, so a `systemctl stop` cannot break redaction of the last batches."""

from __future__ import annotations

import os
import signal

from proxy.governance.redaction import RedactionConfig
from proxy.governance.redaction_pool import RedactionPool


def test_workers_ignore_sigterm_and_keep_redacting():
    pool = RedactionPool(RedactionConfig(salt=b"pool-test"), max_workers=2, inline_chars=0)
    try:
        pool.warm_up()
        pids = list(pool._executor._processes)  # the worker processes
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        items = [("t", f"mail me at user{i}@example.com please") for i in range(4)]
        out = pool.redact_many(items)
        assert all("@example.com" not in text for text, _ in out)
        assert sorted(pool._executor._processes) == sorted(pids)  # the same workers, none replaced
    finally:
        pool.close()
