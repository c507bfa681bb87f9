"""`atdp serve`: run the proxy with uvicorn (uvloop + httptools when installed)."""

from __future__ import annotations

import argparse


def cmd_serve(args) -> int:
    import logging

    import uvicorn

    from proxy.app import create_app
    from proxy.config import check_listen_address, load_settings

    # A log line per upstream request would cost more than the proxy itself.
    for name in ("httpx", "httpcore", "presidio-analyzer", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import sys

    # The writer thread shares the GIL with the event loop: hand it back often so a batch being
    # written never holds a model response for the default 5 ms.
    sys.setswitchinterval(0.0005)
    # Fewer, cheaper garbage collections: the request path allocates many short-lived objects and a
    # full collection over a warm heap is a latency spike.
    import gc

    gc.set_threshold(50_000, 20, 100)
    settings = load_settings()
    if args.host:
        settings.host = args.host
    if args.port:
        settings.port = args.port
    check_listen_address(settings)
    if args.workers > 1:
        from proxy.tools.workers import supervise

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return supervise(args, settings)
    from proxy.config import spool_folder
    from proxy.providers import ProviderConfigError
    from proxy.record.spool import claim_folder

    # A spool folder of this process's own, held while it lives (replicas on one volume: claim_folder).
    settings.worker, _held = claim_folder(lambda k: spool_folder(settings.home, k), settings.worker)
    try:
        app = create_app(settings)
    except ProviderConfigError as e:
        raise SystemExit(f"atdp serve: {e}") from None
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=30)
    if args.reuse_port:  # one of `--workers N` (proxy.tools.workers): the port is shared with the others
        from proxy.tools.workers import listening_socket

        uvicorn.Server(config).run(sockets=[listening_socket(settings.host, settings.port)])
    else:
        uvicorn.Server(config).run()
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the proxy (default 127.0.0.1:8700)")
    p.add_argument("--host", help="listen address (ATDP_HOST; loopback unless you say otherwise)")
    p.add_argument("--port", type=int, help="listen port (ATDP_PORT)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--workers", type=int, default=1,
                   help="proxy processes on this port (each with its writer; > 1 shares continuation links "
                        "through PostgreSQL)")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for each of --workers
    p.set_defaults(func=cmd_serve)
