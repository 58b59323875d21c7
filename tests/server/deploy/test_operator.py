"""The dask-kubernetes operator drives a distributed-core cluster: docs/deploy/kubernetes/
daskcluster.yaml is a DaskCluster the operator's own CRD accepts, and the operator's own
controller code scales a real scheduler through its HTTP API.

There is no Kubernetes here. The manifest is checked against the CRD the operator's Helm
chart installs (shipped in the dask-kubernetes package) and its pod specs against
Kubernetes' schemas; then `get_desired_workers`, `retire_workers` and
`check_scheduler_idle` of `dask_kubernetes.operator.controller` run unchanged against a
`dcore scheduler` started with the manifest's arguments, with only the Service lookup
(`get_scheduler_address`) stubbed to answer the scheduler's dashboard URL. One worker is
started as the operator starts a worker pod: the manifest's command, the address and the
name in DASK_SCHEDULER_ADDRESS and DASK_WORKER_NAME, the token in DCORE_TOKEN.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import textwrap
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

import pytest
import yaml
from server_helpers import DCORE, Processes, wait_for, wait_until_no_tasks

from distributed_server import Client
from distributed_server.comm import parse_address
from distributed_server.dashboard.http import parse_http_address
from distributed_server.security import ENVIRONMENT_VARIABLES

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "docs" / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "daskcluster.yaml"
#: The oldest Kubernetes release the manifest is checked against (as test_deploy_kubernetes).
KUBERNETES_VERSION = "1.29"
#: The Helm chart's CRDs inside the dask-kubernetes package: the schemas resolved. (The
#: package's customresources/*.yaml are templates: their schema is a $ref to
#: python://k8s_crd_resolver/..., which only the chart's build resolves.)
CHART_CRDS = "deployment/helm/dask-kubernetes-operator/crds"
#: What the operator calls a worker of the default worker group (its Deployment's name).
ENV_WORKER = "dcore-operated-default-worker-5f1c2e9a0b"
NAMESPACE = "default"

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------ the manifest


def documents() -> dict:
    """{kind: object} of daskcluster.yaml."""
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def the_container(pod_spec: dict) -> dict:
    [container] = pod_spec["containers"]
    return container


def flag(args: list, name: str) -> str:
    return args[args.index(name) + 1]


def readme() -> str:
    return (DEPLOY / "README.md").read_text()


def operator_section() -> str:
    text = readme()
    start = text.index("\n## Kubernetes with the dask-kubernetes operator\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def secret_command() -> list[str]:
    """The section's `kubectl create secret` line, split into words."""
    line = re.search(r"^kubectl create secret generic .+$", operator_section(),
                     re.MULTILINE).group(0)
    return line.split()


def autoscaler() -> dict:
    """The DaskAutoscaler the section shows."""
    for block in re.findall(r"^ *```yaml\n(.*?)^ *```", operator_section(),
                            re.MULTILINE | re.DOTALL):
        found = yaml.safe_load(textwrap.dedent(block))
        if found.get("kind") == "DaskAutoscaler":
            return found
    raise AssertionError("no DaskAutoscaler in the README's operator section")


def need_dask_kubernetes() -> None:
    """Skip where dask-kubernetes is not installed (CI installs the [test] extra, which
    has it); where it is, a failing import fails the test."""
    if importlib.util.find_spec("dask_kubernetes") is None:
        pytest.skip("dask-kubernetes is not installed (it is in the [test] extra)")


def test_the_pod_specs_service_and_network_policy_are_valid_kubernetes_objects():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is in the [test] extra")
    found = documents()
    assert set(found) == {"DaskCluster", "NetworkPolicy"}
    spec = found["DaskCluster"]["spec"]
    # The operator puts each pod spec into a Deployment's template, unchanged but for env.
    for role in ("scheduler", "worker"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"dcore-{role}"},
               "spec": spec[role]["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "dcore-operated-scheduler"},
               "spec": spec["scheduler"]["service"]}
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    kubernetes_validate.validate(found["NetworkPolicy"], KUBERNETES_VERSION, strict=True)


