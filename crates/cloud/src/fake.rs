//! [`FakeCloud`]: a [`Provider`] in memory with EC2's rules (interface and
//! per-interface address limits, secondary addresses and /28 prefixes
//! sharing an interface's slots, no address given twice in the subnet),
//! for tests of the pool and of the agent. Clones share one cloud, so a
//! test keeps a handle to inspect what the pool did.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ipnetwork::Ipv4Network;

use crate::{CloudError, Instance, Interface, Limits, NodeView, Provider, Result};

#[derive(Debug)]
struct State {
    instance: Instance,
    limits: Limits,
    subnet: Ipv4Network,
    attached: BTreeMap<String, Interface>,
    /// Created, tagged as ours, not attached (a crash between create and
    /// attach).
    unattached: BTreeMap<String, Interface>,
    /// Every address in the subnet some interface holds (primaries,
    /// secondaries, prefixes' addresses).
    used: BTreeSet<Ipv4Addr>,
    next_eni: u32,
    throttle_next: u32,
    calls: BTreeMap<&'static str, u64>,
    total_calls: u64,
    latency: Duration,
    /// assign_ips answers with every address of the interface, its primary
    /// first, as moto does (EC2 answers with the new ones).
    answer_like_moto: bool,
}

/// An in-memory cloud for one instance.
#[derive(Debug, Clone)]
pub struct FakeCloud {
    state: Arc<Mutex<State>>,
}

