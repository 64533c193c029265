//! The node's CNI network: bridge + host-local on the node's pod subnet,
//! then portmap, as flannel's CNI plugin delegates it (the agent masquerades,
//! so the bridge doesn't). With `"ebpf": true` the fastpath plugin follows the
//! bridge (its pin root the agent's, whose other-node map it shares), and
//! the bridge's pods get netkit pairs where the kernel has netkit. With the policy inputs from the API (the
//! Canal-style preset), the policy plugin follows the bridge, reading the
//! agent's mirror of NetworkPolicies and asking it for pods' labels.

use std::path::{Path, PathBuf};

use ipnetwork::{Ipv4Network, Ipv6Network};
use serde_json::{Value, json};

pub const FILE_NAME: &str = "10-rcni.conflist";
pub const NETWORK_NAME: &str = "rcni";
pub const BRIDGE: &str = "cni0";

/// The policy plugin's entry: paths as the node (the runtime running the
/// plugin) sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyPlugin {
    pub policy_dir: PathBuf,
    pub agent_socket: PathBuf,
    /// The plugin's dataDir (its default when unset).
    pub data_dir: Option<PathBuf>,
    /// The plugin's backend (its default, auto, when unset).
    pub backend: Option<String>,
}

impl PolicyPlugin {
    fn render(&self) -> Value {
        let mut v = json!({
            "type": "policy",
            "policyDir": self.policy_dir,
            "agentSocket": self.agent_socket,
        });
        if let Some(d) = &self.data_dir {
            v["dataDir"] = json!(d);
        }
        if let Some(b) = &self.backend {
            v["backend"] = json!(b);
        }
        v
    }
}

/// A dual-stack node gets a second range (host-local gives the pod one
/// address from each), and the bridge a default route per family; an
/// IPv6-only node (`pod_cidr` `None`) only the IPv6 range (the bridge then
/// holds only the IPv6 gateway, the subnet's `::1`).
pub fn render(
    pod_cidr: Option<Ipv4Network>,
    pod_cidr6: Option<Ipv6Network>,
    mtu: u32,
    ipam_data_dir: Option<&Path>,
    policy: Option<&PolicyPlugin>,
    fastpath_pin_root: Option<&Path>,
) -> Value {
    let mut ranges: Vec<Value> = pod_cidr
        .map(|p| json!([{"subnet": p.to_string()}]))
        .into_iter()
        .collect();
    if let Some(p6) = pod_cidr6 {
        ranges.push(json!([{"subnet": p6.to_string()}]));
    }
    let mut ipam = json!({
        "type": "host-local",
        "ranges": ranges,
    });
    if let Some(d) = ipam_data_dir {
        ipam["dataDir"] = json!(d);
    }
    let mut bridge = json!({
        "type": "bridge",
        "bridge": BRIDGE,
        "isGateway": true,
        "isDefaultGateway": true,
        "hairpinMode": true,
        // The node's range is the API's, not ours: a node deleted and
        // registered again gets a new podCIDR while cni0 keeps the old
        // gateway, and without this every new pod fails with "cni0 already
        // has an IP address different from" (flannel's users delete cni0
        // by hand). Pods left in the old range are cut off already: the
        // other nodes route only the new one.
        "forceAddress": true,
        "mtu": mtu,
        "ipam": ipam,
    });
    // With the eBPF datapath, pods get netkit pairs where the kernel has
    // netkit (6.7+): the fast path then runs at the pod's transmit. The
    // bridge plugin gives a veth pair (and says so) where it has none.
    if fastpath_pin_root.is_some() {
        bridge["linkType"] = json!("netkit");
    }
    let mut plugins = vec![bridge];
    // Right after the bridge: they need the pod's veth from prevResult.
    // Their order does not matter: policy's programs attach in front.
    if let Some(root) = fastpath_pin_root {
        plugins.push(json!({"type": "fastpath", "pinRoot": root}));
    }
    plugins.extend(policy.map(PolicyPlugin::render));
    // The pod's bandwidth annotations (the runtime's `bandwidth`
    // capability): after fastpath, bandwidth shapes by departure time and
    // the pod keeps the fast path.
    if fastpath_pin_root.is_some() {
        plugins.push(json!({"type": "bandwidth", "capabilities": {"bandwidth": true}}));
    }
    plugins.push(json!({"type": "portmap", "capabilities": {"portMappings": true}}));
    json!({
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": plugins,
    })
}

