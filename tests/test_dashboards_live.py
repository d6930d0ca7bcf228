"""The Grafana dashboards and alert rules against live data: a real Prometheus scraping a real
`headroom serve --backend twin` that has served a few completions.

- every metric a dashboard or rule names is declared by telemetry/metrics.py (static, always runs);
- each dashboard's model_name variable finds the served model;
- every panel query runs without error, and every query returns data unless all the metrics it names
  are in OPTIONAL_METRICS (series that legitimately stay absent: see the reasons there). Counters that
  only move on OOMs or backoffs still return data: the server exports them at 0 from the start;
- every alert rule evaluates without error.

Skips (with the reason) where `headroom serve`, the twin or the adaptive controller is not built yet, or
where the `prometheus` binary (Debian's `prometheus` package) is missing. About 20-40 s.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((REPO / "dashboards" / "grafana" / "dashboards").glob("*.json"))
RULES = REPO / "dashboards" / "prometheus" / "rules.yml"
PROMETHEUS = shutil.which("prometheus")
# Metric names as they appear in PromQL (vLLM's carry a colon).
METRIC_RE = re.compile(r"\b(?:vllm:|headroom_)[A-Za-z0-9_:]+")
# (headroom_device_*_bytes are absent on CPU, where nothing reports device memory; the twin emulates NVML.)
OPTIONAL_METRICS = {
    "headroom_limit_max_batched_tokens": "absent while unlimited, which the adaptive controller leaves it",
}
# Grafana's built-in variables, sized for this test: a 1m window covers the whole run.
BUILTINS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "1s"}
NUM_REQUESTS = 8
HTTP = httpx.Client(timeout=10)  # one client: a fresh httpx.get per query costs ~0.1 s

pytestmark = pytest.mark.timeout(180)


def panel_targets() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every panel."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            out += [(path.name, panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return out


def rule_exprs() -> list[str]:
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def model_variable_metric(dashboard: dict) -> str:
    var = next(v for v in dashboard["templating"]["list"] if v["name"] == "model_name")
    match = re.fullmatch(r"label_values\(([^,]+),\s*model_name\)", var["query"]["query"])
    assert match, var["query"]
    return match.group(1)


SELECTOR = '{model_name=~"$model_name",replica=~"$replica"'


def test_dashboards_are_templated() -> None:
    """Static: every panel and query uses the datasource variable and filters on $model_name and $replica (a
    `--replicas N` fleet labels every series with its replica; one process has no such label, which `.*`
    matches)."""
    assert [p.name for p in DASHBOARDS] == ["controller.json", "serving.json"]
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model_name", "replica"}
        model_variable_metric(dashboard)
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]
                assert SELECTOR in target["expr"], (panel["title"], target["expr"])


def test_every_named_metric_is_exported() -> None:
    """Static: every metric the dashboards and rules name is declared by telemetry/metrics.py."""
    from telemetry.metrics import Metrics

    text = Metrics().exposition().decode()
    declared = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        declared.add(name)
        if kind == "histogram":
            declared |= {name + "_bucket", name + "_sum", name + "_count"}
    named = {m for _, _, expr in panel_targets() for m in METRIC_RE.findall(expr)}
    named |= {m for expr in rule_exprs() for m in METRIC_RE.findall(expr)}
    assert named - declared == set(), "named in dashboards/rules but not declared in telemetry/metrics.py"
    assert set(OPTIONAL_METRICS) <= declared


# ---- the live stack ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], object], what: str, timeout: float, proc: subprocess.Popen, log: Path):
    """Poll `check` until it returns a truthy value; fail with the process log if it dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}\n{log.read_text()[-4000:]}")
        try:
            value = check()
            if value:
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{log.read_text()[-4000:]}")


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def missing_server_parts() -> list[str]:
    missing = []
    for module in ("engine.serving.cli", "engine.backends.twin.backend", "controller.adaptive"):
        try:
            found = find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(module)
    return missing


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    if PROMETHEUS is None:
        pytest.skip("prometheus not found (apt-get install prometheus)")
    missing = missing_server_parts()
    if missing:
        pytest.skip(f"`headroom serve --backend twin --policy adaptive` needs {', '.join(missing)} (not built yet)")
    port, log = free_port(), tmp_path_factory.mktemp("server") / "server.log"
    script = Path(sys.executable).with_name("headroom")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "headroom.cli"]
    cmd += ["serve", "--backend", "twin", "--policy", "adaptive", "--host", "127.0.0.1", "--port", str(port)]
    proc = start(cmd, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: HTTP.get(url + "/v1/models", timeout=2).status_code == 200, "the server", 60, proc, log)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def prometheus(server: str, tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "headroom", "static_configs": [{"targets": [server.removeprefix("http://")]}]}],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port, log = free_port(), tmp / "prometheus.log"
    proc = start(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: HTTP.get(url + "/-/ready", timeout=2).status_code == 200, "prometheus", 30, proc, log)
        wait_for(lambda: query(url, 'up{job="headroom"} == 1'), "the first scrape", 30, proc, log)
        yield url
    finally:
        stop(proc)


