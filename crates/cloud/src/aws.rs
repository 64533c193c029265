//! The EC2 provider, through the official AWS SDK for Rust.
//!
//! Identity (instance id, type, region, primary MAC) comes from IMDSv2,
//! everything else from the EC2 API: DescribeInstances once at start (the
//! primary interface's subnet and security groups, which new interfaces
//! get), then DescribeNetworkInterfaces and DescribeVpcs per
//! [`Provider::describe`], DescribeNetworkInterfaces of one interface per
//! [`Provider::describe_interface`] (DescribeInstanceTypes and
//! DescribeSubnets once each: a type's limits and a subnet's CIDR never
//! change).
//!
//! [`Aws::from_env`] follows the SDK's standard configuration: the
//! credential chain (environment, profile, web identity, container, IMDS),
//! `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_EC2`, and
//! `AWS_EC2_METADATA_SERVICE_ENDPOINT` for IMDS. [`Aws::with_endpoints`]
//! names both endpoints (and the credentials) instead.
//!
//! The SDK's own retries are off: a throttled call comes back as
//! [`CloudError::Throttled`] at once, and the pool's backoff decides when
//! to try again (the SDK's standard mode would retry three times itself,
//! hiding the throttling and multiplying the calls).
//!
//! [`Provider::calls`] counts the EC2 requests sent (IMDS's are not: they
//! are local to the instance and not rate-limited by the EC2 API).
//!
//! TLS is rustls on ring (aws-smithy-http-client's `rustls-ring`): the SDK's
//! default client is rustls on aws-lc, a C build the static release keeps
//! out.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_config::imds;
use aws_config::provider_config::ProviderConfig;
use aws_sdk_ec2::Client;
use aws_sdk_ec2::config::http::HttpResponse;
use aws_sdk_ec2::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_ec2::config::retry::RetryConfig;
use aws_sdk_ec2::config::timeout::TimeoutConfig;
use aws_sdk_ec2::config::{ConfigBag, Intercept, Region, RuntimeComponents, SharedHttpClient};
use aws_sdk_ec2::error::{BoxError, DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_ec2::types::{
    AttachmentStatus, Filter, NetworkInterface, NetworkInterfaceStatus, ResourceType, Tag,
    TagSpecification,
};
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
use ipnetwork::Ipv4Network;

pub use aws_sdk_ec2::config::Credentials;

use crate::{CloudError, Instance, Interface, Limits, NodeView, Provider, Result};

/// The tag every interface this provider creates carries, valued with the
/// instance id: an interface left unattached by a crash between create and
/// attach is found by it ([`Provider::leaked_interfaces`]).
pub const INSTANCE_TAG: &str = "rcni.io/instance-id";

/// How long [`Provider::delete_interface`] waits for a detached interface
/// to become `available` (EC2 refuses to delete one still detaching).
const DETACH_WAIT: Duration = Duration::from_secs(20);
const DETACH_POLL: Duration = Duration::from_millis(500);

/// EC2 through the SDK, for the instance this runs on.
#[derive(Debug)]
pub struct Aws {
    ec2: Client,
    instance_id: String,
    instance_type: String,
    region: String,
    primary_mac: String,
    /// The primary interface's subnet and security groups: new interfaces
    /// are made in the same (as the AWS VPC CNI does without custom
    /// networking).
    subnet_id: String,
    security_groups: Vec<String>,
    limits: OnceLock<Limits>,
    /// Subnets' CIDRs by id: a subnet's IPv4 CIDR never changes, so each is
    /// described once.
    subnets: Mutex<BTreeMap<String, Ipv4Network>>,
    /// Secondary interfaces' attachment ids, from the last describe or
    /// attach: a delete is then DetachNetworkInterface and
    /// DeleteNetworkInterface alone, as ipamd's, with no Describe first.
    attachments: Mutex<BTreeMap<String, String>>,
    calls: Arc<AtomicU64>,
}

/// What IMDS says about this instance.
struct Identity {
    instance_id: String,
    instance_type: String,
    region: String,
    primary_mac: String,
}

/// The SDK's IMDS read timeout is 1 s: a node busy starting its pods
/// misses it (seen on this project's 2-core CI). IMDS answers locally, so
/// a longer wait costs nothing when it is healthy.
const IMDS_TIMEOUT: Duration = Duration::from_secs(5);

impl Aws {
    /// The standard SDK configuration: IMDSv2 (`AWS_EC2_METADATA_SERVICE_ENDPOINT`
    /// overrides where it is), the standard credential chain and endpoint
    /// overrides (`AWS_ENDPOINT_URL_EC2`, `AWS_ENDPOINT_URL`).
    pub async fn from_env() -> Result<Aws> {
        let http = https_client();
        let provider_config = ProviderConfig::default().with_http_client(http.clone());
        let imds = imds::Client::builder()
            .configure(&provider_config)
            .read_timeout(IMDS_TIMEOUT)
            .build();
        let id = identity(&imds).await?;
        let shared = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .region(Region::new(id.region.clone()))
            .retry_config(RetryConfig::disabled())
            .timeout_config(timeouts())
            .load()
            .await;
        let calls = Arc::new(AtomicU64::new(0));
        let conf = aws_sdk_ec2::config::Builder::from(&shared)
            .interceptor(CountRequests(calls.clone()))
            .build();
        Aws::start(Client::from_conf(conf), id, calls).await
    }

    /// EC2 at `ec2_url` and IMDS at `imds_url` (`http://host:port`), with
    /// these credentials (or the standard chain's for `None`); the
    /// environment's endpoint overrides are not read.
    pub async fn with_endpoints(
        ec2_url: &str,
        imds_url: &str,
        credentials: Option<Credentials>,
    ) -> Result<Aws> {
        let http = https_client();
        let provider_config = ProviderConfig::default().with_http_client(http.clone());
        let imds = imds::Client::builder()
            .configure(&provider_config)
            .endpoint(imds_url)
            .map_err(|e| CloudError::Other(format!("IMDS endpoint {imds_url}: {e}")))?
            .read_timeout(IMDS_TIMEOUT)
            .build();
        let id = identity(&imds).await?;
        let calls = Arc::new(AtomicU64::new(0));
        let mut conf = aws_sdk_ec2::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .http_client(http)
            .region(Region::new(id.region.clone()))
            .endpoint_url(ec2_url)
            .retry_config(RetryConfig::disabled())
            .timeout_config(timeouts())
            .interceptor(CountRequests(calls.clone()));
        conf = match credentials {
            Some(c) => conf.credentials_provider(c),
            None => {
                let chain =
                    aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
                        .configure(
                            provider_config.with_region(Some(Region::new(id.region.clone()))),
                        )
                        .build()
                        .await;
                conf.credentials_provider(chain)
            }
        };
        Aws::start(Client::from_conf(conf.build()), id, calls).await
    }

    /// DescribeInstances: the primary interface's subnet and groups.
    async fn start(ec2: Client, id: Identity, calls: Arc<AtomicU64>) -> Result<Aws> {
        let out = ec2
            .describe_instances()
            .instance_ids(&id.instance_id)
            .send()
            .await
            .map_err(|e| map_err("DescribeInstances", e))?;
        let instance = out
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .find(|i| i.instance_id() == Some(id.instance_id.as_str()))
            .ok_or_else(|| {
                CloudError::NotFound(format!("DescribeInstances: no instance {}", id.instance_id))
            })?;
        let primary = instance
            .network_interfaces()
            .iter()
            .find(|n| n.attachment().and_then(|a| a.device_index()) == Some(0))
            .ok_or_else(|| {
                CloudError::Other(format!(
                    "DescribeInstances: instance {} has no interface at device index 0",
                    id.instance_id
                ))
            })?;
        let subnet_id = primary
            .subnet_id()
            .or(instance.subnet_id())
            .ok_or_else(|| CloudError::Other("DescribeInstances: no subnet".into()))?
            .to_string();
        let security_groups = primary
            .groups()
            .iter()
            .filter_map(|g| g.group_id().map(str::to_string))
            .collect();
        Ok(Aws {
            ec2,
            instance_id: id.instance_id,
            instance_type: id.instance_type,
            region: id.region,
            primary_mac: id.primary_mac,
            subnet_id,
            security_groups,
            limits: OnceLock::new(),
            subnets: Mutex::new(BTreeMap::new()),
            attachments: Mutex::new(BTreeMap::new()),
            calls,
        })
    }

    /// This instance's id, as IMDS gave it.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    async fn limits(&self) -> Result<Limits> {
        if let Some(l) = self.limits.get() {
            return Ok(*l);
        }
        let out = self
            .ec2
            .describe_instance_types()
            .instance_types(self.instance_type.as_str().into())
            .send()
            .await
            .map_err(|e| map_err("DescribeInstanceTypes", e))?;
        let info = out
            .instance_types()
            .first()
            .and_then(|t| t.network_info())
            .ok_or_else(|| {
                CloudError::Other(format!(
                    "DescribeInstanceTypes: no network info for {}",
                    self.instance_type
                ))
            })?;
        let positive = |v: Option<i32>, what: &str| {
            v.and_then(|v| u32::try_from(v).ok())
                .filter(|v| *v > 0)
                .ok_or_else(|| {
                    CloudError::Other(format!(
                        "DescribeInstanceTypes: {} has no {what}",
                        self.instance_type
                    ))
                })
        };
        let limits = Limits {
            max_interfaces: positive(
                info.maximum_network_interfaces(),
                "MaximumNetworkInterfaces",
            )?,
            addrs_per_interface: positive(
                info.ipv4_addresses_per_interface(),
                "Ipv4AddressesPerInterface",
            )?,
        };
        Ok(*self.limits.get_or_init(|| limits))
    }

    /// These subnets' IPv4 CIDRs, DescribeSubnets for those not known yet.
    async fn subnet_cidrs(
        &self,
        ids: impl IntoIterator<Item = String>,
    ) -> Result<BTreeMap<String, Ipv4Network>> {
        let ids: BTreeSet<String> = ids.into_iter().collect();
        let missing: Vec<String> = {
            let known = self.subnets.lock().unwrap_or_else(|e| e.into_inner());
            ids.iter()
                .filter(|i| !known.contains_key(*i))
                .cloned()
                .collect()
        };
        if !missing.is_empty() {
            let out = self
                .ec2
                .describe_subnets()
                .set_subnet_ids(Some(missing))
                .send()
                .await
                .map_err(|e| map_err("DescribeSubnets", e))?;
            let mut found = Vec::new();
            for s in out.subnets() {
                if let (Some(id), Some(cidr)) = (s.subnet_id(), s.cidr_block()) {
                    found.push((id.to_string(), parse_net("DescribeSubnets", cidr)?));
                }
            }
            self.subnets
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(found);
        }
        let known = self.subnets.lock().unwrap_or_else(|e| e.into_inner());
        Ok(ids
            .into_iter()
            .filter_map(|i| known.get(&i).map(|c| (i, *c)))
            .collect())
    }

    /// DescribeVpcs: the VPC's associated IPv4 CIDR blocks.
    async fn vpc_cidrs(&self, vpc_id: &str) -> Result<Vec<Ipv4Network>> {
        let out = self
            .ec2
            .describe_vpcs()
            .vpc_ids(vpc_id)
            .send()
            .await
            .map_err(|e| map_err("DescribeVpcs", e))?;
        let vpc = out
            .vpcs()
            .first()
            .ok_or_else(|| CloudError::NotFound(format!("DescribeVpcs: no VPC {vpc_id}")))?;
        let mut cidrs = Vec::new();
        for a in vpc.cidr_block_association_set() {
            // A block being disassociated (or that failed to associate) no
            // longer routes to the VPC.
            let state = a.cidr_block_state().and_then(|s| s.state());
            let associated = state.is_none_or(|s| s.as_str() == "associated");
            if let (true, Some(c)) = (associated, a.cidr_block()) {
                let net = parse_net("DescribeVpcs", c)?;
                if !cidrs.contains(&net) {
                    cidrs.push(net);
                }
            }
        }
        if cidrs.is_empty()
            && let Some(c) = vpc.cidr_block()
        {
            cidrs.push(parse_net("DescribeVpcs", c)?);
        }
        Ok(cidrs)
    }

    async fn attached(&self) -> Result<Vec<NetworkInterface>> {
        let out = self
            .ec2
            .describe_network_interfaces()
            .filters(filter("attachment.instance-id", &self.instance_id))
            .send()
            .await
            .map_err(|e| map_err("DescribeNetworkInterfaces", e))?;
        Ok(out.network_interfaces().to_vec())
    }

    async fn one_interface(&self, id: &str) -> Result<NetworkInterface> {
        let out = self
            .ec2
            .describe_network_interfaces()
            .network_interface_ids(id)
            .send()
            .await
            .map_err(|e| map_err("DescribeNetworkInterfaces", e))?;
        out.network_interfaces()
            .iter()
            .find(|n| n.network_interface_id() == Some(id))
            .cloned()
            .ok_or_else(|| CloudError::NotFound(format!("network interface {id}")))
    }

    /// DeleteNetworkInterface, retried while EC2 is still detaching it
    /// (`InvalidNetworkInterface.InUse`, `IncorrectState`), as ipamd's
    /// deleteENI does, rather than polled with DescribeNetworkInterfaces.
    async fn delete_when_detached(&self, id: &str) -> Result<()> {
        let deadline = tokio::time::Instant::now() + DETACH_WAIT;
        loop {
            match self
                .ec2
                .delete_network_interface()
                .network_interface_id(id)
                .send()
                .await
            {
                Ok(_) => return Ok(()),
                Err(e)
                    if matches!(
                        e.code(),
                        Some("InvalidNetworkInterface.InUse" | "IncorrectState")
                    ) && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(DETACH_POLL).await
                }
                Err(e) => return Err(map_err("DeleteNetworkInterface", e)),
            }
        }
    }

    async fn delete(&self, id: &str) -> Result<()> {
        self.ec2
            .delete_network_interface()
            .network_interface_id(id)
            .send()
            .await
            .map_err(|e| map_err("DeleteNetworkInterface", e))?;
        Ok(())
    }
}

