"""`/ui`: the console's static files (HTML, CSS, ES modules), served by `atdp serve` itself.

The files are read once at start-up from the package (`proxy/console/static`); a name outside that
fixed set is a 404, so no path ever reaches the file system. Every answer carries a
Content-Security-Policy that allows scripts and styles from this origin only (no inline script, no
`eval`), API calls to this origin only, and no framing. The pages fetch their data from the ATDP
routes with the key the operator typed, which the browser keeps in `sessionStorage`; no data and no
key is ever part of what these routes serve.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import ApiError
from proxy.http import Route

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def load_assets() -> dict[str, tuple[bytes, str]]:
    """Every file of the static folder: name -> (bytes, media type)."""
    folder = resources.files("proxy.console") / "static"
    out: dict[str, tuple[bytes, str]] = {}
    for item in folder.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1] if "." in item.name else ""
        if item.is_file() and suffix in TYPES:
            out[item.name] = (item.read_bytes(), TYPES[suffix])
    if "index.html" not in out:
        raise RuntimeError("the console's static files are missing from the package (proxy/console/static)")
    return out


def _answer(body: bytes, media_type: str) -> Response:
    return Response(body, media_type=media_type, headers=SECURITY_HEADERS)


def routes() -> list[Route]:
    assets = load_assets()
    index = assets["index.html"]

    async def page(request: Request) -> Response:
        return _answer(*index)

    async def asset(request: Request) -> Response:
        found = assets.get(request.path_params["name"])
        if found is None:
            raise ApiError(404, "no such console file")
        return _answer(*found)

    return [Route("/ui", page, ("GET", "HEAD")),
            Route("/ui/{name}", asset, ("GET", "HEAD"))]
