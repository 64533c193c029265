"""What bench/k8s-services.sh measures, run by rcni-k8s-lab inside a lab
whose rcni has "kubeProxyReplacement": true and whose kube-proxy was
removed (KUBECONFIG, RCNI_LAB_DIR, RCNI_LAB_NODES and RCNI_KUBE_PROXY set).

Services are added through the API up to each --sizes in turn (no
selector; an EndpointSlice of their own naming --endpoints backend pods,
each serving bench/svc.py's server). At each size, each proxy in turn
answers Services for a client pod on the first node:

- rcni: the Service hooks on the node's cgroup, kube-proxy absent; the
  client runs in its pod's cgroup (the hooks' subtree).
- iptables, nftables: kube-proxy from the same release in that mode,
  started on the node with the lab's own configuration; the client runs
  outside the node's cgroup, so rcni's hooks leave it to kube-proxy's rules.
  kube-proxy is stopped and `--cleanup` takes its rules out afterwards.

Per proxy: how long it took to answer every Service (kube-proxy's first
sync), connect() to --probes random ClusterIPs --passes times (p50, p99),
the same to the backend pods' own addresses (what each connection pays
without a Service), connections per second over --cps-seconds, the time
from an EndpointSlice written to the first connection through it
(--changes Services made and removed, p50 and max), and the resident
memory of kube-proxy and of rcni-node. At the first size also: round trip
p50 (bench/rr.py) and single-stream iperf3 throughput through a ClusterIP
and to the backend pod's own address, alternating, --dp-rounds each. Idle:
the client where the scheduler puts it; busy: the client on the last CPU,
as the servers.
"""
import argparse
import concurrent.futures as cf
import http.client
import json
import os
import random
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import k8s_net as k

NS = "bench-svc"
PORT = 8080


class Api:
    """The API server, from the admin's kubeconfig: one keep-alive
    connection per thread."""

    def __init__(self, kubeconfig):
        text = open(kubeconfig).read()
        get = lambda key: re.search(rf"{key}: [\"']?([^,}}\s\"']+)", text).group(1)
        m = re.match(r"https://([^:/]+):(\d+)", get("server"))
        self.host, self.port = m.group(1), int(m.group(2))
        self.ctx = ssl.create_default_context(cafile=get("certificate-authority"))
        self.ctx.load_cert_chain(get("client-certificate"), get("client-key"))
        self.local = threading.local()

    def call(self, method, path, body=None):
        for attempt in range(5):
            c = getattr(self.local, "c", None)
            if c is None:
                c = self.local.c = http.client.HTTPSConnection(self.host, self.port, context=self.ctx,
                                                               timeout=60)
            try:
                c.request(method, path, body=json.dumps(body) if body is not None else None,
                          headers={"Content-Type": "application/json"})
                r = c.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException):
                self.local.c = None
                time.sleep(0.2 * (attempt + 1))
                continue
            if r.status == 429 or r.status >= 500:
                time.sleep(0.2 * (attempt + 1))
                continue
            if r.status >= 300 and not (method == "DELETE" and r.status == 404):
                sys.exit(f"{method} {path}: {r.status} {data[:300]!r}")
            return json.loads(data) if data else None
        sys.exit(f"{method} {path}: the API server kept failing")


def service(name):
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": PORT, "protocol": "TCP"}]}}


def endpoint_slice(name, backends):
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"kubernetes.io/service-name": name,
                                    "endpointslice.kubernetes.io/managed-by": "bench.rcni.io"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [b], "conditions": {"ready": True}} for b in backends],
            "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}]}


def add_services(api, start, end, backends):
    """Services start..end-1 with their slices; their ClusterIPs."""
    def one(i):
        name = f"svc-{i:05d}"
        ip = api.call("POST", f"/api/v1/namespaces/{NS}/services", service(name))["spec"]["clusterIP"]
        api.call("POST", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                 endpoint_slice(name, backends))
        return ip
    t0 = time.monotonic()
    ips = []
    with cf.ThreadPoolExecutor(12) as ex:
        for n, ip in enumerate(ex.map(one, range(start, end)), 1):
            ips.append(ip)
            if n % 2000 == 0:
                print(f"  {start + n} Services ({n / (time.monotonic() - t0):.0f}/s)", file=sys.stderr,
                      flush=True)
    return ips


