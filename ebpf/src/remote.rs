//! Cross-node forwarding, for the `rcni-node` agent: the other nodes' pod
//! subnets (`rcni_remote`) and `rcni_from_net` on the node's uplink and
//! VXLAN devices, each a tcx link pinned as `link-net-<ifname in hex>`
//! (bpffs refuses a '.' in a name, and VXLAN devices are `rcni.<VNI>`).

use crate::attach::{Hook, detach_pinned_link, tcx_programs};
use crate::load::{collect, not_found_ok};
use crate::types::{remote_key, remote_of};
use crate::{Datapath, Error, MAX_REMOTES, Program, RemoteHop, RemoteStats, Result};
use aya::maps::PerCpuValues;
use aya::programs::TcAttachType;
use ipnetwork::IpNetwork;
use std::path::Path;

const NET_LINK_PREFIX: &str = "link-net-";

fn net_link_pin(ifname: &str) -> String {
    let hex: String = ifname.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{NET_LINK_PREFIX}{hex}")
}

fn ifname_of_pin(name: &str) -> Option<String> {
    let hex = name.strip_prefix(NET_LINK_PREFIX)?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

impl Datapath {
    /// The other nodes' pod subnets and where their packets go.
    pub fn remote_routes(&self) -> Result<Vec<(IpNetwork, RemoteHop)>> {
        let all = collect(self.remote.iter(), "read rcni_remote")?;
        Ok(all
            .into_iter()
            .filter_map(|(k, v)| {
                let (ip, len) = remote_of(&k)?;
                Some((IpNetwork::new(ip, len).ok()?, v))
            })
            .collect())
    }

    /// Writes `net`'s entry. Its counter slot stays what it was; a new
    /// entry gets the lowest slot no other entry has, zeroed (a slot a
    /// removed peer had would carry its counts over).
    pub fn set_remote_route(&mut self, net: IpNetwork, hop: RemoteHop) -> Result<()> {
        let k = remote_key(net.network(), net.prefix())
            .ok_or_else(|| Error::msg(format!("bad prefix {net}")))?;
        let all = self.remote_routes()?;
        let slot = match all.iter().find(|(n, _)| *n == net) {
            Some((_, old)) => old.slot,
            None => {
                let used: std::collections::BTreeSet<u32> =
                    all.iter().map(|(_, h)| h.slot).collect();
                let slot = (0..MAX_REMOTES)
                    .find(|s| !used.contains(s))
                    .ok_or_else(|| Error::msg("rcni_remote is full"))?;
                let zero = PerCpuValues::try_from(vec![
                    RemoteStats::default();
                    aya::util::nr_cpus().map_err(|(_, e)| {
                        Error::io("count the CPUs", e)
                    })?
                ])
                .map_err(|e| Error::aya("zero a peer's counters", e))?;
                self.remote_stats
                    .set(slot, zero, 0)
                    .map_err(|e| Error::aya("zero a peer's counters", e))?;
                slot
            }
        };
        self.remote
            .insert(&k, RemoteHop { slot, ..hop }, 0)
            .map_err(|e| Error::aya(format!("write rcni_remote {net}"), e))
    }

    /// What this node's pods sent through the datapath to each peer
    /// subnet, summed over CPUs.
    pub fn remote_stats(&self) -> Result<Vec<(IpNetwork, RemoteHop, RemoteStats)>> {
        self.remote_routes()?
            .into_iter()
            .map(|(n, h)| {
                let per_cpu = self
                    .remote_stats
                    .get(&h.slot, 0)
                    .map_err(|e| Error::aya("read rcni_remote_stats", e))?;
                let mut sum = RemoteStats::default();
                for s in per_cpu.iter() {
                    sum.tx_packets += s.tx_packets;
                    sum.tx_bytes += s.tx_bytes;
                }
                Ok((n, h, sum))
            })
            .collect()
    }

    /// Gone already is fine.
    pub fn remove_remote_route(&mut self, net: IpNetwork) -> Result<()> {
        let Some(k) = remote_key(net.network(), net.prefix()) else {
            return Ok(());
        };
        not_found_ok(self.remote.remove(&k), "remove from rcni_remote")
    }

    /// Hooks `rcni_from_net` to `ifname`'s tcx ingress (a name in the
    /// calling thread's network namespace), last, its link pinned in the
    /// network's directory. Pinned datapaths only.
    pub fn attach_net(&mut self, ifname: &str) -> Result<()> {
        let dir = self
            .dir
            .clone()
            .ok_or_else(|| Error::msg("attach_net needs a pinned datapath"))?;
        let pin = dir.join(net_link_pin(ifname));
        self.attach_program(
            Program::FromNet,
            ifname,
            TcAttachType::Ingress,
            Some(pin),
            Hook::Tcx,
        )
    }

    /// Whether `rcni_from_net` sits on `ifname`'s tcx ingress with its link
    /// pinned.
    pub fn net_attached(&mut self, ifname: &str) -> Result<bool> {
        let Some(dir) = self.dir.clone() else {
            return Ok(false);
        };
        if !dir.join(net_link_pin(ifname)).exists() {
            return Ok(false);
        }
        let id = self.program_id_of(Program::FromNet)?;
        Ok(tcx_programs(ifname)?.contains(&id))
    }
}

/// The devices with an `rcni_from_net` link pinned in `dir`, sorted.
pub fn net_links(dir: &Path) -> Result<Vec<String>> {
    crate::attach::pinned_ids(dir, ifname_of_pin)
}

/// Detaches and unpins `rcni_from_net`'s link on `ifname`; gone already is
/// fine. True if there was one.
pub fn detach_net(dir: &Path, ifname: &str) -> Result<bool> {
    detach_pinned_link(&dir.join(net_link_pin(ifname)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_link_pins_name_the_device_without_dots() {
        for dev in ["eth0", "rcni.1", "rcni6.16777215", "a-b_c@d"] {
            let pin = net_link_pin(dev);
            assert!(!pin.contains('.'), "{pin}");
            assert_eq!(ifname_of_pin(&pin).as_deref(), Some(dev));
        }
        assert_eq!(net_link_pin("rcni.1"), "link-net-72636e692e31");
        for bad in ["link-net-7", "link-net-zz", "link-pol-in-00", "prog"] {
            assert_eq!(ifname_of_pin(bad), None, "{bad}");
        }
    }
}
