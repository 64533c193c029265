//! Link-layer (`AF_PACKET`) addresses, for the plugins that send raw frames
//! (tuning's gratuitous ARP, the DHCP client).

use nix::sys::socket::{LinkAddr, SockaddrLike};

/// The `AF_PACKET` address of `dst` on interface `ifindex` for frames of
/// `ethertype` (host order, e.g. `0x0806` for ARP).
pub fn link_addr(ifindex: u32, ethertype: u16, dst: [u8; 6]) -> std::io::Result<LinkAddr> {
    let mut sll_addr = [0u8; 8];
    sll_addr[..6].copy_from_slice(&dst);
    let sll = libc::sockaddr_ll {
        sll_family: libc::AF_PACKET as u16,
        sll_protocol: ethertype.to_be(),
        sll_ifindex: ifindex as i32,
        sll_hatype: 0,
        sll_pkttype: 0,
        sll_halen: 6,
        sll_addr,
    };
    // SAFETY: `sll` is a fully initialised sockaddr_ll and the length given
    // is its size; from_raw copies it out. Neither nix nor socket2 builds an
    // AF_PACKET address any other way (nix's LinkAddr otherwise only comes
    // back from the kernel).
    unsafe {
        LinkAddr::from_raw(
            (&raw const sll).cast(),
            Some(size_of::<libc::sockaddr_ll>() as libc::socklen_t),
        )
    }
    .ok_or_else(|| std::io::Error::other("not a link-layer address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_addr_fields() {
        let a = link_addr(7, 0x0806, [0xff; 6]).unwrap();
        assert_eq!(a.ifindex(), 7);
        assert_eq!(a.protocol(), 0x0806u16.to_be());
        assert_eq!(a.halen(), 6);
        assert_eq!(a.addr(), Some([0xff; 6]));
    }
}
