"""docs/deploy/kubernetes: the manifests are valid Kubernetes objects, wired to what
`dcore` reads, and the commands their containers hold run a TLS + token cluster.

There is no Kubernetes here, so the test plays the kubelet's part: each pod is a network
namespace on a bridge (a pod network), the container's command is the image's entrypoint
plus its `args`, with `$(VAR)` references, `fieldRef` and `secretKeyRef` values filled in
and the Secret's files written where its volume is mounted (paths under a mount point are
mapped to a directory of the test). The Service name resolves to the scheduler pod's
address through the namespace's own /etc/hosts (`ip netns exec` mounts
/etc/netns/NAME/hosts over it), so the worker's command runs exactly as written. Without
root or iproute2 every pod runs on this machine's loopback and the Service's name in the
arguments is replaced by 127.0.0.1.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import yaml

from distributed_server.comm import parse_address
from distributed_server.dashboard.http import parse_http_address
from distributed_server.security import ENVIRONMENT_VARIABLES, Security, new_token

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "docs" / "deploy"
MANIFESTS = ("scheduler.yaml", "worker.yaml")
#: The oldest Kubernetes release the manifests are checked against.
KUBERNETES_VERSION = "1.29"
SUBNET = "10.231.78"

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ the manifests


def objects() -> dict:
    """{(kind, name): object} of every manifest."""
    found = {}
    for manifest in MANIFESTS:
        for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / manifest).read_text()):
            found[doc["kind"], doc["metadata"]["name"]] = doc
    return found


def the_container(deployment: dict) -> dict:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list, name: str) -> str:
    return args[args.index(name) + 1]


def image_entrypoint() -> tuple[list, list]:
    """(ENTRYPOINT, CMD) of docs/deploy/Containerfile's image (exec form)."""
    text = (DEPLOY / "Containerfile").read_text()
    entry = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", text, re.MULTILINE).group(1))
    cmd = yaml.safe_load(re.search(r"^CMD (.+)$", text, re.MULTILINE).group(1))
    return entry, cmd


def secret_command() -> list[str]:
    """The `kubectl create secret` line of docs/deploy/README.md, split into words."""
    text = (DEPLOY / "README.md").read_text()
    line = re.search(r"^kubectl create secret generic .+$", text, re.MULTILINE).group(0)
    return line.split()


def secret_keys() -> dict:
    """{key: file name} that the README's command puts in the Secret."""
    keys = {}
    for word in secret_command():
        if word.startswith("--from-file="):
            key, _, path = word[len("--from-file="):].partition("=")
            keys[key] = path
    return keys


def test_the_manifests_are_valid_kubernetes_objects():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is in the [test] extra")
    found = objects()
    assert set(found) == {("Deployment", "dcore-scheduler"), ("Service", "dcore-scheduler"),
                          ("Deployment", "dcore-worker")}
    for (kind, name), doc in found.items():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        if kind == "Deployment":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), name


