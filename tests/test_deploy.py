"""docker-compose.yml, checked by a real compose parser (Debian's docker-compose 1.29; no Docker engine needed)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from tiers import process_fixture
from typer.testing import CliRunner

from cli import app
from jobs.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE, ENV_EXAMPLE, DOCKERFILE = ROOT / "docker-compose.yml", ROOT / ".env.example", ROOT / "Dockerfile"
LONG_RUNNING = {"redis", "postgres", "dht", "server1", "server2", "worker", "beat", "api"}
ONE_SHOT = {"migrate", "model", "swarm-init"}
MONITORING = {"prometheus", "grafana"}  # the profile `monitoring`: started only with --profile monitoring
MEMBERS = {"dht", "server1", "server2", "worker"}  # the processes of the private swarm, each with its own key
HEALTHY, COMPLETED = "service_healthy", "service_completed_successfully"


def compose_config(env_file: Path) -> subprocess.CompletedProcess[str]:
    """`docker-compose config`: the file validated, interpolated from `env_file` and normalized."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: run 'apt-get install -y docker-compose' (.ci/run does)",
                    pytrace=False)
    # only PATH: variables of this shell must not override the env file under test
    return subprocess.run([exe, "-f", str(COMPOSE), "--env-file", str(env_file), "config"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})


def services_for(env_file: Path) -> dict[str, Any]:
    """The normalized services, failing with compose's own message if the file is invalid."""
    proc = compose_config(env_file)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["services"]


