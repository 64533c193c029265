//! Azure: pods' addresses are IP configurations of the VM's primary NIC, as
//! Azure CNI gives them. The VM's identity comes from the Instance Metadata
//! Service (IMDS) and a managed identity's token from IMDS too; the NIC, its
//! VNet and the address changes go through Azure Resource Manager (ARM).
//!
//! Where Azure differs from EC2:
//! - Azure cannot attach a NIC to a running VM (a VM's NICs are set while it
//!   is stopped), so there is one interface: the primary NIC.
//!   [`Provider::create_interface`] and the prefix calls are
//!   [`CloudError::Unsupported`].
//! - Adding addresses is one NIC update: GET the NIC, append IP
//!   configurations with Dynamic allocation, PUT it back with `If-Match` (a
//!   concurrent writer makes the PUT fail with 412: the GET and PUT run once
//!   more), follow the long-running operation, then read the addresses Azure
//!   chose. Removing is the same PUT without those configurations.
//! - A NIC holds at most 256 IP configurations, its primary one included.
//!   By default the provider reports 31 (Azure CNI's default of 30 pods per
//!   node, plus the primary): with the pool's WARM_ENI_TARGET of one whole
//!   interface, a node then holds 30 addresses up front, as Azure CNI
//!   reserves max pods' worth per node, so Azure CNI's subnet sizing holds.
//!   Reporting 256 would make the first node take 255 addresses, a whole /24.
//!   `RCNI_AZURE_MAX_IP_CONFIGS` sets it, up to 256.
//!
//! Not covered: VM scale set instances (AKS node pools), whose NICs belong to
//! the scale set's model and change through it.

use std::net::Ipv4Addr;
use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, IF_MATCH, RETRY_AFTER};
use hyper::{Method, Request, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use ipnetwork::Ipv4Network;
use serde_json::{Value, json};

use crate::{CloudError, Instance, Interface, Limits, NodeView, Provider, Result};

/// IMDS's fixed, link-local address.
pub const IMDS_ENDPOINT: &str = "http://169.254.169.254";
/// Azure Resource Manager in Azure's public cloud.
pub const ARM_ENDPOINT: &str = "https://management.azure.com";
/// The token's audience: ARM's resource id (a URL with its trailing slash).
pub const ARM_RESOURCE: &str = "https://management.azure.com/";

pub const IMDS_ENDPOINT_ENV: &str = "RCNI_AZURE_IMDS_ENDPOINT";
pub const ARM_ENDPOINT_ENV: &str = "RCNI_AZURE_ARM_ENDPOINT";
/// Another cloud's ARM audience (Azure China, US Government).
pub const ARM_RESOURCE_ENV: &str = "RCNI_AZURE_ARM_RESOURCE";
/// A user-assigned identity's client id, for a VM with more than one.
pub const CLIENT_ID_ENV: &str = "RCNI_AZURE_CLIENT_ID";
/// IP configurations per NIC the pool may use, the primary one included
/// (default [`DEFAULT_IP_CONFIGS`], at most [`MAX_IP_CONFIGS_PER_NIC`]).
pub const MAX_IP_CONFIGS_ENV: &str = "RCNI_AZURE_MAX_IP_CONFIGS";

/// Azure's limit of IP configurations (private addresses) per NIC, the
/// primary one included ("Private IP addresses per network interface").
pub const MAX_IP_CONFIGS_PER_NIC: u32 = 256;
/// What the provider reports unless told otherwise: Azure CNI's default max
/// pods (30) and the NIC's own address.
pub const DEFAULT_IP_CONFIGS: u32 = 31;

const IMDS_INSTANCE_API: &str = "2021-02-01";
const IMDS_TOKEN_API: &str = "2018-02-01";
const COMPUTE_API: &str = "2024-07-01";
const NETWORK_API: &str = "2024-05-01";

/// Our IP configurations' names: `rcni-<n>`.
const IP_CONFIG_PREFIX: &str = "rcni-";

/// One request's bound. IMDS answers locally in milliseconds; ARM within
/// seconds, or it is in trouble and the pool had better try again later.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a NIC update may run before the call gives up (NIC updates take
/// seconds; Azure's SDKs poll for minutes, but the pool retries anyway).
const OPERATION_TIMEOUT: Duration = Duration::from_secs(120);
/// Polling a long-running operation: Retry-After within these bounds, the
/// default when there is none.
const POLL_MIN: Duration = Duration::from_millis(200);
const POLL_MAX: Duration = Duration::from_secs(10);
const POLL_DEFAULT: Duration = Duration::from_secs(1);
/// A token is fetched again this long before it expires.
const TOKEN_MARGIN: Duration = Duration::from_secs(300);

type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The Azure provider: every method is one short sequence of requests. The
/// managed identity's token is cached until shortly before it expires.
pub struct Azure {
    imds: String,
    arm: String,
    resource: String,
    client_id: Option<String>,
    max_ip_configs: u32,
    http: HttpClient,
    calls: AtomicU64,
    token: Mutex<Option<Token>>,
}

struct Token {
    value: String,
    refresh_at: Instant,
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self, what: &str) -> Result<Value> {
        serde_json::from_slice(&self.body)
            .map_err(|e| CloudError::Other(format!("{what}: the answer is not JSON: {e}")))
    }

    fn retry_after(&self) -> Option<Duration> {
        let v = self.headers.get(RETRY_AFTER)?.to_str().ok()?;
        v.trim().parse::<u64>().ok().map(Duration::from_secs)
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.to_str().ok()
    }
}

impl Azure {
    /// The provider against the given IMDS and ARM base URLs (no trailing
    /// slash needed): tests point both at a fake.
    pub fn with_endpoints(imds_url: &str, arm_url: &str) -> Result<Azure> {
        Ok(Azure {
            imds: imds_url.trim_end_matches('/').to_string(),
            arm: arm_url.trim_end_matches('/').to_string(),
            resource: ARM_RESOURCE.to_string(),
            client_id: None,
            max_ip_configs: DEFAULT_IP_CONFIGS,
            http: http_client()?,
            calls: AtomicU64::new(0),
            token: Mutex::new(None),
        })
    }

    /// The real endpoints, or those `RCNI_AZURE_IMDS_ENDPOINT` and
    /// `RCNI_AZURE_ARM_ENDPOINT` name; `RCNI_AZURE_ARM_RESOURCE`,
    /// `RCNI_AZURE_CLIENT_ID` and `RCNI_AZURE_MAX_IP_CONFIGS` as their
    /// constants say. Nothing is asked of Azure yet.
    pub async fn from_env() -> Result<Azure> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut a = Azure::with_endpoints(
            &var(IMDS_ENDPOINT_ENV).unwrap_or_else(|| IMDS_ENDPOINT.into()),
            &var(ARM_ENDPOINT_ENV).unwrap_or_else(|| ARM_ENDPOINT.into()),
        )?;
        if let Some(r) = var(ARM_RESOURCE_ENV) {
            a.resource = r;
        }
        a.client_id = var(CLIENT_ID_ENV);
        if let Some(m) = var(MAX_IP_CONFIGS_ENV) {
            let n = m.parse::<u32>().map_err(|_| {
                CloudError::Other(format!("{MAX_IP_CONFIGS_ENV}={m:?}: not a number"))
            })?;
            a = a.max_ip_configs(n)?;
        }
        Ok(a)
    }

    /// At most `n` IP configurations on the NIC (2..=256: the primary one and
    /// at least one pod's).
    pub fn max_ip_configs(mut self, n: u32) -> Result<Azure> {
        if !(2..=MAX_IP_CONFIGS_PER_NIC).contains(&n) {
            return Err(CloudError::Other(format!(
                "max IP configurations per NIC {n}: 2 to {MAX_IP_CONFIGS_PER_NIC}"
            )));
        }
        self.max_ip_configs = n;
        Ok(self)
    }

    /// A user-assigned managed identity's client id.
    pub fn client_id(mut self, id: &str) -> Azure {
        self.client_id = Some(id.to_string());
        self
    }

    async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(hyper::header::HeaderName, &str)],
        body: Option<&Value>,
    ) -> Result<Reply> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let what = format!("{method} {}", url.split('?').next().unwrap_or(url));
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(k, *v);
        }
        let body = match body {
            Some(v) => {
                req = req.header(CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let req = req
            .body(body)
            .map_err(|e| CloudError::Other(format!("{what}: {e}")))?;
        let exchange = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| CloudError::Other(format!("{what}: {}", chain(&e))))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| CloudError::Other(format!("{what}: {}", chain(&e))))?
                .to_bytes();
            Ok(Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| {
                CloudError::Other(format!(
                    "{what}: no answer in {} s",
                    REQUEST_TIMEOUT.as_secs()
                ))
            })?
    }

    /// A GET to IMDS, which wants `Metadata: true` (it refuses requests a
    /// proxy could have forwarded).
    async fn imds_get(&self, path_and_query: &str, what: &str) -> Result<Value> {
        let url = format!("{}{path_and_query}", self.imds);
        let hdr = hyper::header::HeaderName::from_static("metadata");
        let r = self.send(Method::GET, &url, &[(hdr, "true")], None).await?;
        if !r.status.is_success() {
            return Err(error_of(what, &r));
        }
        r.json(what)
    }

    async fn token(&self) -> Result<String> {
        if let Some(t) = lock(&self.token).as_ref()
            && Instant::now() < t.refresh_at
        {
            return Ok(t.value.clone());
        }
        let mut q = format!(
            "/metadata/identity/oauth2/token?api-version={IMDS_TOKEN_API}&resource={}",
            query_encode(&self.resource)
        );
        if let Some(id) = &self.client_id {
            q.push_str("&client_id=");
            q.push_str(&query_encode(id));
        }
        let v = self.imds_get(&q, "managed identity token").await?;
        let value = v
            .get("access_token")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| CloudError::Other("managed identity token: no access_token".into()))?
            .to_string();
        // IMDS gives the lifetime as a string of seconds.
        let life = match v.get("expires_in") {
            Some(Value::String(s)) => s.parse::<u64>().ok(),
            Some(Value::Number(n)) => n.as_u64(),
            _ => None,
        }
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(3600));
        let keep = if life > TOKEN_MARGIN * 2 {
            life - TOKEN_MARGIN
        } else {
            life / 2
        };
        *lock(&self.token) = Some(Token {
            value: value.clone(),
            refresh_at: Instant::now() + keep,
        });
        Ok(value)
    }

    /// One ARM request at `url` (the caller judges the status). A 401 drops
    /// the cached token so the next call fetches a fresh one.
    async fn arm_url(
        &self,
        method: Method,
        url: &str,
        body: Option<&Value>,
        if_match: Option<&str>,
    ) -> Result<Reply> {
        let token = self.token().await?;
        let bearer = format!("Bearer {token}");
        let mut headers = vec![(AUTHORIZATION, bearer.as_str())];
        if let Some(e) = if_match {
            headers.push((IF_MATCH, e));
        }
        let r = self.send(method, url, &headers, body).await?;
        if r.status == StatusCode::UNAUTHORIZED {
            *lock(&self.token) = None;
        }
        Ok(r)
    }

    fn resource_url(&self, id: &str, api: &str) -> String {
        format!("{}{id}?api-version={api}", self.arm)
    }

    /// GET a resource by id; its JSON or the error its status means.
    async fn get(&self, id: &str, api: &str, what: &str) -> Result<Value> {
        let r = self
            .arm_url(Method::GET, &self.resource_url(id, api), None, None)
            .await?;
        if !r.status.is_success() {
            return Err(error_of(what, &r));
        }
        r.json(what)
    }

    /// Follows a NIC update to its end (the Azure-AsyncOperation URL, or the
    /// NIC's provisioningState without one) and returns the NIC as it is
    /// then. The PUT was accepted, so the change is Azure's already: a
    /// throttled poll waits and polls again (within the bound) rather than
    /// leave the pool unaware of addresses the NIC now has.
    async fn finish_update(&self, nic_id: &str, put: Reply) -> Result<Value> {
        let what = format!("updating NIC {nic_id}");
        let nic = put.json(&what)?;
        if provisioning_state(&nic) == Some("Succeeded") {
            return Ok(nic);
        }
        let deadline = Instant::now() + OPERATION_TIMEOUT;
        let mut wait = put.retry_after();
        let mut op = put.header("azure-asyncoperation").map(str::to_string);
        // The token goes only to ARM itself, never to a URL an answer names
        // elsewhere.
        if let Some(url) = &op
            && !url.starts_with(&format!("{}/", self.arm))
        {
            return Err(CloudError::Other(format!(
                "{what}: the operation's status URL {url:?} is not on {}",
                self.arm
            )));
        }
        let nic_url = self.resource_url(nic_id, NETWORK_API);
        loop {
            let pause = wait.unwrap_or(POLL_DEFAULT).clamp(POLL_MIN, POLL_MAX);
            if Instant::now() + pause > deadline {
                return Err(CloudError::Other(format!(
                    "{what}: still running after {} s",
                    OPERATION_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(pause).await;
            // The operation's status while there is one, then the NIC.
            let url = op.as_deref().unwrap_or(&nic_url);
            let r = self.arm_url(Method::GET, url, None, None).await?;
            if !r.status.is_success() {
                match error_of(&what, &r) {
                    CloudError::Throttled(_) => {
                        wait = r.retry_after();
                        continue;
                    }
                    e => return Err(e),
                }
            }
            let v = r.json(&what)?;
            wait = r.retry_after();
            if op.is_some() {
                match v.get("status").and_then(Value::as_str) {
                    Some("Succeeded") => {
                        op = None;
                        wait = Some(Duration::ZERO);
                    }
                    Some(s @ ("Failed" | "Canceled")) => {
                        return Err(operation_error(&what, s, &v));
                    }
                    _ => {}
                }
                continue;
            }
            match provisioning_state(&v) {
                Some("Succeeded") | None => return Ok(v),
                Some(s @ ("Failed" | "Canceled")) => {
                    return Err(CloudError::Other(format!("{what}: {s}")));
                }
                _ => {}
            }
        }
    }

    /// GET the NIC, let `edit` change its IP configurations, PUT it back
    /// with If-Match and follow the update. A 412 (another writer changed
    /// the NIC between our GET and PUT) runs GET and edit again once.
    /// `edit` returning `None` means there is nothing to change.
    async fn update_nic<T>(
        &self,
        nic_id: &str,
        mut edit: impl FnMut(&mut Vec<Value>) -> Result<Option<T>>,
    ) -> Result<Option<(T, Value)>> {
        let what = format!("NIC {nic_id}");
        let mut stale = false;
        loop {
            let r = self
                .arm_url(
                    Method::GET,
                    &self.resource_url(nic_id, NETWORK_API),
                    None,
                    None,
                )
                .await?;
            if !r.status.is_success() {
                return Err(error_of(&what, &r));
            }
            let mut nic = r.json(&what)?;
            let etag = nic
                .get("etag")
                .and_then(Value::as_str)
                .map(str::to_string)
                .or_else(|| r.header("etag").map(str::to_string));
            let Some(configs) = nic
                .pointer_mut("/properties/ipConfigurations")
                .and_then(Value::as_array_mut)
            else {
                return Err(CloudError::Other(format!("{what}: no ipConfigurations")));
            };
            let Some(out) = edit(configs)? else {
                return Ok(None);
            };
            let put = self
                .arm_url(
                    Method::PUT,
                    &self.resource_url(nic_id, NETWORK_API),
                    Some(&nic),
                    etag.as_deref(),
                )
                .await?;
            if put.status == StatusCode::PRECONDITION_FAILED {
                if !stale {
                    stale = true;
                    continue;
                }
                return Err(CloudError::Other(format!(
                    "{what}: changed by another writer twice while we updated it (HTTP 412)"
                )));
            }
            if !put.status.is_success() {
                return Err(error_of(&what, &put));
            }
            let after = self.finish_update(nic_id, put).await?;
            return Ok(Some((out, after)));
        }
    }
}

impl Provider for Azure {
    async fn describe(&self) -> Result<NodeView> {
        let meta = self
            .imds_get(
                &format!("/metadata/instance?api-version={IMDS_INSTANCE_API}"),
                "instance metadata",
            )
            .await?;
        let compute = meta.get("compute").cloned().unwrap_or(Value::Null);
        let field = |k: &str| {
            compute
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let (name, size, location) = (field("name"), field("vmSize"), field("location"));
        let mut vm_id = field("resourceId");
        if !field("vmScaleSetName").is_empty() || vm_id.contains("/virtualMachineScaleSets/") {
            return Err(CloudError::Unsupported(format!(
                "VM {name} is a scale set instance: its NIC changes through the scale set's model"
            )));
        }
        if vm_id.is_empty() {
            let (sub, rg) = (field("subscriptionId"), field("resourceGroupName"));
            if sub.is_empty() || rg.is_empty() || name.is_empty() {
                return Err(CloudError::Other(
                    "instance metadata: no resourceId, subscriptionId, resourceGroupName or name"
                        .into(),
                ));
            }
            vm_id = format!(
                "/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines/{name}"
            );
        }
        let local_macs: Vec<String> = meta
            .pointer("/network/interface")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|i| i.get("macAddress").and_then(Value::as_str))
            .filter_map(normalize_mac)
            .collect();

        let vm = self.get(&vm_id, COMPUTE_API, &format!("VM {name}")).await?;
        let nic_id = primary_nic_id(&vm)
            .ok_or_else(|| CloudError::Other(format!("VM {name}: no primary network interface")))?;
        let nic = self
            .get(&nic_id, NETWORK_API, &format!("NIC {nic_id}"))
            .await?;
        let view = NicView::parse(&nic)?;
        if !local_macs.is_empty() && !local_macs.contains(&view.mac) {
            return Err(CloudError::Other(format!(
                "NIC {nic_id} ({}) is not one of this machine's interfaces {local_macs:?}",
                view.mac
            )));
        }
        let vnet_id = view
            .subnet_id
            .to_ascii_lowercase()
            .find("/subnets/")
            .map(|i| view.subnet_id[..i].to_string())
            .ok_or_else(|| {
                CloudError::Other(format!(
                    "NIC {nic_id}: subnet id {:?} is not a VNet's",
                    view.subnet_id
                ))
            })?;
        let vnet = self
            .get(&vnet_id, NETWORK_API, &format!("VNet {vnet_id}"))
            .await?;
        let vpc_cidrs: Vec<Ipv4Network> = vnet
            .pointer("/properties/addressSpace/addressPrefixes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter_map(|p| Ipv4Network::from_str(p).ok())
            .collect();
        let listed = vnet
            .pointer("/properties/subnets")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|s| {
                s.get("id")
                    .and_then(Value::as_str)
                    .is_some_and(|id| id.eq_ignore_ascii_case(&view.subnet_id))
            })
            .and_then(subnet_prefix);
        let subnet = match listed {
            Some(s) => s,
            None => {
                let s = self
                    .get(
                        &view.subnet_id,
                        NETWORK_API,
                        &format!("subnet {}", view.subnet_id),
                    )
                    .await?;
                subnet_prefix(&s).ok_or_else(|| {
                    CloudError::Other(format!("subnet {}: no IPv4 addressPrefix", view.subnet_id))
                })?
            }
        };
        let interface = Interface {
            id: view.id,
            mac: view.mac.clone(),
            device_index: 0,
            subnet,
            primary_ip: view.primary_ip,
            secondary_ips: view.secondary_ips,
            prefixes: Vec::new(),
        };
        Ok(NodeView {
            instance: Instance {
                id: name,
                instance_type: size,
                region: location,
                primary_mac: view.mac,
                vpc_cidrs,
            },
            limits: Limits {
                max_interfaces: 1,
                addrs_per_interface: self.max_ip_configs,
            },
            interfaces: vec![interface],
        })
    }

    async fn create_interface(&self, _device_index: u32) -> Result<Interface> {
        Err(CloudError::Unsupported(
            "Azure attaches NICs only to a stopped VM: pods' addresses stay on the primary NIC"
                .into(),
        ))
    }

    async fn leaked_interfaces(&self) -> Result<Vec<String>> {
        // Nothing is ever created, so nothing can be left behind.
        Ok(Vec::new())
    }

    async fn delete_interface(&self, id: &str) -> Result<()> {
        Err(CloudError::Unsupported(format!(
            "not deleting {id}: the Azure provider only uses the VM's primary NIC"
        )))
    }

    async fn describe_interface(&self, id: &str) -> Result<Interface> {
        // The whole view (IMDS, VM, NIC, VNet): the pool changes the NIC's
        // configurations rarely (it reserves them up front), and the
        // subnet's prefix comes with the VNet.
        self.describe()
            .await?
            .interfaces
            .into_iter()
            .find(|i| i.id.eq_ignore_ascii_case(id))
            .ok_or_else(|| CloudError::NotFound(format!("NIC {id} is not this VM's primary NIC")))
    }

    async fn assign_these_ips(&self, interface: &str, _ips: &[Ipv4Addr]) -> Result<()> {
        // A Static IP configuration would do it; not done yet: the pod's
        // assignment is kept and flagged instead.
        Err(CloudError::Unsupported(format!(
            "assigning given addresses back to NIC {interface} is not done on Azure"
        )))
    }

    async fn assign_ips(&self, interface: &str, count: u32) -> Result<Vec<Ipv4Addr>> {
        check_nic_id(interface)?;
        if count == 0 {
            return Ok(Vec::new());
        }
        let max = self.max_ip_configs as usize;
        let done = self
            .update_nic(interface, |configs| {
                if configs.len() + count as usize > max {
                    return Err(CloudError::Limit(format!(
                        "NIC {interface} has {} IP configurations; {count} more would pass {max}",
                        configs.len()
                    )));
                }
                let subnet = configs
                    .iter()
                    .find(|c| c.pointer("/properties/primary") == Some(&Value::Bool(true)))
                    .or(configs.first())
                    .and_then(|c| c.pointer("/properties/subnet/id"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        CloudError::Other(format!(
                            "NIC {interface}: no subnet on its IP configurations"
                        ))
                    })?
                    .to_string();
                let taken: Vec<String> = configs
                    .iter()
                    .filter_map(|c| c.get("name").and_then(Value::as_str))
                    .map(str::to_ascii_lowercase)
                    .collect();
                let names: Vec<String> = (0u32..)
                    .map(|n| format!("{IP_CONFIG_PREFIX}{n}"))
                    .filter(|n| !taken.contains(n))
                    .take(count as usize)
                    .collect();
                for n in &names {
                    configs.push(json!({
                        "name": n,
                        "properties": {
                            "privateIPAllocationMethod": "Dynamic",
                            "privateIPAddressVersion": "IPv4",
                            "subnet": {"id": subnet},
                        },
                    }));
                }
                Ok(Some(names))
            })
            .await?;
        let Some((names, nic)) = done else {
            return Ok(Vec::new());
        };
        let configs = nic
            .pointer("/properties/ipConfigurations")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        names
            .iter()
            .map(|n| {
                configs
                    .iter()
                    .find(|c| {
                        c.get("name")
                            .and_then(Value::as_str)
                            .is_some_and(|x| x.eq_ignore_ascii_case(n))
                    })
                    .and_then(|c| c.pointer("/properties/privateIPAddress"))
                    .and_then(Value::as_str)
                    .and_then(|a| a.parse::<Ipv4Addr>().ok())
                    .ok_or_else(|| {
                        CloudError::Other(format!(
                            "NIC {interface}: Azure gave IP configuration {n} no IPv4 address"
                        ))
                    })
            })
            .collect()
    }

    async fn unassign_ips(&self, interface: &str, ips: &[Ipv4Addr]) -> Result<()> {
        check_nic_id(interface)?;
        if ips.is_empty() {
            return Ok(());
        }
        self.update_nic(interface, |configs| {
            let addr = |c: &Value| {
                c.pointer("/properties/privateIPAddress")
                    .and_then(Value::as_str)
                    .and_then(|a| a.parse::<Ipv4Addr>().ok())
            };
            let primary = |c: &Value| c.pointer("/properties/primary") == Some(&Value::Bool(true));
            if let Some(p) = configs
                .iter()
                .find(|c| primary(c) && addr(c).is_some_and(|a| ips.contains(&a)))
            {
                return Err(CloudError::Other(format!(
                    "NIC {interface}: {} is its primary address, never a pod's",
                    addr(p).map(|a| a.to_string()).unwrap_or_default()
                )));
            }
            let before = configs.len();
            configs.retain(|c| primary(c) || !addr(c).is_some_and(|a| ips.contains(&a)));
            // Addresses already gone are success: the call is idempotent.
            Ok((configs.len() != before).then_some(()))
        })
        .await?;
        Ok(())
    }

    async fn assign_prefixes(&self, _interface: &str, _count: u32) -> Result<Vec<Ipv4Network>> {
        Err(CloudError::Unsupported(
            "Azure NICs take single addresses, not prefixes".into(),
        ))
    }

    async fn unassign_prefixes(&self, _interface: &str, prefixes: &[Ipv4Network]) -> Result<()> {
        if prefixes.is_empty() {
            return Ok(());
        }
        Err(CloudError::Unsupported(
            "Azure NICs take single addresses, not prefixes".into(),
        ))
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

/// What the provider reads of a NIC.
#[derive(Debug, PartialEq, Eq)]
struct NicView {
    id: String,
    mac: String,
    primary_ip: Ipv4Addr,
    secondary_ips: Vec<Ipv4Addr>,
    subnet_id: String,
}

impl NicView {
    fn parse(nic: &Value) -> Result<NicView> {
        let id = nic
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let bad = |why: &str| CloudError::Other(format!("NIC {id}: {why}"));
        let mac = nic
            .pointer("/properties/macAddress")
            .and_then(Value::as_str)
            .and_then(normalize_mac)
            .ok_or_else(|| bad("no MAC address"))?;
        let configs = nic
            .pointer("/properties/ipConfigurations")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no ipConfigurations"))?;
        let v4 = |c: &Value| {
            let version = c
                .pointer("/properties/privateIPAddressVersion")
                .and_then(Value::as_str)
                .unwrap_or("IPv4");
            if version != "IPv4" {
                return None;
            }
            c.pointer("/properties/privateIPAddress")
                .and_then(Value::as_str)
                .and_then(|a| a.parse::<Ipv4Addr>().ok())
        };
        let primary = configs
            .iter()
            .find(|c| c.pointer("/properties/primary") == Some(&Value::Bool(true)))
            .or(if configs.len() == 1 {
                configs.first()
            } else {
                None
            })
            .ok_or_else(|| bad("no primary IP configuration"))?;
        let primary_ip =
            v4(primary).ok_or_else(|| bad("its primary IP configuration has no IPv4 address"))?;
        let subnet_id = primary
            .pointer("/properties/subnet/id")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("its primary IP configuration has no subnet"))?
            .to_string();
        let secondary_ips = configs
            .iter()
            .filter(|c| !std::ptr::eq(*c, primary))
            .filter_map(v4)
            .collect();
        Ok(NicView {
            id,
            mac,
            primary_ip,
            secondary_ips,
            subnet_id,
        })
    }
}

fn http_client() -> Result<HttpClient> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(webpki_root_certs::TLS_SERVER_ROOT_CERTS.iter().cloned());
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| CloudError::Other(format!("TLS: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    // IMDS is plain HTTP on a link-local address; ARM is HTTPS.
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// What an error status means for the pool: throttled (try again later),
/// a limit, not found, or anything else with Azure's code and message.
fn error_of(what: &str, r: &Reply) -> CloudError {
    let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    // ARM: {"error": {"code", "message"}}; IMDS: {"error": "...",
    // "error_description": "..."}.
    let (code, message) = match body.get("error") {
        Some(Value::Object(e)) => (
            e.get("code").and_then(Value::as_str).unwrap_or_default(),
            e.get("message").and_then(Value::as_str).unwrap_or_default(),
        ),
        Some(Value::String(s)) => (
            s.as_str(),
            body.get("error_description")
                .and_then(Value::as_str)
                .unwrap_or_default(),
        ),
        _ => ("", ""),
    };
    let retry = r
        .retry_after()
        .map(|d| format!(", retry after {} s", d.as_secs()))
        .unwrap_or_default();
    let text = format!(
        "{what}: HTTP {}{}{}{retry}",
        r.status.as_u16(),
        if code.is_empty() {
            String::new()
        } else {
            format!(" {code}")
        },
        if message.is_empty() {
            String::new()
        } else {
            format!(": {message}")
        },
    );
    match r.status {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
            CloudError::Throttled(text)
        }
        // ARM serializes writes to a resource: another update still running
        // is a wait, like a throttle.
        StatusCode::CONFLICT if code == "AnotherOperationInProgress" => CloudError::Throttled(text),
        StatusCode::NOT_FOUND => CloudError::NotFound(text),
        _ if is_limit_code(code) => CloudError::Limit(text),
        _ => CloudError::Other(text),
    }
}

/// ARM's codes for a full subnet (SubnetIsFull, documented) and for the
/// per-NIC and subscription limits (not documented by name: their codes say
/// Limit or Quota).
fn is_limit_code(code: &str) -> bool {
    code == "SubnetIsFull"
        || [
            "LimitExceeded",
            "ExceedsLimit",
            "LimitReached",
            "QuotaExceeded",
        ]
        .iter()
        .any(|k| code.contains(k))
}

fn operation_error(what: &str, status: &str, op: &Value) -> CloudError {
    let code = op
        .pointer("/error/code")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let message = op
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let text = format!("{what}: {status} {code}: {message}");
    if is_limit_code(code) {
        CloudError::Limit(text)
    } else {
        CloudError::Other(text)
    }
}

fn provisioning_state(v: &Value) -> Option<&str> {
    v.pointer("/properties/provisioningState")
        .and_then(Value::as_str)
}

fn primary_nic_id(vm: &Value) -> Option<String> {
    let nics = vm
        .pointer("/properties/networkProfile/networkInterfaces")?
        .as_array()?;
    nics.iter()
        .find(|n| n.pointer("/properties/primary") == Some(&Value::Bool(true)))
        .or(if nics.len() == 1 { nics.first() } else { None })
        .and_then(|n| n.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

fn subnet_prefix(subnet: &Value) -> Option<Ipv4Network> {
    let one = subnet
        .pointer("/properties/addressPrefix")
        .and_then(Value::as_str)
        .into_iter();
    let many = subnet
        .pointer("/properties/addressPrefixes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str);
    one.chain(many).find_map(|p| Ipv4Network::from_str(p).ok())
}

/// Azure writes MACs as `000D3AF806EC` (IMDS) or `00-0D-3A-F8-06-EC` (ARM);
/// the node finds links by `00:0d:3a:f8:06:ec`.
pub fn normalize_mac(s: &str) -> Option<String> {
    let hex: String = s
        .chars()
        .filter(|c| !matches!(c, '-' | ':' | '.'))
        .collect();
    if hex.len() != 12 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let hex = hex.to_ascii_lowercase();
    Some(
        (0..6)
            .map(|i| &hex[2 * i..2 * i + 2])
            .collect::<Vec<_>>()
            .join(":"),
    )
}

/// The pool hands back what describe gave; anything else must not become
/// part of a URL.
fn check_nic_id(id: &str) -> Result<()> {
    let ok = id.starts_with("/subscriptions/")
        && id
            .to_ascii_lowercase()
            .contains("/providers/microsoft.network/networkinterfaces/")
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/-_.()".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CloudError::NotFound(format!(
            "{id:?} is not an Azure network interface's resource id"
        )))
    }
}

/// Percent-encoding of a query value (RFC 3986's unreserved characters
/// stay).
fn query_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere while holding it left only a cached token.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// hyper's errors say "client error (Connect)"; the cause is in the chain.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(status: u16, body: Value, retry: Option<&str>) -> Reply {
        let mut headers = HeaderMap::new();
        if let Some(r) = retry {
            headers.insert(RETRY_AFTER, r.parse().unwrap());
        }
        Reply {
            status: StatusCode::from_u16(status).unwrap(),
            headers,
            body: Bytes::from(body.to_string()),
        }
    }

    #[test]
    fn macs_in_both_of_azures_spellings() {
        assert_eq!(
            normalize_mac("000D3AF806EC").as_deref(),
            Some("00:0d:3a:f8:06:ec")
        );
        assert_eq!(
            normalize_mac("00-0D-3A-F8-06-EC").as_deref(),
            Some("00:0d:3a:f8:06:ec")
        );
        assert_eq!(normalize_mac("00-0D-3A-F8-06"), None);
        assert_eq!(normalize_mac("00-0D-3A-F8-06-EG"), None);
        assert_eq!(normalize_mac(""), None);
    }

    #[test]
    fn errors_by_status_and_code() {
        let arm = |code: &str| json!({"error": {"code": code, "message": "m"}});
        assert!(matches!(
            error_of("x", &reply(429, arm("TooManyRequests"), Some("3"))),
            CloudError::Throttled(m) if m.contains("retry after 3 s")
        ));
        assert!(matches!(
            error_of("x", &reply(503, Value::Null, None)),
            CloudError::Throttled(_)
        ));
        assert!(matches!(
            error_of("x", &reply(409, arm("AnotherOperationInProgress"), None)),
            CloudError::Throttled(_)
        ));
        assert!(matches!(
            error_of("x", &reply(409, arm("Conflict"), None)),
            CloudError::Other(_)
        ));
        assert!(matches!(
            error_of("x", &reply(400, arm("SubnetIsFull"), None)),
            CloudError::Limit(_)
        ));
        assert!(matches!(
            error_of(
                "x",
                &reply(
                    400,
                    arm("NetworkInterfaceIpConfigurationCountExceedsLimit"),
                    None
                )
            ),
            CloudError::Limit(_)
        ));
        assert!(matches!(
            error_of("x", &reply(404, arm("ResourceNotFound"), None)),
            CloudError::NotFound(_)
        ));
        let imds = json!({"error": "invalid_request", "error_description": "no identity"});
        assert!(matches!(
            error_of("token", &reply(400, imds, None)),
            CloudError::Other(m) if m.contains("invalid_request: no identity")
        ));
        // A body that is not JSON at all still gives the status.
        let r = Reply {
            status: StatusCode::BAD_GATEWAY,
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"<html>"),
        };
        assert_eq!(error_of("x", &r), CloudError::Other("x: HTTP 502".into()));
    }

    #[test]
    fn a_nic_as_arm_returns_it() {
        let subnet = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Network/virtualNetworks/v/subnets/n";
        let cfg = |name: &str, addr: &str, primary: bool| {
            json!({"name": name, "properties": {"privateIPAddress": addr, "primary": primary,
                "privateIPAddressVersion": "IPv4", "subnet": {"id": subnet}}})
        };
        let nic = json!({"id": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Network/networkInterfaces/nic",
        "properties": {"macAddress": "00-0D-3A-F8-06-EC", "ipConfigurations": [
            cfg("rcni-0", "10.1.0.5", false),
            cfg("ipconfig1", "10.1.0.4", true),
            {"name": "v6", "properties": {"privateIPAddress": "fd00::5", "privateIPAddressVersion": "IPv6"}},
            cfg("rcni-1", "10.1.0.6", false),
        ]}});
        let v = NicView::parse(&nic).unwrap();
        assert_eq!(v.mac, "00:0d:3a:f8:06:ec");
        assert_eq!(v.primary_ip, Ipv4Addr::new(10, 1, 0, 4));
        assert_eq!(
            v.secondary_ips,
            [Ipv4Addr::new(10, 1, 0, 5), Ipv4Addr::new(10, 1, 0, 6)]
        );
        assert_eq!(v.subnet_id, subnet);
        // Two configurations and neither primary: refused, not guessed.
        let nic = json!({"id": "n", "properties": {"macAddress": "000D3AF806EC", "ipConfigurations": [
            cfg("a", "10.1.0.5", false), cfg("b", "10.1.0.6", false)]}});
        assert!(NicView::parse(&nic).is_err());
    }

    #[test]
    fn nic_ids_that_may_become_urls() {
        let good = "/subscriptions/0000/resourceGroups/rg(1)/providers/Microsoft.Network/networkInterfaces/vm-nic_1.a";
        assert!(check_nic_id(good).is_ok());
        for bad in [
            "eni-0123",
            "/subscriptions/0/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm",
            "/subscriptions/0/resourceGroups/rg/providers/Microsoft.Network/networkInterfaces/n?x=1",
            "/subscriptions/0/resourceGroups/rg/providers/Microsoft.Network/networkInterfaces/n#",
            "/subscriptions/0/resourceGroups/rg/providers/Microsoft.Network/networkInterfaces/a b",
        ] {
            assert!(
                matches!(check_nic_id(bad), Err(CloudError::NotFound(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(
            query_encode(ARM_RESOURCE),
            "https%3A%2F%2Fmanagement.azure.com%2F"
        );
    }

    #[test]
    fn the_primary_nic_of_a_vm() {
        let vm = json!({"properties": {"networkProfile": {"networkInterfaces": [
            {"id": "/a", "properties": {"primary": false}},
            {"id": "/b", "properties": {"primary": true}}]}}});
        assert_eq!(primary_nic_id(&vm).as_deref(), Some("/b"));
        let vm =
            json!({"properties": {"networkProfile": {"networkInterfaces": [{"id": "/only"}]}}});
        assert_eq!(primary_nic_id(&vm).as_deref(), Some("/only"));
        let vm = json!({"properties": {"networkProfile": {"networkInterfaces": [{"id": "/a"}, {"id": "/b"}]}}});
        assert_eq!(primary_nic_id(&vm), None);
    }
}
