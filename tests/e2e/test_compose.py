"""docker-compose.yml and the Dockerfiles, checked without a Docker engine.

`docker compose config` runs when the compose CLI is installed. Everywhere, the file is loaded as
YAML, its `${VAR}` knobs are expanded by compose's rules, and what the containers would run is
checked against the real parts: the proxy and trainer commands go through atdp's own argument
parser (and torchrun's, and vLLM's when its environment exists), the containers' environments
through `load_settings`, and the proxy image's install steps are replayed from its COPY lines into a
temporary folder, whose `atdp` then migrates a database and creates a key.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy import text

from proxy.store import db
from tests.compose_files import (
    BASE_ENV,
    COMPOSE,
    DEPLOY_DOC,
    GPU,
    HAPROXY_CFG,
    REPO,
    SERVICES,
    TRAINER_SERVICES,
    VLLM_SERVICES,
    _walk,
    build_specs,
    code_env_names,
    compose_cli,
    copy_sources,
    dockerignore,
    env_of,
    haproxy_sections,
    ignored,
    instructions,
    interpolate,
    knobs,
    mounts,
    raw,
    render,
)


@pytest.mark.skipif(compose_cli() is None, reason="no docker compose CLI here; the YAML checks below stand in")
def test_docker_compose_config_accepts_the_file():
    cmd = compose_cli()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATDP_", "COMPOSE_"))}
    r = subprocess.run([*cmd, "-f", str(COMPOSE), "--profile", GPU, "config", "-q"],
                       env={**env, **BASE_ENV}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # A plain `docker compose up`: no profile, no variable set.
    r = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "--services"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {name for name, profile in SERVICES.items() if profile is None}


# --- the compose file --------------------------------------------------------------------------------

def test_services_profiles_and_images():
    services = render()["services"]
    assert set(services) == set(SERVICES)
    for name, profile in SERVICES.items():
        svc = services[name]
        assert svc.get("profiles", []) == ([profile] if profile else []), name
        assert "image" in svc or "build" in svc, name
        if name != "postgres":  # the official image's own server command
            assert svc.get("command"), f"{name}: the compose file says what runs"
    assert services["postgres"]["image"] == "postgres:16"
    assert services["vllm"]["image"].startswith("vllm/vllm-openai:")
    assert services["lb"]["image"].startswith("haproxy:")


def test_no_variable_is_required_and_the_admin_key_is_generated_once(tmp_path):
    """A plain `docker compose up` needs nothing set: without ATDP_ADMIN_KEY the first process makes one
    in the shared volume and every proxy replica and the trainer read that one."""
    from proxy.config import load_settings

    services = _walk(raw(), lambda s: interpolate(s, {}))["services"]  # raises InterpolationError on a `:?`
    keys = set()
    for name in ("proxy", *TRAINER_SERVICES):
        env = env_of(services[name])
        assert env["ATDP_ADMIN_KEY"] == ""
        home = env["ATDP_HOME"]
        assert env["ATDP_ADMIN_KEY_FILE"].startswith(home + "/")  # on the shared volume
        assert mounts(services[name])[home][0] == "atdp-data", name
        env["ATDP_ADMIN_KEY_FILE"] = str(tmp_path / Path(env["ATDP_ADMIN_KEY_FILE"]).name)
        env["ATDP_HOME"] = str(tmp_path / "home")
        keys.add(load_settings(env).admin_key)
    (key,) = keys
    assert len(key) >= 32 and (tmp_path / "admin-key").stat().st_mode & 0o777 == 0o600
    # The operator's key wins, and nothing is written then.
    env = env_of(render()["services"]["proxy"])
    assert load_settings({**env, "ATDP_HOME": str(tmp_path / "home"), "ATDP_ADMIN_KEY_FILE": str(tmp_path / "other")}
                         ).admin_key == BASE_ENV["ATDP_ADMIN_KEY"]
    assert not (tmp_path / "other").exists()


def test_a_plain_up_is_a_complete_local_stack():
    """No profile: PostgreSQL, a vLLM the proxy's upstream names, the proxy, the load balancer, the
    trainer; and whatever a default service depends on is a default service too."""
    from proxy.config import load_settings

    services = render()["services"]
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    assert default == {"postgres", "vllm-cpu", "proxy", "lb", "trainer-cpu"}
    for name in default:
        assert set(services[name].get("depends_on") or {}) <= default, name
    upstream = urlsplit(load_settings(env_of(services["proxy"])).upstream_urls[0]).hostname
    assert any(upstream in {n, *((services[n].get("networks") or {}).get("default") or {}).get("aliases", [])}
               for n in default)


def test_the_proxy_scales_behind_the_load_balancer():
    """`--scale proxy=3`: no fixed container name or host port anywhere; only `lb` publishes, and the
    proxies share continuation links through PostgreSQL."""
    from proxy.cli import build_parser
    from proxy.config import load_settings

    services = render()["services"]
    assert all("container_name" not in svc for svc in services.values())
    published = [name for name, svc in services.items() if svc.get("ports")]
    assert published == ["lb"]
    proxy = services["proxy"]
    args = build_parser().parse_args(proxy["command"][1:])
    assert proxy["expose"] == [str(args.port)]
    assert args.workers == 1 and build_parser().parse_args(render(ATDP_PROXY_WORKERS="4")["services"]["proxy"]
                                                            ["command"][1:]).workers == 4
    assert load_settings(env_of(proxy)).shared_links is True
    lb = services["lb"]
    host_addr, host_port, container_port = lb["ports"][0].rsplit(":", 2)
    assert (host_addr, host_port) == ("127.0.0.1", "8700")
    config_path = lb["command"][lb["command"].index("-f") + 1]
    assert mounts(lb)[config_path] == ("./docker/haproxy.cfg", "ro")
    assert (REPO / "docker" / "haproxy.cfg").resolve() == HAPROXY_CFG
    assert lb["depends_on"]["proxy"]["condition"] == "service_healthy"
    cfg = haproxy_sections()
    (frontend,) = [k for k in cfg if k.startswith("frontend ")]
    assert ["bind", f":{container_port}"] in cfg[frontend]
    backend_name = next(d[1] for d in cfg[frontend] if d[0] == "default_backend")
    backend = cfg[f"backend {backend_name}"]
    assert ["balance", "roundrobin"] in backend
    # Every replica, found through Docker's DNS, on the port the proxy listens on, checked on /healthz.
    template = next(d for d in backend if d[:1] == ["server-template"])
    assert template[3] == f"proxy:{args.port}" and int(template[2]) >= 3
    default_server = next(d for d in backend if d[0] == "default-server")
    resolvers = default_server[default_server.index("resolvers") + 1]
    assert "check" in default_server
    assert ["nameserver", "dns", "127.0.0.11:53"] in cfg[f"resolvers {resolvers}"]
    assert ["option", "httpchk", "GET", "/healthz"] in backend and ["http-check", "expect", "status", "200"] in backend
    # Streams live as long as the proxy's own upstream timeout allows.
    seconds = {d[1]: int(d[2].rstrip("s")) for d in cfg["defaults"] if d[0] == "timeout"}
    upstream_timeout = load_settings(env_of(proxy)).upstream_timeout_s
    assert seconds["server"] > upstream_timeout and seconds["client"] > upstream_timeout


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="no haproxy here; the parsed checks above stand in")
def test_haproxy_accepts_its_config():
    r = subprocess.run(["haproxy", "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_knob_is_documented():
    doc = DEPLOY_DOC.read_text()
    missing = sorted(k for k in knobs() if f"`{k}`" not in doc)
    assert not missing, f"docs/deploy.md does not describe {missing}"


def test_container_atdp_variables_are_read_by_the_code():
    known = code_env_names()
    services = render()["services"]
    for name, svc in services.items():
        unknown = sorted(k for k in env_of(svc) if k.startswith("ATDP_") and k not in known)
        assert not unknown, f"{name} sets {unknown}, which no code reads"
    for name in ("proxy", *TRAINER_SERVICES):
        env = env_of(services[name])
        assert {"ATDP_DATABASE_URL", "ATDP_ADMIN_KEY", "ATDP_HOME"} <= set(env), name
    assert "ATDP_UPSTREAM_URL" in env_of(services["proxy"])


def test_build_contexts_dockerfiles_and_copy_sources_exist():
    specs = build_specs()
    assert set(specs) == {"proxy", "vllm-cpu", "trainer", "trainer-cpu"}
    patterns = dockerignore()
    used = set()
    for name, (context, dockerfile, _) in specs.items():
        assert context.is_dir(), name
        assert dockerfile.is_file(), f"{name}: {dockerfile}"
        used.add(dockerfile.name)
        sources = copy_sources(dockerfile)
        assert sources, dockerfile
        for src in sources:
            assert (context / src).exists(), f"{dockerfile.name}: COPY {src} is not in the build context"
            assert not ignored(src, patterns), f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"
        stages = {args.split()[-1] for word, args in instructions(dockerfile) if word == "FROM" and " AS " in args.upper()}
        for word, args in instructions(dockerfile):
            if word == "COPY" and "--from=" in args:
                assert re.search(r"--from=(\S+)", args).group(1) in stages, f"{dockerfile.name}: {args}"
    assert used == {p.name for p in (REPO / "docker").glob("*.Dockerfile")}
    # The context must not drag environments, models or secrets along.
    for path in (".venv", ".git", "models", ".env", "proxy/__pycache__"):
        assert ignored(path, patterns), path


def test_built_images_run_as_a_non_root_user():
    for _, dockerfile, _ in build_specs().values():
        steps = instructions(dockerfile)
        final = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
        users = [args for word, args in steps[final:] if word == "USER"]
        assert users and users[-1] not in ("root", "0"), dockerfile.name


def test_trainer_image_keeps_torch_version_and_lets_the_index_pick_the_build():
    """Replays the trainer Dockerfile's rewrite of constraints.txt."""
    run = next(args for word, args in instructions(REPO / "docker" / "trainer.Dockerfile")
               if word == "RUN" and "constraints.txt >" in args)
    sed = shlex.split(run.split(">")[0])
    assert sed[0] == "sed"
    rewritten = subprocess.run(sed, cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    original = (REPO / "constraints.txt").read_text().splitlines()
    assert len(rewritten) == len(original)
    torch_pin = next(x for x in original if x.startswith("torch=="))
    version = torch_pin.split("==")[1].split("+")[0]
    assert f"torch=={version}" in rewritten
    assert [x for x in rewritten if not x.startswith("torch==")] == [x for x in original if not x.startswith("torch==")]
    assert build_specs()["trainer-cpu"][2]["TORCH_INDEX_URL"].endswith("/whl/cpu")


def test_postgres_is_healthchecked_and_waited_for():
    services = render()["services"]
    pg = services["postgres"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert mounts(pg)["/var/lib/postgresql/data"][0] == "pg-data"
    for name in ("proxy", *TRAINER_SERVICES):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name
    for name in TRAINER_SERVICES:
        assert services[name]["depends_on"]["proxy"]["condition"] == "service_healthy", name
    assert "/healthz" in " ".join(services["proxy"]["healthcheck"]["test"])


def test_named_volumes_are_declared():
    doc = render()
    declared = set(doc["volumes"])
    used = {src for svc in doc["services"].values() for src, _ in mounts(svc).values() if not src.startswith((".", "/", "~"))}
    assert used == declared


def test_proxy_has_time_to_drain_its_writer_on_stop():
    # uvicorn's graceful shutdown (30 s) + the writer's drain (30 s) fit before Docker's SIGKILL.
    grace = render()["services"]["proxy"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) >= 60


def test_proxy_listens_on_all_interfaces_with_keys_required():
    from proxy.cli import build_parser
    from proxy.config import check_listen_address, load_settings

    services = render()["services"]
    proxy = services["proxy"]
    argv = proxy["command"]
    assert argv[0] == "atdp"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"
    env = env_of(proxy)
    settings = load_settings(env)
    settings.host, settings.port = args.host, args.port or settings.port
    check_listen_address(settings)  # raises if open mode were on off loopback
    assert settings.open_mode is False
    assert settings.admin_key == BASE_ENV["ATDP_ADMIN_KEY"]
    # Published (by the load balancer) on the host's loopback unless the operator says otherwise.
    host_addr, host_port, _ = services["lb"]["ports"][0].rsplit(":", 2)
    assert (host_addr, host_port) == ("127.0.0.1", "8700")
    assert f":{settings.port}/healthz" in " ".join(proxy["healthcheck"]["test"])
    # The database URL names the postgres service and its credentials.
    pg = env_of(services["postgres"])
    url = urlsplit(settings.database_url)
    assert (url.hostname, url.port, url.username, url.password, url.path) == (
        "postgres", 5432, pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], "/" + pg["POSTGRES_DB"])
    # The operator's own values win.
    custom = render(ATDP_UPSTREAM_URL="http://a:8000,http://b:8000", POSTGRES_PASSWORD="s3cret")
    settings = load_settings(env_of(custom["services"]["proxy"]))
    assert settings.upstream_urls == ["http://a:8000", "http://b:8000"]
    assert urlsplit(settings.database_url).password == "s3cret"
    assert env_of(custom["services"]["postgres"])["POSTGRES_PASSWORD"] == "s3cret"


def _vllm_args(service: dict[str, Any]) -> dict[str, str]:
    out = {}
    for arg in service["command"]:
        key, _, value = arg.partition("=")
        out[key] = value
    return out


def test_upstream_url_reaches_either_vllm_service_on_the_internal_network():
    from proxy.config import load_settings

    services = render()["services"]
    upstream = urlsplit(load_settings(env_of(services["proxy"])).upstream_urls[0])
    for name in VLLM_SERVICES:
        svc = services[name]
        names = {name, *((svc.get("networks") or {}).get("default") or {}).get("aliases", [])}
        assert upstream.hostname in names, name
        args = _vllm_args(svc)
        assert (args["--host"], int(args["--port"])) == ("0.0.0.0", upstream.port), name
        assert "ports" not in svc, f"{name}: vLLM's dev-mode routes must not be published on the host"
        assert env_of(svc)["VLLM_SERVER_DEV_MODE"] == "1", name


def test_gpu_services_reserve_nvidia_devices_and_cpu_services_do_not():
    services = render()["services"]
    for name, profile in SERVICES.items():
        devices = (((services[name].get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        if profile == GPU:
            assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
        else:
            assert not devices, name


def test_checkpoints_and_models_have_the_same_paths_everywhere():
    """The proxy tells vLLM to load a checkpoint by the path the trainer wrote it to."""
    from proxy.config import load_settings

    services = render()["services"]
    home = load_settings(env_of(services["proxy"])).home
    data_volume = mounts(services["proxy"])[str(home)][0]
    models = mounts(services["proxy"])["/models"]
    for name in (*VLLM_SERVICES, *TRAINER_SERVICES):
        m = mounts(services[name])
        assert m[str(home)][0] == data_volume, name
        assert m["/models"] == models, name
    for name in TRAINER_SERVICES:
        assert load_settings(env_of(services[name])).checkpoints_dir == home / "checkpoints"
        assert mounts(services[name])[str(home)][1] == "rw"
    # vLLM reads the model (and checkpoints) from the same folder the trainer loads the base from.
    model = render(ATDP_MODEL="/models/my-model")["services"]
    assert {_vllm_args(model[name])["--model"] for name in VLLM_SERVICES} == {"/models/my-model"}


def test_trainer_command_runs_atdp_train_under_torchrun(monkeypatch):
    from torch.distributed.run import get_args_parser

    from proxy.cli import build_parser
    from proxy.config import load_settings

    for nproc in ("1", "4"):
        services = render(ATDP_TRAIN_NPROC=nproc)["services"]
        proxy_port = load_settings(env_of(services["proxy"])).port
        for name in TRAINER_SERVICES:
            svc = services[name]
            assert svc["command"][0] == "torchrun"
            tr = get_args_parser().parse_args(svc["command"][1:])
            assert tr.module and tr.standalone and tr.nproc_per_node == nproc
            assert tr.training_script == "proxy.cli"
            env = env_of(svc)
            assert urlsplit(env["ATDP_PROXY_URL"])[1:3] == (f"proxy:{proxy_port}", "")
            # Empty pass-through knobs must leave atdp train's defaults in place.
            for key in list(os.environ):
                if key.startswith("ATDP_"):
                    monkeypatch.delenv(key)
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            args = build_parser().parse_args(tr.training_script_args)
            assert args.command == "train" and not args.once
            assert (args.lr, args.min_steps, args.lora_r) == (1e-5, 32, 0)
            assert args.proxy_url == env["ATDP_PROXY_URL"]
    monkeypatch.setenv("ATDP_TRAIN_LR", render(ATDP_TRAIN_LR="3e-6")["services"]["trainer"]["environment"]["ATDP_TRAIN_LR"])
    assert build_parser().parse_args(["train"]).lr == 3e-6


def _vllm_python() -> str | None:
    from proxy.demo.vllm import find_vllm_python

    return find_vllm_python()


@pytest.mark.skipif(_vllm_python() is None, reason="no vLLM environment (scripts/vllm_env.sh)")
def test_vllm_accepts_both_services_arguments():
    """vLLM's own server parser (from the environment the CPU image builds) reads both commands."""
    services = render()["services"]
    check = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
        "    validate_parsed_serve_args(a)\n"
        "    out.append([a.model, a.served_model_name, a.port, a.enable_auto_tool_choice])\n"
        "print(json.dumps(out))\n"
    )
    commands = [services[name]["command"] for name in VLLM_SERVICES]
    r = subprocess.run([_vllm_python(), "-c", check, json.dumps(commands)], capture_output=True, text=True,
                       timeout=300, cwd=REPO / "docker")
    assert r.returncode == 0, r.stderr[-3000:]
    parsed = json.loads(r.stdout.strip().splitlines()[-1])
    assert parsed == [["HuggingFaceTB/SmolLM2-135M-Instruct", ["atdp"], 8000, True]] * 2
    # The GPU service runs the same module as the CPU image's entrypoint.
    entry = next(args for word, args in instructions(REPO / "docker" / "vllm-cpu.Dockerfile") if word == "ENTRYPOINT")
    assert json.loads(entry)[1:] == services["vllm"]["entrypoint"][1:]


# --- the proxy image's install, replayed -------------------------------------------------------------

def test_proxy_image_install_migrates_and_creates_keys(tmp_path, new_database):
    """The proxy Dockerfile's COPY lines into a fresh folder, built and installed as it does (not
    editable), then its `atdp` does what `docker compose exec proxy atdp ...` does."""
    dockerfile = REPO / "docker" / "proxy.Dockerfile"
    patterns = dockerignore()
    src = tmp_path / "src"
    src.mkdir()
    for item in copy_sources(dockerfile):
        path = REPO / item
        if path.is_dir():
            shutil.copytree(path, src / item, ignore=lambda d, names: [
                n for n in names if ignored(str((Path(d) / n).relative_to(REPO)), patterns)])
        else:
            shutil.copy2(path, src / Path(item).name)
    assert not list(src.rglob("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(src)],
                   check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "wheels").glob("atdp-*.whl"))
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    url = new_database("atdp_compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATDP_")}
    env.update(PYTHONPATH=str(site), ATDP_DATABASE_URL=url, ATDP_HOME=str(tmp_path / "home"))

    def atdp(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(site / "bin" / "atdp"), *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    where = subprocess.run([sys.executable, "-c", "import proxy, migrations; print(proxy.__file__, migrations.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where  # the installed copy, not the checkout
    shipped = sorted(p.name for p in (site / "migrations" / "versions").glob("*.py"))
    assert shipped == sorted(p.name for p in (REPO / "migrations" / "versions").glob("*.py"))
    r = atdp("db", "upgrade")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"database at {shipped[-1].split('_')[0]}" in r.stdout  # the newest shipped migration
    r = atdp("keys", "create", "--tenant", "acme")
    assert r.returncode == 0, r.stderr[-3000:]
    key = r.stdout.strip()
    assert len(key) >= 32 and "tenant acme" in r.stderr
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT tenant_id, is_admin FROM api_keys")).all()
    finally:
        engine.dispose()
    assert [(r.tenant_id, r.is_admin) for r in rows] == [("acme", False)]