def _strict(schema):
    """A CRD schema in which an object with listed properties takes no others: what
    `kubectl apply` (server-side field validation, strict by default) refuses, where the
    API server would otherwise drop an unknown field silently."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _strict(s) for name, s in value.items()}
        else:
            out[key] = _strict(value)
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _check_against_crd(resource: dict, crd_file: str) -> None:
    import jsonschema  # kubernetes-validate's dependency (the [test] extra)

    crd = yaml.safe_load((resources.files("dask_kubernetes.operator") / CHART_CRDS /
                          crd_file).read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    assert resource["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
    assert resource["kind"] == crd["spec"]["names"]["kind"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", resource["metadata"]["name"])
    schema = _strict(version["schema"]["openAPIV3Schema"])
    body = {k: v for k, v in resource.items() if k not in ("apiVersion", "kind", "metadata")}
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(body), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])
    return schema


def test_the_daskcluster_and_the_autoscaler_validate_against_the_operators_crds():
    need_dask_kubernetes()
    cluster = documents()["DaskCluster"]
    schema = _check_against_crd(cluster, "daskcluster.yaml")
    _check_against_crd(autoscaler(), "daskautoscaler.yaml")
    assert autoscaler()["spec"]["cluster"] == cluster["metadata"]["name"]

    # The check has teeth: a misspelt field and a wrong type are refused.
    import jsonschema

    typo = json.loads(json.dumps(cluster))
    typo["spec"]["worker"]["replica"] = typo["spec"]["worker"].pop("replicas")
    wrong = json.loads(json.dumps(cluster))
    wrong["spec"]["worker"]["spec"]["containers"][0]["args"] = "worker"
    for bad in (typo, wrong):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"spec": bad["spec"]}, schema, jsonschema.Draft7Validator)


def test_the_daskcluster_is_wired_to_what_dcore_and_the_operator_read():
    found = documents()
    cluster = found["DaskCluster"]
    name = cluster["metadata"]["name"]
    scheduler, worker = cluster["spec"]["scheduler"], cluster["spec"]["worker"]
    sched = the_container(scheduler["spec"])
    wrk = the_container(worker["spec"])

    # The image's entrypoint is dcore; the scheduler opens the cluster API for the operator.
    assert "command" not in sched and "command" not in wrk
    assert sched["args"][0] == "scheduler" and "--open-cluster-api" in sched["args"]
    assert flag(sched["args"], "--host") == "0.0.0.0"
    listens = {"tcp-comm": int(flag(sched["args"], "--port")),
               "http-dashboard": parse_http_address(
                   flag(sched["args"], "--dashboard-address"), "")[1]}
    # The operator finds the ports by these names, and tells workers port 8786.
    assert listens == {"tcp-comm": 8786, "http-dashboard": 8787}
    container_ports = {p["name"]: p["containerPort"] for p in sched["ports"]}
    service_ports = {p["name"]: p for p in scheduler["service"]["ports"]}
    assert set(service_ports) == set(listens)
    for port_name, port in service_ports.items():
        assert port["port"] == listens[port_name]
        assert container_ports[port["targetPort"]] == listens[port_name]
    # The Service selects the labels the operator gives the scheduler's pod.
    assert scheduler["service"]["selector"] == {"dask.org/cluster-name": name,
                                                "dask.org/component": "scheduler"}
    for probe in ("readinessProbe", "livenessProbe"):
        get = sched[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] == "http-dashboard"
        assert get.get("scheme", "HTTP") == "HTTP"  # no TLS: the operator speaks HTTP

    # The worker names no scheduler and no name: the operator's variables give both.
    assert wrk["args"][0] == "worker" and wrk["args"][1].startswith("--")
    assert "--name" not in wrk["args"] and "--scheduler-file" not in wrk["args"]
    env_names = {e["name"] for e in wrk["env"]}
    assert not env_names & {"DASK_SCHEDULER_ADDRESS", "DASK_WORKER_NAME"}  # the operator's
    probe = wrk["livenessProbe"]["httpGet"]
    assert {p["name"]: p["containerPort"] for p in wrk["ports"]}[probe["port"]] == \
        parse_http_address(flag(wrk["args"], "--dashboard-address"), "")[1]

    # The token, and only the token, from the Secret the README's command makes.
    words = secret_command()
    keys = {w[len("--from-file="):].partition("=")[0] for w in words
            if w.startswith("--from-file=")}
    for container in (sched, wrk):
        env = {e["name"]: e for e in container["env"]}
        dcore_names = {n for n in env if n.startswith("DCORE_")}
        assert dcore_names == {"DCORE_TOKEN"} and dcore_names <= set(ENVIRONMENT_VARIABLES)
        ref = env["DCORE_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == words[4] and ref["key"] in keys

    # The NetworkPolicy covers the scheduler's pod; its HTTP port is the operator's only.
    policy = found["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == scheduler["service"]["selector"]
    assert policy["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["ingress"]}
    assert set(by_port) == set(listens.values())
    [source] = by_port[8787]["from"]
    assert source["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "dask-kubernetes-operator"}
    assert source["namespaceSelector"]["matchLabels"]


# ------------------------------------------------------------------ real processes


def http(method: str, url: str, body=None, headers=None) -> tuple[int, str]:
    """``(status, text)`` of one request, whatever the status."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if isinstance(body, (dict, list)):
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Cluster:
    """A `dcore scheduler` with the manifest's arguments (on loopback, free ports), and
    its workers: nannies ``w0``, ``w1``... and one started as the operator starts a
    worker pod."""

    def __init__(self, directory: Path, open_cluster_api: bool) -> None:
        args = [a for a in self._manifest_args("scheduler")[1:] if open_cluster_api
                or a != "--open-cluster-api"]
        self.processes = Processes(directory, [*args, "--host", "127.0.0.1", "--port", "0",
                                               "--dashboard-address", "127.0.0.1:0"])
        line = self.processes.scheduler.stdout.readline()
        match = re.match(r"Dashboard at (http://127\.0\.0\.1:\d+)/status$", line.strip())
        assert match, (line, self.processes.log())
        self.url = match.group(1)
        self.security = self.processes.security
        self.workers: dict = {}  # name -> process

    @staticmethod
    def _manifest_args(role: str) -> list:
        return the_container(documents()["DaskCluster"]["spec"][role]["spec"])["args"]

    def nanny(self, name: str) -> None:
        self.workers[name] = self.processes.nanny(name=name, log=f"{name}.log")

    def operators_worker(self, name: str) -> None:
        """The manifest's worker command (its own metrics port: pods share no ports
        here), with the environment the operator and the manifest give the pod."""
        env = {**self.processes.env, "DASK_SCHEDULER_ADDRESS": self.processes.address,
               "DASK_WORKER_NAME": name}
        assert env["DCORE_TOKEN"] == self.security.token
        args = [*self._manifest_args("worker"), "--dashboard-address", "127.0.0.1:0"]
        log = self.processes.directory / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(DCORE + args, stdout=out, stderr=out, env=env,
                                    stdin=subprocess.DEVNULL)
        self.processes.procs.append(proc)
        self.workers[name] = proc

    def client(self) -> Client:
        return Client(self.processes.address, security=self.security, set_as_default=False,
                      timeout=60)

    def stop_worker(self, name: str) -> None:
        """As the operator deleting the worker's Deployment: SIGTERM, as to a pod."""
        proc = self.workers.pop(name)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

    def close(self) -> None:
        self.processes.close()
        self.processes.assert_no_errors()


