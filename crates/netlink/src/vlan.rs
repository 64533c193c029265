//! 802.1Q VLAN links.

use std::os::fd::{AsFd, AsRawFd};

use futures::TryStreamExt;
use rcni_netns::NetNs;
use rtnetlink::LinkVlan;
use rtnetlink::packet_route::link::{InfoData, InfoVlan, LinkAttribute, LinkInfo};

use crate::{Error, Netlink, Result, describe_ns};

impl Netlink {
    /// Creates VLAN `vlan_id` on `master` (a link of this namespace), down,
    /// named `name`. With `ns` the link is born in that namespace (the name
    /// must then be free there; callers use a temporary one, as older kernels
    /// also checked it here).
    pub async fn create_vlan(
        &self,
        name: &str,
        master: u32,
        vlan_id: u16,
        mtu: Option<u32>,
        ns: Option<&NetNs>,
    ) -> Result<()> {
        let mut b = LinkVlan::new(name, master, vlan_id);
        if let Some(mtu) = mtu {
            b = b.mtu(mtu);
        }
        let op = match ns {
            Some(ns) => {
                b = b.setns_by_fd(ns.as_fd().as_raw_fd());
                format!(
                    "create vlan {name} (id {vlan_id}) on link {master} in {}",
                    describe_ns(ns)
                )
            }
            None => format!("create vlan {name} (id {vlan_id}) on link {master}"),
        };
        self.add_link(&op, b.build()).await
    }

    /// The VLAN ID of link `index`; `None` if it is not a VLAN link.
    pub async fn vlan_id(&self, index: u32) -> Result<Option<u16>> {
        let op = || format!("get link {index}");
        let mut stream = self.handle.link().get().match_index(index).execute();
        let msg = match stream.try_next().await {
            Ok(Some(m)) => m,
            Ok(None) => return Err(Error::not_found(op())),
            Err(e) => return Err(Error::netlink(op(), e)),
        };
        let id = msg.attributes.iter().find_map(|a| match a {
            LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
                LinkInfo::Data(InfoData::Vlan(v)) => v.iter().find_map(|x| match x {
                    InfoVlan::Id(id) => Some(*id),
                    _ => None,
                }),
                _ => None,
            }),
            _ => None,
        });
        Ok(id)
    }
}
