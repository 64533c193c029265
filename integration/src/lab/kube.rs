//! A stand-in Kubernetes API server for a [`Cluster`], the Node objects
//! the agents read from it, and agents run in the background.

use std::path::PathBuf;

use super::cluster::{Cluster, ClusterNode};
use rcni_testkit::{bin, tied_command_in};

/// An agent run in the background; killed (SIGKILL: nothing to clean, the
/// kernel state is the namespace's) when dropped.
pub struct Agent(pub std::process::Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Node object as the kubelet and kube-controller-manager make it: the
/// node's address as InternalIP, its pod subnet in spec.podCIDRs.
pub fn knode(name: &str, ip: &str, cidr: &str) -> k8s_openapi::api::core::v1::Node {
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};
    k8s_openapi::api::core::v1::Node {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: Some(cidr.into()),
            pod_cidrs: Some(vec![cidr.into()]),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: ip.into(),
            }]),
            ..Default::default()
        }),
    }
}

/// What a node's agent started by [`KubeApi::spawn_agents`] said so far.
pub fn agent_log(n: &ClusterNode) -> String {
    std::fs::read_to_string(n.dir.path().join("agent.log")).unwrap_or_default()
}

/// The stand-in API server, in the router namespace on the underlay
/// address every node reaches directly, with a kubeconfig for it and a
/// net-conf file.
pub struct KubeApi {
    pub api: rcni_fakeapi::FakeApi,
    pub kubeconfig: PathBuf,
    pub net_conf: PathBuf,
    _dir: tempfile::TempDir,
}

impl KubeApi {
    pub fn new(c: &Cluster, net_conf: &str) -> KubeApi {
        KubeApi::listening(c, "192.168.50.254:0", net_conf)
    }

    /// [`KubeApi::new`] for an IPv6-only underlay
    /// ([`Cluster::make_v6only`]): on the router's `fd50::fe`.
    pub fn new_v6(c: &Cluster, net_conf: &str) -> KubeApi {
        KubeApi::listening(c, "[fd50::fe]:0", net_conf)
    }

    fn listening(c: &Cluster, at: &'static str, net_conf: &str) -> KubeApi {
        let listener = c
            .router
            .ns
            .run(move || std::net::TcpListener::bind(at).unwrap())
            .unwrap();
        let api = rcni_fakeapi::FakeApi::start(listener);
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
        let path = dir.path().join("net-conf.json");
        std::fs::write(&path, net_conf).unwrap();
        KubeApi {
            api,
            kubeconfig,
            net_conf: path,
            _dir: dir,
        }
    }

    /// `rcni-node run --kubernetes` in `n`'s namespace against this API,
    /// with the node's own conf, state and IPAM directories; callers add
    /// how the node learns its name and their own flags.
    /// [`KubeApi::agent_command`] started in the background on every node
    /// of `c`, each's stderr into its `agent.log` ([`agent_log`]); `how`
    /// adds what tells the node its name and any other flag.
    pub fn spawn_agents(
        &self,
        c: &Cluster,
        how: impl Fn(&mut std::process::Command, &ClusterNode),
    ) -> Vec<Agent> {
        c.nodes
            .iter()
            .map(|n| {
                let mut cmd = self.agent_command(n);
                how(&mut cmd, n);
                cmd.stderr(std::fs::File::create(n.dir.path().join("agent.log")).unwrap());
                Agent(cmd.spawn().unwrap())
            })
            .collect()
    }

    pub fn agent_command(&self, n: &ClusterNode) -> std::process::Command {
        let mut cmd = tied_command_in(&n.ns.ns, bin("rcni-node"));
        cmd.arg("run")
            .arg("--kubernetes")
            .arg("--net-conf")
            .arg(&self.net_conf)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cni-conf-dir")
            .arg(n.conf_dir())
            .arg("--state-dir")
            .arg(n.dir.path().join("state"))
            .arg("--ipam-data-dir")
            .arg(n.dir.path().join("ipam"))
            .args(["--poll-ms", "20"]);
        cmd
    }
}