@pytest.fixture
def operated(tmp_path):
    """A cluster as the DaskCluster runs it (--open-cluster-api): w0, w1 and the
    operator's worker."""
    cluster = Cluster(tmp_path, open_cluster_api=True)
    try:
        cluster.nanny("w0")
        cluster.nanny("w1")
        cluster.operators_worker(ENV_WORKER)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def closed(tmp_path):
    """A token cluster without --open-cluster-api: w0 and the operator's worker."""
    cluster = Cluster(tmp_path, open_cluster_api=False)
    try:
        cluster.nanny("w0")
        cluster.operators_worker(ENV_WORKER)
        yield cluster
    finally:
        cluster.close()


def test_the_operators_controller_scales_the_cluster_through_the_http_api(operated,
                                                                          monkeypatch):
    need_dask_kubernetes()
    from dask_kubernetes.operator.controller import controller
    service = "dcore-operated-scheduler"
    lookups = []

    async def get_scheduler_address(service_name, namespace, port_name="tcp-comm",
                                    **kwargs):
        """The Service's address: here, the scheduler's dashboard on loopback, written
        as the real lookup writes it (``tcp://HOST:PORT``, which aiohttp speaks HTTP to)."""
        lookups.append((service_name, namespace, port_name))
        if port_name != "http-dashboard":
            raise ConnectionError(f"only the dashboard port is served here, not {port_name}")
        return operated.url.replace("http://", "tcp://")

    monkeypatch.setattr(controller, "get_scheduler_address", get_scheduler_address)
    log = logging.getLogger("test_operator.controller")

    def desired() -> int:
        return asyncio.run(controller.get_desired_workers(scheduler_service_name=service,
                                                          namespace=NAMESPACE))

    def idle_since() -> float:
        return asyncio.run(controller.check_scheduler_idle(
            scheduler_service_name=service, namespace=NAMESPACE, logger=log))

    def workers() -> dict:
        status, text = http("GET", operated.url + "/api/v1/get_workers")  # no credentials
        assert status == 200, text
        found = json.loads(text)
        assert found["num_workers"] == len(found["workers"])
        return {w["name"]: w["address"] for w in found["workers"]}

    with operated.client() as client:
        client.wait_for_workers(3, timeout=60)
        names = workers()
        assert set(names) == {"w0", "w1", ENV_WORKER}
        assert desired() == 0
        assert idle_since() <= time.time()

        # The target grows with the work: 60 tasks of ~0.5 s want more than 3 workers.
        slow = client.map(time.sleep, [0.5 + i / 1000 for i in range(60)])
        targets = []
        wait_for(lambda: targets.append(desired()) or targets[-1] > 3, timeout=30)
        assert targets[-1] <= 60, targets
        status, text = http("GET", operated.url + "/api/v1/check_idle")
        assert (status, json.loads(text)) == (200, {"idle_since": None})
        client.cancel(slow)
        wait_until_no_tasks(client, timeout=60)
        assert idle_since() <= time.time()

        # Results on every worker (random bytes: a recomputed one would differ).
        held = [client.submit(os.urandom, 1000 + 10 * i + j, workers=[address], pure=False)
                for i, address in enumerate(names.values()) for j in range(4)]
        values = client.gather(held)

        # The controller retires two: their results move first, and it gets their names.
        retired = asyncio.run(controller.retire_workers(
            n_workers=2, scheduler_service_name=service,
            worker_group_name="dcore-operated-default", namespace=NAMESPACE, logger=log))
        assert len(retired) == 2 and set(retired) <= set(names), retired
        assert {port for _, _, port in lookups} == {"http-dashboard"}  # never a fallback
        assert all(service_name == service for service_name, _, _ in lookups)
        gone = {names[name] for name in retired}
        [kept] = set(names.values()) - gone
        for key, holders in client.who_has(held).items():
            assert kept in holders, (key, holders)
        assert set(workers()) == set(names)  # they stay connected until their pods go

        # They take no task any more.
        fresh = client.map(pow, range(40), [3] * 40, pure=False)
        assert client.gather(fresh) == [i ** 3 for i in range(40)]
        for key, holders in client.who_has(fresh).items():
            assert holders and not set(holders) & gone, (key, holders)
        assert desired() <= 1

        # The operator deletes their Deployments: no result is lost or recomputed.
        for name in retired:
            operated.stop_worker(name)
        wait_for(lambda: len(workers()) == 1, timeout=30)
        assert client.gather(held) == values
        assert client.submit(sum, fresh).result(timeout=60) == sum(i ** 3 for i in range(40))
        assert idle_since() <= time.time()


