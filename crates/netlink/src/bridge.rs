//! Bridges: creation, port flags and per-port VLANs.

use futures::TryStreamExt;
use rtnetlink::LinkMessageBuilder;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::link::{LinkAttribute, LinkInfo, LinkMessage};

use crate::{Error, Link, Netlink, Result};

impl Netlink {
    /// Create a bridge (down; see [`Netlink::ensure_bridge`]).
    pub async fn create_bridge(&self, name: &str, mtu: Option<u32>) -> Result<Link> {
        self.create_bridge_with(name, mtu, false).await
    }

    /// Create a bridge (down), with VLAN filtering on when asked: the kernel
    /// only honours per-port VLANs on a filtering bridge.
    pub async fn create_bridge_with(
        &self,
        name: &str,
        mtu: Option<u32>,
        vlan_filtering: bool,
    ) -> Result<Link> {
        let mut builder = LinkMessageBuilder::<rtnetlink::LinkBridge>::new(name);
        if let Some(mtu) = mtu {
            builder = builder.mtu(mtu);
        }
        if vlan_filtering {
            builder = builder.vlan_filtering(true);
        }
        self.add_link(&format!("create bridge {name}"), builder.build())
            .await?;
        self.link_by_name(name).await
    }

    /// Make sure a bridge of that name exists and is up. An existing bridge
    /// is reused as is (its MTU is not changed: other ports depend on it);
    /// an existing link of another kind is an error.
    pub async fn ensure_bridge(&self, name: &str, mtu: Option<u32>) -> Result<Link> {
        self.ensure_bridge_with(name, mtu, false, |_| {}).await
    }

    /// [`Netlink::ensure_bridge`], creating the bridge with VLAN filtering
    /// when asked (an existing bridge keeps its setting, as the reference).
    /// `before_up` runs on a bridge that is not up yet (made here, or found
    /// down), before it is set up: what must hold before its first carrier
    /// (its IPv6 sysctls: the link-local address is made then).
    pub async fn ensure_bridge_with(
        &self,
        name: &str,
        mtu: Option<u32>,
        vlan_filtering: bool,
        before_up: impl FnOnce(&Link),
    ) -> Result<Link> {
        let op = || format!("ensure bridge {name}");
        let link = match self.find_link(name).await? {
            Some(l) => l,
            None => match self.create_bridge_with(name, mtu, vlan_filtering).await {
                Ok(l) => l,
                // Someone else created it in between.
                Err(e) if e.is_exists() => self.link_by_name(name).await?,
                Err(e) => return Err(e),
            },
        };
        if link.kind.as_deref() != Some("bridge") {
            return Err(Error::other(
                op(),
                format!(
                    "link {name} exists but is a {}, not a bridge",
                    link.kind.as_deref().unwrap_or("device without kind")
                ),
            ));
        }
        if !link.admin_up {
            before_up(&link);
            self.set_up(link.index).await?;
        }
        self.link_by_index(link.index).await
    }

    /// Whether link `index` is an isolated bridge port (`IFLA_BRPORT_ISOLATED`
    /// in its port data); false for a link that is no bridge port.
    pub async fn bridge_port_isolated(&self, index: u32) -> Result<bool> {
        use rtnetlink::packet_route::link::{InfoBridgePort, InfoPortData};
        let m = self.link_message(index).await?;
        Ok(m.attributes.iter().any(|a| match a {
            LinkAttribute::LinkInfo(infos) => infos.iter().any(|i| match i {
                LinkInfo::PortData(InfoPortData::BridgePort(p)) => {
                    p.contains(&InfoBridgePort::Isolated(true))
                }
                _ => false,
            }),
            _ => false,
        }))
    }

    /// Bridge port flags of an enslaved link (IFLA_BRPORT_*); `None` leaves
    /// a flag as it is.
    pub async fn set_bridge_port(
        &self,
        index: u32,
        hairpin: Option<bool>,
        isolated: Option<bool>,
    ) -> Result<()> {
        let mut b = rtnetlink::LinkBridgePort::new(index);
        if let Some(h) = hairpin {
            b = b.hairpin(h);
        }
        if let Some(i) = isolated {
            b = b.isolated(i);
        }
        self.handle
            .link()
            .set_port(b.build())
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("set bridge port flags of link {index}"), e))
    }

    /// Add VLAN `vid` to bridge port `index`; `pvid_untagged` makes it the
    /// port's access VLAN (ingress untagged, egress untagged).
    pub async fn bridge_vlan_add(&self, index: u32, vid: u16, pvid_untagged: bool) -> Result<()> {
        use rtnetlink::packet_route::link::BridgeVlanInfoFlags as F;
        let flags = if pvid_untagged {
            F::Pvid | F::Untagged
        } else {
            F::empty()
        };
        let msg = rtnetlink::LinkBridgeVlan::new(index)
            .vlan(vid, flags)
            .build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("add vlan {vid} to bridge port {index}"), e))
    }

    pub async fn bridge_vlan_del(&self, index: u32, vid: u16) -> Result<()> {
        use rtnetlink::packet_route::link::BridgeVlanInfoFlags as F;
        let msg = rtnetlink::LinkBridgeVlan::new(index)
            .vlan(vid, F::empty())
            .build();
        self.handle
            .link()
            .del_with_message(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("delete vlan {vid} from bridge port {index}"), e))
    }

    /// VLANs of bridge port `index`: (vid, is the untagged PVID).
    pub async fn bridge_vlans(&self, index: u32) -> Result<Vec<(u16, bool)>> {
        use rtnetlink::packet_route::link::{
            AfSpecBridge, BridgeVlanInfoFlags as F, LinkExtentMask,
        };
        let msgs: Vec<LinkMessage> = self
            .handle
            .link()
            .get()
            .set_filter_mask(AddressFamily::Bridge, vec![LinkExtentMask::Brvlan])
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink(format!("list vlans of bridge port {index}"), e))?;
        let mut out = Vec::new();
        for m in msgs.iter().filter(|m| m.header.index == index) {
            for a in &m.attributes {
                if let LinkAttribute::AfSpecBridge(specs) = a {
                    for s in specs {
                        if let AfSpecBridge::VlanInfo(v) = s {
                            out.push((
                                v.vid,
                                v.flags.contains(F::Pvid) && v.flags.contains(F::Untagged),
                            ));
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}
