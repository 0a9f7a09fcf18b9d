#!/usr/bin/env python3
"""Starts the real binaries on the configuration a deployment gives them.

    configcheck.py k8s RENDERED
        For every container of a rendered workload whose image is apron or apron-agent:
        lays out what the pod would see (ConfigMap and Secret files, empty host paths
        and volumes) under a temporary root, rewrites the paths of its arguments and
        config file into that root, and runs the binary with the pod's environment.

    configcheck.py systemd UNIT CONFIG_DIR
        The same for a systemd unit: /etc/apron comes from CONFIG_DIR, credentials
        (LoadCredential=) are placeholder tokens under /run/credentials/<unit>/, and
        StateDirectory= is an empty directory.

A config passes when every absolute path in it lies on something the deployment
provides, its listen port is the one the manifest or the contract names, the binary
starts ("listening on ADDR" on stdout), GET /healthz answers 200, and SIGTERM stops it
with status 0. The agent runs with APRON_SOURCE=sim (no GPU here); everything else in
its file is parsed and resolved as written. A config with [storage.object_store] gets
a bucket of its own (s3s-fs, $APRON_S3S_FS or ~/.cache/apron-tools/bin/s3s-fs, with
the container's AWS_* keys) at the endpoint it names, or in front of S3's.

`apron ballista scheduler|executor` containers (overlays/cluster) have no HTTP port:
each scheduler starts first and must accept connections on its --bind port, then each
executor is started against it and must accept them on its --bind port; SIGTERM must
stop each with status 0. Their ports must be ones the container declares (and its
probes use). Binaries: $APRON_BIN, $APRON_AGENT_BIN.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from pathlib import Path

import yaml

PLACEHOLDER_TOKEN = "configcheck-placeholder-token-0123456789"
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
# The contract's ports (shared/design.md).
CONTRACT_PORT = {"apron-agent": 9401, "apron": 9402}


class Failure(Exception):
    pass


class Root:
    """A temporary directory standing in for `/` as the process would see it."""

    def __init__(self, base: Path):
        self.base = base
        self.mounts: list[str] = []

    def provide(self, path: str) -> Path:
        self.mounts.append(path.rstrip("/") or "/")
        return self.map(path)

    def map(self, path: str) -> Path:
        return self.base / path.lstrip("/")

    def covers(self, path: str) -> bool:
        return any(path == m or path.startswith(m + "/") for m in self.mounts)

    def write(self, path: str, content: bytes) -> None:
        target = self.map(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


def absolute_paths(value, key: str = ""):
    """(key, value) of every string in a TOML document that is an absolute path."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from absolute_paths(v, f"{key}.{k}" if key else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from absolute_paths(v, f"{key}[{i}]")
    elif isinstance(value, str) and value.startswith("/"):
        yield key, value


