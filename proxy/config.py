"""Settings from the environment (and an optional TOML file that mirrors it).

Every setting is an `ATDP_*` variable; `ATDP_CONFIG` may name a TOML file whose keys are the
variable names without the prefix, lower-case (`upstream_url = "..."`). The environment wins.
"""

from __future__ import annotations

import os
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def default_home() -> Path:
    return Path(os.environ.get("ATDP_HOME") or Path.home() / ".local" / "share" / "atdp")


def _toml_values() -> dict[str, str]:
    path = os.environ.get("ATDP_CONFIG")
    if not path:
        return {}
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return {f"ATDP_{k.upper()}": str(v) for k, v in data.items() if not isinstance(v, dict)}


def _bool(value: str | None, default: bool = False) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


@dataclass
class Settings:
    home: Path = field(default_factory=default_home)
    database_url: str | None = None  # None: embedded PostgreSQL under home/pg
    upstream_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    admin_key: str | None = None
    upstream_api_key: str | None = None  # when vLLM runs with --api-key
    host: str = "127.0.0.1"
    port: int = 8700
    # Open mode: no API key needed, every call belongs to `default_tenant`. Only on loopback.
    open_mode: bool = False
    default_tenant: str = "default"
    production: bool = False  # production mode: new tenants start without training consent
    policy_file: Path | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    queue_size: int = 10_000
    batch_size: int = 256
    flush_interval_s: float = 0.05
    upstream_timeout_s: float = 600.0
    swap_hold_timeout_s: float = 60.0
    swap_drain_timeout_s: float = 120.0  # how long a swap waits for a replica's in-flight calls
    swap_load_timeout_s: float = 600.0  # how long vLLM may take to reload weights
    session_ttl_s: float = 24 * 3600.0
    otel_exporter: str = "none"  # none | console | otlp
    secret: bytes = b""
    redaction_workers: int = 0  # 0: cores beyond the two the proxy and its writer use
    writer_mode: str = "process"  # process: redaction + writes in a child process; thread: in-process
    # The served model's tokenizer (model folder or tokenizer.json): lets the proxy keep token ids of
    # steps that touched redacted text, cleaned; without it those ids are dropped.
    tokenizer: str | None = None
    retention_interval_s: float = 3600.0  # how often the proxy runs the retention job
    response_ttl_s: float = 30 * 24 * 3600.0  # how long /v1/responses conversations are kept (sealed)

    @property
    def spool_dir(self) -> Path:
        return self.home / "spool"

    @property
    def checkpoints_dir(self) -> Path:
        return self.home / "checkpoints"


def _load_secret(home: Path, env_value: str | None) -> bytes:
    """The deployment secret keys content hashes and hash-style redaction; created once per home."""
    if env_value:
        return env_value.encode()
    path = home / "secret"
    if path.exists():
        return path.read_bytes().strip()
    home.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)
    return value


def load_settings(env: dict[str, str] | None = None) -> Settings:
    values = _toml_values()
    values.update(os.environ if env is None else env)
    get = values.get
    home = Path(get("ATDP_HOME") or default_home())
    s = Settings(home=home)
    s.database_url = get("ATDP_DATABASE_URL") or None
    if get("ATDP_UPSTREAM_URL"):
        s.upstream_urls = [u.strip().rstrip("/") for u in get("ATDP_UPSTREAM_URL", "").split(",") if u.strip()]
    s.admin_key = get("ATDP_ADMIN_KEY") or None
    s.upstream_api_key = get("ATDP_UPSTREAM_API_KEY") or None
    s.host = get("ATDP_HOST") or s.host
    s.port = int(get("ATDP_PORT") or s.port)
    s.open_mode = _bool(get("ATDP_OPEN_MODE"))
    s.default_tenant = get("ATDP_DEFAULT_TENANT") or s.default_tenant
    s.production = _bool(get("ATDP_PRODUCTION"))
    s.policy_file = Path(get("ATDP_POLICY_FILE")) if get("ATDP_POLICY_FILE") else None
    s.max_body_bytes = int(get("ATDP_MAX_BODY_BYTES") or s.max_body_bytes)
    s.queue_size = int(get("ATDP_QUEUE_SIZE") or s.queue_size)
    s.upstream_timeout_s = float(get("ATDP_UPSTREAM_TIMEOUT_S") or s.upstream_timeout_s)
    s.swap_hold_timeout_s = float(get("ATDP_SWAP_HOLD_TIMEOUT_S") or s.swap_hold_timeout_s)
    s.swap_drain_timeout_s = float(get("ATDP_SWAP_DRAIN_TIMEOUT_S") or s.swap_drain_timeout_s)
    s.swap_load_timeout_s = float(get("ATDP_SWAP_LOAD_TIMEOUT_S") or s.swap_load_timeout_s)
    s.otel_exporter = (get("ATDP_OTEL_EXPORTER") or s.otel_exporter).lower()
    s.redaction_workers = int(get("ATDP_REDACTION_WORKERS") or 0)
    s.writer_mode = (get("ATDP_WRITER") or s.writer_mode).lower()
    s.tokenizer = get("ATDP_TOKENIZER") or None
    s.retention_interval_s = float(get("ATDP_RETENTION_INTERVAL_S") or s.retention_interval_s)
    s.response_ttl_s = float(get("ATDP_RESPONSE_TTL_S") or s.response_ttl_s)
    s.secret = _load_secret(home, get("ATDP_SECRET"))
    return s


def check_listen_address(settings: Settings) -> None:
    """Refuse configurations that would expose an unauthenticated proxy beyond loopback."""
    if settings.open_mode and settings.host not in LOOPBACK:
        raise SystemExit(
            f"ATDP_OPEN_MODE serves without API keys and is only allowed on loopback, not {settings.host}"
        )