class QueryError(Exception):
    pass


def query(prom: str, expr: str) -> list:
    """Instant query's result; QueryError with Prometheus's message on a query error."""
    body = HTTP.get(prom + "/api/v1/query", params={"query": expr}, timeout=10).json()
    if body["status"] != "success":
        raise QueryError(f"{expr}\n  -> {body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


@pytest.fixture(scope="module")
def loaded(server: str, prometheus: str) -> tuple[str, str]:
    """Serve a few completions, wait until Prometheus has scraped their end. Returns (prometheus, model)."""
    model = HTTP.get(server + "/v1/models", timeout=5).json()["data"][0]["id"]

    def complete(i: int) -> None:
        body = {"model": model, "prompt": "Count to ten: " + "one two " * (4 * i), "max_tokens": 24}
        r = HTTP.post(server + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(complete, range(NUM_REQUESTS)))

    def scraped() -> bool:
        result = query(prometheus, "sum(vllm:request_success_total)")
        return bool(result) and float(result[0]["value"][1]) >= NUM_REQUESTS

    deadline = time.monotonic() + 30
    while not scraped():
        assert time.monotonic() < deadline, "Prometheus never saw the completions"
        time.sleep(0.5)
    time.sleep(2)  # a couple more samples, and rule evaluations, after the load
    return prometheus, model


def test_model_variable_finds_the_model(loaded: tuple[str, str]) -> None:
    prom, model = loaded
    for path in DASHBOARDS:
        metric = model_variable_metric(json.loads(path.read_text()))
        r = HTTP.get(prom + "/api/v1/label/model_name/values", params={"match[]": metric}, timeout=10).json()
        assert model in r["data"], (path.name, metric, r)


def substitute(expr: str, model: str) -> str:
    # A single selected value, regex-escaped as Grafana does, inside a PromQL string (backslashes doubled).
    expr = expr.replace("$model_name", re.escape(model).replace("\\", "\\\\"))
    expr = expr.replace("$replica", ".*")  # All: one process's series have no replica label
    for var, value in BUILTINS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def test_every_panel_query_runs_and_core_queries_return_data(loaded: tuple[str, str]) -> None:
    prom, model = loaded
    errors, empty = [], []
    for dashboard, title, expr in panel_targets():
        try:
            result = query(prom, substitute(expr, model))
        except QueryError as e:
            errors.append(f"{dashboard} / {title}: {e}")
            continue
        if not result and not set(METRIC_RE.findall(expr)) <= set(OPTIONAL_METRICS):
            empty.append(f"{dashboard} / {title}: {expr}")
    assert not errors, "query errors:\n" + "\n".join(errors)
    assert not empty, "core queries with no data:\n" + "\n".join(empty)


# Signals that must be positive once the server has served: a gauge stuck at its initial 0 would still
# "return data" above.
POSITIVE = (
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "headroom_memory_capacity_bytes",
    "headroom_memory_budget_bytes",
    "headroom_kv_blocks_capacity",
    "headroom_engine_healthy",
    "headroom_limit_max_prefill_tokens",
    "headroom_limit_max_num_seqs",
)


def test_core_signals_are_positive(loaded: tuple[str, str]) -> None:
    prom, model = loaded
    values = {m: query(prom, f'{m}{{model_name="{model}"}}') for m in POSITIVE}
    bad = {m: [r["value"][1] for r in v] for m, v in values.items() if not v or float(v[0]["value"][1]) <= 0}
    assert not bad, bad


def test_alert_rules_evaluate(loaded: tuple[str, str]) -> None:
    prom, _ = loaded
    groups = HTTP.get(prom + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(rule_exprs())
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
