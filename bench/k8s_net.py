"""What bench/k8s-flannel.sh measures on one network, run by rcni-k8s-lab
inside the lab (the control plane's network namespace, KUBECONFIG and
RCNI_LAB_NODES set): writes a JSON object to --out.

Two labs run at once, one per network, and take turns (--turns DIR, --me,
--order): each round of each measure runs while the other lab only idles,
and the networks alternate round by round, so that the machine's drift
(the same setup's busy round trip moved from 37 to 56 us between rounds
here) falls on both alike.

- startup: N pods (a Deployment of pause, spread over the nodes by the
  scheduler) from `kubectl apply` to N Ready, --rounds times, each round's
  pods deleted and gone before the next.
- rr, gbit: a pod on the first node to a pod on the second: TCP
  request/response median (bench/rr.py) and single-stream iperf3, from the
  pods' own network namespaces, --dp-rounds times (each figure's median
  kept, with every round's), per regime (idle: where the scheduler puts
  client and server; busy: both on the last CPU, which never idles during a
  round trip, so each hop's cost shows).
  With --freeze (bench/k8s-flannel.sh's default), every process of every
  lab on the machine (control planes, kubelets, containerd, agents, pods)
  is stopped (SIGSTOP) for each rr and gbit round and resumed after: the
  packets need none of them once the pods are wired, and three clusters'
  housekeeping on 2 cores otherwise spreads one network's rounds wider
  than the gap between networks.
"""
import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PAUSE = "registry.k8s.io/pause:3.10.2"


def kubectl(*args, input=None, check=True):
    p = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True)
    if check and p.returncode != 0:
        sys.exit(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def apply(obj):
    kubectl("apply", "-f", "-", input=json.dumps(obj))


def deployment(name, replicas):
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "pause", "image": PAUSE}],
                },
            },
        },
    }


class Turns:
    """Steps numbered across the labs: the k-th round a lab takes (over
    every measure) is step k * len(order) + (order.index(me) - k) mod
    len(order). DIR/turn holds
    the step whose turn it is; the first in order starts at 0 once every
    lab has written DIR/ready-<name>."""

    def __init__(self, d, me, order):
        self.d, self.me, self.order = d, me, order
        self.done = 0  # rounds taken so far, across the measures

    def _read(self):
        try:
            with open(os.path.join(self.d, "turn")) as f:
                return int(f.read() or -1)
        except (OSError, ValueError):
            return -1

    def _write(self, step):
        tmp = os.path.join(self.d, f"turn.{self.me}")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(self.d, "turn"))

    def _wait(self, step, limit=1800):
        t0 = time.monotonic()
        while self._read() < step:
            if time.monotonic() - t0 > limit:
                sys.exit(f"{self.me}: the other lab did not take its turn {step} in {limit} s")
            time.sleep(0.2)

    def ready(self):
        open(os.path.join(self.d, f"ready-{self.me}"), "w").close()
        if self.order[0] == self.me:
            t0 = time.monotonic()
            while not all(os.path.exists(os.path.join(self.d, f"ready-{n}")) for n in self.order):
                if time.monotonic() - t0 > 1800:
                    sys.exit(f"{self.me}: the other lab never got ready")
                time.sleep(0.5)
            self._write(0)

    def take(self, fn):
        # The order turns by one each round: going first or last after the
        # others' rounds was worth 0.15 us of a 38 us round trip here.
        n = len(self.order)
        step = self.done * n + (self.order.index(self.me) - self.done) % n
        self._wait(step)
        try:
            return fn()
        finally:
            self.done += 1
            self._write(step + 1)

    def finish(self):
        # Until the last step ends: this lab's teardown would load the
        # machine while the other measures.
        self._wait(self.done * len(self.order))


def startup(pods, rounds, turns):
    times = []
    for r in range(rounds):
        times.append(turns.take(lambda: startup_round(pods, r)))
    return times


def startup_round(pods, r):
    t0 = time.monotonic()
    apply(deployment("startup", pods))
    kubectl("-n", "bench", "wait", "deployment/startup", "--timeout=600s",
            f"--for=jsonpath={{.status.readyReplicas}}={pods}")
    t = time.monotonic() - t0
    print(f"  startup round {r + 1}: {pods} pods Ready in {t:.2f} s", file=sys.stderr, flush=True)
    kubectl("-n", "bench", "delete", "deployment/startup", "--wait=true")
    kubectl("-n", "bench", "wait", "pods", "-l", "app=startup", "--for=delete", "--timeout=300s")
    return t


def ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[1]


def on_this_lab(pid, inits):
    """Whether `pid` descends from one of this lab's node inits: the labs
    run at once and each has its own pods at the same addresses."""
    try:
        for _ in range(8):
            pid = ppid(pid)
            if pid in inits:
                return True
            if pid in ("0", "1"):
                return False
    except OSError:
        pass
    return False


def pod_pid(ip):
    """The host PID of a process in this lab's pod whose eth0 has `ip`: its
    pause."""
    inits = {kv.split("=")[1] for kv in os.environ["RCNI_LAB_NODES"].split()}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0] != b"/pause":
                    continue
        except OSError:
            continue
        if not on_this_lab(pid, inits):
            continue
        out = subprocess.run(["nsenter", "-t", pid, "-n", "ip", "-4", "-o", "addr", "show"],
                             capture_output=True, text=True).stdout
        if f" {ip}/" in out:
            return pid
    sys.exit(f"no pause process with {ip}")