def node_cmd(node_pid, *cmd):
    return ["nsenter", "--target", node_pid, "--mount", "--pid", "--net", "--", *cmd]


class KubeProxy:
    """kube-proxy in `mode` on the node, as the lab ran it but for the mode
    and its health port, moved off 10256, which rcni's agent serves with the
    hooks on (an empty address means kube-proxy's default, 10256)."""

    def __init__(self, binary, node, node_pid, mode, workdir):
        conf = open(os.path.join(os.environ["RCNI_LAB_DIR"], node, "kube-proxy.yaml")).read()
        conf = re.sub(r"(?m)^mode: .*$", f"mode: {mode}", conf)
        conf = re.sub(r"(?m)^healthzBindAddress: .*$", "healthzBindAddress: 127.0.0.1:10266", conf)
        path = os.path.join(workdir, f"kube-proxy-{mode}.yaml")
        with open(path, "w") as f:
            f.write(conf)
        self.log = open(os.path.join(workdir, f"kube-proxy-{mode}.log"), "w")
        self.binary, self.node_pid = binary, node_pid
        self.p = subprocess.Popen(node_cmd(node_pid, binary, f"--config={path}", "--v=1"),
                                  stdout=self.log, stderr=subprocess.STDOUT)

    def pid(self):
        """kube-proxy's own host PID (nsenter's child in the node's PID
        namespace)."""
        for _ in range(50):
            try:
                kids = open(f"/proc/{self.p.pid}/task/{self.p.pid}/children").read().split()
                if kids:
                    return kids[0]
            except OSError:
                pass
            time.sleep(0.1)
        sys.exit("kube-proxy did not start")

    def stop(self):
        try:
            os.kill(int(self.pid()), signal.SIGKILL)
        except (OSError, SystemExit):
            pass
        self.p.wait()
        self.log.close()
        subprocess.run(node_cmd(self.node_pid, self.binary, "--cleanup"), check=True,
                       capture_output=True)


