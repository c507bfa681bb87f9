"""`header_map`: the request's headers read as Starlette reads them, from one dict built per request."""

from starlette.datastructures import Headers

from proxy.auth import header_map, key_from_headers
from proxy.sessions import detect_client


def _scope(*pairs: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "headers": list(pairs)}


def test_every_header_reads_as_starlette_reads_it_and_the_first_of_repeats_wins():
    scope = _scope(
        (b"authorization", b"Bearer first-key"),
        (b"user-agent", b"claude-cli/2.0.14 (external, cli)"),
        (b"authorization", b"Bearer second-key"),
        (b"x-api-key", b"k\xe9y"),  # latin-1, as the ASGI server hands it over
    )
    mine, theirs = header_map(scope), Headers(scope=scope)
    for name in ("authorization", "user-agent", "x-api-key", "x-atdp-session-id", "session-id"):
        assert mine.get(name) == theirs.get(name), name
    assert key_from_headers(mine) == key_from_headers(theirs) == "first-key"
    assert detect_client(mine) == detect_client(theirs) == "claude-code"


def test_it_is_built_once_per_request():
    scope = _scope((b"x-atdp-session-id", b"s1"))
    first = header_map(scope)
    scope["headers"].append((b"x-atdp-task-id", b"t1"))  # a scope's headers do not change after this point
    assert header_map(scope) is first and "x-atdp-task-id" not in first
    assert header_map(_scope()) == {}
