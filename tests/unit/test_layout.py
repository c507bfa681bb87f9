"""The layout's rules hold: import-linter contracts, the trainer free of web libraries, the service free of
the demo and the tools, explicit route and command tables, small modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500
GENERATED: set[str] = set()  # none today; atdp_schema/schema.json is generated but is not Python


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 broken" in r.stdout


def test_the_trainer_imports_no_web_library():
    r = _python("import trainer.main, sys; assert 'starlette' not in sys.modules")
    assert r.returncode == 0, r.stderr
    web = ("starlette", "uvicorn", "aiohttp", "prometheus_client", "proxy.app", "proxy.http")
    r = _python("import sys, trainer.main, trainer.loop, trainer.lease, trainer.swap; "
                f"print([m for m in {web!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_service_never_imports_the_demo_or_the_tools():
    r = _python("import sys, proxy.app; "
                "print(sorted(m for m in sys.modules if m.startswith(('proxy.demo', 'proxy.tools', 'proxy.cli'))))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_routes_and_commands_are_not_discovered_with_importlib():
    loaders = ("import_module(", "__import__(", "pkgutil")
    users = [p for p in (ROOT / "proxy").rglob("*.py") if any(x in p.read_text() for x in loaders)]
    assert users == []


def test_no_module_is_over_500_lines():
    long = {}
    for folder in ("proxy", "trainer", "atdp_schema", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            n = len(path.read_text().splitlines())
            if n > MAX_LINES and rel not in GENERATED:
                long[rel] = n
    assert long == {}


def test_every_service_module_is_under_the_one_engine_client_contract():
    """Only proxy.engine may import an HTTP-client library in the service; a new module of the service
    is under the contract too (the demo, the tools and the CLI are clients of the proxy)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    sources = next(set(c["source_modules"]) for c in contracts if c["name"].startswith("One engine client"))
    children = {f"proxy.{p.stem if p.suffix == '.py' else p.name}" for p in (ROOT / "proxy").iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert children - sources == {"proxy.engine", "proxy.demo", "proxy.tools", "proxy.cli"}
    libraries = ("import httpx", "import aiohttp", "from httpx", "from aiohttp")
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proxy").rglob("*.py")
                   if not p.is_relative_to(ROOT / "proxy" / "demo") and not p.is_relative_to(ROOT / "proxy" / "tools")
                   and any(x in p.read_text() for x in libraries))
    assert users == ["proxy/engine.py"]