def test_without_open_cluster_api_the_routes_need_credentials(closed):
    url = closed.url + "/api/v1/"
    dashboard = {"Authorization": f"Bearer {closed.security.dashboard_token()}"}
    cluster = {"Authorization": f"Bearer {closed.security.token}"}
    with closed.client() as client:
        client.wait_for_workers(2, timeout=60)
        addresses = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}

    # Nothing without credentials (what the operator sends).
    for route in ("adaptive_target", "get_workers", "check_idle"):
        status, text = http("GET", url + route)
        assert status == 403, text
        status, text = http("GET", url + route, headers=dashboard)  # the dashboard's rules
        assert status == 200, text
    status, text = http("POST", url + "retire_workers", {"n": 1})
    assert status == 403 and "cluster's token" in text, text

    # The dashboard token reads, but does not retire; nor does a link's token.
    status, text = http("POST", url + "retire_workers", {"n": 1}, headers=dashboard)
    assert status == 403 and "dashboard token only reads" in text, text
    status, text = http("POST", url + f"retire_workers?token={closed.security.token}",
                        {"n": 1})
    assert status == 403, text

    # Malformed requests: a one-line reason, and nothing changes.
    for body, headers, expected in (
            (b'{"n": 1', {"Content-Type": "application/json"}, 400),
            (b"[1]", {"Content-Type": "application/json"}, 400),
            ({"n": "1"}, {}, 400), ({"n": -1}, {}, 400), ({"n": True}, {}, 400),
            ({"n": 1, "workers": ["w0"]}, {}, 400), ({}, {}, 400), ({"m": 1}, {}, 400),
            ({"workers": "w0"}, {}, 400), ({"workers": ["no-such-worker"]}, {}, 400),
            (b'{"n": 1}', {"Content-Type": "text/plain"}, 415)):
        status, text = http("POST", url + "retire_workers", body, headers={**cluster,
                                                                           **headers})
        assert status == expected, (body, status, text)
        assert text.startswith(f"{expected} ") and text.count("\n") == 1, text
        assert "Traceback" not in text
    status, text = http("GET", url + "get_workers", headers=dashboard)
    assert json.loads(text)["num_workers"] == 2

    # The cluster token retires: by name, then by count (the one left: none was retired
    # by the refused requests).
    status, text = http("POST", url + "retire_workers", {"workers": [ENV_WORKER]},
                        headers=cluster)
    assert status == 200, text
    retired = json.loads(text)
    assert list(retired) == [addresses[ENV_WORKER]]
    assert retired[addresses[ENV_WORKER]]["name"] == ENV_WORKER
    status, text = http("POST", url + "retire_workers", {"n": 2}, headers=cluster)
    assert status == 200, text
    assert {a: w["name"] for a, w in json.loads(text).items()} == {addresses["w0"]: "w0"}
    status, text = http("POST", url + "retire_workers", {"n": 1}, headers=cluster)
    assert (status, json.loads(text)) == (200, {})
    # Other routes keep their rules under --open-cluster-api too (test above: open ones).
    assert http("GET", closed.url + "/metrics")[0] == 403