/// Cloud mode's network, as the AWS VPC CNI lays pods out: ptp (a veth per
/// pod, a /32 route to it, 169.254.1.1 on the host end as the pod's
/// gateway) with `vpc-ipam` asking the agent's pool on `socket` for an
/// address of the cloud network, then the policy plugin when the agent
/// mirrors policy, then portmap. No masquerade in ptp: pod addresses are
/// the VPC's own, and the agent translates only what leaves the VPC.
pub fn render_cloud(mtu: u32, socket: &Path, policy: Option<&PolicyPlugin>) -> Value {
    let mut plugins = vec![json!({
        "type": "ptp",
        "mtu": mtu,
        "ipam": {"type": "vpc-ipam", "socket": socket},
    })];
    plugins.extend(policy.map(PolicyPlugin::render));
    plugins.push(json!({"type": "portmap", "capabilities": {"portMappings": true}}));
    json!({
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": plugins,
    })
}

/// Writes `DIR/10-rcni.conflist` when its content differs, atomically (a
/// runtime reading the directory sees the old file or the new one). Returns
/// whether it wrote.
pub fn write(dir: &Path, conf: &Value) -> std::io::Result<(PathBuf, bool)> {
    let path = dir.join(FILE_NAME);
    let mut text = serde_json::to_vec_pretty(conf).expect("serialize");
    text.push(b'\n');
    if std::fs::read(&path).ok().as_deref() == Some(text.as_slice()) {
        return Ok((path, false));
    }
    std::fs::create_dir_all(dir)?;
    rcni_statefile::write_replace(&path, &text, 0o644)?;
    Ok((path, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflist_and_rewrite_only_on_change() {
        let c = render(
            Some("10.244.1.0/24".parse().unwrap()),
            None,
            1450,
            None,
            None,
            None,
        );
        assert_eq!(c["plugins"][0]["mtu"], 1450);
        // veth pairs, the reference's, without eBPF.
        assert!(c["plugins"][0].get("linkType").is_none());
        assert_eq!(
            c["plugins"][0]["ipam"]["ranges"][0][0]["subnet"],
            "10.244.1.0/24"
        );
        assert_eq!(c["plugins"][1]["type"], "portmap");
        assert_eq!(
            c["plugins"][0]["ipam"]["ranges"].as_array().unwrap().len(),
            1
        );
        let d6 = render(
            Some("10.244.1.0/24".parse().unwrap()),
            Some("fd00:0:0:1::/64".parse().unwrap()),
            1430,
            None,
            None,
            None,
        );
        assert_eq!(
            d6["plugins"][0]["ipam"]["ranges"][1][0]["subnet"],
            "fd00:0:0:1::/64"
        );
        assert_eq!(d6["plugins"][0]["isDefaultGateway"], true);
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("net.d");
        assert!(write(&sub, &c).unwrap().1);
        assert!(!write(&sub, &c).unwrap().1);
        let c2 = render(
            Some("10.244.1.0/24".parse().unwrap()),
            None,
            1500,
            None,
            None,
            None,
        );
        let (p, wrote) = write(&sub, &c2).unwrap();
        assert!(wrote);
        let back: Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
        assert_eq!(back, c2);
        // No temporary left beside it.
        assert_eq!(std::fs::read_dir(&sub).unwrap().count(), 1);
    }

    #[test]
    fn an_ipv6_only_node_gets_only_the_ipv6_range() {
        let c = render(
            None,
            Some("fd00:0:0:1::/64".parse().unwrap()),
            1430,
            None,
            None,
            None,
        );
        let bridge = &c["plugins"][0];
        assert_eq!(
            bridge["ipam"]["ranges"],
            json!([[{"subnet": "fd00:0:0:1::/64"}]])
        );
        assert_eq!(bridge["mtu"], 1430);
        assert_eq!(bridge["isGateway"], true);
        assert_eq!(bridge["isDefaultGateway"], true);
        assert_eq!(bridge["forceAddress"], true);
    }

    #[test]
    fn the_policy_plugin_follows_the_bridge() {
        let p = PolicyPlugin {
            policy_dir: "/run/rcni/policy.d".into(),
            agent_socket: "/run/rcni/agent.sock".into(),
            data_dir: None,
            backend: None,
        };
        let c = render(
            Some("10.244.1.0/24".parse().unwrap()),
            None,
            1450,
            None,
            Some(&p),
            Some(Path::new("/sys/fs/bpf/rcni")),
        );
        let types: Vec<&str> = c["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            types,
            ["bridge", "fastpath", "policy", "bandwidth", "portmap"]
        );
        assert_eq!(c["plugins"][3]["capabilities"]["bandwidth"], true);
        assert_eq!(c["plugins"][1]["pinRoot"], "/sys/fs/bpf/rcni");
        assert_eq!(c["plugins"][2]["policyDir"], "/run/rcni/policy.d");
        assert_eq!(c["plugins"][2]["agentSocket"], "/run/rcni/agent.sock");
        assert!(c["plugins"][2].get("dataDir").is_none());
        // eBPF: netkit pairs where the kernel has them.
        assert_eq!(c["plugins"][0]["linkType"], "netkit");
    }
}