def test_the_service_and_the_secret_are_wired_to_what_dcore_reads():
    found = objects()
    scheduler = found["Deployment", "dcore-scheduler"]
    worker = found["Deployment", "dcore-worker"]
    service = found["Service", "dcore-scheduler"]

    # The Service selects the scheduler's pod, not a worker's.
    selector = service["spec"]["selector"].items()
    assert selector <= scheduler["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= worker["spec"]["template"]["metadata"]["labels"].items()

    # Its ports lead to the ports the scheduler's arguments listen on.
    sched = the_container(scheduler)
    container_ports = {p["name"]: p["containerPort"] for p in sched["ports"]}
    listens = {"scheduler": int(flag(sched["args"], "--port")),
               "dashboard": parse_http_address(flag(sched["args"], "--dashboard-address"),
                                               "")[1]}
    assert flag(sched["args"], "--host") == "0.0.0.0"
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(service_ports) == {"scheduler", "dashboard"}
    for name, port in service_ports.items():
        assert container_ports[port["targetPort"]] == listens[name], name
        assert port["port"] == listens[name], name  # so pods may dial the Service's port
    assert listens == {"scheduler": 8786, "dashboard": 8787}

    # The worker dials the Service by name on its scheduler port, over TLS since its
    # environment holds the TLS files.
    wrk = the_container(worker)
    scheme, host, port = parse_address(wrk["args"][1])
    assert wrk["args"][0] == "worker"
    assert (scheme, host, port) == ("tls", service["metadata"]["name"],
                                    service_ports["scheduler"]["port"])
    probe = wrk["livenessProbe"]["httpGet"]
    assert {p["name"]: p["containerPort"] for p in wrk["ports"]}[probe["port"]] == \
        parse_http_address(flag(wrk["args"], "--dashboard-address"), "")[1]

    # Every DCORE_ variable is one the code reads; the token comes from the Secret and the
    # TLS files from the Secret's volume, mounted where the variables point.
    keys = secret_keys()
    for deployment in (scheduler, worker):
        container = the_container(deployment)
        pod = deployment["spec"]["template"]["spec"]
        env = {e["name"]: e for e in container["env"]}
        dcore_names = {n for n in env if n.startswith("DCORE_")}
        assert dcore_names == {"DCORE_TOKEN", "DCORE_TLS_CA_FILE", "DCORE_TLS_CERT",
                               "DCORE_TLS_KEY"}
        assert dcore_names <= set(ENVIRONMENT_VARIABLES)
        ref = env["DCORE_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "dcore-cluster" and ref["key"] in keys
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        for name in ("DCORE_TLS_CA_FILE", "DCORE_TLS_CERT", "DCORE_TLS_KEY"):
            path = Path(env[name]["value"])
            secret = mounts[str(path.parent)]["secret"]
            assert secret["secretName"] == ref["name"]
            items = {item["path"]: item["key"] for item in secret["items"]}
            assert items[path.name] in keys, (name, path)
        probe = container.get("readinessProbe", container.get("livenessProbe"))["httpGet"]
        assert probe["path"] == "/health" and probe["scheme"] == "HTTPS"
    assert secret_command()[4] == "dcore-cluster"


def test_a_token_from_a_secret_made_from_a_file_loses_its_newline():
    """`dcore token > token` and `--from-file=token=token` put "TOKEN\n" in DCORE_TOKEN:
    the same cluster as a client given the token without it (a pasted one, or a file)."""
    token = new_token()
    assert Security.from_environment({"DCORE_TOKEN": token + "\n"}).token == token
    assert Security.from_environment({"DCORE_TOKEN": " \n"}).token is None


# ------------------------------------------------------------------ the kubelet's part


def make_secret(directory: Path, dcore: list) -> dict:
    """{key: bytes} of the Secret the README's commands make: a token and TLS files from
    `dcore`, put into a Secret by its `kubectl create secret` line (with --dry-run=client;
    where kubectl is missing, the same keys are read from the files directly)."""
    directory.mkdir()
    token = subprocess.run([*dcore, "token"], capture_output=True, text=True, check=True,
                           timeout=60).stdout
    (directory / "token").write_text(token)
    subprocess.run([*dcore, "tls-files", str(directory), "dcore-scheduler"],
                   capture_output=True, check=True, timeout=60)
    keys = secret_keys()
    if shutil.which("kubectl") is None:
        return {key: (directory / path).read_bytes() for key, path in keys.items()}
    made = subprocess.run([*secret_command(), "--dry-run=client", "-o", "yaml"],
                          cwd=directory, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    secret = yaml.safe_load(made.stdout)
    assert secret["kind"] == "Secret" and set(secret["data"]) == set(keys)
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, variables: dict) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined VAR is replaced, `$$` is a `$`, anything
    else is left as written."""
    def replace(match):
        if match.group(0) == "$$":
            return "$"
        return variables.get(match.group(1), match.group(0))
    return _REFERENCE.sub(replace, text)


class Pod:
    """One pod of a Deployment, run as the kubelet would run its one container."""

    def __init__(self, deployment: dict, name: str, ip: str, namespace: str | None,
                 secret: dict, directory: Path, dcore: list) -> None:
        self.name, self.ip, self.namespace = name, ip, namespace
        self.spec = deployment["spec"]["template"]["spec"]
        self.container = the_container(deployment)
        self.directory = directory
        directory.mkdir()
        self.mounts = self._volumes(secret)
        self.env = self._environment(secret)
        entrypoint, cmd = image_entrypoint()
        command = self.container.get("command", entrypoint)
        args = self.container.get("args", [] if "command" in self.container else cmd)
        words = [expand(w, self.env) for w in [*command, *args]]
        assert words[0] == "dcore", words
        self.argv = [*dcore, *words[1:]]
        self.proc = None
        self.log = directory / "log"

    def _volumes(self, secret: dict) -> dict:
        """{mountPath: directory here}, with each secret volume's items written."""
        volumes = {}
        for volume in self.spec["volumes"]:
            path = self.directory / volume["name"]
            path.mkdir()
            if "secret" in volume:
                for item in volume["secret"]["items"]:
                    (path / item["path"]).write_bytes(secret[item["key"]])
                    os.chmod(path / item["path"], volume["secret"]["defaultMode"])
            else:
                assert "emptyDir" in volume, volume
            volumes[volume["name"]] = path
        return {m["mountPath"]: volumes[m["name"]] for m in self.container["volumeMounts"]}

    def _here(self, path: str) -> str:
        for mount, local in self.mounts.items():
            if path == mount or path.startswith(mount + "/"):
                return str(local) + path[len(mount):]
        return path

    def _environment(self, secret: dict) -> dict:
        env = {}
        for var in self.container.get("env", []):
            if "value" in var:
                env[var["name"]] = self._here(expand(var["value"], env))
                continue
            source = var["valueFrom"]
            if "secretKeyRef" in source:
                env[var["name"]] = secret[source["secretKeyRef"]["key"]].decode()
            else:
                field = source["fieldRef"]["fieldPath"]
                env[var["name"]] = {"metadata.name": self.name, "status.podIP": self.ip}[field]
        return env

    def start(self, *extra: str, resolve_service: str | None = None) -> None:
        """Run the container's command (plus ``extra`` arguments). In loopback mode
        (``resolve_service``) that Service name in the arguments becomes 127.0.0.1."""
        argv = [*self.argv, *extra]
        if resolve_service is not None:
            argv = [a.replace(f"//{resolve_service}:", "//127.0.0.1:") for a in argv]
        base = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
        env = {**base, **self.env}
        tmp = self.mounts.get("/tmp")
        if tmp is not None:
            env["TMPDIR"] = str(tmp)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(_in(self.namespace, argv), stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.output(), re.MULTILINE)
            if match:
                return match
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"{self.name}: no {pattern!r} in\n{self.output()}"
            time.sleep(0.1)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _in(namespace: str | None, argv: list) -> list:
    return argv if namespace is None else ["ip", "netns", "exec", namespace, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class PodNetwork:
    """Network namespaces on one bridge, one per pod; each has an /etc/hosts naming the
    Service. ``namespaces`` is None in loopback mode (no root or no iproute2)."""

    def __init__(self, pods: list[str], service: str) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.service = service
        self.made: list[str] = []
        if os.geteuid() != 0 or shutil.which("ip") is None:
            self.namespaces = None
            self.ips = {pod: "127.0.0.1" for pod in pods}
            return
        self.ips = {pod: f"{SUBNET}.{10 + i}" for i, pod in enumerate(pods)}
        self.namespaces = {pod: f"dck-{i}-{self.tag}" for i, pod in enumerate(pods)}
        bridge_ns = f"dck-net-{self.tag}"
        try:
            self._add(bridge_ns)
            _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge_ns, "link", "set", "br0", "up")
            for i, pod in enumerate(pods):
                ns, outer, inner = self.namespaces[pod], f"dkh{i}{self.tag}", f"dkp{i}{self.tag}"
                self._add(ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "netns", bridge_ns)
                _ip("link", "set", inner, "netns", ns)
                _ip("-n", bridge_ns, "link", "set", outer, "master", "br0")
                _ip("-n", bridge_ns, "link", "set", outer, "up")
                _ip("-n", ns, "link", "set", inner, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.ips[pod]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            self.close()
            pytest.fail(f"cannot make the pod network: {e}: {getattr(e, 'stderr', '')}")

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)

    def resolve_service_to(self, pod: str) -> None:
        """The Service's name resolves to ``pod``'s address in every pod."""
        if self.namespaces is None:
            return
        for name, ns in self.namespaces.items():
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.ips[name]} {name}\n"
                                       f"{self.ips[pod]} {self.service}\n")

    def close(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


CLIENT = textwrap.dedent("""
    import json, ssl, sys, urllib.error, urllib.request
    from distributed_server import Client

    address, dashboard, worker_probes, token = sys.argv[1:5]
    probes = json.loads(worker_probes)

    def get(url, bearer=None):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # as the kubelet's probes: no client certificate
        request = urllib.request.Request(url)
        if bearer:
            request.add_header("Authorization", f"Bearer {bearer}")
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""

    with Client(address, timeout=60, set_as_default=False) as client:
        client.wait_for_workers(len(probes), timeout=60)
        squares = client.map(lambda x: x * x, range(200))
        pairs = [client.submit(lambda a, b: a + b, squares[i], squares[i + 1])
                 for i in range(0, 200, 2)]
        total = client.submit(sum, pairs).result(timeout=60)
        workers = client.scheduler_info()["workers"]
        print("workers", json.dumps(sorted((w["name"], a) for a, w in workers.items())))
        print("total", total)
    print("probe", get(f"{dashboard}/health")[0])
    print("metrics without token", get(f"{dashboard}/metrics")[0])
    status, body = get(f"{dashboard}/metrics", bearer=token)
    print("metrics with token", status, "dcore_" in body)
    for url in probes:
        print("worker probe", get(f"{url}/health")[0])
""")


@pytest.fixture
def pod_network():
    network = PodNetwork(["scheduler", "worker-0", "worker-1", "client"], "dcore-scheduler")
    yield network
    network.close()


def test_the_containers_commands_run_a_tls_cluster_of_pods(pod_network, tmp_path):
    dcore_script = Path(sys.executable).parent / "dcore"
    dcore = [str(dcore_script)] if dcore_script.exists() else \
        [sys.executable, "-m", "distributed_server.cli"]
    found = objects()
    service = found["Service", "dcore-scheduler"]
    secret = make_secret(tmp_path / "secret", dcore)
    net = pod_network
    net.resolve_service_to("scheduler")
    loopback = service["metadata"]["name"] if net.namespaces is None else None
    if loopback:
        busy = [port for port in (8786, 8787, 8788) if not _free(port)]
        if busy:
            pytest.skip(f"without root the pods share this machine's network, where port(s) "
                        f"{busy} are taken; as root each pod gets its own namespace")
    ns = net.namespaces or {}

    def pod(deployment, name, role):
        return Pod(found["Deployment", deployment], name, net.ips[role], ns.get(role),
                   secret, tmp_path / role, dcore)

    scheduler = pod("dcore-scheduler", "dcore-scheduler-5c7d8-x2x4q", "scheduler")
    # On a shared loopback two worker pods would want the same metrics port: one pod there.
    workers = [pod("dcore-worker", f"dcore-worker-6f9b4-{i}abcd", f"worker-{i}")
               for i in range(1 if loopback else 2)]
    pods = [scheduler, *workers]
    try:
        scheduler.start("--validate")  # as every server test runs its scheduler
        listening = scheduler.wait_for(r"^Scheduler at (tls://\S+)")
        dashboard = scheduler.wait_for(r"^Dashboard at (https://\S+)/status")
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert parse_address(listening.group(1)) == ("tls", "0.0.0.0", ports["scheduler"])
        assert dashboard.group(1).endswith(f":{ports['dashboard']}"), dashboard.group(1)

        for worker in workers:
            worker.start(resolve_service=loopback)
        for worker in workers:
            at = worker.wait_for(r"^Worker at (tls://\S+) connected to (\S+)")
            assert at.group(2) == "tls://dcore-scheduler:8786" or loopback
            assert parse_address(at.group(1))[1] == worker.ip

        worker_port = parse_http_address(
            flag(workers[0].container["args"], "--dashboard-address"), "")[1]
        probes = [f"https://{w.ip}:{worker_port}" for w in workers]
        host = "127.0.0.1" if loopback else service["metadata"]["name"]
        client_env = {**{k: v for k, v in os.environ.items()
                         if k not in ENVIRONMENT_VARIABLES}, **scheduler.env}
        client = subprocess.run(
            _in(ns.get("client"), [sys.executable, "-c", CLIENT,
                                   f"tls://{host}:{ports['scheduler']}",
                                   f"https://{host}:{ports['dashboard']}",
                                   json.dumps(probes),
                                   scheduler.env["DCORE_TOKEN"].strip()]),
            capture_output=True, text=True, timeout=180, env=client_env, cwd=tmp_path)
        assert client.returncode == 0, client.stdout + client.stderr
        out = client.stdout
        assert f"total {sum(i * i for i in range(200))}" in out, out
        names = re.search(r"^workers (.+)$", out, re.MULTILINE).group(1)
        for worker in workers:
            assert f'"{worker.name}", "tls://{worker.ip}:' in names, names
        assert "probe 200" in out and "metrics without token 403" in out, out
        assert "metrics with token 200 True" in out, out
        assert out.count("worker probe 200") == len(workers), out
    finally:
        for p in reversed(pods):  # as the kubelet deletes pods: SIGTERM, then a grace period
            p.terminate()
        codes = {}
        for p in pods:
            if p.proc is None:
                continue
            try:
                codes[p.name] = p.proc.wait(30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                codes[p.name] = p.proc.wait()
    assert set(codes.values()) == {0}, (codes, [p.output() for p in pods])
    errors = [line for line in scheduler.output().splitlines() if " ERROR " in line]
    assert not errors, scheduler.output()
