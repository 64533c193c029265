//! The Kubernetes API server of a [`Cluster`]: the real kube-apiserver
//! when scripts/k8s-build's cache holds it ([`super::apiserver`]), else the
//! stand-in (`testing/fakeapi`), which the tests that inject faults a real
//! server cannot be made to show ask for by name; the Node objects the
//! agents read from it, and agents run in the background.

use std::path::PathBuf;

use k8s_openapi::Resource;
use rcni_fakeapi::FakeApi;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::apiserver::RealApi;
use super::cluster::{Cluster, ClusterNode};
use rcni_testkit::{bin, tied_command_in};

/// Either server, with what both do.
pub enum Api {
    Real(RealApi),
    Fake(FakeApi),
}

impl Api {
    pub fn put<K: Resource + Serialize>(&self, obj: &K) -> u64 {
        match self {
            Api::Real(a) => a.put(obj),
            Api::Fake(a) => a.put(obj),
        }
    }

    pub fn get<K: Resource + DeserializeOwned>(&self, ns: Option<&str>, name: &str) -> Option<K> {
        match self {
            Api::Real(a) => a.get(ns, name),
            Api::Fake(a) => a.get(ns, name),
        }
    }

    pub fn delete<K: Resource>(&self, ns: Option<&str>, name: &str) -> bool {
        match self {
            Api::Real(a) => a.delete::<K>(ns, name),
            Api::Fake(a) => a.delete::<K>(ns, name),
        }
    }

    /// The stand-in, for the faults only it shows (a test that uses them
    /// makes its server with [`KubeApi::fake`]).
    pub fn fake(&self) -> &FakeApi {
        match self {
            Api::Fake(a) => a,
            Api::Real(_) => panic!("a fault of the stand-in asked of the real server"),
        }
    }

    pub fn is_real(&self) -> bool {
        matches!(self, Api::Real(_))
    }
}

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

/// The API server, in the router namespace on the underlay address every
/// node reaches directly, with a kubeconfig for the agents and a net-conf
/// file.
pub struct KubeApi {
    pub api: Api,
    pub kubeconfig: PathBuf,
    pub net_conf: PathBuf,
    _dir: tempfile::TempDir,
}

impl KubeApi {
    /// The real server where the cache holds it (`RCNI_KUBE_API=fake`
    /// asks for the stand-in), else the stand-in, saying why.
    pub fn new(c: &Cluster, net_conf: &str) -> KubeApi {
        KubeApi::either(c, "192.168.50.254", net_conf)
    }

    /// [`KubeApi::new`] for an IPv6-only underlay
    /// ([`Cluster::make_v6only`]): on the router's `fd50::fe`.
    pub fn new_v6(c: &Cluster, net_conf: &str) -> KubeApi {
        KubeApi::either(c, "fd50::fe", net_conf)
    }

    /// The stand-in, for a test of faults only it shows: a server that
    /// stops answering at once and comes back with its history compacted,
    /// watches dropped or expired at a chosen moment, the requests and
    /// patches it received.
    pub fn fake(c: &Cluster, net_conf: &str) -> KubeApi {
        KubeApi::with_fake(c, "192.168.50.254:0", net_conf)
    }

    fn either(c: &Cluster, host: &'static str, net_conf: &str) -> KubeApi {
        if std::env::var("RCNI_KUBE_API").as_deref() == Ok("fake") {
            eprintln!("kube: the stand-in API server (RCNI_KUBE_API=fake)");
        } else {
            match RealApi::start(&c.router.ns, host) {
                Ok(real) => {
                    eprintln!("kube: the real kube-apiserver on {host}");
                    return KubeApi::with(Api::Real(real), None, net_conf);
                }
                Err(e) => eprintln!("kube: the stand-in API server: no real one here: {e}"),
            }
        }
        let at = if host.contains(':') {
            "[fd50::fe]:0"
        } else {
            "192.168.50.254:0"
        };
        KubeApi::with_fake(c, at, net_conf)
    }

    fn with_fake(c: &Cluster, at: &'static str, net_conf: &str) -> KubeApi {
        let listener = c
            .router
            .ns
            .run(move || std::net::TcpListener::bind(at).unwrap())
            .unwrap();
        let api = FakeApi::start(listener);
        let kubeconfig = api.kubeconfig();
        KubeApi::with(Api::Fake(api), Some(kubeconfig), net_conf)
    }

    fn with(api: Api, kubeconfig: Option<String>, net_conf: &str) -> KubeApi {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        match (&api, kubeconfig) {
            (_, Some(k)) => std::fs::write(&path, k).unwrap(),
            (Api::Real(r), None) => {
                std::fs::copy(&r.kubeconfig, &path).unwrap();
            }
            (Api::Fake(_), None) => unreachable!("the stand-in's kubeconfig is given"),
        }
        let conf = dir.path().join("net-conf.json");
        std::fs::write(&conf, net_conf).unwrap();
        KubeApi {
            api,
            kubeconfig: path,
            net_conf: conf,
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
