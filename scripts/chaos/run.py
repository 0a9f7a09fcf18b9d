#!/usr/bin/env python3
"""The chaos orchestrator behind scripts/chaos.sh (read that file's header first).

Runs one `apron serve` and N `apron-agent --source sim` processes from private copies of
the binaries, SIGKILLs them at random moments (seeded), restarts each after a random
short delay, shifts some agents' clocks with libfaketime, fills the collector's disk
(a small tmpfs that chaos.sh mounted) in episodes, then stops the chaos, lets every
agent drain its spool, stops everything gracefully and leaves the evidence in WORK for
scripts/chaos/verify.py:

  WORK/events.jsonl             every start, kill, exit, ENOSPC episode and probe
  WORK/agents/<id>/windows/NNNN.jsonl   windows_out of instance NNNN of that agent
  WORK/agents/<id>/spool/       its spool (must be empty at the end)
  WORK/agents/<id>/agent.log    stderr of all its instances
  WORK/collector.log            stderr of all collector instances
  WORK/stored.arrows            every gpu_samples (host, gpu_uuid, time) row, from
                                POST /api/v1/sql on the running collector after the drain
  WORK/collector-metrics.txt    the collector's /metrics just before it is stopped
  WORK/run.json                 the run's parameters and counters
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"

# Clock shifts of the first agents (the rest run on the real clock). A libfaketime spec
# is relative to the real time at each process start; "x0.8" makes the clock run at 80 %
# speed, so it drifts further behind for as long as the process lives and jumps forward
# again at a restart (never backwards: a faster clock would re-emit window times an
# earlier instance of the same agent already produced).
CLOCK_SHIFTS = [
    ("+1h", "+3600s"),
    ("-10min", "-600s"),
    ("drift x0.8 (from -30s)", "-30s x0.8"),
]

SQL = "SELECT host, gpu_uuid, time FROM gpu_samples"


def now():
    return time.monotonic()


class Events:
    def __init__(self, path):
        self.f = open(path, "a", buffering=1)
        self.t0 = now()

    def log(self, kind, **kw):
        rec = {"t": round(now() - self.t0, 3), "wall": time.time(), "kind": kind, **kw}
        self.f.write(json.dumps(rec) + "\n")
        return rec


def say(msg):
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def http(method, url, body=None, headers=None, timeout=5.0):
    """(status, body bytes); status 0 when the server did not answer."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        return 0, str(e).encode()


class Proc:
    """One restartable process slot: the collector or one agent."""

    def __init__(self, name, kind):
        self.name = name
        self.kind = kind
        self.p = None
        self.instance = 0
        self.restart_at = 0.0
        self.started_at = 0.0
        self.kills = 0
        self.unexpected_exits = 0

    def running(self):
        return self.p is not None and self.p.poll() is None


