"""What deploy/*.yaml must say beyond Kubernetes' schemas (which
kubernetes-validate checks): the agent's command line, the mounts, the
permissions, the preset, and the image scripts/image builds. Run by
scripts/check-deploy with the venv's python (PyYAML comes with
kubernetes-validate): check-deploy.py VERSION RCNI_YAML UNINSTALL_YAML.
Prints each problem and exits 1 if there is any."""

import json
import re
import sys
from pathlib import Path

import yaml

version, rcni_yaml, uninstall_yaml = sys.argv[1:4]
image = f"localhost/rcni:{version}"
problems = []


def want(cond, msg):
    if not cond:
        problems.append(msg)


def load(path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_checks(where, spec):
    """What every rcni pod needs, agent or uninstall."""
    want(spec.get("hostNetwork") is True, f"{where}: hostNetwork is not true")
    want(
        spec.get("priorityClassName") == "system-node-critical",
        f"{where}: priorityClassName is not system-node-critical",
    )
    want(
        spec.get("tolerations") == [{"operator": "Exists"}],
        f"{where}: tolerations must be exactly [{{operator: Exists}}] (every taint)",
    )
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        cw = f"{where}: container {c['name']}"
        want(c.get("image") == image, f"{cw}: image is {c.get('image')}, not {image}")
        want(
            c.get("imagePullPolicy") == "IfNotPresent",
            f"{cw}: imagePullPolicy must be IfNotPresent (the image is imported, not pulled)",
        )
        want(
            c.get("securityContext", {}).get("privileged") is True,
            f"{cw}: not privileged",
        )
        for m in c.get("volumeMounts", []):
            want(m["name"] in vols, f"{cw}: mount of unknown volume {m['name']}")
            want(
                m.get("mountPropagation", "None")
                in ("None", "HostToContainer", "Bidirectional"),
                f"{cw}: mountPropagation {m.get('mountPropagation')}",
            )
    return vols


def host_mounts(container, vols):
    """{path in container: host path} of a container's hostPath mounts."""
    out = {}
    for m in container.get("volumeMounts", []):
        v = vols.get(m["name"], {})
        if "hostPath" in v:
            out[m["mountPath"]] = v["hostPath"]["path"]
    return out


rcni = load(rcni_yaml)
for kind, name in [
    ("Namespace", "rcni-system"),
    ("ServiceAccount", "rcni-node"),
    ("ClusterRole", "rcni-node"),
    ("ClusterRoleBinding", "rcni-node"),
    ("ConfigMap", "rcni-config"),
    ("DaemonSet", "rcni-node"),
]:
    want((kind, name) in rcni, f"{rcni_yaml}: no {kind} {name}")
if problems:
    print("\n".join(problems))
    sys.exit(1)

# RBAC: exactly what the agent uses.
grants = set()
for r in rcni[("ClusterRole", "rcni-node")]["rules"]:
    for g in r["apiGroups"]:
        for res in r["resources"]:
            for v in r["verbs"]:
                grants.add((g, res, v))
need = {("", "nodes", v) for v in ("get", "list", "watch", "patch")}
need |= {(g, r, v) for g, r in [("", "pods"), ("", "namespaces"), ("", "services"), ("discovery.k8s.io", "endpointslices"), ("networking.k8s.io", "networkpolicies")] for v in ("list", "watch")}
want(grants == need, f"ClusterRole rcni-node: grants {sorted(grants ^ need)} differ from what the agent needs")
crb = rcni[("ClusterRoleBinding", "rcni-node")]
want(crb["roleRef"]["name"] == "rcni-node", "ClusterRoleBinding: wrong role")
want(
    crb["subjects"] == [{"kind": "ServiceAccount", "name": "rcni-node", "namespace": "rcni-system"}],
    "ClusterRoleBinding: subject is not the rcni-node ServiceAccount",
)

# The preset: the agent's cluster file without nodes; vxlan by default.
try:
    net = json.loads(rcni[("ConfigMap", "rcni-config")]["data"]["net-conf.json"])
except (KeyError, ValueError) as e:
    net = None
    problems.append(f"ConfigMap rcni-config: net-conf.json: {e}")
if net is not None:
    # The agent's own list (node/src/registry/cluster.rs NET_KEYS), so the two cannot drift.
    src = (Path(__file__).resolve().parent.parent / "node/src/registry/cluster.rs").read_text()
    m = re.search(r"const NET_KEYS: &\[&str\] = &\[(.*?)\];", src, re.S)
    keys = set(re.findall(r'"([^"]+)"', m.group(1))) if m else set()
    want(bool(keys), "node/src/registry/cluster.rs: NET_KEYS not found")
    m = re.search(r"const NET_CONF_ONLY_KEYS: &\[&str\] = &\[(.*?)\];", src, re.S)
    want(m is not None, "node/src/registry/cluster.rs: NET_CONF_ONLY_KEYS not found")
    keys |= set(re.findall(r'"([^"]+)"', m.group(1))) if m else set()
    want(set(net) <= keys, f"net-conf.json: keys {sorted(set(net) - keys)} are not the agent's")
    want(net.get("backend") == "vxlan", "net-conf.json: the default backend must be vxlan (the Canal-style preset)")
    want(net.get("ebpf", False) is False, "net-conf.json: ebpf must be off by default")
    want(net.get("encryption", "none") == "none", "net-conf.json: encryption must be none by default")
    want("network" in net, "net-conf.json: no network")

ds = rcni[("DaemonSet", "rcni-node")]
spec = ds["spec"]["template"]["spec"]
vols = pod_checks("DaemonSet rcni-node", spec)
want(spec.get("serviceAccountName") == "rcni-node", "DaemonSet rcni-node: serviceAccountName")
want(
    {v["configMap"]["name"] for v in vols.values() if "configMap" in v} == {"rcni-config"},
    "DaemonSet rcni-node: net-conf volume is not ConfigMap rcni-config",
)
inits = spec.get("initContainers", [])
want(len(inits) == 1, "DaemonSet rcni-node: one init container expected")
if inits:
    init = inits[0]
    want(
        init.get("command") == ["/usr/bin/rcni-node", "install"] and not init.get("args"),
        f"DaemonSet rcni-node: init container runs {init.get('command')}, not rcni-node install",
    )
    hm = host_mounts(init, vols)
    want(hm.get("/host/opt/cni/bin") == "/opt/cni/bin", "init container: /opt/cni/bin not at /host/opt/cni/bin")
    want(hm.get("/host/var/lib/rcni") == "/var/lib/rcni", "init container: /var/lib/rcni not at /host/var/lib/rcni")
agents = spec.get("containers", [])
want(len(agents) == 1, "DaemonSet rcni-node: one container expected")
if agents:
    agent = agents[0]
    # The CLI contract of `rcni-node run` in Kubernetes mode.
    want(
        agent.get("command")
        == [
            "/usr/bin/rcni-node",
            "run",
            "--kubernetes",
            "--net-conf",
            "/etc/rcni/net-conf.json",
            "--cni-conf-dir",
            "/host/etc/cni/net.d",
            "--policy-dir",
            "/run/rcni/policy.d",
            "--cni-bin-dir",
            "/opt/rcni/bin",
            "--cgroup-root",
            "/host/sys/fs/cgroup",
        ]
        and not agent.get("args"),
        f"DaemonSet rcni-node: the agent runs {agent.get('command')} {agent.get('args', '')}",
    )
    want(
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in agent.get("env", []),
        "agent: NODE_NAME is not from spec.nodeName",
    )
    want(
        any(m["mountPath"] == "/etc/rcni" and vols[m["name"]].get("configMap") for m in agent.get("volumeMounts", [])),
        "agent: net-conf.json is not mounted at /etc/rcni",
    )
    hm = host_mounts(agent, vols)
    for inside, host in [
        ("/host/etc/cni/net.d", "/etc/cni/net.d"),
        ("/sys/fs/bpf", "/sys/fs/bpf"),
        ("/var/lib/cni", "/var/lib/cni"),
        ("/run/netns", "/run/netns"),
        ("/run/rcni", "/run/rcni"),
        ("/var/lib/rcni-node", "/var/lib/rcni-node"),
        ("/host/sys/fs/cgroup", "/sys/fs/cgroup"),
    ]:
        want(hm.get(inside) == host, f"agent: host {host} is not mounted at {inside}")
    # The API server's own address for a cluster without kube-proxy
    # ("kubeProxyReplacement": true), optional so that nothing else needs it.
    want(
        {"configMapRef": {"name": "kubernetes-services-endpoint", "optional": True}}
        in agent.get("envFrom", []),
        "agent: no optional envFrom of ConfigMap kubernetes-services-endpoint",
    )

un = load(uninstall_yaml)
uds = un.get(("DaemonSet", "rcni-uninstall"))
want(uds is not None, f"{uninstall_yaml}: no DaemonSet rcni-uninstall")
if uds:
    uspec = uds["spec"]["template"]["spec"]
    uvols = pod_checks("DaemonSet rcni-uninstall", uspec)
    for c in uspec.get("initContainers", []) + uspec.get("containers", []):
        hm = host_mounts(c, uvols)
        for inside, host in [
            ("/host/opt/cni/bin", "/opt/cni/bin"),
            ("/host/etc/cni/net.d", "/etc/cni/net.d"),
            ("/host/var/lib/rcni", "/var/lib/rcni"),
        ]:
            want(hm.get(inside) == host, f"uninstall {c['name']}: host {host} is not mounted at {inside}")
    want(
        [c.get("command") for c in uspec.get("initContainers", [])] == [["/usr/bin/rcni-node", "uninstall"]],
        "DaemonSet rcni-uninstall: the init container does not run rcni-node uninstall",
    )

if problems:
    print("\n".join(problems))
    sys.exit(1)
