#!/usr/bin/env python3
"""Runs the shell commands of docs/deploy.md as written.

    doc_steps.py DOC.md

Every ```sh block of DOC must follow one of these markers:

    <!-- doc-steps: run -->            run here, below
    <!-- doc-steps: packages.sh -->    run by tests/deploy/packages.sh (the builds, dpkg)
    <!-- doc-steps: not run: WHY -->   cannot run here (a cluster, placeholders), and why

The `run` blocks run in order, each with `bash -euo pipefail`, in a scratch copy of the
repository (deploy/, scripts/, Cargo.toml; target/ship and the binaries linked in), in a
private mount namespace whose /etc and /usr/local are overlays on a scratch directory:
what they install reaches neither the checkout nor the machine. What has no stand-in
here is replaced by a program of the same name on PATH that checks what it is given:

- kubectl: `kustomize` is the real one; `apply -k DIR` renders DIR and runs the checks
  of validate.sh on it (kubernetes-validate --strict, check_manifests.py refs with the
  keys the page's own `create secret` / `patch secret` gave apron-tokens, configcheck.py
  on the rendered configs), and fails unless every image it runs was loaded (kind) or
  pushed (skopeo) before; `apply -f FILE` validates FILE; `create secret generic` runs
  the real one with --dry-run=client; `get nodes` answers one node; `label node` must
  name it.
- kind `load image-archive FILE`, skopeo `copy oci-archive:FILE docker://NAME`: FILE
  must be an OCI archive with one manifest whose blobs are all there; the image counts
  as available under its annotated name (kind) or NAME (skopeo).
- systemctl: `daemon-reload` does nothing; `enable --now UNIT` runs `systemd-analyze
  verify` on /etc/systemd/system/UNIT (any output fails) and configcheck.py on the unit
  and /etc/apron, which starts its binary the way the unit would.
- cargo `build --release -p apron -p apron-agent`: links APRON_BIN and APRON_AGENT_BIN
  as target/release/apron and apron-agent.

Environment: APRON_BIN, APRON_AGENT_BIN (the binaries), APRON_KUBECTL (the real kubectl).
Exits 1 with the failing block and its output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHIMS = ("kubectl", "kind", "skopeo", "systemctl", "cargo")
MARKER = re.compile(r"<!-- doc-steps: (run|packages\.sh|not run: .+) -->")
NODE = "kind-control-plane"
KUBE_VERSION = "1.33.0"


class Failure(Exception):
    pass


# ── the page ─────────────────────────────────────────────────────────────────────
def blocks(doc: Path) -> list[tuple[int, str, str]]:
    """(line, marker, text) of every ```sh block."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            start = i
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = MARKER.fullmatch(prev.strip())
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            out.append((start + 1, m.group(1) if m else "", "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        i += 1
    return out


# ── state shared by the stand-ins ────────────────────────────────────────────────
def state_path() -> Path:
    return Path(os.environ["DOC_STEPS_STATE"])


def load_state() -> dict:
    p = state_path()
    return json.loads(p.read_text()) if p.exists() else {"images": [], "secrets": {}, "labels": []}


def save_state(st: dict) -> None:
    state_path().write_text(json.dumps(st))


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise Failure(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def oci_archive_name(path: str) -> str:
    """The name an OCI archive's one manifest is annotated with; checks its blobs."""
    try:
        with tarfile.open(path) as tar:
            names = set(tar.getnames())
            index = json.load(tar.extractfile("./index.json") or tar.extractfile("index.json"))
            (manifest,) = index["manifests"]
            def blob(digest: str) -> bytes:
                f = tar.extractfile("./blobs/" + digest.replace(":", "/"))
                return f.read()
            body = json.loads(blob(manifest["digest"]))
            for d in [body["config"]] + body["layers"]:
                if "./blobs/" + d["digest"].replace(":", "/") not in names:
                    raise Failure(f"{path}: blob {d['digest']} missing")
    except (OSError, KeyError, tarfile.TarError, ValueError) as e:
        raise Failure(f"{path}: not an OCI archive with one image ({e})")
    return manifest.get("annotations", {}).get("io.containerd.image.name", "")


# ── the stand-ins ────────────────────────────────────────────────────────────────
def shim_kind(args: list[str]) -> None:
    if args[:2] != ["load", "image-archive"] or len(args) != 3:
        raise Failure(f"kind stand-in: only `load image-archive FILE`, not {args}")
    name = oci_archive_name(args[2])
    if not name:
        raise Failure(f"{args[2]}: no io.containerd.image.name annotation: kind would import it nameless")
    st = load_state()
    st["images"].append(name)
    save_state(st)


def shim_skopeo(args: list[str]) -> None:
    if len(args) != 3 or args[0] != "copy" or not args[1].startswith("oci-archive:") \
            or not args[2].startswith("docker://"):
        raise Failure(f"skopeo stand-in: only `copy oci-archive:FILE docker://NAME`, not {args}")
    oci_archive_name(args[1].removeprefix("oci-archive:"))
    st = load_state()
    st["images"].append(args[2].removeprefix("docker://"))
    save_state(st)