impl Provider for Aws {
    async fn describe(&self) -> Result<NodeView> {
        let limits = self.limits().await?;
        let enis = self.attached().await?;
        let vpc_id = enis
            .iter()
            .find_map(|n| n.vpc_id())
            .ok_or_else(|| {
                CloudError::Other(format!(
                    "DescribeNetworkInterfaces: no interface attached to {}",
                    self.instance_id
                ))
            })?
            .to_string();
        let subnets = self
            .subnet_cidrs(
                enis.iter()
                    .filter_map(|n| n.subnet_id().map(str::to_string)),
            )
            .await?;
        let vpc_cidrs = self.vpc_cidrs(&vpc_id).await?;
        *self.attachments.lock().unwrap_or_else(|e| e.into_inner()) = enis
            .iter()
            .filter_map(|n| {
                let a = n.attachment()?;
                (a.device_index()? > 0).then_some(())?;
                Some((
                    n.network_interface_id()?.to_string(),
                    a.attachment_id()?.to_string(),
                ))
            })
            .collect();
        let mut interfaces = enis
            .iter()
            .map(|n| interface_of(n, &subnets))
            .collect::<Result<Vec<_>>>()?;
        interfaces.sort_by_key(|i| i.device_index);
        Ok(NodeView {
            instance: Instance {
                id: self.instance_id.clone(),
                instance_type: self.instance_type.clone(),
                region: self.region.clone(),
                primary_mac: self.primary_mac.clone(),
                vpc_cidrs,
            },
            limits,
            interfaces,
        })
    }