@process_fixture(scope="module")  # runs docker-compose
def config() -> dict[str, Any]:
    """The whole normalized compose file for .env.example."""
    proc = compose_config(ENV_EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_the_compose_file_defines_every_service_of_the_deployment(config: dict[str, Any]) -> None:
    assert set(config["services"]) == LONG_RUNNING | ONE_SHOT | MONITORING


def test_a_plain_up_starts_the_deployment_alone_the_monitoring_profile_adds_prometheus_and_grafana(
        config: dict[str, Any]) -> None:
    profiles = {name: service.get("profiles", []) for name, service in config["services"].items()}
    assert {name for name, listed in profiles.items() if not listed} == LONG_RUNNING | ONE_SHOT
    assert {name: profiles[name] for name in MONITORING} == {name: ["monitoring"] for name in MONITORING}
    # nothing of the deployment waits for them, and they add no named volume a plain `up` would create
    assert not any(set(service.get("depends_on", {})) & MONITORING for service in config["services"].values())
    assert not any(named_mounts(config["services"][name]) for name in MONITORING)


def test_every_long_running_service_has_a_healthcheck_and_one_shots_do_not_restart(config: dict[str, Any]) -> None:
    for name in LONG_RUNNING | MONITORING:
        health = config["services"][name].get("healthcheck", {})
        assert health.get("test") and not health.get("disable"), name
    for name in ONE_SHOT:
        assert config["services"][name]["restart"] == "no", name


def test_services_wait_for_healthy_dependencies_and_finished_one_shots(config: dict[str, Any]) -> None:
    stores = {"redis": HEALTHY, "postgres": HEALTHY, "migrate": COMPLETED}
    members = {"swarm-init": COMPLETED}  # every member starts once its key and the swarm file exist
    expected = {
        "migrate": {"postgres": HEALTHY},
        "dht": members,
        "server1": {"dht": HEALTHY, "model": COMPLETED, **members},
        "server2": {"dht": HEALTHY, "model": COMPLETED, **members},
        "worker": {**stores, "model": COMPLETED, "dht": HEALTHY, **members},
        "beat": stores,
        "api": {**stores, "model": COMPLETED},
    }
    got = {name: {dep: spec["condition"] for dep, spec in service.get("depends_on", {}).items()}
           for name, service in config["services"].items() if service.get("depends_on")}
    assert got == expected


def test_named_volumes_keep_postgres_data_models_the_keys_the_dht_address_and_the_home(config: dict[str, Any]) -> None:
    assert {"postgres-data", "models", "swarmbatch-home", "dht-address", "swarm-file", *KEY_VOLUMES} <= set(config["volumes"])

    def mounts(name: str) -> set[str]:
        return {entry.rsplit(":", 1)[0] for entry in config["services"][name]["volumes"]}

    assert "postgres-data:/var/lib/postgresql/data" in mounts("postgres")
    assert {"dht-identity:/keys", "dht-address:/dht"} <= mounts("dht")
    for name in ("server1", "server2", "worker", "api", "model"):
        assert "models:/data/models" in mounts(name), name
    for name in ("worker", "api", "model", "beat"):
        assert "swarmbatch-home:/data" in mounts(name), name
    for name in ("server1", "server2", "worker"):
        assert "dht-address:/dht" in mounts(name), name


# ---- least privilege: who reaches the store, who may write the models ----------------------------------------------

STORE_USERS = {"migrate", "worker", "beat", "api"}
P2P_FACING = {"dht", "server1", "server2"}  # their ports face the network when BIND_ADDR is set


def test_the_p2p_facing_services_have_neither_the_stores_address_nor_its_password(config: dict[str, Any]) -> None:
    services = config["services"]
    password = "change-me-to-a-long-random-password"  # .env.example's
    assert password in services["worker"]["environment"]["SWARMBATCH_DATABASE_URL"]  # the check below can see it
    for name in P2P_FACING | {"model", "swarm-init"}:
        environment = services[name].get("environment", {})
        assert not {"SWARMBATCH_DATABASE_URL", "SWARMBATCH_BROKER_URL", "POSTGRES_PASSWORD"} & set(environment), name
        assert not any(password in str(value) for value in environment.values()), name
    for name in STORE_USERS:
        assert services[name]["environment"]["SWARMBATCH_DATABASE_URL"].startswith("postgresql"), name


def test_redis_and_postgres_sit_on_an_internal_network_that_only_the_stores_users_join(config: dict[str, Any]) -> None:
    services, networks = config["services"], config["networks"]
    assert networks["store"].get("internal") is True
    assert not any(network.get("internal") for name, network in networks.items() if name != "store")

    def joined(name: str) -> set[str]:
        return set(services[name].get("networks") or {})

    for name in ("redis", "postgres"):
        assert joined(name) == {"store"}, name
    assert {name for name in services if "store" in joined(name)} == {"redis", "postgres", *STORE_USERS}
    assert {name for name in services if "swarm" in joined(name)} == P2P_FACING | {"worker", "prometheus"}
    assert services["swarm-init"].get("network_mode") == "none"


def test_only_the_model_preparation_writes_the_models_and_the_api_sees_no_schedules(config: dict[str, Any]) -> None:
    services = config["services"]
    writers = {name for name, service in services.items()
               if any(entry.startswith("models:") and not entry.endswith(":ro") for entry in service.get("volumes", []))}
    assert writers == {"model"}
    assert not any(entry.split(":")[1] == "/schedules" for entry in services["api"]["volumes"])
    for name in P2P_FACING:  # nor the home the store's users share (beat's schedule file, demo logs)
        assert "swarmbatch-home" not in named_mounts(services[name]), name


# ---- deployment defaults: bind address, a non-root user, keys mounted into their owners alone, no example password ---

KEY_VOLUMES = {"dht-identity": "dht", "server1-identity": "server1", "server2-identity": "server2",
               "worker-identity": "worker"}  # volume -> owner


def named_mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's named volumes (not bind mounts): volume -> its path in the container."""
    found = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if not source.startswith(("/", ".")):
            found[source] = target
    return found


def test_every_port_is_published_on_bind_addr_which_defaults_to_this_host_only(config: dict[str, Any],
                                                                              tmp_path: Path) -> None:
    published = {name: service["ports"] for name, service in config["services"].items() if service.get("ports")}
    assert set(published) == {"dht", "server1", "server2", "api"} | MONITORING  # never Redis or PostgreSQL
    assert all(port.startswith("127.0.0.1:") for ports in published.values() for port in ports), published
    env_file = tmp_path / ".env"
    env_file.write_text(ENV_EXAMPLE.read_text() + "BIND_ADDR=192.0.2.10\n")  # the last one wins
    ports = [port for service in services_for(env_file).values() for port in service.get("ports", [])]
    assert len(ports) == 8 and all(port.startswith("192.0.2.10:") for port in ports), ports


def identity_path(service: dict[str, Any], args: list[str]) -> str:
    """The key file a member process runs with: its --identity, or SWARMBATCH_IDENTITY (the worker's clients)."""
    return args[args.index("--identity") + 1] if "--identity" in args else service["environment"]["SWARMBATCH_IDENTITY"]


def test_each_private_key_is_mounted_into_the_service_that_owns_it_and_swarm_init_alone(config: dict[str, Any]) -> None:
    services, invocations = config["services"], swarmbatch_invocations(config["services"])
    init_mounts = named_mounts(services["swarm-init"])
    for volume, owner in KEY_VOLUMES.items():
        assert {name for name, service in services.items() if volume in named_mounts(service)} == {owner, "swarm-init"}
        identity = identity_path(services[owner], invocations[owner])
        assert identity.startswith(named_mounts(services[owner])[volume] + "/"), (owner, identity)
        # swarm-init writes the key where the owner reads it: the same file name in the same volume
        assert init_mounts[volume] == f"/members/{owner}" and identity.endswith("/identity.key"), (owner, identity)
    assert "key=/members/$$member/identity.key" in " ".join(services["swarm-init"]["command"])
    assert not services["swarm-init"].get("ports")
    for name in ("api", "beat", "migrate", "model"):  # nothing holding a key: not even a shared volume
        assert not set(named_mounts(services[name])) & set(KEY_VOLUMES), name
        assert "--identity" not in invocations[name] and "SWARMBATCH_IDENTITY" not in services[name]["environment"]


def test_the_compose_swarm_is_private_every_member_reads_the_swarm_file_swarm_init_writes(
        config: dict[str, Any]) -> None:
    services = config["services"]
    assert named_mounts(services["swarm-init"])["swarm-file"] == "/swarm"
    assert "swarm-file:/swarm:rw" in services["swarm-init"]["volumes"]  # written there
    for name in MEMBERS:
        assert "swarm-file:/swarm:ro" in services[name]["volumes"], name
        assert services[name]["environment"]["SWARMBATCH_SWARM_FILE"] == "/swarm/swarm.json", name
    for name in ("api", "beat", "migrate", "model"):  # they never talk to the swarm
        assert "swarm-file" not in named_mounts(services[name]), name
    script = " ".join(services["swarm-init"]["command"])
    assert "swarmbatch swarm init /swarm/swarm.json" in script
    assert "for member in " + " ".join(sorted(MEMBERS)) + ";" in script
    assert "swarmbatch swarm add-member /swarm/swarm.json $$key --name $$member" in script


def dockerfile_lines() -> list[str]:
    return [line.strip() for line in DOCKERFILE.read_text().splitlines()]


def test_the_image_runs_as_a_non_root_user_who_owns_every_volume_mount_point(config: dict[str, Any]) -> None:
    lines = dockerfile_lines()
    user_at = max(i for i, line in enumerate(lines) if line.startswith("USER "))
    user = lines[user_at].split()[1].split(":")[0]
    assert user not in {"root", "0"} and any("useradd" in line and line.endswith(f" {user}") for line in lines)
    chown_at, chowned = next((i, line.split("chown ", 1)[1].split()) for i, line in enumerate(lines) if "chown " in line)
    assert chowned[0].split(":")[0] == user and chown_at < user_at
    swarmbatch = [s for s in config["services"].values() if s.get("image", "").startswith("swarmbatch")]
    targets = {target for service in swarmbatch for target in named_mounts(service).values()}
    assert targets <= set(chowned[1:]), f"mount points not owned by {user} in the image: {targets - set(chowned[1:])}"
    assert all(service.get("user") in (None, user) for service in swarmbatch)  # no service switches back to root


@pytest.mark.swarm  # runs sh
def test_the_example_password_stops_the_stack_at_migrate_in_one_line(config: dict[str, Any]) -> None:
    example = re.search(r"^POSTGRES_PASSWORD=(.+)$", ENV_EXAMPLE.read_text(), flags=re.M)
    assert example is not None
    migrate = config["services"]["migrate"]
    assert migrate["environment"]["POSTGRES_PASSWORD"] == example.group(1)
    # the shell check before `exec swarmbatch db upgrade`, as the container's sh gets it ($$ is compose's escape)
    check = " ".join(migrate["command"]).replace("$$", "$").split("&& exec swarmbatch")[0]

    def run(password: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", "-c", check], capture_output=True, text=True, timeout=30,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "POSTGRES_PASSWORD": password})

    refused = run(example.group(1))
    assert refused.returncode == 2 and refused.stderr.startswith("Error: POSTGRES_PASSWORD is the example")
    assert len(refused.stderr.splitlines()) == 1
    assert run("a-long-random-password-of-our-own").returncode == 0
    # and nothing that uses the database starts unless migrate succeeded (its dependencies are tested above)
    for name in ("worker", "beat", "api"):
        assert config["services"][name]["depends_on"]["migrate"]["condition"] == COMPLETED


def test_the_servers_block_ranges_come_from_the_env_file(config: dict[str, Any], tmp_path: Path) -> None:
    assert "--blocks 0:15" in server_command(config["services"], "server1")
    assert "--blocks 15:30" in server_command(config["services"], "server2")
    env_file = tmp_path / ".env"
    env_file.write_text(ENV_EXAMPLE.read_text() + "SERVER1_BLOCKS=0:7\nSERVER2_BLOCKS=7:30\n")  # the last one wins
    services = services_for(env_file)
    assert "--blocks 0:7 " in server_command(services, "server1")
    assert "--blocks 7:30 " in server_command(services, "server2")


def server_command(services: dict[str, Any], name: str) -> str:
    """A shell-wrapped service's command line as one string."""
    return " ".join(services[name]["command"])


@pytest.mark.swarm  # runs docker-compose
def test_compose_refuses_to_run_without_a_postgres_password(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("\n".join(line for line in ENV_EXAMPLE.read_text().splitlines()
                                  if not line.startswith("POSTGRES_PASSWORD=")))
    proc = compose_config(env_file)
    assert proc.returncode != 0 and "set POSTGRES_PASSWORD in .env" in proc.stderr


def all_swarmbatch_invocations(services: dict[str, Any]) -> dict[str, list[list[str]]]:
    """Per service, the argument lists of every `swarmbatch` command it runs (image entrypoint, or inside `sh -c`)."""
    found: dict[str, list[list[str]]] = {}
    for name, service in services.items():
        if "image" in service and not service["image"].startswith("swarmbatch"):
            continue
        command = service["command"]
        if service.get("entrypoint") == ["/bin/sh", "-c"]:
            found[name] = []
            for segment in re.split(r"&&|\|\||;|[{}]", " ".join(command)):
                if "swarmbatch " in segment and "echo" not in segment:
                    words = shlex.split(segment.split("swarmbatch ", 1)[1])
                    found[name].append(words[:words.index(">")] if ">" in words else words)
        else:
            found[name] = [list(command)]
    return found


def swarmbatch_invocations(services: dict[str, Any]) -> dict[str, list[str]]:
    """Per service, the argument list of its (first) `swarmbatch` command."""
    return {name: commands[0] for name, commands in all_swarmbatch_invocations(services).items()}


def resolve(args: list[str]) -> tuple[list[str], Any]:
    """The subcommand path at the start of `args` and its click command (typer ships its own click: duck-typed)."""
    command: Any = typer.main.get_command(app)
    path: list[str] = []
    while hasattr(command, "commands") and len(args) > len(path) and args[len(path)] in command.commands:
        word = args[len(path)]
        command, path = command.commands[word], [*path, word]
    return path, command


def test_every_swarmbatch_command_in_the_compose_file_is_a_real_cli_command(config: dict[str, Any]) -> None:
    invocations = all_swarmbatch_invocations(config["services"])
    assert set(invocations) == LONG_RUNNING - {"redis", "postgres"} | ONE_SHOT
    assert len(invocations["swarm-init"]) == 3  # swarm init, new-key, add-member
    runner = CliRunner()
    for name, args in ((name, args) for name, commands in invocations.items() for args in commands):
        path, command = resolve(args)
        assert path and not hasattr(command, "commands"), f"{name}: {args}"
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, f"{name}: swarmbatch {' '.join(path)} --help: {result.output}"
        known = {opt for param in command.params for opt in param.opts}
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(args)))
        assert flags <= known, f"{name}: swarmbatch {' '.join(path)} has no {sorted(flags - known)}"


def test_every_variable_the_compose_file_uses_is_documented_in_env_example() -> None:
    used = set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", COMPOSE.read_text()))
    documented = set(re.findall(r"^([A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), flags=re.M))
    assert used - documented == set()
    settings = {f"SWARMBATCH_{field.upper()}" for field in Settings.model_fields}
    assert {name for name in documented if name.startswith("SWARMBATCH_")} <= settings


def test_the_image_installs_the_cpu_torch_before_the_project_and_runs_swarmbatch() -> None:
    lines = dockerfile_lines()
    # by default from the PyTorch CPU index (a build without it passes TORCH_SOURCE, scripts/compose-smoke.sh)
    assert 'ARG TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cpu"' in lines
    torch_at = lines.index("RUN pip install torch==2.13.0 $TORCH_SOURCE")
    project_at = next(i for i, line in enumerate(lines) if line.startswith("RUN pip install ."))
    assert "FROM python:3.11-slim" in lines and torch_at < project_at
    assert 'ENTRYPOINT ["swarmbatch"]' in lines



def test_every_data_file_of_the_shipped_packages_is_package_data_so_a_non_editable_install_has_it() -> None:
    # setuptools ships a package's .py files alone; anything else (the demo's documents, the web view, alembic's
    # template) reaches a non-editable install (the image, `pip install .`) only through a package-data glob
    from launch import demo

    assert len(demo.sample_documents()) >= 4
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {path for package, globs in setuptools["package-data"].items() for glob in globs
              for path in (ROOT / package.replace(".", "/")).glob(glob)}
    packages = [ROOT / name.rstrip("*") for name in setuptools["packages"]["find"]["include"]]
    data = {path for package in packages for path in package.rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    assert set(demo.sample_documents()) <= data
    unlisted = sorted(str(path.relative_to(ROOT)) for path in data - listed)
    assert not unlisted, f"not in [tool.setuptools.package-data]: {unlisted}"


# ---- the stack for real: scripts/compose-smoke.sh ---------------------------------------------------------------------
SKIPPED = 77  # the script's exit status when it cannot run here; its last stderr line says why


@pytest.mark.slow  # the real SmolLM2, a Docker build and the whole stack: minutes (docs/deploying.md, docker compose)
@pytest.mark.swarm
@pytest.mark.timeout(3600)
def test_the_compose_stack_builds_runs_a_batch_through_its_private_swarm_and_leaves_nothing_running() -> None:
    """The image from the project's Dockerfile; `up` healthy; the swarm private (an outsider's key refused); a key
    from `keys create`; a JSONL batch over HTTP through the worker and both servers; /metrics; the demo inside the
    image; `down -v` leaves nothing. The script also stops dockerd and undoes its host changes if it started it."""
    if os.environ.get("SWARMBATCH_SKIP_COMPOSE") == "1":
        pytest.skip("SWARMBATCH_SKIP_COMPOSE=1")
    script = subprocess.Popen(["bash", str(ROOT / "scripts" / "compose-smoke.sh")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        out, err = script.communicate(timeout=3300)
    except subprocess.TimeoutExpired:
        script.terminate()  # SIGTERM: its trap takes the stack down and stops the dockerd it started
        out, err = script.communicate(timeout=300)
        pytest.fail(f"compose-smoke.sh ran over 3300 s:\n{out[-6000:]}\n{err[-6000:]}")
    if script.returncode == SKIPPED:
        pytest.skip(err.strip().splitlines()[-1])
    assert script.returncode == 0, f"{out[-6000:]}\n{err[-6000:]}"
    assert "nothing of swarmbatch-smoke is left" in out
    print(out[out.index("---- image sizes"):])


def test_every_name_a_healthcheck_imports_from_our_packages_exists() -> None:
    # a moved function (jobs.runtime.get_runtime -> jobs.assembly) left the compose worker unhealthy: the
    # healthchecks' `python -c` code runs only inside the stack, so its imports are checked here
    import importlib

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    imported = [(service, module, name) for service, spec in compose["services"].items()
                for part in map(str, (spec.get("healthcheck") or {}).get("test") or [])
                for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", part)
                for name in names.replace(" ", "").split(",")]
    assert any(module == "jobs.assembly" for _, module, _ in imported), imported  # the walker read the worker's
    for service, module, name in imported:
        assert hasattr(importlib.import_module(module), name), f"{service}'s healthcheck imports {module}.{name}"


# ---- the profile `monitoring` (docs/monitoring.md; deploy/prometheus is also checked by promtool in test_monitoring) --
def bind_mounts(service: dict[str, Any]) -> dict[Path, str]:
    """A service's bind mounts: host path -> its path in the container."""
    found = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if source.startswith("/"):
            found[Path(source)] = target
    return found


def test_the_monitoring_services_mount_the_repositorys_config_files_read_only(config: dict[str, Any]) -> None:
    mounts = {name: bind_mounts(config["services"][name]) for name in MONITORING}
    deploy = ROOT / "deploy"
    assert mounts["prometheus"] == {deploy / "prometheus" / "prometheus.yml": "/etc/prometheus/prometheus.yml",
                                    deploy / "prometheus" / "alerts.yml": "/etc/prometheus/alerts.yml"}
    assert mounts["grafana"] == {deploy / "grafana" / "provisioning": "/etc/grafana/provisioning",
                                 deploy / "grafana" / "dashboards": "/var/lib/grafana/dashboards"}
    for name in MONITORING:
        assert all(path.exists() for path in mounts[name]), mounts[name]
        assert all(entry.endswith(":ro") for entry in config["services"][name]["volumes"]), name
    # prometheus.yml's relative paths are relative to it: the rules beside it, the token its container writes there
    prometheus = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["alerts.yml"]
    command = " ".join(config["services"]["prometheus"]["command"])
    token = next(job["authorization"]["credentials_file"] for job in prometheus["scrape_configs"] if "authorization" in job)
    assert f'> /etc/prometheus/{token} &&' in command and "--config.file=/etc/prometheus/prometheus.yml" in command
    dashboards = yaml.safe_load((deploy / "grafana" / "provisioning" / "dashboards" / "swarmbatch.yml").read_text())
    assert dashboards["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert list((deploy / "grafana" / "dashboards").glob("*.json"))


def test_prometheus_scrapes_the_api_and_every_server_that_serves_metrics(config: dict[str, Any]) -> None:
    services = config["services"]
    api = swarmbatch_invocations(services)["api"]
    expected = {"swarmbatch-api": {f"api:{api[api.index('--port') + 1]}"}, "swarmbatch-servers": set()}
    for name, args in swarmbatch_invocations(services).items():
        if "--metrics-port" in args:
            expected["swarmbatch-servers"].add(f"{name}:{args[args.index('--metrics-port') + 1]}")
    assert expected["swarmbatch-servers"] == {"server1:9100", "server2:9100"}
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: {target for group in job["static_configs"] for target in group["targets"]}
               for job in prometheus["scrape_configs"]}
    assert targets == expected
    # and the API's token reaches Prometheus (empty: /metrics is public)
    assert services["prometheus"]["environment"]["METRICS_TOKEN"] == services["api"]["environment"]["SWARMBATCH_METRICS_TOKEN"]


@pytest.mark.swarm  # runs sh
def test_grafana_refuses_to_start_without_an_admin_password_in_one_line(config: dict[str, Any]) -> None:
    check = " ".join(config["services"]["grafana"]["command"]).replace("$$", "$").split("&& exec /run.sh")[0]

    def run(password: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", "-c", check], capture_output=True, text=True, timeout=30,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GF_SECURITY_ADMIN_PASSWORD": password})

    refused = run("")
    assert refused.returncode == 2 and refused.stderr == "Error: set GRAFANA_ADMIN_PASSWORD in .env for the monitoring profile\n"
    assert run("a-long-random-password").returncode == 0
    assert config["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ""  # .env.example sets none