def shim_cargo(args: list[str]) -> None:
    if args != ["build", "--release", "-p", "apron", "-p", "apron-agent"]:
        raise Failure(f"cargo stand-in: only `build --release -p apron -p apron-agent`, not {args}")
    Path("target/release").mkdir(parents=True, exist_ok=True)
    for name, env in (("apron", "APRON_BIN"), ("apron-agent", "APRON_AGENT_BIN")):
        dst = Path("target/release") / name
        dst.unlink(missing_ok=True)
        dst.symlink_to(os.environ[env])


def shim_systemctl(args: list[str]) -> None:
    if args == ["daemon-reload"]:
        return
    if len(args) != 3 or args[:2] != ["enable", "--now"]:
        raise Failure(f"systemctl stand-in: only daemon-reload and `enable --now UNIT`, not {args}")
    unit = args[2] if args[2].endswith(".service") else args[2] + ".service"
    path = Path("/etc/systemd/system") / unit
    if not path.exists():
        raise Failure(f"{path}: not installed")
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    if r.returncode != 0 or r.stdout.strip() or r.stderr.strip():
        raise Failure(f"systemd-analyze verify {path}:\n{r.stdout}{r.stderr}")
    run([sys.executable, str(HERE / "configcheck.py"), "systemd", str(path), "/etc/apron"])


def kubectl_real() -> str:
    return os.environ["DOC_STEPS_KUBECTL"]


def shim_kubectl(args: list[str]) -> None:
    ns = None
    rest = []
    it = iter(args)
    for a in it:
        if a in ("-n", "--namespace"):
            ns = next(it)
        elif a.startswith("--namespace="):
            ns = a.split("=", 1)[1]
        else:
            rest.append(a)
    st = load_state()
    if rest[:1] == ["kustomize"]:
        os.execv(kubectl_real(), [kubectl_real()] + args)
    if rest == ["get", "nodes", "-o", "name"]:
        print(f"node/{NODE}")
        return
    if rest[:2] == ["label", "node"] and len(rest) == 4:
        if rest[2] != NODE:
            raise Failure(f"kubectl label node {rest[2]}: no such node (the stand-in cluster has {NODE})")
        st["labels"].append(rest[3])
        save_state(st)
        return
    if rest[:3] == ["create", "secret", "generic"]:
        if ns != "apron":
            raise Failure(f"kubectl create secret: namespace {ns!r}, the manifests' is apron")
        r = run([kubectl_real(), "-n", ns] + rest + ["--dry-run=client", "-o", "json"])
        secret = json.loads(r.stdout)
        st["secrets"][secret["metadata"]["name"]] = sorted(secret.get("data", {}))
        save_state(st)
        return
    if rest[:2] == ["patch", "secret"] and len(rest) == 5 and rest[3] == "-p":
        name = rest[2]
        if ns != "apron" or name not in st["secrets"]:
            raise Failure(f"kubectl patch secret {name} in {ns!r}: no such Secret created before")
        body = json.loads(rest[4])
        keys = set(body.get("stringData", {})) | set(body.get("data", {}))
        st["secrets"][name] = sorted(set(st["secrets"][name]) | keys)
        save_state(st)
        return
    if rest[:2] == ["apply", "-f"] and len(rest) == 3:
        kube_validate(rest[2])
        return
    if rest[:2] == ["apply", "-k"] and len(rest) == 3:
        apply_k(rest[2], st)
        return
    raise Failure(f"kubectl stand-in: {args} is not something this page is expected to run")


def kube_validate(path: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", KUBE_VERSION,
                        path], capture_output=True, text=True)
    if r.returncode != 0 or r.stdout.strip() or r.stderr.strip():
        raise Failure(f"kubernetes-validate {path}:\n{r.stdout}{r.stderr}")