    async fn create_interface(&self, device_index: u32) -> Result<Interface> {
        let index = i32::try_from(device_index)
            .map_err(|_| CloudError::Other(format!("device index {device_index} out of range")))?;
        let tag = TagSpecification::builder()
            .resource_type(ResourceType::NetworkInterface)
            .tags(
                Tag::builder()
                    .key(INSTANCE_TAG)
                    .value(&self.instance_id)
                    .build(),
            )
            .build();
        let out = self
            .ec2
            .create_network_interface()
            .subnet_id(&self.subnet_id)
            .set_groups((!self.security_groups.is_empty()).then(|| self.security_groups.clone()))
            .description(format!("rcni pod addresses of {}", self.instance_id))
            .tag_specifications(tag)
            .send()
            .await
            .map_err(|e| map_err("CreateNetworkInterface", e))?;
        let eni = out.network_interface().ok_or_else(|| {
            CloudError::Other("CreateNetworkInterface: no interface in the answer".into())
        })?;
        let id = eni
            .network_interface_id()
            .ok_or_else(|| CloudError::Other("CreateNetworkInterface: no interface id".into()))?
            .to_string();
        let attached = self
            .ec2
            .attach_network_interface()
            .network_interface_id(&id)
            .instance_id(&self.instance_id)
            .device_index(index)
            .send()
            .await;
        let attachment_id = match attached {
            Ok(a) => a.attachment_id().map(str::to_string),
            Err(e) => {
                let err = map_err("AttachNetworkInterface", e);
                // Not attached, so no one would ever use or find it but the
                // leak sweep: delete it now. If that fails too, the tag lets
                // leaked_interfaces find it later.
                let _ = self.delete(&id).await;
                return Err(err);
            }
        };
        if let Some(att) = &attachment_id {
            self.attachments
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.clone(), att.clone());
        }
        if let Some(att) = attachment_id {
            // As the AWS VPC CNI does: the interface goes with the instance
            // when the instance is terminated. Best effort: without it the
            // interface outlives a terminated instance, but works.
            let _ = self
                .ec2
                .modify_network_interface_attribute()
                .network_interface_id(&id)
                .attachment(
                    aws_sdk_ec2::types::NetworkInterfaceAttachmentChanges::builder()
                        .attachment_id(att)
                        .delete_on_termination(true)
                        .build(),
                )
                .send()
                .await;
        }
        let subnets = match eni.subnet_id() {
            Some(s) => self.subnet_cidrs([s.to_string()]).await?,
            None => BTreeMap::new(),
        };
        let mut iface = interface_of(eni, &subnets)?;
        iface.device_index = device_index;
        Ok(iface)
    }

    async fn leaked_interfaces(&self) -> Result<Vec<String>> {
        // The tag alone in the request: EC2 filters on `status` too, but
        // filtering it here works against any model of the API.
        let out = self
            .ec2
            .describe_network_interfaces()
            .filters(filter(&format!("tag:{INSTANCE_TAG}"), &self.instance_id))
            .send()
            .await
            .map_err(|e| map_err("DescribeNetworkInterfaces", e))?;
        Ok(out
            .network_interfaces()
            .iter()
            .filter(|n| n.status() == Some(&NetworkInterfaceStatus::Available))
            .filter_map(|n| n.network_interface_id().map(str::to_string))
            .collect())
    }

    async fn delete_interface(&self, id: &str) -> Result<()> {
        let cached = self
            .attachments
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(att_id) = cached {
            match self
                .ec2
                .detach_network_interface()
                .attachment_id(&att_id)
                .send()
                .await
                .map_err(|e| map_err("DetachNetworkInterface", e))
            {
                // Already detached (by someone else): on to the delete.
                Ok(_) | Err(CloudError::NotFound(_)) => {}
                Err(e) => {
                    self.attachments
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id.to_string(), att_id);
                    return Err(e);
                }
            }
            return self.delete_when_detached(id).await;
        }
        let eni = self.one_interface(id).await?;
        if let Some(att) = eni.attachment()
            && att.status() != Some(&AttachmentStatus::Detached)
        {
            if att.device_index() == Some(0) {
                return Err(CloudError::Other(format!(
                    "{id} is the instance's primary interface"
                )));
            }
            if att.status() != Some(&AttachmentStatus::Detaching) {
                let att_id = att
                    .attachment_id()
                    .ok_or_else(|| CloudError::Other(format!("{id}: attachment without an id")))?;
                self.ec2
                    .detach_network_interface()
                    .attachment_id(att_id)
                    .send()
                    .await
                    .map_err(|e| map_err("DetachNetworkInterface", e))?;
            }
            return self.delete_when_detached(id).await;
        }
        self.delete(id).await
    }

    async fn describe_interface(&self, id: &str) -> Result<Interface> {
        let eni = self.one_interface(id).await?;
        let att = eni.attachment();
        if att.and_then(|a| a.instance_id()) != Some(self.instance_id.as_str()) {
            return Err(CloudError::NotFound(format!(
                "DescribeNetworkInterfaces: {id} is not attached to {}",
                self.instance_id
            )));
        }
        let subnets = match eni.subnet_id() {
            Some(s) => self.subnet_cidrs([s.to_string()]).await?,
            None => BTreeMap::new(),
        };
        interface_of(&eni, &subnets)
    }

    async fn assign_these_ips(&self, interface: &str, ips: &[Ipv4Addr]) -> Result<()> {
        if ips.is_empty() {
            return Ok(());
        }
        // Without AllowReassignment: an address another interface has now
        // is that interface's, EC2 refuses and the pod's entry is kept.
        self.ec2
            .assign_private_ip_addresses()
            .network_interface_id(interface)
            .set_private_ip_addresses(Some(ips.iter().map(ToString::to_string).collect()))
            .send()
            .await
            .map_err(|e| map_err("AssignPrivateIpAddresses", e))?;
        Ok(())
    }

    async fn assign_ips(&self, interface: &str, count: u32) -> Result<Vec<Ipv4Addr>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let out = self
            .ec2
            .assign_private_ip_addresses()
            .network_interface_id(interface)
            .secondary_private_ip_address_count(count_i32(count)?)
            .send()
            .await
            .map_err(|e| map_err("AssignPrivateIpAddresses", e))?;
        out.assigned_private_ip_addresses()
            .iter()
            .filter_map(|a| a.private_ip_address())
            .map(|a| parse_ip("AssignPrivateIpAddresses", a))
            .collect()
    }

    async fn unassign_ips(&self, interface: &str, ips: &[Ipv4Addr]) -> Result<()> {
        if ips.is_empty() {
            return Ok(());
        }
        self.ec2
            .unassign_private_ip_addresses()
            .network_interface_id(interface)
            .set_private_ip_addresses(Some(ips.iter().map(ToString::to_string).collect()))
            .send()
            .await
            .map_err(|e| map_err("UnassignPrivateIpAddresses", e))?;
        Ok(())
    }

    async fn assign_prefixes(&self, interface: &str, count: u32) -> Result<Vec<Ipv4Network>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let out = self
            .ec2
            .assign_private_ip_addresses()
            .network_interface_id(interface)
            .ipv4_prefix_count(count_i32(count)?)
            .send()
            .await
            .map_err(|e| map_err("AssignPrivateIpAddresses", e))?;
        out.assigned_ipv4_prefixes()
            .iter()
            .filter_map(|p| p.ipv4_prefix())
            .map(|p| parse_net("AssignPrivateIpAddresses", p))
            .collect()
    }

    async fn unassign_prefixes(&self, interface: &str, prefixes: &[Ipv4Network]) -> Result<()> {
        if prefixes.is_empty() {
            return Ok(());
        }
        self.ec2
            .unassign_private_ip_addresses()
            .network_interface_id(interface)
            .set_ipv4_prefixes(Some(prefixes.iter().map(ToString::to_string).collect()))
            .send()
            .await
            .map_err(|e| map_err("UnassignPrivateIpAddresses", e))?;
        Ok(())
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

/// Counts every request the client sends (each attempt, were retries on).
#[derive(Debug)]
struct CountRequests(Arc<AtomicU64>);

impl Intercept for CountRequests {
    fn name(&self) -> &'static str {
        "rcni-count-requests"
    }

    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> std::result::Result<(), BoxError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn https_client() -> SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https()
}