def test_open_cluster_api_opens_those_four_routes_only(operated):
    for route in ("adaptive_target", "get_workers", "check_idle"):
        status, text = http("GET", f"{operated.url}/api/v1/{route}")
        assert status == 200, text
    for path in ("/status", "/api/v1/status", "/api/v1/task-stream", "/metrics"):
        status, text = http("GET", operated.url + path)
        assert status == 403, (path, text)
    status, text = http("POST", f"{operated.url}/api/v1/retire_workers", {"n": 0})
    assert (status, json.loads(text)) == (200, {})
    status, text = http("POST", f"{operated.url}/api/v1/retire_workers", b"{",
                        headers={"Content-Type": "application/json"})
    assert status == 400, text
    assert "open without credentials" in operated.processes.log()  # the WARNING


def test_dcore_worker_takes_the_operators_address_and_name(closed):
    with closed.client() as client:
        client.wait_for_workers(2, timeout=60)
        names = {w["name"] for w in client.scheduler_info()["workers"].values()}
    assert names == {"w0", ENV_WORKER}
    status, text = http("GET", closed.url + "/api/v1/get_workers",
                        headers={"Authorization": f"Bearer {closed.security.token}"})
    assert status == 200, text
    found = {w["name"]: w["address"] for w in json.loads(text)["workers"]}
    assert set(found) == {"w0", ENV_WORKER}
    assert parse_address(found[ENV_WORKER])[1] == "127.0.0.1"


@pytest.mark.parametrize("args, env, message", [
    (["worker"], {}, "DASK_SCHEDULER_ADDRESS"),
    (["worker"], {"DASK_SCHEDULER_ADDRESS": "nonsense"}, "DASK_SCHEDULER_ADDRESS"),
    (["scheduler", "--open-cluster-api", "--no-dashboard"], {}, "--no-dashboard"),
])
def test_missing_or_bad_settings_get_a_one_line_error(args, env, message):
    base = {k: v for k, v in os.environ.items()
            if k not in (*ENVIRONMENT_VARIABLES, "DASK_SCHEDULER_ADDRESS", "DASK_WORKER_NAME")}
    result = subprocess.run(DCORE + args, env={**base, **env}, capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr
