//! Labs: the simulated machines the tests run plugins and agents on. A
//! node with pods on one bridge ([`Node`]), a node on a LAN with a client
//! and chained meta plugins ([`chain`]), a cluster of nodes on an underlay
//! behind a router ([`cluster`]), dnsmasq and the DHCP daemon ([`dhcp`]), a
//! node with two networks ([`multinet`]).

pub mod chain;
pub mod cluster;
pub mod dhcp;
pub mod multinet;
mod node;

pub use node::Node;