fn timeouts() -> TimeoutConfig {
    // Bounded, so a hung endpoint stalls one refill, never the pool: EC2
    // answers in well under a second.
    TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(5))
        .operation_timeout(Duration::from_secs(30))
        .build()
}

async fn identity(imds: &imds::Client) -> Result<Identity> {
    let get = async |path: &str| -> Result<String> {
        let v = imds
            .get(format!("/latest/meta-data/{path}"))
            .await
            .map_err(|e| CloudError::Other(format!("IMDS {path}: {}", DisplayErrorContext(&e))))?;
        let v: String = v.into();
        let v = v.trim().to_string();
        if v.is_empty() {
            return Err(CloudError::Other(format!("IMDS {path}: empty")));
        }
        Ok(v)
    };
    Ok(Identity {
        instance_id: get("instance-id").await?,
        instance_type: get("instance-type").await?,
        region: get("placement/region").await?,
        primary_mac: get("mac").await?.to_ascii_lowercase(),
    })
}

fn filter(name: &str, value: &str) -> Filter {
    Filter::builder().name(name).values(value).build()
}

fn count_i32(count: u32) -> Result<i32> {
    i32::try_from(count).map_err(|_| CloudError::Other(format!("count {count} out of range")))
}

fn parse_ip(op: &str, s: &str) -> Result<Ipv4Addr> {
    s.parse()
        .map_err(|_| CloudError::Other(format!("{op}: bad IPv4 address {s:?}")))
}