def rewrite_config(root: Root, config_path: str, label: str, only: tuple[str, ...] = ()) -> dict:
    """Checks that every path of the config is provided and points it into the root;
    with `only`, the paths of those sections (what the binary reads of the file)."""
    target = root.map(config_path)
    if not target.is_file():
        raise Failure(f"{label}: config {config_path} is not provided by any mount")
    text = target.read_text(encoding="utf-8")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Failure(f"{label}: {config_path}: not TOML: {e}") from e
    for key, path in absolute_paths(doc):
        if only and not key.startswith(only):
            continue
        if not root.covers(path):
            raise Failure(f"{label}: {config_path}: `{key}` = {path!r} lies on nothing the deployment provides")
        quoted = json.dumps(path)
        if quoted not in text:
            raise Failure(f"{label}: {config_path}: `{key}` must be a basic (double-quoted) string to be checked")
        text = text.replace(quoted, json.dumps(str(root.map(path))))
    target.write_text(text, encoding="utf-8")
    return doc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3s_fs() -> str:
    candidates = [os.environ.get("APRON_S3S_FS", ""), str(Path.home() / ".cache/apron-tools/bin/s3s-fs")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise Failure(f"s3s-fs not found ({' or '.join(c for c in candidates if c)}): scripts/install-test-tools.sh")


class Bucket:
    """s3s-fs serving the bucket a config's [storage.object_store] names, at an endpoint
    the config is pointed at (its text rewritten), with the container's keys."""

    def __init__(self, root: Root, config: Path, doc: dict, env: dict[str, str], label: str):
        self.proc = None
        store = doc.get("storage", {}).get("object_store")
        if store is None:
            return
        bucket = store["url"].removeprefix("s3://").split("/", 1)[0]
        key = store.get("access_key_id") or env.get("AWS_ACCESS_KEY_ID")
        secret = store.get("secret_access_key") or env.get("AWS_SECRET_ACCESS_KEY")
        if not (key and secret):
            raise Failure(f"{label}: [storage.object_store] has no keys in the file or AWS_* in the environment")
        data = root.base / "s3"
        (data / bucket).mkdir(parents=True)
        port = free_port()
        self.proc = subprocess.Popen(
            [s3s_fs(), "--host", "127.0.0.1", "--port", str(port), "--access-key", key, "--secret-key", secret,
             str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(port, self.proc, f"{label}: s3s-fs")
        endpoint = json.dumps(f"http://127.0.0.1:{port}")
        text = config.read_text(encoding="utf-8")
        if "endpoint" in store:
            text = text.replace(json.dumps(store["endpoint"]), endpoint)
            added = ""
        else:
            added = f"endpoint = {endpoint}\n"
        if "allow_http" in store:
            text = re.sub(r"(?m)^allow_http\s*=\s*false", "allow_http = true", text)
        else:
            added += "allow_http = true\n"
        text = re.sub(r"(?m)^\[storage\.object_store\]\s*$", lambda m: m.group(0) + "\n" + added, text, count=1)
        config.write_text(text, encoding="utf-8")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def check_published(root: Root, doc: dict, label: str) -> None:
    """A collector that stopped cleanly has written its shard's status to the bucket."""
    if doc.get("cluster", {}).get("role") != "collector":
        return
    url = doc["storage"]["object_store"]["url"].removeprefix("s3://").rstrip("/")
    statuses = list((root.base / "s3" / url / "_apron" / "shards").glob("*.json"))
    if not statuses:
        raise Failure(f"{label}: stopped without writing its shard's status to the bucket")
    print(f"ok   {label}: wrote {statuses[0].name} to the bucket")


def wait_for_port(port: int, proc: subprocess.Popen, label: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log else []
            raise Failure(f"{label}: exited with status {proc.returncode} before accepting connections\n    "
                          + "\n    ".join(tail))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise Failure(f"{label}: nothing accepts connections on port {port} after {START_TIMEOUT_S} s")
        time.sleep(0.1)


def listen_port(doc: dict, binary: str) -> int | None:
    section = doc.get("agent" if binary == "apron-agent" else "server", {})
    listen = section.get("listen")
    return int(listen.rsplit(":", 1)[1]) if listen else None


def run(binary: str, exe: str, args: list[str], env: dict[str, str], root: Root, label: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root.base), "NO_COLOR": "1", **env}
    if binary == "apron-agent":
        env.update(APRON_LISTEN="127.0.0.1:0", APRON_SOURCE="sim")
    else:
        env.update(APRON_HTTP="127.0.0.1:0")
    stderr_path = root.base / "stderr.log"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([exe, *args], env=env, stdout=subprocess.PIPE, stderr=stderr,
                                stdin=subprocess.DEVNULL, cwd=root.base)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace").rstrip("\n"))
            if lines[-1].startswith("listening on "):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def failure(text: str) -> Failure:
        log = stderr_path.read_text(errors="replace").strip().splitlines()[-15:]
        return Failure(f"{label}: {text}\n    " + "\n    ".join(lines + log))

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.is_set():
            if proc.poll() is not None:
                raise failure(f"exited with status {proc.returncode} before listening")
            if time.monotonic() > deadline:
                raise failure(f"not listening after {START_TIMEOUT_S} s")
            ready.wait(0.1)
        addr = next(l for l in lines if l.startswith("listening on ")).split()[-1]
        with urllib.request.urlopen(f"http://{addr}/healthz", timeout=10) as resp:
            body = json.loads(resp.read())
            if resp.status != 200 or body.get("status") != "ok":
                raise failure(f"GET /healthz answered {resp.status} {body}")
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise failure(f"still running {STOP_TIMEOUT_S} s after SIGTERM") from None
        if code != 0:
            raise failure(f"exited with status {code} after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"ok   {label}: started on {addr}, /healthz ok, stopped cleanly")


def binaries() -> dict[str, str]:
    out = {"apron": os.environ.get("APRON_BIN", ""), "apron-agent": os.environ.get("APRON_AGENT_BIN", "")}
    for name, path in out.items():
        if not path or not os.access(path, os.X_OK):
            raise Failure(f"{name}: no executable at {path!r} (APRON_BIN / APRON_AGENT_BIN)")
    return out


# ───────────────────────────── Kubernetes ─────────────────────────────

def secret_data(secret: dict | None, key: str) -> bytes:
    if secret is None:  # the documented external Secret: a placeholder stands in
        return PLACEHOLDER_TOKEN.encode()
    if key in (secret.get("stringData") or {}):
        return secret["stringData"][key].encode()
    return base64.b64decode(secret["data"][key])


def check_k8s(rendered: str) -> int:
    exes = binaries()
    with open(rendered, encoding="utf-8") as f:
        objs = [d for d in yaml.safe_load_all(f) if d]
    index = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs}
    checked = 0
    nodes: list[BallistaNode] = []
    for obj in objs:
        if obj["kind"] not in ("DaemonSet", "StatefulSet", "Deployment"):
            continue
        ns = obj["metadata"].get("namespace", "")
        pod = obj["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for claim in obj["spec"].get("volumeClaimTemplates", []):
            volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": {}}
        for c in pod["containers"]:
            binary = c["image"].split("@")[0].rsplit(":", 1)[0].rsplit("/", 1)[-1]
            if binary not in exes:
                continue
            label = f"{obj['kind']}/{obj['metadata']['name']} container {c['name']} ({binary})"
            if c.get("command"):
                raise Failure(f"{label}: sets `command`; the image's entrypoint is the binary")
            env = container_env(c, ns, index, label)
            args = expand(list(c.get("args", [])), env)
            if binary == "apron" and args[:1] == ["ballista"]:
                def layout(root: Root, c=c, ns=ns, volumes=volumes) -> None:
                    for m in c.get("volumeMounts", []):
                        lay_out_mount(root, m, volumes[m["name"]], ns, index)
                nodes.append(BallistaNode(label, c, args, env, layout))
                continue
            with tempfile.TemporaryDirectory(prefix="apron-configcheck-") as tmp:
                root = Root(Path(tmp))
                for m in c.get("volumeMounts", []):
                    lay_out_mount(root, m, volumes[m["name"]], ns, index)
                doc = {}
                if "--config" in args:
                    i = args.index("--config") + 1
                    doc = rewrite_config(root, args[i], label)
                    args[i] = str(root.map(args[i]))
                ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                port = listen_port(doc, binary)
                probe_ports = {c[p]["httpGet"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                               if "httpGet" in c.get(p, {})}
                for p in probe_ports:
                    number = ports.get(p, p)
                    if number != port:
                        raise Failure(f"{label}: a probe targets port {number}, the config listens on {port}")
                    if number != CONTRACT_PORT[binary]:
                        raise Failure(f"{label}: port {number} is not the contract's {CONTRACT_PORT[binary]}")
                bucket = Bucket(root, root.map(c["args"][c["args"].index("--config") + 1]), doc, env, label) \
                    if doc else None
                try:
                    run(binary, exes[binary], args, env, root, label)
                    check_published(root, doc, label)
                finally:
                    if bucket:
                        bucket.close()
                checked += 1
    checked += check_ballista(nodes, exes["apron"])
    if not checked:
        raise Failure(f"{rendered}: no apron or apron-agent container")
    return checked


def container_env(c: dict, ns: str, index: dict, label: str) -> dict[str, str]:
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = "configcheck-node"
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secret_data(index.get(("Secret", ns, ref["name"])), ref["key"]).decode()
        else:
            raise Failure(f"{label}: env {e['name']}: unsupported source {e.get('valueFrom')}")
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """`$(NAME)` in an argument is the container's variable, as the kubelet expands it."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


# ───────────────────────────── Ballista ─────────────────────────────

class BallistaNode:
    """An `apron ballista …` container, laid out and started on loopback ports."""

    def __init__(self, label, c, args, env, layout):
        """`c`: the container (its ports and probes are checked), or None for a unit;
        `layout(root)` lays out what the process sees."""
        self.label, self.c, self.args, self.env, self.layout = label, c, args, env, layout
        self.role = args[1] if len(args) > 1 else ""
        if self.role not in ("scheduler", "executor"):
            raise Failure(f"{label}: `ballista {self.role}`: expected scheduler or executor")
        self.proc: subprocess.Popen | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix="apron-configcheck-")
        self.port = 0

    def flag(self, name: str) -> str | None:
        return self.args[self.args.index(name) + 1] if name in self.args else None

    def set_flag(self, args: list[str], name: str, value: str) -> None:
        if name in args:
            args[args.index(name) + 1] = value
        else:
            args += [name, value]

    def declared(self) -> dict:
        return {p.get("name"): p["containerPort"] for p in self.c.get("ports", [])}

    def check_ports(self) -> None:
        ports = self.declared()
        bind = self.flag("--bind")
        if bind is None:
            raise Failure(f"{self.label}: no --bind: the default is loopback only")
        port = int(bind.rsplit(":", 1)[1])
        if port not in ports.values():
            raise Failure(f"{self.label}: --bind {bind}: port {port} is not a port the container declares")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            tcp = self.c.get(probe, {}).get("tcpSocket")
            if tcp and ports.get(tcp["port"], tcp["port"]) != port:
                raise Failure(f"{self.label}: {probe} checks port {tcp['port']}, the node listens on {port}")
        grpc = self.flag("--grpc-port")
        if grpc is not None and int(grpc) not in ports.values():
            raise Failure(f"{self.label}: --grpc-port {grpc} is not a port the container declares")

    def start(self, exe: str, scheduler_port: int | None) -> None:
        if self.c is not None:
            self.check_ports()
        root = Root(Path(self.tmp.name))
        self.layout(root)
        args = list(self.args)
        for i, a in enumerate(args):
            if a.startswith("/"):
                if not root.covers(a):
                    raise Failure(f"{self.label}: {a} lies on nothing the deployment provides")
                if i > 0 and args[i - 1] == "--config":
                    # A Ballista node reads only these sections of the query servers' file.
                    rewrite_config(root, a, self.label, only=("storage.object_store.", "query."))
                args[i] = str(root.map(a))
        self.port = free_port()
        self.set_flag(args, "--bind", f"127.0.0.1:{self.port}")
        self.set_flag(args, "--external-host", "127.0.0.1")
        if self.role == "executor":
            if scheduler_port is None:
                raise Failure(f"{self.label}: an executor, and no scheduler in the deployment")
            self.set_flag(args, "--scheduler", f"df://127.0.0.1:{scheduler_port}")
            self.set_flag(args, "--grpc-port", str(free_port()))
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root.base), "NO_COLOR": "1", **self.env}
        self.log = root.base / "stderr.log"
        with open(self.log, "wb") as stderr:
            self.proc = subprocess.Popen([exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                         stdin=subprocess.DEVNULL, cwd=root.base)
        wait_for_port(self.port, self.proc, self.label, self.log)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Failure(f"{self.label}: still running {STOP_TIMEOUT_S} s after SIGTERM") from None
        if code != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-15:]
            raise Failure(f"{self.label}: exited with status {code} after SIGTERM\n    " + "\n    ".join(tail))
        print(f"ok   {self.label}: accepted connections, stopped cleanly")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.tmp.cleanup()


def check_ballista(nodes: list[BallistaNode], exe: str) -> int:
    """The schedulers first (each executor is started against the first one), then the
    executors one by one; the schedulers are stopped last."""
    schedulers = [n for n in nodes if n.role == "scheduler"]
    executors = [n for n in nodes if n.role == "executor"]
    if executors and not schedulers:
        # A unit on its own: a scheduler on the executor's file stands in for its cluster's.
        e = executors[0]
        config = e.flag("--config")
        args = ["ballista", "scheduler"] + (["--config", config] if config else [])
        schedulers.append(BallistaNode(f"{e.label}: its scheduler", None, args, e.env, e.layout))
        nodes = nodes + schedulers
    try:
        for n in schedulers:
            n.start(exe, None)
        for n in executors:
            n.start(exe, schedulers[0].port if schedulers else None)
            n.stop()
        for n in schedulers:
            n.stop()
    finally:
        for n in nodes:
            n.close()
    return len(nodes)


def lay_out_mount(root: Root, mount: dict, volume: dict, ns: str, index: dict) -> None:
    path = mount["mountPath"]
    sub = mount.get("subPath")
    if "configMap" in volume or "secret" in volume:
        if "configMap" in volume:
            obj = index.get(("ConfigMap", ns, volume["configMap"]["name"]))
            if obj is None:
                raise Failure(f"ConfigMap {volume['configMap']['name']} is not rendered")
            files = {k: v.encode() for k, v in obj.get("data", {}).items()}
            items = volume["configMap"].get("items")
        else:
            obj = index.get(("Secret", ns, volume["secret"]["secretName"]))
            items = volume["secret"].get("items")
            keys = [i["key"] for i in items] if items else list((obj or {}).get("data", {}))
            files = {k: secret_data(obj, k) for k in keys}
        if items:
            files = {i.get("path", i["key"]): files[i["key"]] for i in items}
        root.provide(path)
        if sub:
            root.write(path, files[sub])
        else:
            root.map(path).mkdir(parents=True, exist_ok=True)
            for name, content in files.items():
                root.write(f"{path}/{name}", content)
    elif volume.get("hostPath", {}).get("type") == "File":
        root.provide(path)
        root.write(path, b"")
    else:  # host directories, claims, emptyDir: an empty directory
        root.provide(path).mkdir(parents=True, exist_ok=True)


# ───────────────────────────── systemd ─────────────────────────────

def unit_settings(unit: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in unit.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line[0] in "#;[" or "=" not in line:
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def check_systemd(unit_file: str, config_dir: str) -> int:
    exes = binaries()
    unit = Path(unit_file)
    s = unit_settings(unit)
    argv = shlex.split(s["ExecStart"][-1])
    binary = Path(argv[0]).name
    if binary not in exes:
        raise Failure(f"{unit}: ExecStart runs {argv[0]}, neither apron nor apron-agent")
    label = f"{unit.name} ({binary})"

    def layout(root: Root) -> None:
        conf = root.provide("/etc/apron")
        conf.mkdir(parents=True)
        for f in Path(config_dir).glob("*.toml"):
            (conf / f.name).write_bytes(f.read_bytes())
        for cred in s.get("LoadCredential", []):
            ident = cred.split(":", 1)[0]
            root.provide(f"/run/credentials/{unit.name}")
            root.write(f"/run/credentials/{unit.name}/{ident}", PLACEHOLDER_TOKEN.encode())
        for state in " ".join(s.get("StateDirectory", [])).split():
            root.provide(f"/var/lib/{state}").mkdir(parents=True, exist_ok=True)

    if argv[1:2] == ["ballista"]:
        # `%H` (the host's name) as systemd expands it; the bucket's keys as an
        # EnvironmentFile= would give them.
        args = [a.replace("%H", "configcheck-host") for a in argv[1:]]
        env = {"AWS_ACCESS_KEY_ID": PLACEHOLDER_TOKEN, "AWS_SECRET_ACCESS_KEY": PLACEHOLDER_TOKEN}
        return check_ballista([BallistaNode(label, None, args, env, layout)], exes[binary])
    with tempfile.TemporaryDirectory(prefix="apron-configcheck-") as tmp:
        root = Root(Path(tmp))
        layout(root)
        args = argv[1:]
        doc = {}
        if "--config" in args:
            i = args.index("--config") + 1
            doc = rewrite_config(root, args[i], label)
            args[i] = str(root.map(args[i]))
        port = listen_port(doc, binary)
        if port != CONTRACT_PORT[binary]:
            raise Failure(f"{label}: listens on port {port}, not the contract's {CONTRACT_PORT[binary]}")
        run(binary, exes[binary], args, {}, root, label)
    return 1


def main() -> int:
    try:
        if len(sys.argv) == 3 and sys.argv[1] == "k8s":
            check_k8s(sys.argv[2])
        elif len(sys.argv) == 4 and sys.argv[1] == "systemd":
            check_systemd(sys.argv[2], sys.argv[3])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Failure as e:
        print(f"FAIL {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
