"""Reading docker-compose.yml and the Dockerfiles without a Docker engine: compose's variable
interpolation, services' environments and mounts, Dockerfile COPY sources, the compose CLI if installed."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
HAPROXY_CFG = REPO / "docker" / "haproxy.cfg"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
GPU, CPU = "gpu", "cpu"
# None: no profile, started by a plain `docker compose up` (the CPU stack).
SERVICES = {"postgres": None, "proxy": None, "lb": None, "vllm": GPU, "trainer": GPU, "vllm-cpu": None,
            "trainer-cpu": None}
VLLM_SERVICES = ("vllm", "vllm-cpu")
TRAINER_SERVICES = ("trainer", "trainer-cpu")
BASE_ENV = {"ATDP_ADMIN_KEY": "admin-compose-test", "ATDP_SECRET": "compose-test-secret"}


# --- compose's variable interpolation (the subset compose documents) ---------------------------------

class InterpolationError(ValueError):
    pass


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _closing_brace(s: str, start: int) -> int:
    depth = 1
    i = start
    while i < len(s):
        if s.startswith("${", i):
            depth, i = depth + 1, i + 2
            continue
        if s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InterpolationError(f"unclosed ${{ in {s!r}")


def interpolate(s: str, env: Mapping[str, str], seen: set[str] | None = None) -> str:
    """`$$`, `$NAME`, `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?err}`, `${NAME?err}`,
    `${NAME:+alt}`, `${NAME+alt}`; defaults are interpolated too. `seen` collects the names."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("$$", i):
            out.append("$")
            i += 2
        elif s.startswith("${", i):
            end = _closing_brace(s, i + 2)
            body = s[i + 2:end]
            m = _NAME.match(body)
            if not m:
                raise InterpolationError(f"bad variable in {s!r}")
            name, rest = m.group(), body[m.end():]
            if seen is not None:
                seen.add(name)
            value = env.get(name)
            op = next((o for o in (":-", ":?", ":+", "-", "?", "+") if rest.startswith(o)), None)
            if op is None and rest:
                raise InterpolationError(f"bad modifier {rest!r} in {s!r}")
            arg = interpolate(rest[len(op):], env, seen) if op else ""
            empty = value is None or (op is not None and op.startswith(":") and value == "")
            if op in (":-", "-"):
                out.append(arg if empty else value)
            elif op in (":?", "?"):
                if empty:
                    raise InterpolationError(f"{name}: {arg}")
                out.append(value)
            elif op in (":+", "+"):
                out.append("" if empty else arg)
            else:
                out.append(value or "")
            i = end + 1
        elif s[i] == "$" and (m := _NAME.match(s, i + 1)):
            if seen is not None:
                seen.add(m.group())
            out.append(env.get(m.group(), ""))
            i = m.end()
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _walk(node: Any, fn) -> Any:
    if isinstance(node, dict):
        return {k: _walk(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk(v, fn) for v in node]
    return fn(node) if isinstance(node, str) else node


def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def render(**env: str) -> dict[str, Any]:
    """The compose file as compose would hand it to the engine, with this environment."""
    values = {**BASE_ENV, **env}
    return _walk(raw(), lambda s: interpolate(s, values))


def knobs() -> set[str]:
    names: set[str] = set()
    _walk(raw(), lambda s: interpolate(s, BASE_ENV, names))
    return names


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """container path -> (source, mode) for short-syntax volumes."""
    out = {}
    for spec in service.get("volumes") or []:
        parts = spec.split(":")
        source, target, mode = parts[0], parts[1], parts[2] if len(parts) > 2 else "rw"
        out[target] = (source, mode)
    return out


def code_env_names() -> set[str]:
    """Every ATDP_* name the shipped code can read: the settings model's variables (ATDP_ + field name,
    or the field's ATDP_* alias) and any other ATDP_* name the code mentions."""
    from pydantic import AliasChoices

    from proxy.config import Settings, TrainSettings

    names: set[str] = {f"ATDP_TRAIN_{name.upper()}" for name in TrainSettings.model_fields}  # Settings.train
    for field, info in Settings.model_fields.items():
        names.add(f"ATDP_{field.upper()}")
        if isinstance(info.validation_alias, AliasChoices):
            names |= {a for a in info.validation_alias.choices if isinstance(a, str) and a.startswith("ATDP_")}
    for package in ("proxy", "trainer", "atdp_schema", "migrations"):
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r"\bATDP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


def haproxy_sections() -> dict[str, list[list[str]]]:
    """docker/haproxy.cfg as {"backend proxies": [["balance", "roundrobin"], ...], ...}."""
    out: dict[str, list[list[str]]] = {}
    section = None
    for line in HAPROXY_CFG.read_text().splitlines():
        stripped = line.split("#", 1)[0].strip()
        if not stripped:
            continue
        if not line[0].isspace():
            section = stripped
            out[section] = []
        else:
            assert section is not None, f"directive outside a section: {line!r}"
            out[section].append(stripped.split())
    return out


# --- Dockerfiles -----------------------------------------------------------------------------------

def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, buf = [], ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def copy_sources(dockerfile: Path) -> list[str]:
    """Sources of COPY/ADD lines that read the build context (not another stage)."""
    sources = []
    for word, args in instructions(dockerfile):
        if word not in ("COPY", "ADD"):
            continue
        parts = json.loads(args) if args.startswith("[") else shlex.split(args)
        flags = [p for p in parts if p.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        sources += [p for p in parts if not p.startswith("--")][:-1]
    return sources


def dockerignore() -> list[str]:
    path = REPO / ".dockerignore"
    return [x.strip() for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule for these patterns: a path is out if it or a parent matches (no `!` used)."""
    assert not any(p.startswith("!") for p in patterns), "update ignored() for negated patterns"
    parts = Path(rel).parts
    for n in range(1, len(parts) + 1):
        prefix = "/".join(parts[:n])
        for pattern in patterns:
            p = pattern.rstrip("/")
            if fnmatch.fnmatchcase(prefix, p):
                return True
            if p.startswith("**/") and fnmatch.fnmatchcase(parts[n - 1], p[3:]):
                return True
    return False


def build_specs() -> dict[str, tuple[Path, Path, dict]]:
    out = {}
    for name, svc in raw()["services"].items():
        if "build" in svc:
            b = svc["build"]
            context = (REPO / b["context"]).resolve()
            out[name] = (context, context / b.get("dockerfile", "Dockerfile"), b.get("args") or {})
    return out


# --- the compose CLI, where installed ----------------------------------------------------------------

def compose_cli() -> list[str] | None:
    """A Compose CLI that reads the Compose Specification: v2 or later. Compose v1 (Debian's
    `docker-compose` 1.29) refuses the file's top-level `name`, which the spec has and v1 predates."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            r = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        major = r.stdout.strip().lstrip("v").split(".")[0]
        if r.returncode == 0 and major.isdigit() and int(major) >= 2:
            return cmd
    return None