fn parse_net(op: &str, s: &str) -> Result<Ipv4Network> {
    let net: Ipv4Network = s
        .parse()
        .map_err(|_| CloudError::Other(format!("{op}: bad IPv4 CIDR {s:?}")))?;
    // The network itself, as the pool and the node's routes use it.
    Ipv4Network::new(net.network(), net.prefix())
        .map_err(|_| CloudError::Other(format!("{op}: bad IPv4 CIDR {s:?}")))
}

fn interface_of(
    n: &NetworkInterface,
    subnets: &BTreeMap<String, Ipv4Network>,
) -> Result<Interface> {
    let id = n
        .network_interface_id()
        .ok_or_else(|| CloudError::Other("network interface without an id".into()))?;
    let subnet_id = n.subnet_id().unwrap_or_default();
    let subnet = *subnets
        .get(subnet_id)
        .ok_or_else(|| CloudError::NotFound(format!("{id}: subnet {subnet_id:?}")))?;
    let primary_ip = n
        .private_ip_address()
        .ok_or_else(|| CloudError::Other(format!("{id}: no primary address")))
        .and_then(|a| parse_ip("DescribeNetworkInterfaces", a))?;
    let mut secondary_ips = Vec::new();
    for a in n.private_ip_addresses() {
        let Some(ip) = a.private_ip_address() else {
            continue;
        };
        let ip = parse_ip("DescribeNetworkInterfaces", ip)?;
        if a.primary() != Some(true) && ip != primary_ip {
            secondary_ips.push(ip);
        }
    }
    let prefixes = n
        .ipv4_prefixes()
        .iter()
        .filter_map(|p| p.ipv4_prefix())
        .map(|p| parse_net("DescribeNetworkInterfaces", p))
        .collect::<Result<Vec<_>>>()?;
    let device_index = n
        .attachment()
        .and_then(|a| a.device_index())
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(0);
    Ok(Interface {
        id: id.to_string(),
        mac: n.mac_address().unwrap_or_default().to_ascii_lowercase(),
        device_index,
        subnet,
        primary_ip,
        secondary_ips,
        prefixes,
    })
}