def rss_mib(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def agent_pid():
    inits = {kv.split("=")[1] for kv in os.environ["RCNI_LAB_NODES"].split()}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if open(f"/proc/{pid}/comm").read().strip() != "rcni-node":
                continue
        except OSError:
            continue
        if k.on_this_lab(pid, inits):
            return pid
    sys.exit("no rcni-node on the lab")


def pod_cgroup(pid):
    """The pod's directory in the cgroup v2 tree."""
    for line in open(f"/proc/{pid}/cgroup"):
        if line.startswith("0::"):
            rel = line[3:].strip()
            for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
                if os.path.exists(os.path.join(root + rel, "cgroup.procs")):
                    return root + rel
    sys.exit(f"no cgroup v2 directory for {pid}")


class Client:
    def __init__(self, cpid, cgroup):
        self.cpid, self.cgroup = cpid, cgroup

    def argv(self, regime, *args):
        pin = ["taskset", "-c", str(os.cpu_count() - 1)] if regime == "busy" else []
        if args[0] == "rr":
            tool = ["python3", f"{k.HERE}/rr.py", "client", *args[1:]]
        elif args[0] == "iperf":
            tool = ["iperf3", "-c", args[1], "-p", str(DP_PORTS["iperf"]), "-t", args[2], "-J"]
        else:
            tool = ["python3", f"{k.HERE}/svc.py", *args]
        inner = ["nsenter", "-t", self.cpid, "-n", *pin, *tool]
        if self.cgroup is None:
            return inner
        return ["sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"', "sh", *inner]

    def run(self, regime, *args, timeout=900):
        p = subprocess.run(self.argv(regime, *args), capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            sys.exit(f"svc.py {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout.strip()


def write_targets(path, pairs):
    with open(path, "w") as f:
        f.writelines(f"{a} {p}\n" for a, p in pairs)


def wait_answers(client, ips, workdir, timeout):
    """Until a sample of the Services (and the newest) all connect."""
    sample = random.sample(ips, min(len(ips), 50)) + [ips[-1]]
    path = os.path.join(workdir, "sample")
    write_targets(path, [(ip, 80) for ip in sample])
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        p = subprocess.run(client.argv("idle", "connect", path, "1"), capture_output=True, text=True)
        if p.returncode == 0 and not json.loads(p.stdout)["failed"]:
            return time.monotonic() - t0
        time.sleep(0.5)
    sys.exit(f"the Services did not answer within {timeout} s")


def change_latency(api, client, backends, n, tag):
    """From an EndpointSlice written to the first connection through it, in
    ms, for `n` new Services (removed again after)."""
    out = []
    for i in range(n):
        name = f"chg-{tag}-{i}"
        ip = api.call("POST", f"/api/v1/namespaces/{NS}/services", service(name))["spec"]["clusterIP"]
        p = subprocess.Popen(client.argv("idle", "until", ip, "80", "120"), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() != "known":
            sys.exit(f"Service {name} ({ip}) never refused: its proxy never learnt it")
        t0 = time.monotonic_ns()
        api.call("POST", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                 endpoint_slice(name, backends))
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline().strip()
        p.wait()
        if not line.isdigit():
            sys.exit(f"Service {name} ({ip}): no connection within 120 s of its EndpointSlice")
        out.append((int(line) - t0) / 1e6)
        api.call("DELETE", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices/{name}")
        api.call("DELETE", f"/api/v1/namespaces/{NS}/services/{name}")
    return out


DP_PORTS = {"rr": 5301, "iperf": 5201}


def dp_service(api, backend):
    """The Service the round trip and throughput go through (rr.py's and
    iperf3's ports, to backend-0)."""
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dp", "namespace": NS},
           "spec": {"ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"}
                              for n, p in DP_PORTS.items()]}}
    ip = api.call("POST", f"/api/v1/namespaces/{NS}/services", svc)["spec"]["clusterIP"]
    sl = endpoint_slice("dp", [backend])
    sl["ports"] = [{"name": n, "port": p, "protocol": "TCP"} for n, p in DP_PORTS.items()]
    api.call("POST", f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", sl)
    return ip


def datapath(client, spid, targets, regime, rounds, rr, seconds):
    """Round trip p50 (us, bench/rr.py) and single-stream throughput
    (Gbit/s, iperf3) to each of `targets` (name -> address), the targets
    alternating round by round; medians over rounds."""
    pin = ["taskset", "-c", str(os.cpu_count() - 1)] if regime == "busy" else []
    got = {t: {"rr_us": [], "gbit": []} for t in targets}
    for r in range(rounds):
        order = list(targets.items())
        if r % 2:
            order.reverse()
        for name, addr in order:
            srv = subprocess.Popen(["nsenter", "-t", spid, "-n", *pin, "python3",
                                    f"{k.HERE}/rr.py", "server"], stdout=subprocess.PIPE, text=True)
            srv.stdout.readline()
            got[name]["rr_us"].append(float(client.run(regime, "rr", addr, str(rr))))
            srv.wait(timeout=30)
            srv = subprocess.Popen(["nsenter", "-t", spid, "-n", *pin, "iperf3", "-s", "-1", "-p",
                                    str(DP_PORTS["iperf"])], stdout=subprocess.DEVNULL)
            time.sleep(0.3)
            out = json.loads(client.run(regime, "iperf", addr, str(seconds)))
            got[name]["gbit"].append(out["end"]["sum_received"]["bits_per_second"] / 1e9)
            srv.wait(timeout=30)
    return {t: {m: statistics.median(v) for m, v in d.items()} | {"rounds": d}
            for t, d in got.items()}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--sizes", default="100,1000,10000,30000")
    a.add_argument("--proxies", default="rcni,iptables,nftables")
    a.add_argument("--endpoints", type=int, default=1)
    a.add_argument("--probes", type=int, default=300)
    a.add_argument("--passes", type=int, default=3)
    a.add_argument("--cps-seconds", type=float, default=3)
    a.add_argument("--changes", type=int, default=20)
    a.add_argument("--dp-rounds", type=int, default=3,
                   help="round trip and throughput rounds, at the first size (0: none)")
    a.add_argument("--rr", type=int, default=5000)
    a.add_argument("--dp-seconds", type=float, default=5)
    a.add_argument("--out", required=True)
    a.add_argument("--summary", action="store_true", help="print --out's table and exit")
    o = a.parse_args()
    if o.summary:
        summary(json.load(open(o.out)))
        return
    sizes = [int(s) for s in o.sizes.split(",")]
    proxies = o.proxies.split(",")
    node, node_pid = os.environ["RCNI_LAB_NODES"].split()[0].split("=")
    api = Api(os.environ["KUBECONFIG"])
    workdir = tempfile.mkdtemp(prefix="k8s-services-")

    k.kubectl("create", "namespace", NS)
    k.kubectl("-n", NS, "wait", "serviceaccount/default", "--for=create", "--timeout=60s")
    names = ["client"] + [f"backend-{i}" for i in range(o.endpoints)]
    for name in names:
        k.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "pause", "image": k.PAUSE}]}}))
    k.kubectl("-n", NS, "wait", *[f"pod/{n}" for n in names], "--for=condition=Ready",
              "--timeout=180s")
    ip = {n: k.kubectl("-n", NS, "get", "pod", n, "-o", "jsonpath={.status.podIP}") for n in names}
    backends = [ip[n] for n in names[1:]]
    cpid = k.pod_pid(ip["client"])
    servers = []
    for b in backends:
        s = subprocess.Popen(["nsenter", "-t", k.pod_pid(b), "-n", "taskset", "-c",
                              str(os.cpu_count() - 1), "python3", f"{k.HERE}/svc.py", "server",
                              str(PORT)], stdout=subprocess.PIPE, text=True)
        s.stdout.readline()
        servers.append(s)
    in_pod = Client(cpid, pod_cgroup(cpid))
    outside = Client(cpid, None)
    agent = agent_pid()
    dp_ip = dp_service(api, backends[0]) if o.dp_rounds else None
    spid = k.pod_pid(backends[0])
    direct = os.path.join(workdir, "direct")
    write_targets(direct, [(b, PORT) for b in backends] * max(1, o.probes // len(backends)))

    results = []
    ips = []
    try:
        for size in sizes:
            print(f"k8s-services: adding Services up to {size}", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            ips += add_services(api, len(ips), size, backends)
            made = time.monotonic() - t0
            probe = os.path.join(workdir, f"probe-{size}")
            write_targets(probe, [(i, 80) for i in random.sample(ips, min(o.probes, len(ips)))])
            for proxy in proxies:
                kp = None
                client = in_pod if proxy == "rcni" else outside
                t0 = time.monotonic()
                if proxy != "rcni":
                    kp = KubeProxy(os.environ["RCNI_KUBE_PROXY"], node, node_pid, proxy, workdir)
                try:
                    ready = wait_answers(client, ips, workdir, 900)
                    r = {"size": size, "proxy": proxy, "endpoints": o.endpoints,
                         "ready_s": round(time.monotonic() - t0, 2), "api_s": round(made, 1)}
                    for regime in ("idle", "busy"):
                        svc = json.loads(client.run(regime, "connect", probe, str(o.passes)))
                        pod = json.loads(client.run(regime, "connect", direct, str(o.passes)))
                        failed = len(svc["failed"]) + len(pod["failed"])
                        svc, pod = svc["us"], pod["us"]
                        cps, cps_failed = client.run(regime, "cps", probe,
                                                     str(o.cps_seconds)).split()
                        r[regime] = {"p50": pct(svc, 0.5), "p99": pct(svc, 0.99),
                                     "pod_p50": pct(pod, 0.5), "pod_p99": pct(pod, 0.99),
                                     "cps": float(cps),
                                     "failed": {"connect": failed, "cps": int(cps_failed)}}
                    if dp_ip and size == sizes[0]:
                        targets = {"service": dp_ip, "pod": backends[0]}
                        r["datapath"] = {rg: datapath(client, spid, targets, rg, o.dp_rounds, o.rr,
                                                      o.dp_seconds)
                                         for rg in ("idle", "busy")}
                    ch = change_latency(api, client, backends, o.changes, f"{size}-{proxy}")
                    r["change_ms"] = {"p50": statistics.median(ch), "max": max(ch), "all": ch}
                    r["kube_proxy_mib"] = rss_mib(kp.pid()) if kp else None
                    r["agent_mib"] = rss_mib(agent)
                finally:
                    if kp:
                        kp.stop()
                results.append(r)
                i, b = r["idle"], r["busy"]
                print(f"k8s-services: {size} {proxy}: ready {r['ready_s']} s; connect p50/p99 "
                      f"idle {i['p50']:.0f}/{i['p99']:.0f} us (pod {i['pod_p50']:.0f}/"
                      f"{i['pod_p99']:.0f}), busy {b['p50']:.0f}/{b['p99']:.0f} us (pod "
                      f"{b['pod_p50']:.0f}/{b['pod_p99']:.0f}); {i['cps']:.0f} cps idle, "
                      f"{b['cps']:.0f} busy; change p50 {r['change_ms']['p50']:.0f} ms max "
                      f"{r['change_ms']['max']:.0f}; failed connections idle {i['failed']}, busy "
                      f"{b['failed']}", file=sys.stderr, flush=True)
                with open(o.out, "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        for s in servers:
            s.kill()
    summary(results)


def summary(results):
    """rcni against each kube-proxy mode, size by size: ratios under 1 are
    rcni's lead (for connections per second, over 1)."""
    by = {(r["size"], r["proxy"]): r for r in results}
    print("\n| Services | proxy | ready s | connect p50 / p99 us (idle) | pod p50 | busy p50 / p99 "
          "| cps idle / busy | change p50 / max ms | kube-proxy MiB | rcni-node MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        i, b, c = r["idle"], r["busy"], r["change_ms"]
        kp = f"{r['kube_proxy_mib']:.0f}" if r["kube_proxy_mib"] else "-"
        print(f"| {r['size']} | {r['proxy']} | {r['ready_s']} | {i['p50']:.0f} / {i['p99']:.0f} | "
              f"{i['pod_p50']:.0f} | {b['p50']:.0f} / {b['p99']:.0f} | {i['cps']:.0f} / "
              f"{b['cps']:.0f} | {c['p50']:.0f} / {c['max']:.0f} | {kp} | {r['agent_mib']:.0f} |")
    print("\nThrough a ClusterIP against the backend pod's own address (round trip p50 us, "
          "throughput Gbit/s):")
    for r in results:
        for rg, d in (r.get("datapath") or {}).items():
            sv, pd = d["service"], d["pod"]
            print(f"  {r['proxy']} {rg}: rr {sv['rr_us']:.1f} vs {pd['rr_us']:.1f} "
                  f"({sv['rr_us'] / pd['rr_us']:.2f}), throughput {sv['gbit']:.2f} vs "
                  f"{pd['gbit']:.2f} ({sv['gbit'] / pd['gbit']:.2f})")
    print("\nrcni / kube-proxy (connect p50, p99 idle and busy; cps idle and busy; change p50):")
    for (size, proxy), r in sorted(by.items()):
        mine = by.get((size, "rcni"))
        if proxy == "rcni" or not mine:
            continue
        q = lambda f: f(mine) / f(r) if f(r) else float("nan")
        print(f"  {size} vs {proxy}: p50 {q(lambda x: x['idle']['p50']):.2f}, p99 "
              f"{q(lambda x: x['idle']['p99']):.2f}, busy p50 {q(lambda x: x['busy']['p50']):.2f}, "
              f"busy p99 {q(lambda x: x['busy']['p99']):.2f}; cps {q(lambda x: x['idle']['cps']):.2f}, "
              f"busy {q(lambda x: x['busy']['cps']):.2f}; change {q(lambda x: x['change_ms']['p50']):.2f}")


if __name__ == "__main__":
    main()
