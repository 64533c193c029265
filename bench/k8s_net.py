"""What bench/k8s-flannel.sh measures on one network, run by rcni-k8s-lab
inside the lab (the control plane's network namespace, KUBECONFIG and
RCNI_LAB_NODES set): writes a JSON object to --out.

- startup: N pods (a Deployment of pause, spread over the nodes by the
  scheduler) from `kubectl apply` to N Ready, --rounds times, each round's
  pods deleted and gone before the next.
- rr, gbit: a pod on the first node to a pod on the second: TCP
  request/response median (bench/rr.py) and single-stream iperf3, from the
  pods' own network namespaces, --dp-rounds times (each figure's median
  kept, with every round's), per regime (idle: where the scheduler puts
  client and server; busy: both on the last CPU, which never idles during a
  round trip, so each hop's cost shows).
"""
import argparse
import json
import os
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


def startup(pods, rounds):
    times = []
    for r in range(rounds):
        t0 = time.monotonic()
        apply(deployment("startup", pods))
        kubectl("-n", "bench", "wait", "deployment/startup", "--timeout=600s",
                f"--for=jsonpath={{.status.readyReplicas}}={pods}")
        t = time.monotonic() - t0
        times.append(t)
        print(f"  startup round {r + 1}: {pods} pods Ready in {t:.2f} s", file=sys.stderr, flush=True)
        kubectl("-n", "bench", "delete", "deployment/startup", "--wait=true")
        kubectl("-n", "bench", "wait", "pods", "-l", "app=startup", "--for=delete", "--timeout=300s")
    return times


def pod_pid(ip):
    """The host PID of a process in the pod whose eth0 has `ip`: its pause."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0] != b"/pause":
                    continue
        except OSError:
            continue
        out = subprocess.run(["nsenter", "-t", pid, "-n", "ip", "-4", "-o", "addr", "show"],
                             capture_output=True, text=True).stdout
        if f" {ip}/" in out:
            return pid
    sys.exit(f"no pause process with {ip}")


def in_pod(pid, regime, *cmd):
    pin = ["taskset", "-c", str(os.cpu_count() - 1)] if regime == "busy" else []
    return ["nsenter", "-t", pid, "-n", *pin, *cmd]


def datapath(regimes, seconds, rr, rounds):
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
    runs = {r: [] for r in regimes}
    for _ in range(rounds):
        for regime in regimes:
            runs[regime].append(one_run(cpid, spid, ip["server"], regime, seconds, rr))
    kubectl("-n", "bench", "delete", "pod", "client", "server", "--wait=true")
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
    o = a.parse_args()
    regimes = ["idle", "busy"] if o.regime == "both" else [o.regime]
    kubectl("create", "namespace", "bench")
    kubectl("-n", "bench", "wait", "serviceaccount/default", "--for=create", "--timeout=60s")
    result = {"startup_s": startup(o.pods, o.rounds)}
    result["datapath"] = datapath(regimes, o.seconds, o.rr, o.dp_rounds)
    result["startup_median_s"] = statistics.median(result["startup_s"])
    with open(o.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