/// EC2's error codes to the pool's cases. Throttling shows as
/// RequestLimitExceeded (EC2's own), or Throttling/HTTP 429/503 from
/// anything in front of it.
fn map_err<E>(op: &str, e: SdkError<E, HttpResponse>) -> CloudError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let code = e.code().map(str::to_string);
    let status = e.raw_response().map(|r| r.status().as_u16());
    // EC2's own code and message when it answered with an error document;
    // the whole chain (dispatch failure, timeout, unparsable answer) else.
    let text = match (&code, e.message()) {
        (Some(c), Some(m)) => format!("{op}: {c}: {m}"),
        (Some(c), None) => format!("{op}: {c}"),
        _ => match status {
            Some(s) => format!("{op}: HTTP {s}: {}", DisplayErrorContext(&e)),
            None => format!("{op}: {}", DisplayErrorContext(&e)),
        },
    };
    classify(code.as_deref(), status, text)
}

fn classify(code: Option<&str>, status: Option<u16>, text: String) -> CloudError {
    match code {
        Some(
            "RequestLimitExceeded"
            | "Throttling"
            | "ThrottlingException"
            | "RequestThrottled"
            | "RequestThrottledException"
            | "TooManyRequestsException",
        ) => CloudError::Throttled(text),
        Some(
            "PrivateIpAddressLimitExceeded"
            | "AttachmentLimitExceeded"
            | "InsufficientFreeAddressesInSubnet"
            // Prefix delegation: no free /28 left in the subnet.
            | "InsufficientCidrBlocks"
            | "NetworkInterfaceLimitExceeded",
        ) => CloudError::Limit(text),
        Some(c) if c.ends_with(".NotFound") => CloudError::NotFound(text),
        _ if matches!(status, Some(429 | 503)) => CloudError::Throttled(text),
        _ => CloudError::Other(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_the_pool_cases() {
        let c = |code, status| classify(code, status, "x".into());
        assert!(matches!(
            c(Some("RequestLimitExceeded"), Some(503)),
            CloudError::Throttled(_)
        ));
        assert!(matches!(c(None, Some(503)), CloudError::Throttled(_)));
        assert!(matches!(c(None, Some(429)), CloudError::Throttled(_)));
        assert!(matches!(
            c(Some("PrivateIpAddressLimitExceeded"), Some(400)),
            CloudError::Limit(_)
        ));
        assert!(matches!(
            c(Some("AttachmentLimitExceeded"), Some(400)),
            CloudError::Limit(_)
        ));
        assert!(matches!(
            c(Some("InsufficientFreeAddressesInSubnet"), Some(400)),
            CloudError::Limit(_)
        ));
        assert!(matches!(
            c(Some("InvalidNetworkInterfaceID.NotFound"), Some(400)),
            CloudError::NotFound(_)
        ));
        assert!(matches!(
            c(Some("UnauthorizedOperation"), Some(403)),
            CloudError::Other(_)
        ));
        assert!(matches!(c(None, Some(500)), CloudError::Other(_)));
    }

    #[test]
    fn cidrs_are_normalised() {
        assert_eq!(
            parse_net("t", "10.0.1.17/28").unwrap(),
            "10.0.1.16/28".parse::<Ipv4Network>().unwrap()
        );
        assert!(parse_net("t", "fd00::/64").is_err());
    }
}
