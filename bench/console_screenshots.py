"""Screenshots of every console page for docs/console.md, from a seeded store behind the real proxy.

  python bench/console_screenshots.py [--sessions 300] [--out docs/console] [--database-url URL]

Writes sign-in.png, sessions.png, session.png, feedback.png, versions.png, version-card.png,
diagnosis.png and learning.png (1280 px wide) into `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.console_stack import console_stack  # noqa: E402
from tests.browser import chromium  # noqa: E402


def drawn(page, name: str, timeout: float = 60.0) -> None:
    # Polled from here: the console's CSP forbids the eval that wait_for_function needs.
    deadline = time.monotonic() + timeout
    while page.evaluate("document.body.dataset.ready") != name:
        if time.monotonic() > deadline:
            raise TimeoutError(f"page {name} not drawn")
        time.sleep(0.02)


def small(path: Path) -> None:
    """A UI screenshot needs few colours: a 64-colour palette PNG is a third of the size."""
    from PIL import Image

    with Image.open(path) as img:
        img.convert("RGB").quantize(colors=64).save(path, optimize=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--out", default="docs/console")
    ap.add_argument("--database-url", default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with console_stack(args.sessions, args.database_url) as stack, chromium() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        page = context.new_page()
        page.goto(stack.url + "/ui")
        page.wait_for_selector("#signin")
        page.screenshot(path=out / "sign-in.png")
        small(out / "sign-in.png")
        page.fill("#key", stack.admin_key)
        page.click("#signin button[type=submit]")
        drawn(page, "sessions")

        def shot(hash_: str | None, name: str, ready: str, *, full: bool = False, before=None) -> None:
            if hash_ is not None:  # None: the page already shown
                page.evaluate("document.body.removeAttribute('data-ready')")
                page.evaluate(f"location.hash = {json.dumps(hash_)}")
                drawn(page, ready)
            if before:
                before()
            page.screenshot(path=out / f"{name}.png", full_page=full)
            small(out / f"{name}.png")
            print(out / f"{name}.png", flush=True)

        shot("#/sessions?client=codex", "sessions", "sessions")
        shot("#/session/globex/sess-000007", "session", "session")
        shot(None, "feedback", "session",
             before=lambda: (page.fill("#fb-comment", "Ran the right tests first; good."),
                             page.locator("#feedback").scroll_into_view_if_needed()))
        shot("#/versions", "versions", "versions")
        shot("#/version/v2", "version-card", "version",
             before=lambda: (page.click("#rollback-open"), page.fill("#rollback-confirm-name", "v2"),
                             page.locator("#rollback-confirm").scroll_into_view_if_needed()))
        shot("#/diagnosis", "diagnosis", "diagnosis")
        shot("#/learning", "learning", "learning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