def in_pod(pid, regime, *cmd):
    pin = ["taskset", "-c", str(os.cpu_count() - 1)] if regime == "busy" else []
    return ["nsenter", "-t", pid, "-n", *pin, *cmd]


def datapath_pods():
    nodes = [kv.split("=")[0] for kv in os.environ["RCNI_LAB_NODES"].split()]
    for name, node in (("client", nodes[0]), ("server", nodes[1])):
        apply({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "bench"},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "pause", "image": PAUSE}]},
        })
    kubectl("-n", "bench", "wait", "pod/client", "pod/server", "--for=condition=Ready", "--timeout=120s")
    ip = {n: kubectl("-n", "bench", "get", "pod", n, "-o", "jsonpath={.status.podIP}") for n in ("client", "server")}
    cpid, spid = pod_pid(ip["client"]), pod_pid(ip["server"])
    subprocess.run(in_pod(cpid, "idle", "ping", "-c", "3", "-W", "2", "-q", ip["server"]),
                   check=True, capture_output=True)
    return cpid, spid, ip["server"]


def processes():
    """{pid: (ppid, comm, cmdline)} of every process now."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        out[pid] = (stat.rsplit(")", 1)[1].split()[1], comm, cmd)
    return out


def lab_processes():
    """Every descendant of every rcni-k8s-lab on the machine (each lab's
    control plane, nodes, their daemons and pods), but not the labs
    themselves nor this script's kind (the measuring tools and the other
    labs' turn-takers)."""
    procs = processes()
    children = {}
    for pid, (pp, _, _) in procs.items():
        children.setdefault(pp, []).append(pid)
    stack = [p for p, (_, comm, _) in procs.items() if comm == "rcni-k8s-lab"]
    found = []
    while stack:
        for c in children.get(stack.pop(), []):
            if b"k8s_net.py" in procs[c][2]:
                continue
            found.append(int(c))
            stack.append(c)
    return found


@contextlib.contextmanager
def frozen(on):
    """Every lab process stopped while the body runs (see the module's
    doc), resumed however the body ends. Processes a stopped one would
    have started cannot appear meanwhile; one that exits is skipped."""
    stopped = []
    try:
        if on:
            # Twice: a process forked while the first pass ran.
            for _ in range(2):
                for pid in lab_processes():
                    if pid in stopped:
                        continue
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                        stopped.append(pid)
            time.sleep(0.2)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def datapath(pods, regimes, seconds, rr, rounds, turns, freeze):
    runs = {r: [] for r in regimes}

    def run(regime):
        with frozen(freeze):
            return one_run(*pods, regime, seconds, rr)

    for _ in range(rounds):
        for regime in regimes:
            runs[regime].append(turns.take(lambda: run(regime)))
    # Per regime: each figure's median over the rounds, and every round's.
    return {r: {"rr_p50_us": statistics.median(x["rr_p50_us"] for x in v),
                "gbit": statistics.median(x["gbit"] for x in v),
                "rounds": v} for r, v in runs.items()}


def one_run(cpid, spid, server, regime, seconds, rr):
    srv = subprocess.Popen(in_pod(spid, regime, "iperf3", "-s", "-1", "-p", "5201"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    j = subprocess.run(in_pod(cpid, regime, "iperf3", "-c", server, "-p", "5201", "-t", str(seconds), "-J"),
                       capture_output=True, text=True, check=True).stdout
    srv.wait(timeout=30)
    gbit = json.loads(j)["end"]["sum_received"]["bits_per_second"] / 1e9
    srv = subprocess.Popen(in_pod(spid, regime, "python3", f"{HERE}/rr.py", "server"),
                           stdout=subprocess.PIPE, text=True)
    srv.stdout.readline()
    p50 = float(subprocess.run(in_pod(cpid, regime, "python3", f"{HERE}/rr.py", "client", server, str(rr)),
                               capture_output=True, text=True, check=True).stdout)
    srv.wait(timeout=30)
    print(f"  {regime}: rr p50 {p50:.1f} us, {gbit:.2f} Gbit/s", file=sys.stderr, flush=True)
    return {"rr_p50_us": p50, "gbit": gbit}


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--out", required=True)
    a.add_argument("--pods", type=int, default=30)
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--seconds", type=int, default=5)
    a.add_argument("--rr", type=int, default=5000)
    a.add_argument("--dp-rounds", type=int, default=3)
    a.add_argument("--regime", default="both", choices=["idle", "busy", "both"])
    a.add_argument("--freeze", action="store_true", help="stop every lab process during rr and gbit rounds")
    a.add_argument("--turns", required=True, help="the directory both labs share")
    a.add_argument("--me", required=True)
    a.add_argument("--order", required=True, help="the networks, comma-separated, in turn order")
    o = a.parse_args()
    regimes = ["idle", "busy"] if o.regime == "both" else [o.regime]
    turns = Turns(o.turns, o.me, o.order.split(","))
    kubectl("create", "namespace", "bench")
    kubectl("-n", "bench", "wait", "serviceaccount/default", "--for=create", "--timeout=60s")
    pods = datapath_pods()
    turns.ready()
    result = {"startup_s": startup(o.pods, o.rounds, turns)}
    result["datapath"] = datapath(pods, regimes, o.seconds, o.rr, o.dp_rounds, turns, o.freeze)
    turns.finish()
    kubectl("-n", "bench", "delete", "pod", "client", "server", "--wait=true")
    result["startup_median_s"] = statistics.median(result["startup_s"])
    with open(o.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
