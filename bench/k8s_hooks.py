"""What bench/k8s-hooks.sh measures, run by rcni-k8s-lab inside an rcni
lab (KUBECONFIG and RCNI_LAB_NODES set): the pod-to-pod round trip across
nodes (bench/rr.py, median of --rr round trips) with the policy plugin's
programs on the two pods' host veths and with them taken off, alternating
round by round (the order flipped each round) in one lab, so the machine's
drift falls on both alike. The programs are taken off with `tc filter del`
and put back from their pins (prog-pod on ingress, prog-pol-in on egress),
as the plugin attaches them on clsact. Prints each round and the medians.
"""
import argparse
import os
import statistics
import subprocess
import sys

import k8s_net as k

PIN = "/sys/fs/bpf/rcni/rcni"


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

    for n, v in ends:
        if "pref 10" not in node_sh(n, "tc", "filter", "show", "dev", v, "egress"):
            sys.exit(f"no policy program on {v}'s egress: is the policy plugin in the chain?")
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
