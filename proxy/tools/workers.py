"""`atdp serve --workers N`: N proxy processes on one host and one port, sharing PostgreSQL only.

Each worker is a whole `atdp serve` (its event loop, its writer child, its caches) with a listening
socket of its own bound with SO_REUSEPORT, so the kernel spreads new connections over the workers.
The parent serves nothing: it migrates the database once (workers starting together would race the
migration), starts the workers, starts again one that dies, and on SIGTERM or SIGINT passes SIGTERM
on and waits until every worker has drained (each waits for its writer's acknowledgements, as a
single proxy does), so a clean shutdown loses no step.

With N > 1 the continuation links are shared (`ATDP_SHARED_LINKS=1`, whatever the environment
says): a client that sends no id reaches any worker on its next call, and only the database knows
the turn another worker served. Swaps already close every worker's gate (proxy.rollout.swapbus),
and a canary's routing is read by all (proxy.rollout.canarybus).

Writers are not shared: a worker holds every step until its own child acknowledges it durable, and
that protocol is a pipe between the two. One writer per worker also scales the redaction and the
writes with the workers; PostgreSQL is the only thing they share. Each worker spools to its own
folder (`spool/worker-K`, or the first one no live process holds: proxy.record.spool.claim_folder):
a spool is drained by the process that appends to it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from proxy.config import Settings

log = logging.getLogger("atdp.workers")

CLEAN = {0, -signal.SIGTERM, -signal.SIGINT}  # uvicorn re-raises the signal it stopped on


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket several processes bind at once (SO_REUSEPORT): the kernel balances new connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _migrate(settings: Settings) -> None:
    from proxy.store import db

    try:
        db.upgrade(db.database_url(settings))  # embedded: this also starts the server the workers join
    except Exception as e:  # each worker retries on its own, as a single proxy does
        log.warning("database not ready before the workers start (%s: %s)", type(e).__name__, e)


class Supervisor:
    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        self.n = args.workers
        self.cmd = [sys.executable, "-m", "proxy.cli", "serve", "--reuse-port", "--host", settings.host,
                    "--port", str(settings.port), "--log-level", args.log_level]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, float] = {}
        self.stopping = False

    def spawn(self, k: int) -> None:
        env = {**os.environ, "ATDP_WORKER": str(k), "ATDP_SHARED_LINKS": "1"}
        self.procs[k] = subprocess.Popen(self.cmd, env=env)
        self.started[k] = time.monotonic()

    def stop(self, signum: int, frame: object) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        for k in range(1, self.n + 1):
            self.spawn(k)
        log.info("%d workers on %s", self.n, " ".join(self.cmd[-5:-2]))
        while not self.stopping:
            time.sleep(0.5)
            for k, p in list(self.procs.items()):
                if self.stopping or p.poll() is None:
                    continue
                # A worker that dies at once (port taken, bad settings) would die again: back off.
                quick = time.monotonic() - self.started[k] < 10
                log.warning("worker %d exited (%s); starting it again%s", k, p.returncode,
                            " in 5 s" if quick else "")
                if quick:
                    time.sleep(5)
                if not self.stopping:
                    self.spawn(k)
        codes = [p.wait() for p in self.procs.values()]
        return 0 if all(c in CLEAN for c in codes) else 1


def supervise(args: argparse.Namespace, settings: Settings) -> int:
    _migrate(settings)
    return Supervisor(args, settings).run()
