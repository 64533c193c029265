//! Pods on the cloud network's own addresses, as the AWS VPC CNI and Azure
//! CNI give them: the node's cloud interfaces (EC2 ENIs, Azure NICs) carry
//! secondary addresses (or, on AWS, /28 prefixes) that the pool hands to
//! pods, so pods are reachable across the VPC with no overlay and no NAT.
//!
//! - [`Provider`]: one cloud's API (describe this instance, attach an
//!   interface, assign and unassign addresses). [`aws`] and [`azure`].
//! - [`pool`]: the warm pool, the cloud-independent part (AWS VPC CNI's
//!   semantics and defaults: WARM_ENI_TARGET, WARM_IP_TARGET,
//!   MINIMUM_IP_TARGET, WARM_PREFIX_TARGET, cooldown, max pods).
//! - [`checkpoint`]: the pods' assignments on disk.

use std::future::Future;
use std::net::Ipv4Addr;

use ipnetwork::Ipv4Network;
use serde::{Deserialize, Serialize};

pub mod aws;
pub mod azure;
pub mod checkpoint;
/// An in-memory [`Provider`] for tests of the pool and the agent.
pub mod fake;
pub mod manager;
pub mod pool;

/// What a cloud call failed with. Throttling is its own case: the pool
/// backs off and tries again, and pods meanwhile get code 11 (try again).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CloudError {
    /// The API refused for rate (EC2 `RequestLimitExceeded`, HTTP 429/503).
    #[error("throttled: {0}")]
    Throttled(String),
    /// The instance type's limit (interfaces, addresses) or the subnet's
    /// free addresses are reached.
    #[error("limit reached: {0}")]
    Limit(String),
    /// Something named does not exist (any more).
    #[error("not found: {0}")]
    NotFound(String),
    /// The provider cannot do this (Azure: prefixes, a second NIC).
    #[error("not supported: {0}")]
    Unsupported(String),
    /// Identity, credentials, metadata service, or anything else.
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, CloudError>;

/// This instance, as its metadata service and the cloud API describe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// EC2 instance id, or the Azure VM's name.
    pub id: String,
    /// EC2 instance type (`m5.large`) or Azure VM size.
    pub instance_type: String,
    /// EC2 region or Azure location.
    pub region: String,
    /// The primary interface's MAC, lower case, `aa:bb:cc:dd:ee:ff`.
    pub primary_mac: String,
    /// The VPC's (VNet's) IPv4 CIDR blocks: destinations that keep the
    /// pod's address (everything else is SNATed to the primary address).
    pub vpc_cidrs: Vec<Ipv4Network>,
}

/// The instance type's limits (EC2 DescribeInstanceTypes' NetworkInfo).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// MaximumNetworkInterfaces.
    pub max_interfaces: u32,
    /// Ipv4AddressesPerInterface, the interface's primary address included.
    pub addrs_per_interface: u32,
}

/// One interface of the instance and the addresses the cloud has assigned
/// to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interface {
    /// `eni-...`, or the Azure NIC's resource id.
    pub id: String,
    /// Lower case, `aa:bb:cc:dd:ee:ff`: how the node finds its link.
    pub mac: String,
    /// 0 for the primary interface. Its route table on the node is
    /// `device_index + 1`, as the AWS VPC CNI numbers them.
    pub device_index: u32,
    /// The interface's subnet: the gateway is its first host address.
    pub subnet: Ipv4Network,
    /// The interface's own address (never a pod's).
    pub primary_ip: Ipv4Addr,
    /// Secondary addresses, each a pod's or free.
    pub secondary_ips: Vec<Ipv4Addr>,
    /// Delegated prefixes (/28 on AWS), 16 pods' addresses each.
    pub prefixes: Vec<Ipv4Network>,
}

impl Interface {
    /// The subnet's gateway: AWS and Azure both route from the subnet's
    /// first host address.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.subnet.network()) + 1)
    }
}

/// [`Provider::describe`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    pub instance: Instance,
    pub limits: Limits,
    /// Attached interfaces, by device index.
    pub interfaces: Vec<Interface>,
}

/// One cloud's API, as the pool needs it. Every call is one request (or
/// one short sequence) to the cloud; the pool decides when to call.
pub trait Provider: Send + Sync {
    /// The instance, its limits and its attached interfaces with their
    /// assigned addresses.
    fn describe(&self) -> impl Future<Output = Result<NodeView>> + Send;
    /// A new interface in the primary interface's subnet, tagged as this
    /// instance's (so one left unattached by a crash is found and deleted),
    /// attached at `device_index`.
    fn create_interface(&self, device_index: u32)
    -> impl Future<Output = Result<Interface>> + Send;
    /// Interfaces tagged as this instance's that are not attached (left by
    /// a crash between create and attach), to delete.
    fn leaked_interfaces(&self) -> impl Future<Output = Result<Vec<String>>> + Send;
    /// Detach (if attached) and delete.
    fn delete_interface(&self, id: &str) -> impl Future<Output = Result<()>> + Send;
    /// One attached interface as the cloud describes it now. What the pool
    /// hands out after an assignment comes from here, not from the
    /// assignment's answer: answers differ between models of the API (moto
    /// lists the interface's primary address with the new ones, EC2 only
    /// the new ones), a describe is the cloud's own view.
    fn describe_interface(&self, id: &str) -> impl Future<Output = Result<Interface>> + Send;
    /// `count` more secondary addresses on the interface; returns what the
    /// call answered (for the log: see [`Provider::describe_interface`]).
    fn assign_ips(
        &self,
        interface: &str,
        count: u32,
    ) -> impl Future<Output = Result<Vec<Ipv4Addr>>> + Send;
    /// These very addresses onto the interface as secondary addresses: a
    /// restarted agent's way to take back a pod's address the cloud no
    /// longer shows there. Refused (an error) when someone else has one.
    fn assign_these_ips(
        &self,
        interface: &str,
        ips: &[Ipv4Addr],
    ) -> impl Future<Output = Result<()>> + Send;
    fn unassign_ips(
        &self,
        interface: &str,
        ips: &[Ipv4Addr],
    ) -> impl Future<Output = Result<()>> + Send;
    /// `count` more /28 prefixes on the interface (AWS prefix delegation).
    fn assign_prefixes(
        &self,
        interface: &str,
        count: u32,
    ) -> impl Future<Output = Result<Vec<Ipv4Network>>> + Send;
    fn unassign_prefixes(
        &self,
        interface: &str,
        prefixes: &[Ipv4Network],
    ) -> impl Future<Output = Result<()>> + Send;
    /// How many API requests this provider has made (for the figures).
    fn calls(&self) -> u64;
}
