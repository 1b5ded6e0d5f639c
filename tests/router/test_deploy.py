"""The deployment recipes under deploy/ cannot run here: parse them, and check that every `radixgen` command
line they hold parses with the real CLI, that probes hit real routes, and that the Kubernetes pieces agree
(grace period vs the server's drain time, worker DNS names vs the headless Service, ports)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

import radixgen.cli as cli
import radixgen.cli.router as cli_router
import radixgen.cli.serve as cli_serve
from radixgen.router.app import create_router_app
from radixgen.router.config import RouterConfig
from radixgen.runtime.server.launch import SHUTDOWN_GRACE_S

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
GRACE_MARGIN_S = (5, 60)  # terminationGracePeriodSeconds - SHUTDOWN_GRACE_S must fall in this range


def k8s_docs() -> list[dict]:
    return [d for f in K8S for d in yaml.safe_load_all(f.read_text()) if d]


def k8s_containers() -> list[tuple[dict, dict]]:
    """(the workload, one of its containers) for every Deployment / StatefulSet."""
    out = []
    for doc in k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            out += [(doc, c) for c in doc["spec"]["template"]["spec"]["containers"]]
    return out


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def dockerfile_argv(path: Path) -> list[str]:
    """ENTRYPOINT + CMD (exec form) of a Dockerfile."""
    text = path.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    return entry + cmd


def every_command() -> list[tuple[str, list[str]]]:
    """(where, argv) of every radixgen command line in deploy/."""
    out = []
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        out.append((name, dockerfile_argv(DEPLOY / name)))
    for service, spec in compose()["services"].items():
        out.append((f"compose {service}", spec["entrypoint"] + spec["command"]))
    for workload, c in k8s_containers():
        out.append((f"k8s {workload['metadata']['name']}", c["command"] + c.get("args", [])))
    # the Dockerfile's usage comment: `docker run ... radixgen:cpu serve ...`
    for line in (DEPLOY / "Dockerfile.cpu").read_text().splitlines():
        m = re.search(r"radixgen:cpu (serve .*?)\s*(#|$)", line)
        if m:
            out.append(("Dockerfile.cpu usage", ["radixgen", *m.group(1).split()]))
    return out


def parse_with_the_cli(argv: list[str], monkeypatch) -> tuple[str, object]:
    """Run radixgen.cli.main on argv with the real parsers and validation; capture what it would run."""
    seen = []
    monkeypatch.setattr(cli_serve, "run_server", lambda args: seen.append(("serve", args)) or 0)
    monkeypatch.setattr(cli_router, "run_router", lambda config, urls: seen.append(("router", (config, urls))) or 0)
    assert argv[0] == "radixgen", argv
    assert cli.main(argv[1:]) == 0
    return seen[0]


def test_every_command_parses_with_the_cli(monkeypatch):
    commands = every_command()
    assert len(commands) >= 8
    kinds = set()
    for where, argv in commands:
        try:
            kind, parsed = parse_with_the_cli(argv, monkeypatch)
        except SystemExit as e:  # argparse: an unknown flag or a bad value
            pytest.fail(f"{where}: `{' '.join(argv)}` does not parse (exit {e.code})")
        kinds.add(kind)
        if kind == "serve":
            assert parsed.server.host == "0.0.0.0" and parsed.server.port == 30000, where
    assert kinds == {"serve", "router"}


def test_the_cli_rejects_what_is_not_there(monkeypatch):
    """The check above can fail: a made-up flag or a bad value is refused by the same path."""
    for argv in (["radixgen", "serve", "--no-such-flag"], ["radixgen", "router", "--policy", "fastest"],
                 ["radixgen", "router", "--worker-urls", "worker-0:30000"]):
        with pytest.raises(SystemExit):
            parse_with_the_cli(argv, monkeypatch)


def probes() -> list[tuple[str, str, str]]:
    """(where, which app: server or router, path) of every probe and healthcheck."""
    out = []
    for workload, c in k8s_containers():
        app = "router" if c["command"] + c["args"][:1] == ["radixgen", "router"] else "server"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                probe = c[kind]["httpGet"]
                names = {p["name"]: p["containerPort"] for p in c["ports"]}
                port = names.get(probe["port"], probe["port"])
                assert str(port) == _flag(c["args"], "--port"), f"{workload['metadata']['name']} {kind}: port"
                out.append((f"{workload['metadata']['name']} {kind}", app, probe["path"]))
    for service, spec in compose()["services"].items():
        app = spec["command"][0] if spec["command"][0] == "router" else "server"
        url = re.search(r"http://localhost:(\d+)(/[\w/]*)", " ".join(spec["healthcheck"]["test"]))
        assert url.group(1) == _flag(spec["command"], "--port"), f"compose {service}: healthcheck port"
        out.append((f"compose {service}", app, url.group(2)))
    return out


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_router_probes_hit_real_routes():
    routes = {r.path for r in create_router_app(RouterConfig()).routes}
    found = [(where, path) for where, app, path in probes() if app == "router"]
    assert found
    for where, path in found:
        assert path in routes, f"{where}: {path} is not a route of the router ({sorted(routes)})"


@pytest.mark.slow
def test_server_probes_hit_real_routes(workers):
    found = [(where, path) for where, app, path in probes() if app == "server"]
    assert len(found) >= 4
    for where, path in found:  # probes carry no API key: the route must answer without one
        r = httpx.get(workers[0].url + path, timeout=30)
        assert r.status_code == 200, f"{where}: GET {path} -> {r.status_code}"


def test_grace_periods_match_the_drain_time():
    grace = [(w["metadata"]["name"], w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
             for w in k8s_docs() if w["kind"] in ("Deployment", "StatefulSet")]
    grace += [(f"compose {s}", int(spec["stop_grace_period"].rstrip("s"))) for s, spec in compose()["services"].items()]
    lo, hi = GRACE_MARGIN_S
    for where, seconds in grace:
        assert SHUTDOWN_GRACE_S + lo <= seconds <= SHUTDOWN_GRACE_S + hi, f"{where}: {seconds}s"


def test_router_lists_the_headless_service_pods(monkeypatch):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    sts = docs[("StatefulSet", "radixgen-worker")]
    svc = docs[("Service", sts["spec"]["serviceName"])]
    assert svc["spec"]["clusterIP"] == "None"  # headless
    assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    port = svc["spec"]["ports"][0]["port"]
    router = docs[("Deployment", "radixgen-router")]["spec"]["template"]["spec"]["containers"][0]
    _, (config, urls) = parse_with_the_cli(router["command"] + router["args"], monkeypatch)
    expected = tuple(f"http://{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}"
                     for i in range(sts["spec"]["replicas"]))
    assert urls == expected
    front = docs[("Service", "radixgen-router")]
    labels = docs[("Deployment", "radixgen-router")]["spec"]["template"]["metadata"]["labels"]
    assert front["spec"]["selector"] == labels
    # compose: the router lists the worker services
    c = compose()
    spec = c["services"]["router"]
    _, (_, compose_urls) = parse_with_the_cli(spec["entrypoint"] + spec["command"], monkeypatch)
    workers = [s for s in c["services"] if s.startswith("worker")]
    assert sorted(compose_urls) == sorted(f"http://{s}:30000" for s in workers)
