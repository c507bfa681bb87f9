"""Logging set-up for every atdp process: no credentials in any log line.

HTTP client libraries log the URLs they call (httpx at INFO: `HTTP Request: POST http://u:pw@h/...`;
aiohttp in its errors), and a replica's or a database's URL may carry a user, a password or a token
in its query. `CredentialFilter` rewrites such a URL to `scheme://host:port/path` (no userinfo, no
query, no fragment) in a record's message and arguments. It sits on the root handlers (records of
every logger pass them) and on the HTTP clients' own loggers (so handlers added later, pytest's
included, see clean records too).
"""

from __future__ import annotations

import logging
import re

_URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)([^\s/?#@'\"]+@)?([^\s/?#'\"]*)([^\s?#'\"]*)(\?[^\s#'\"]*)?(#[^\s'\"]*)?")
_CLIENT_LOGGERS = ("httpx", "httpcore", "aiohttp.client", "aiohttp.internal", "aiohttp.server", "urllib3",
                   "uvicorn.error", "sqlalchemy.engine", "alembic")


def strip_url_credentials(text: str) -> str:
    """`text` with the userinfo, query and fragment of every URL in it removed."""
    return _URL.sub(lambda m: m.group(1) + m.group(3) + m.group(4), text)


class CredentialFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to the handler to report
            return True
        clean = strip_url_credentials(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_FILTER = CredentialFilter()


def install() -> None:
    """Put the credential filter on the root handlers and the HTTP clients' loggers (idempotent)."""
    for handler in logging.getLogger().handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    for name in _CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def configure(level: int = logging.INFO, quiet: tuple[str, ...] = ()) -> None:
    """The processes' logging: one line per record, credentials filtered; `quiet` loggers at WARNING."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    install()
