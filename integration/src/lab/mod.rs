//! Labs: the simulated machines the tests run plugins and agents on. A
//! node with pods on one bridge ([`Node`]), a node on a LAN with a client
//! and chained meta plugins ([`chain`]), a cluster of nodes on an underlay
//! behind a router ([`cluster`]) and the Kubernetes API its agents read
//! ([`kube`]: a real kube-apiserver ([`apiserver`]) or a stand-in), racks of nodes behind top-of-rack routers
//! running BIRD for the BGP backend ([`fabric`]), dnsmasq and the DHCP
//! daemon ([`dhcp`]), a node with two networks ([`multinet`]); the
//! traffic the tests send between their pods ([`traffic`]); and reading
//! the agent's metrics ([`metrics`]).

pub mod apiserver;
pub mod chain;
pub mod cluster;
pub mod dhcp;
pub mod fabric;
pub mod k8s;
pub mod kube;
pub mod metrics;
pub mod multinet;
mod node;
pub mod traffic;
pub mod vpc;

pub use node::Node;