def apply_k(directory: str, st: dict) -> None:
    import yaml

    out = Path(tempfile.mkdtemp(prefix="apply-", dir=state_path().parent))
    rendered = out / "rendered.yaml"
    rendered.write_text(run([kubectl_real(), "kustomize", directory]).stdout)
    run([sys.executable, str(HERE / "check_manifests.py"), "split", str(rendered), str(out)])
    kube_validate(str(out / "core.yaml"))
    run([sys.executable, str(HERE / "check_manifests.py"), "custom", str(out / "custom.yaml")])
    refs = [sys.executable, str(HERE / "check_manifests.py"), "refs", str(rendered)]
    for name, keys in st["secrets"].items():
        refs += ["--external-secret", f"{name}={','.join(keys)}"]
    run(refs)
    run([sys.executable, str(HERE / "configcheck.py"), "k8s", str(rendered)])
    missing = []
    for obj in yaml.safe_load_all(rendered.read_text()):
        spec = (obj or {}).get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if c["image"] not in st["images"]:
                missing.append(c["image"])
            selector = spec.get("nodeSelector") or {}
            if "apron-sim" in selector and f"apron-sim={selector['apron-sim']}" not in st["labels"]:
                missing.append(f"a node labelled apron-sim={selector['apron-sim']}")
    if missing:
        raise Failure(f"kubectl apply -k {directory}: the cluster has no {sorted(set(missing))} "
                      f"(loaded or pushed: {st['images']})")


# ── the runner ───────────────────────────────────────────────────────────────────
def scratch_repo(root: Path) -> Path:
    work = root / "repo"
    work.mkdir()
    for name in ("deploy", "scripts", "tests"):
        shutil.copytree(REPO / name, work / name, symlinks=True)
    shutil.copy2(REPO / "Cargo.toml", work / "Cargo.toml")
    (work / "target").mkdir()
    ship = REPO / "target" / "ship"
    if ship.exists():
        (work / "target" / "ship").symlink_to(ship)
    return work


def write_shims(root: Path) -> Path:
    bin_dir = root / "shims"
    bin_dir.mkdir()
    for name in SHIMS:
        p = bin_dir / name
        p.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" --shim {name} "$@"\n')
        p.chmod(0o755)
    return bin_dir


def inner(doc: Path) -> int:
    root = Path(tempfile.mkdtemp(prefix="doc-steps-"))
    try:
        return run_blocks(doc, root)
    finally:
        for target in ("/etc", "/usr/local"):
            subprocess.run(["umount", target], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def run_blocks(doc: Path, root: Path) -> int:
    # /etc and /usr/local as overlays: the page's `install` lines write into scratch.
    for target in ("/etc", "/usr/local"):
        upper, workdir = root / ("upper" + target.replace("/", "_")), root / ("work" + target.replace("/", "_"))
        upper.mkdir()
        workdir.mkdir()
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={target},upperdir={upper},workdir={workdir}", target])
    repo = scratch_repo(root)
    env = dict(os.environ)
    env["PATH"] = f"{write_shims(root)}:{env['PATH']}"
    env["DOC_STEPS_STATE"] = str(root / "state.json")
    problems = 0
    for line, marker, text in blocks(doc):
        where = f"{doc.name}:{line}"
        if not marker:
            print(f"FAIL {where}: an sh block without a <!-- doc-steps: … --> marker")
            problems += 1
            continue
        if marker != "run":
            print(f"     {where}: {marker}")
            continue
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            print(f"FAIL {where}: exit {r.returncode}\n" + "".join("     | " + l + "\n" for l in text.splitlines())
                  + "".join("     " + l + "\n" for l in (r.stdout + r.stderr).splitlines()[-40:]))
            problems += 1
        else:
            print(f"ok   {where}: ran")
    return 1 if problems else 0


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--shim":
        try:
            globals()["shim_" + sys.argv[2]](sys.argv[3:])
        except Failure as e:
            print(f"{sys.argv[2]} (doc-steps stand-in): {e}", file=sys.stderr)
            return 1
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--inner":
        try:
            return inner(Path(sys.argv[2]).resolve())
        except Failure as e:
            print(f"FAIL {e}")
            return 1
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    for env in ("APRON_BIN", "APRON_AGENT_BIN", "APRON_KUBECTL"):
        if not os.environ.get(env):
            print(f"FAIL {env} is not set", file=sys.stderr)
            return 2
    os.environ["DOC_STEPS_KUBECTL"] = os.environ["APRON_KUBECTL"]
    for env in ("APRON_BIN", "APRON_AGENT_BIN"):
        os.environ[env] = str(Path(os.environ[env]).resolve())
    # A private mount namespace: the overlays vanish with it.
    return subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable,
                           str(Path(__file__).resolve()), "--inner", sys.argv[1]]).returncode


if __name__ == "__main__":
    sys.exit(main())
