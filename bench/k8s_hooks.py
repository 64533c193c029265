"""What bench/k8s-hooks.sh measures, run by rcni-k8s-lab inside an rcni
lab (KUBECONFIG and RCNI_LAB_NODES set): the pod-to-pod round trip across
nodes (bench/rr.py, median of --rr round trips) with the policy plugin's
programs on the two pods' host veths and with them taken off, alternating
round by round (the order flipped each round) in one lab, so the machine's
drift falls on both alike. The programs are taken off with `tc filter del`
and put back from their pins (prog-pod on ingress, prog-pol-in on egress),
as the plugin attaches them on clsact. A NetworkPolicy elsewhere
(ELSEWHERE) puts them there first. Prints each round and the medians.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import k8s_net as k

PIN = "/sys/fs/bpf/rcni/rcni"

# The programs are on the veths only while the network has a policy: one in
# a namespace of its own, which selects neither bench pod, puts them there
# and makes them check (the endpoint and rule set lookups of every packet).
ELSEWHERE = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "deny-in", "namespace": "bench-elsewhere"},
    "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
}


def node_sh(pid, *cmd):
    """In the node's network and mount namespaces (its bpffs, its tc)."""
    return subprocess.run(["nsenter", "-t", pid, "-n", "-m", *cmd],
                          capture_output=True, text=True, check=True).stdout


def host_veth(pod_pid, node_pid):
    """The node side of the pod's eth0: its peer's ifindex, by name."""
    out = subprocess.run(["nsenter", "-t", pod_pid, "-n", "ip", "-o", "link", "show", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    peer = out.split("@if")[1].split(":")[0]
    for line in node_sh(node_pid, "ip", "-o", "link").splitlines():
        if line.split(":")[0] == peer:
            return line.split(":")[1].strip().split("@")[0]
    sys.exit(f"no device {peer} on the node")


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--rounds", type=int, default=6)
    a.add_argument("--rr", type=int, default=5000)
    o = a.parse_args()
    k.kubectl("create", "namespace", "bench")
    k.kubectl("-n", "bench", "wait", "serviceaccount/default", "--for=create", "--timeout=60s")
    cpid, spid, server = k.datapath_pods()
    nodes = [kv.split("=")[1] for kv in os.environ["RCNI_LAB_NODES"].split()]
    ends = [(nodes[0], host_veth(cpid, nodes[0])), (nodes[1], host_veth(spid, nodes[1]))]

    def off():
        for n, v in ends:
            for hook in ("ingress", "egress"):
                node_sh(n, "tc", "filter", "del", "dev", v, hook, "pref", "10")

    def on():
        for n, v in ends:
            for hook, prog in (("ingress", "prog-pod"), ("egress", "prog-pol-in")):
                node_sh(n, "tc", "filter", "add", "dev", v, hook, "pref", "10", "handle", "1",
                        "bpf", "da", "object-pinned", f"{PIN}/{prog}")

    def rr(regime):
        srv = subprocess.Popen(k.in_pod(spid, regime, "python3", f"{k.HERE}/rr.py", "server"),
                               stdout=subprocess.PIPE, text=True)
        srv.stdout.readline()
        p50 = float(subprocess.run(k.in_pod(cpid, regime, "python3", f"{k.HERE}/rr.py", "client",
                                            server, str(o.rr)),
                                   capture_output=True, text=True, check=True).stdout)
        srv.wait(timeout=30)
        return p50

    k.kubectl("create", "namespace", "bench-elsewhere")
    k.apply(ELSEWHERE)
    hooked = lambda: all("pref 10" in node_sh(n, "tc", "filter", "show", "dev", v, "egress")
                         for n, v in ends)
    deadline = time.monotonic() + 60
    while not hooked():
        if time.monotonic() > deadline:
            sys.exit("no policy program on the pods' veths 60 s after a NetworkPolicy was "
                     "made: is the policy plugin in the chain, and rcni-node syncing?")
        time.sleep(0.5)
    res = {(s, r): [] for s in ("with", "without") for r in ("busy", "idle")}
    state = "with"
    try:
        for i in range(o.rounds):
            for s in (("with", "without") if i % 2 == 0 else ("without", "with")):
                if s != state:
                    (off if s == "without" else on)()
                    state = s
                for regime in ("busy", "idle"):
                    res[(s, regime)].append(rr(regime))
            print(f"  round {i + 1}: " + ", ".join(f"{s} {r} {v[-1]:.1f} us"
                                                   for (s, r), v in res.items()), flush=True)
    finally:
        if state == "without":
            on()
    for regime in ("busy", "idle"):
        w = statistics.median(res[("with", regime)])
        wo = statistics.median(res[("without", regime)])
        print(f"{regime}: rr p50 with the programs {w:.2f} us, without {wo:.2f} us, "
              f"the programs cost {w - wo:.2f} us per round trip ({w / wo:.3f}x)")


if __name__ == "__main__":
    main()