class Chaos:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.work = a.work
        self.bin = a.bin
        self.mnt = a.mnt
        self.data = os.path.join(self.mnt, "data")
        self.ballast = os.path.join(self.mnt, "ballast")
        self.ev = Events(os.path.join(self.work, "events.jsonl"))
        self.ingest_token = uuid.uuid4().hex + uuid.uuid4().hex
        self.sql_token = uuid.uuid4().hex + uuid.uuid4().hex
        self.url = f"http://127.0.0.1:{a.port}"
        self.collector = Proc("collector", "collector")
        self.agents = [Proc(f"chaos-a{i}", "agent") for i in range(a.agents)]
        for ag in self.agents:
            ag.restart_at = float("inf")  # started once the collector is up
        self.shifts = {}
        for i, ag in enumerate(self.agents):
            if i < len(CLOCK_SHIFTS):
                self.shifts[ag.name] = CLOCK_SHIFTS[i]
        self.enospc_active = False
        self.counters = {
            "kills_collector": 0,
            "kills_agent": 0,
            "kills_during_enospc": 0,
            "restarts_collector": 0,
            "restarts_agent": 0,
            "unexpected_exits_collector": 0,
            "unexpected_exits_agent": 0,
            "enospc_episodes": 0,
            "enospc_probe_answers": [],
            "recovery_probe_answers": [],
            "max_spool_bytes_during_enospc": 0,
        }

    # ── set-up ───────────────────────────────────────────────────────────────────
    def write_configs(self):
        os.makedirs(self.data, exist_ok=True)
        tok = os.path.join(self.work, "ingest.token")
        with open(tok, "w") as f:
            f.write(self.ingest_token + "\n")
        os.chmod(tok, 0o600)
        self.server_toml = os.path.join(self.work, "apron.toml")
        with open(self.server_toml, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{self.a.port}"

[ingest]
tokens = ["{self.ingest_token}"]
clock_skew_threshold = "30s"

[sql]
tokens = ["{self.sql_token}"]

[storage]
data_dir = "{self.data}"
# Small and frequent, so kills land in persists, WAL segment rolls and compactions.
persist_interval = "3s"
wal_segment_bytes = 1048576
maintenance_interval = "5s"
compaction_max_files = 4
superseded_grace = "10s"
""")
        for i, ag in enumerate(self.agents):
            d = os.path.join(self.work, "agents", ag.name)
            os.makedirs(os.path.join(d, "windows"), exist_ok=True)
            os.makedirs(os.path.join(d, "spool"), exist_ok=True)
            with open(os.path.join(d, "agent.toml"), "w") as f:
                f.write(f"""[agent]
source = "sim"
listen = "127.0.0.1:0"
collector = "{self.url}"
window = "1s"
hostname = "{ag.name}"

[samplers]
utilization = "500ms"
gpm = "500ms"
disabled = ["processes"]

[sim]
nodes = 1
gpus_per_node = {self.a.gpus}
seed = {1000 + i}
host_prefix = "{ag.name}-n"
scenarios = ["training", "inference-bursty", "unallocated-idle", "notebook-stranded"]

[shipper]
# verify.py's FLUSH_INTERVAL_S / REQUEST_TIMEOUT_S bound the tail a kill may lose: keep in step.
token_file = "{tok}"
agent_id = "{ag.name}"
flush_interval = "2s"
spool_dir = "{os.path.join(d, 'spool')}"
request_timeout = "5s"
max_backoff = "4s"
""")

    # ── processes ────────────────────────────────────────────────────────────────
    def start(self, pr):
        pr.instance += 1
        if pr.kind == "collector":
            cmd = [os.path.join(self.bin, "apron"), "serve", "--config", self.server_toml]
            log = open(os.path.join(self.work, "collector.log"), "ab")
            env = dict(os.environ, RUST_LOG="info")
            env.pop("LD_PRELOAD", None)
        else:
            d = os.path.join(self.work, "agents", pr.name)
            out = os.path.join(d, "windows", f"{pr.instance:04d}.jsonl")
            cmd = [os.path.join(self.bin, "apron-agent"), "--config", os.path.join(d, "agent.toml"),
                   "--windows-out", out]
            log = open(os.path.join(d, "agent.log"), "ab")
            env = dict(os.environ)
            env.pop("APRON_COLLECTOR_TOKEN", None)
            shift = self.shifts.get(pr.name)
            if shift:
                env["LD_PRELOAD"] = LIBFAKETIME
                env["FAKETIME"] = shift[1]
                env["FAKETIME_NO_CACHE"] = "1"
                # Rust waits (Condvar, futex) take absolute CLOCK_MONOTONIC deadlines in a raw
                # syscall that libfaketime cannot see: with a faked monotonic clock every
                # timed wait hangs or fires at once (the agent then closes no window at all).
                # A skewed host has a wrong wall clock, not a wrong monotonic one.
                env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
        log.write(f"\n===== chaos: {pr.name} instance {pr.instance} starting =====\n".encode())
        log.flush()
        pr.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=self.work)
        log.close()
        pr.started_at = now()
        if pr.instance > 1:
            self.counters[f"restarts_{pr.kind}"] += 1
        self.ev.log("start", target=pr.name, kind_of=pr.kind, instance=pr.instance, pid=pr.p.pid)

    def kill9(self, pr):
        pid = pr.p.pid
        uptime = now() - pr.started_at
        os.kill(pid, signal.SIGKILL)
        pr.p.wait()
        pr.kills += 1
        self.counters[f"kills_{pr.kind}"] += 1
        if self.enospc_active:
            self.counters["kills_during_enospc"] += 1
        self.ev.log("kill", target=pr.name, kind_of=pr.kind, instance=pr.instance, pid=pid,
                    uptime=round(uptime, 3), enospc=self.enospc_active)
        pr.p = None
        pr.restart_at = now() + self.rng.uniform(self.a.restart_min, self.a.restart_max)

    def reap(self, pr):
        """A process that exited without our kill: record it and schedule a restart."""
        if pr.p is None or pr.p.poll() is None:
            return
        rc = pr.p.returncode
        pr.unexpected_exits += 1
        self.counters[f"unexpected_exits_{pr.kind}"] += 1
        self.ev.log("exit", target=pr.name, kind_of=pr.kind, instance=pr.instance, rc=rc,
                    uptime=round(now() - pr.started_at, 3), enospc=self.enospc_active)
        say(f"{pr.name} instance {pr.instance} exited by itself (rc {rc}); restarting")
        pr.p = None
        pr.restart_at = now() + 1.0

    def stop(self, pr, timeout=40.0):
        """SIGTERM and wait; SIGKILL after `timeout`. Returns the exit status."""
        if pr.p is None:
            return None
        if pr.p.poll() is not None:
            self.reap(pr)
            return None
        pid = pr.p.pid
        pr.p.send_signal(signal.SIGTERM)
        try:
            rc = pr.p.wait(timeout)
            forced = False
        except subprocess.TimeoutExpired:
            pr.p.kill()
            rc = pr.p.wait()
            forced = True
        self.ev.log("stop", target=pr.name, kind_of=pr.kind, instance=pr.instance, pid=pid, rc=rc, forced=forced)
        pr.p = None
        return rc

    def all_procs(self):
        return [self.collector] + self.agents

    def tick(self):
        for pr in self.all_procs():
            if pr.p is not None:
                self.reap(pr)
            if pr.p is None and now() >= pr.restart_at:
                self.start(pr)

    def collector_healthy(self):
        st, _ = http("GET", self.url + "/healthz", timeout=2)
        return st == 200

    def wait_collector(self, timeout):
        end = now() + timeout
        while now() < end:
            self.tick()
            if self.collector.running() and self.collector_healthy():
                return True
            time.sleep(0.2)
        return False

    # ── spools ───────────────────────────────────────────────────────────────────
    def spool_files(self, ag):
        d = os.path.join(self.work, "agents", ag.name, "spool")
        out = []
        for n in os.listdir(d):
            p = os.path.join(d, n)
            if n.endswith(".arrows") and not n.startswith(".") and os.path.isfile(p):
                out.append(p)
        return sorted(out)

    def spool_bytes(self):
        total = 0
        for ag in self.agents:
            for p in self.spool_files(ag):
                try:
                    total += os.path.getsize(p)
                except OSError:
                    pass
        return total

    def rejected(self):
        out = []
        for ag in self.agents:
            d = os.path.join(self.work, "agents", ag.name, "spool", "rejected")
            if os.path.isdir(d):
                out += [os.path.join(d, n) for n in os.listdir(d)]
        return out

    # ── ENOSPC ───────────────────────────────────────────────────────────────────
    def usage(self):
        """Bytes used under each top-level directory of the collector's disk."""
        out = {}
        for root, _dirs, files in os.walk(self.mnt):
            rel = os.path.relpath(root, self.mnt).split(os.sep)
            top = "/".join(rel[:3]) if rel[0] == "data" else rel[0]
            for n in files:
                try:
                    out[top] = out.get(top, 0) + os.path.getsize(os.path.join(root, n))
                except OSError:
                    pass
        st = os.statvfs(self.mnt)
        out["(free)"] = st.f_bavail * st.f_frsize
        return out

    def fill_disk(self):
        """Writes a ballast file until the tmpfs is full (ENOSPC): 1 MiB writes, then
        4 KiB, then 512 B, so even the last page goes. Returns (bytes written, left)."""
        written = 0
        try:
            fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError:
            fd = None
        if fd is not None:
            for size in (1 << 20, 4096, 512):
                buf = b"\0" * size
                while True:
                    try:
                        n = os.write(fd, buf)
                    except OSError:
                        break
                    written += n
                    if n < size:
                        break
            os.close(fd)
        st = os.statvfs(self.mnt)
        return written, st.f_bavail * st.f_frsize

    def probe(self):
        """Re-sends one batch from an agent's spool with its own agent/epoch/sequence,
        exactly as the agent would retry it (the collector's dedup makes this safe: if
        stored now, the agent's own later send is answered "duplicate")."""
        cands = [(ag, p) for ag in self.agents for p in self.spool_files(ag)]
        if not cands:
            return {"status": None, "body": "no spooled batch to send"}
        ag, path = self.rng.choice(cands)
        name = os.path.basename(path)
        try:
            with open(path, "rb") as f:
                body = f.read()
        except OSError as e:
            return {"status": None, "body": f"spool file vanished: {e}"}
        stem = name[: -len(".arrows")]
        key, table = stem.rsplit(".", 1)
        epoch, seq = key.rsplit("-", 1)
        st, resp = http("POST", self.url + "/api/v1/ingest", body=body, headers={
            "Authorization": f"Bearer {self.ingest_token}",
            "Content-Type": "application/vnd.apache.arrow.stream",
            "x-apron-table": table, "x-apron-agent": ag.name,
            "x-apron-epoch": epoch, "x-apron-sequence": str(int(seq)),
        }, timeout=10)
        return {"status": st, "body": resp.decode(errors="replace")[:400], "agent": ag.name, "batch": name}

    # ── the run ──────────────────────────────────────────────────────────────────
    def run(self):
        a = self.a
        self.write_configs()
        say(f"seed {a.seed}; collector {self.url}; {len(self.agents)} agents × {a.gpus} GPUs; "
            f"target {a.kills} kills; {a.enospc} ENOSPC episodes; work dir {self.work}")
        for ag, (label, spec) in ((ag, self.shifts[ag.name]) for ag in self.agents if ag.name in self.shifts):
            say(f"{ag.name} runs under libfaketime FAKETIME='{spec}' ({label})")
        self.start(self.collector)
        if not self.wait_collector(120):
            say("the collector did not become healthy at the first start; see collector.log")
            return 2
        for ag in self.agents:
            ag.restart_at = 0.0
        say(f"warm-up {a.warmup:.0f}s")
        end = now() + a.warmup
        while now() < end:
            self.tick()
            time.sleep(0.1)

        # ENOSPC episodes start at evenly spread kill counts.
        enospc_at = [a.kills * (k + 1) // (a.enospc + 1) for k in range(a.enospc)]
        total = lambda: self.counters["kills_collector"] + self.counters["kills_agent"]  # noqa: E731
        next_kill = now() + self.rng.uniform(a.gap_min, a.gap_max)
        enospc_end = None
        probe_at = None
        t_chaos = now()
        while total() < a.kills or self.enospc_active:
            self.tick()
            t = now()
            if not self.enospc_active and enospc_at and total() >= enospc_at[0]:
                enospc_at.pop(0)
                before = self.usage()
                written, left = self.fill_disk()
                self.enospc_active = True
                self.counters["enospc_episodes"] += 1
                hold = self.rng.uniform(a.enospc_hold * 0.75, a.enospc_hold * 1.25)
                enospc_end = t + hold
                probe_at = t + 1.0
                self.ev.log("enospc_begin", ballast_bytes=written, bytes_left=left, hold=round(hold, 1), usage_before=before)
                say(f"ENOSPC episode {self.counters['enospc_episodes']}: disk filled "
                    f"({written >> 20} MiB ballast, {left} bytes left), holding {hold:.0f}s")
            if self.enospc_active:
                self.counters["max_spool_bytes_during_enospc"] = max(
                    self.counters["max_spool_bytes_during_enospc"], self.spool_bytes())
                if probe_at is not None and t >= probe_at:
                    # Every few seconds while full: one retried batch, as an agent sends it.
                    probe_at = t + 3.0
                    ans = self.probe()
                    ans["episode"] = self.counters["enospc_episodes"]
                    self.counters["enospc_probe_answers"].append(ans)
                    self.ev.log("probe_full", **ans)
                    say(f"  ingest while full: HTTP {ans['status']} {ans['body'][:200]}")
                if t >= enospc_end:
                    if os.path.exists(self.ballast):
                        os.remove(self.ballast)
                    self.enospc_active = False
                    self.ev.log("enospc_end")
                    say("  space freed; checking that ingest recovers")
                    self.recovery_probe()
                    next_kill = now() + self.rng.uniform(a.gap_min, a.gap_max)
                    continue
            if total() < a.kills and t >= next_kill:
                running = [p for p in self.all_procs() if p.running()]
                if running:
                    if self.collector.running() and self.rng.random() < a.p_collector:
                        target = self.collector
                    else:
                        agents = [p for p in running if p.kind == "agent"] or running
                        target = self.rng.choice(agents)
                    self.kill9(target)
                    if total() % 10 == 0:
                        say(f"{total()} kills ({self.counters['kills_collector']} collector, "
                            f"{self.counters['kills_agent']} agent); spool {self.spool_bytes() >> 10} KiB")
                next_kill = t + self.rng.uniform(a.gap_min, a.gap_max)
            time.sleep(0.05)
        self.counters["chaos_seconds"] = round(now() - t_chaos, 1)
        say(f"chaos over after {self.counters['chaos_seconds']}s: "
            f"{self.counters['kills_collector']} collector + {self.counters['kills_agent']} agent kills")
        return self.finish()

    def recovery_probe(self):
        """After space is freed: the collector (maybe restarting) must accept ingest again."""
        t0 = now()
        ans = {"status": None}
        while now() - t0 < 90:
            self.tick()
            if self.collector.running() and self.collector_healthy():
                ans = self.probe()
                if ans["status"] == 200 or ans["status"] is None:
                    break
            time.sleep(0.5)
        ans["seconds"] = round(now() - t0, 1)
        ans["episode"] = self.counters["enospc_episodes"]
        self.counters["recovery_probe_answers"].append(ans)
        self.ev.log("probe_recovered", **ans)
        say(f"  after freeing: HTTP {ans['status']} {str(ans.get('body'))[:120]} after {ans['seconds']}s")

    def finish(self):
        a = self.a
        for pr in self.all_procs():
            if pr.p is None:
                pr.restart_at = 0
        if not self.wait_collector(120):
            say("FAIL: the collector does not come back up (crash loop?); see collector.log")
            self.counters["collector_not_up_at_end"] = True
        # Drain: every agent's spool empty at once (new batches go straight through).
        t0 = now()
        drained = False
        while now() - t0 < a.drain_timeout:
            self.tick()
            if all(p.running() for p in self.all_procs()) and all(not self.spool_files(ag) for ag in self.agents):
                drained = True
                break
            time.sleep(0.5)
        self.counters["drain_seconds"] = round(now() - t0, 1)
        self.ev.log("drained", ok=drained, seconds=self.counters["drain_seconds"])
        say(f"spools {'drained' if drained else 'NOT drained'} after {self.counters['drain_seconds']}s")
        # Stop the agents gracefully: the last windows are sent at shutdown. An agent
        # whose shutdown had to spool (collector slow) is started again to drain it.
        rounds = 0
        pending = list(self.agents)
        while pending and rounds < 3:
            rounds += 1
            for ag in pending:
                if not ag.running():
                    self.start(ag)
            time.sleep(3 if rounds > 1 else 0)
            if rounds > 1:
                t1 = now()
                while now() - t1 < 60 and any(self.spool_files(ag) for ag in pending):
                    time.sleep(0.5)
            for ag in pending:
                self.stop(ag)
            pending = [ag for ag in pending if self.spool_files(ag)]
            if pending:
                say(f"spooled at shutdown: {', '.join(p.name for p in pending)}; draining again")
        self.counters["agents_left_with_spool"] = [ag.name for ag in pending]
        self.counters["rejected_files"] = self.rejected()
        # What the collector holds, asked the way a user asks.
        st, body = http("POST", self.url + "/api/v1/sql", body=SQL.encode(), headers={
            "Authorization": f"Bearer {self.sql_token}",
            "Accept": "application/vnd.apache.arrow.stream",
        }, timeout=120)
        self.counters["sql_status"] = st
        if st == 200:
            with open(os.path.join(self.work, "stored.arrows"), "wb") as f:
                f.write(body)
        else:
            say(f"SQL query failed: HTTP {st} {body[:300]!r}")
        st, body = http("GET", self.url + "/metrics", timeout=10)
        with open(os.path.join(self.work, "collector-metrics.txt"), "wb") as f:
            f.write(body)
        rc = self.stop(self.collector, timeout=120)
        self.counters["collector_stop_rc"] = rc
        say(f"collector stopped (rc {rc})")
        return 0

    def save(self):
        info = {k: v for k, v in vars(self.a).items()}
        info["clock_shifts"] = {k: {"label": v[0], "FAKETIME": v[1]} for k, v in self.shifts.items()}
        info["instances"] = {p.name: p.instance for p in self.all_procs()}
        info["counters"] = self.counters
        info["sql_token"] = self.sql_token
        with open(os.path.join(self.work, "run.json"), "w") as f:
            json.dump(info, f, indent=2, default=str)

    def kill_all(self):
        for pr in self.all_procs():
            if pr.p is not None and pr.p.poll() is None:
                pr.p.kill()
                pr.p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--mnt", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--kills", type=int, default=120)
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--enospc", type=int, default=3)
    ap.add_argument("--enospc-hold", type=float, default=25.0)
    ap.add_argument("--gap-min", type=float, default=0.5)
    ap.add_argument("--gap-max", type=float, default=4.0)
    ap.add_argument("--restart-min", type=float, default=0.2)
    ap.add_argument("--restart-max", type=float, default=3.0)
    ap.add_argument("--p-collector", type=float, default=0.3)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--drain-timeout", type=float, default=180.0)
    a = ap.parse_args()
    c = Chaos(a)
    rc = 1
    try:
        rc = c.run()
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        c.kill_all()
        if os.path.exists(c.ballast):
            os.remove(c.ballast)
        c.save()
    sys.exit(rc)


if __name__ == "__main__":
    main()