impl FakeCloud {
    /// An instance with these limits whose primary interface (device 0,
    /// `eni-0`) sits in `subnet` with the subnet's tenth host address.
    pub fn new(limits: Limits, subnet: Ipv4Network) -> FakeCloud {
        let primary_ip = Ipv4Addr::from(u32::from(subnet.network()) + 10);
        let primary = Interface {
            id: "eni-0".into(),
            mac: mac(0),
            device_index: 0,
            subnet,
            primary_ip,
            secondary_ips: vec![],
            prefixes: vec![],
        };
        let mut used = BTreeSet::new();
        // The network, AWS's 3 reserved addresses and the broadcast.
        let base = u32::from(subnet.network());
        used.extend((0..4).map(|k| Ipv4Addr::from(base + k)));
        used.insert(subnet.broadcast());
        used.insert(primary_ip);
        FakeCloud {
            state: Arc::new(Mutex::new(State {
                instance: Instance {
                    id: "i-0123456789abcdef0".into(),
                    instance_type: "fake.large".into(),
                    region: "us-fake-1".into(),
                    primary_mac: primary.mac.clone(),
                    vpc_cidrs: vec![subnet],
                },
                limits,
                subnet,
                attached: [(primary.id.clone(), primary)].into(),
                unattached: BTreeMap::new(),
                used,
                next_eni: 1,
                throttle_next: 0,
                calls: BTreeMap::new(),
                total_calls: 0,
                latency: Duration::ZERO,
                answer_like_moto: false,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next `n` calls (any method) answer [`CloudError::Throttled`].
    pub fn throttle_next(&self, n: u32) {
        self.lock().throttle_next = n;
    }

    /// Every call waits this long first (an EC2 call takes time; a test can
    /// kill the pool in the middle of one).
    pub fn set_latency(&self, d: Duration) {
        self.lock().latency = d;
    }

    /// assign_ips answers as moto's AssignPrivateIpAddresses does: the
    /// interface's primary address and all its secondary ones, not only
    /// the new ones.
    pub fn answer_like_moto(&self, on: bool) {
        self.lock().answer_like_moto = on;
    }

    /// Calls per method, throttled ones included.
    pub fn call_counts(&self) -> BTreeMap<String, u64> {
        self.lock()
            .calls
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect()
    }

    pub fn calls_to(&self, method: &str) -> u64 {
        self.lock().calls.get(method).copied().unwrap_or(0)
    }

    /// What the cloud has assigned: per attached interface, its secondary
    /// addresses (/32) and prefixes.
    pub fn assigned(&self) -> BTreeMap<String, Vec<Ipv4Network>> {
        self.lock()
            .attached
            .values()
            .map(|i| {
                let mut v: Vec<Ipv4Network> = i
                    .secondary_ips
                    .iter()
                    .map(|ip| Ipv4Network::new(*ip, 32).expect("/32"))
                    .collect();
                v.extend(i.prefixes.iter().copied());
                (i.id.clone(), v)
            })
            .collect()
    }

    /// The attached interfaces, by device index.
    pub fn interfaces(&self) -> Vec<Interface> {
        let mut v: Vec<Interface> = self.lock().attached.values().cloned().collect();
        v.sort_by_key(|i| i.device_index);
        v
    }

    /// An interface tagged as this instance's but left unattached, as a
    /// crash between create and attach leaves one; returns its id.
    pub fn leak_interface(&self) -> String {
        let mut st = self.lock();
        let iface = st.new_interface(u32::MAX);
        let id = iface.id.clone();
        st.unattached.insert(id.clone(), iface);
        id
    }

    /// Ids of the unattached interfaces.
    pub fn unattached(&self) -> Vec<String> {
        self.lock().unattached.keys().cloned().collect()
    }

    /// Removes an address from an interface behind the pool's back (another
    /// tool or a person did it).
    pub fn drop_ip(&self, ip: Ipv4Addr) {
        let mut st = self.lock();
        for i in st.attached.values_mut() {
            i.secondary_ips.retain(|x| *x != ip);
        }
        st.used.remove(&ip);
    }

    /// Marks `ip` as someone else's in the subnet (another instance took
    /// it): nobody here can be given it.
    pub fn take_ip(&self, ip: Ipv4Addr) {
        self.lock().used.insert(ip);
    }

    async fn call(&self, method: &'static str) -> Result<()> {
        let latency = {
            let mut st = self.lock();
            *st.calls.entry(method).or_default() += 1;
            st.total_calls += 1;
            st.latency
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let mut st = self.lock();
        if st.throttle_next > 0 {
            st.throttle_next -= 1;
            return Err(CloudError::Throttled(format!(
                "{method}: Request limit exceeded."
            )));
        }
        Ok(())
    }
}

fn mac(n: u32) -> String {
    let b = n.to_be_bytes();
    format!("02:fa:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3])
}

impl State {
    fn free_ip(&mut self) -> Result<Ipv4Addr> {
        let ip = self
            .subnet
            .iter()
            .find(|ip| !self.used.contains(ip))
            .ok_or_else(|| CloudError::Limit("InsufficientFreeAddressesInSubnet".into()))?;
        self.used.insert(ip);
        Ok(ip)
    }

    fn free_prefix(&mut self) -> Result<Ipv4Network> {
        let base = u32::from(self.subnet.network());
        let end = u32::from(self.subnet.broadcast());
        let mut at = base;
        while at.saturating_add(15) <= end {
            let p = Ipv4Network::new(Ipv4Addr::from(at), 28).expect("/28");
            if p.iter().all(|ip| !self.used.contains(&ip)) {
                self.used.extend(p.iter());
                return Ok(p);
            }
            at += 16;
        }
        Err(CloudError::Limit("InsufficientCidrBlocks".into()))
    }

    fn new_interface(&mut self, device_index: u32) -> Interface {
        let n = self.next_eni;
        self.next_eni += 1;
        let primary_ip = self.free_ip().unwrap_or(Ipv4Addr::UNSPECIFIED);
        Interface {
            id: format!("eni-{n:017x}"),
            mac: mac(n),
            device_index,
            subnet: self.subnet,
            primary_ip,
            secondary_ips: vec![],
            prefixes: vec![],
        }
    }

    fn attached_mut(&mut self, id: &str) -> Result<&mut Interface> {
        self.attached.get_mut(id).ok_or_else(|| {
            CloudError::NotFound(format!("InvalidNetworkInterfaceID.NotFound: {id}"))
        })
    }

    fn release(&mut self, iface: &Interface) {
        self.used.remove(&iface.primary_ip);
        for ip in &iface.secondary_ips {
            self.used.remove(ip);
        }
        for p in &iface.prefixes {
            for ip in p.iter() {
                self.used.remove(&ip);
            }
        }
    }
}

impl Provider for FakeCloud {
    async fn describe(&self) -> Result<NodeView> {
        self.call("describe").await?;
        let st = self.lock();
        let mut interfaces: Vec<Interface> = st.attached.values().cloned().collect();
        interfaces.sort_by_key(|i| i.device_index);
        Ok(NodeView {
            instance: st.instance.clone(),
            limits: st.limits,
            interfaces,
        })
    }

    async fn create_interface(&self, device_index: u32) -> Result<Interface> {
        self.call("create_interface").await?;
        let mut st = self.lock();
        if st.attached.len() as u32 >= st.limits.max_interfaces {
            return Err(CloudError::Limit(
                "AttachmentLimitExceeded: the instance has its maximum of interfaces".into(),
            ));
        }
        if st.attached.values().any(|i| i.device_index == device_index) {
            return Err(CloudError::Other(format!(
                "InvalidParameterValue: device index {device_index} is in use"
            )));
        }
        let iface = st.new_interface(device_index);
        st.attached.insert(iface.id.clone(), iface.clone());
        Ok(iface)
    }

    async fn leaked_interfaces(&self) -> Result<Vec<String>> {
        self.call("leaked_interfaces").await?;
        Ok(self.lock().unattached.keys().cloned().collect())
    }

    async fn delete_interface(&self, id: &str) -> Result<()> {
        self.call("delete_interface").await?;
        let mut st = self.lock();
        let iface = match st.attached.remove(id) {
            Some(i) => i,
            None => st.unattached.remove(id).ok_or_else(|| {
                CloudError::NotFound(format!("InvalidNetworkInterfaceID.NotFound: {id}"))
            })?,
        };
        if iface.device_index == 0 {
            st.attached.insert(iface.id.clone(), iface);
            return Err(CloudError::Other(
                "OperationNotPermitted: the primary interface cannot be detached".into(),
            ));
        }
        st.release(&iface);
        Ok(())
    }

    async fn describe_interface(&self, id: &str) -> Result<Interface> {
        self.call("describe_interface").await?;
        let mut st = self.lock();
        Ok(st.attached_mut(id)?.clone())
    }

    async fn assign_these_ips(&self, interface: &str, ips: &[Ipv4Addr]) -> Result<()> {
        self.call("assign_these_ips").await?;
        let mut st = self.lock();
        let slots = st.limits.addrs_per_interface.saturating_sub(1);
        let subnet = st.subnet;
        let i = st.attached_mut(interface)?;
        let used = (i.secondary_ips.len() + i.prefixes.len()) as u32;
        let new: Vec<Ipv4Addr> = ips
            .iter()
            .copied()
            .filter(|ip| !i.secondary_ips.contains(ip))
            .collect();
        if used + new.len() as u32 > slots {
            return Err(CloudError::Limit(format!(
                "PrivateIpAddressLimitExceeded: {interface} has {used} of {slots}"
            )));
        }
        if let Some(ip) = new
            .iter()
            .find(|ip| !subnet.contains(**ip) || st.used.contains(ip))
        {
            return Err(CloudError::Other(format!(
                "InvalidParameterValue: {ip} is in use or not in {subnet}"
            )));
        }
        st.used.extend(&new);
        st.attached_mut(interface)?.secondary_ips.extend(&new);
        Ok(())
    }

    async fn assign_ips(&self, interface: &str, count: u32) -> Result<Vec<Ipv4Addr>> {
        self.call("assign_ips").await?;
        let mut st = self.lock();
        let slots = st.limits.addrs_per_interface.saturating_sub(1);
        let i = st.attached_mut(interface)?;
        let used = (i.secondary_ips.len() + i.prefixes.len()) as u32;
        if used + count > slots {
            return Err(CloudError::Limit(format!(
                "PrivateIpAddressLimitExceeded: {interface} has {used} of {slots}"
            )));
        }
        let mut ips = Vec::new();
        for _ in 0..count {
            ips.push(st.free_ip()?);
        }
        let like_moto = st.answer_like_moto;
        let i = st.attached_mut(interface)?;
        i.secondary_ips.extend(&ips);
        if like_moto {
            return Ok(std::iter::once(i.primary_ip)
                .chain(i.secondary_ips.iter().copied())
                .collect());
        }
        Ok(ips)
    }

    async fn unassign_ips(&self, interface: &str, ips: &[Ipv4Addr]) -> Result<()> {
        self.call("unassign_ips").await?;
        let mut st = self.lock();
        let i = st.attached_mut(interface)?;
        if let Some(ip) = ips.iter().find(|ip| !i.secondary_ips.contains(ip)) {
            return Err(CloudError::NotFound(format!(
                "InvalidParameterValue: {ip} is not assigned to {interface}"
            )));
        }
        i.secondary_ips.retain(|ip| !ips.contains(ip));
        for ip in ips {
            st.used.remove(ip);
        }
        Ok(())
    }

    async fn assign_prefixes(&self, interface: &str, count: u32) -> Result<Vec<Ipv4Network>> {
        self.call("assign_prefixes").await?;
        let mut st = self.lock();
        let slots = st.limits.addrs_per_interface.saturating_sub(1);
        let i = st.attached_mut(interface)?;
        let used = (i.secondary_ips.len() + i.prefixes.len()) as u32;
        if used + count > slots {
            return Err(CloudError::Limit(format!(
                "PrivateIpAddressLimitExceeded: {interface} has {used} of {slots}"
            )));
        }
        let mut v = Vec::new();
        for _ in 0..count {
            v.push(st.free_prefix()?);
        }
        st.attached_mut(interface)?.prefixes.extend(&v);
        Ok(v)
    }

    async fn unassign_prefixes(&self, interface: &str, prefixes: &[Ipv4Network]) -> Result<()> {
        self.call("unassign_prefixes").await?;
        let mut st = self.lock();
        let i = st.attached_mut(interface)?;
        if let Some(p) = prefixes.iter().find(|p| !i.prefixes.contains(p)) {
            return Err(CloudError::NotFound(format!(
                "InvalidParameterValue: {p} is not assigned to {interface}"
            )));
        }
        i.prefixes.retain(|p| !prefixes.contains(p));
        for p in prefixes {
            for ip in p.iter() {
                st.used.remove(&ip);
            }
        }
        Ok(())
    }

    fn calls(&self) -> u64 {
        self.lock().total_calls
    }
}
