//! Names and comments that identify an attachment's rules. They must be
//! byte-for-byte those of the reference (`pkg/utils/utils.go`,
//! `pkg/ip/ipmasq_nftables_linux.go`): that is what lets either
//! implementation find and delete the other's rules.

use sha2::{Digest, Sha512};

/// iptables chain names are at most 28 characters in the reference.
const MAX_CHAIN_LENGTH: usize = 28;

/// knftables' `CommentLengthMax`: longer comments are cut, by the
/// reference as by us, so a cut comment still matches.
pub const NFT_COMMENT_MAX: usize = 128;

/// Lower-case hex of SHA-512, as Go's `fmt.Sprintf("%x", sha512.Sum512(..))`.
fn sha512_hex(s: &str) -> String {
    use std::fmt::Write;
    let digest = Sha512::digest(s.as_bytes());
    let mut out = String::with_capacity(128);
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// `MustFormatHashWithPrefix(length, prefix, toHash)`: the prefix followed
/// by the hash, cut to `length` characters.
pub fn hash_with_prefix(length: usize, prefix: &str, to_hash: &str) -> String {
    let mut s = format!("{prefix}{}", sha512_hex(to_hash));
    s.truncate(length);
    s
}

/// The per-container iptables chain, `CNI-` and 24 hex digits of
/// SHA-512(network + containerID) (`utils.FormatChainName`). The reference
/// keys it by network and container only, not by ifname.
pub fn chain_name(network: &str, container_id: &str) -> String {
    hash_with_prefix(
        MAX_CHAIN_LENGTH,
        "CNI-",
        &format!("{network}{container_id}"),
    )
}

/// `utils.MustFormatChainNameWithPrefix(network, containerID, prefix)`:
/// `CNI-<prefix>` and the hash of network + containerID, 28 characters in
/// all (portmap's `CNI-DN-...`).
pub fn chain_name_with_prefix(prefix: &str, network: &str, container_id: &str) -> String {
    hash_with_prefix(
        MAX_CHAIN_LENGTH,
        &format!("CNI-{prefix}"),
        &format!("{network}{container_id}"),
    )
}

/// Go's `%q` for the strings that can occur here. Network names and
/// container IDs are restricted to `[a-zA-Z0-9_.-]` by the skel, so only the
/// escapes of `"` and `\` matter; anything else is kept as is.
/// Also how `iptables-save` prints a comment, so rules we render compare
/// equal to what the kernel lists.
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// The iptables rule comment, `name: "<net>" id: "<cid>"`
/// (`utils.FormatComment`).
pub fn iptables_comment(network: &str, container_id: &str) -> String {
    format!("name: {} id: {}", go_quote(network), go_quote(container_id))
}

/// Reads back `(network, containerID)` from an iptables comment written by
/// [`iptables_comment`]; `None` for any other comment.
pub fn parse_iptables_comment(comment: &str) -> Option<(&str, &str)> {
    let rest = comment.strip_prefix("name: \"")?;
    let (network, rest) = rest.split_once("\" id: \"")?;
    let container_id = rest.strip_suffix('"')?;
    if network.contains('"') || container_id.contains('"') {
        return None;
    }
    Some((network, container_id))
}

/// 16 hex digits identifying a network in nftables comments
/// (`hashForNetwork`).
pub fn nft_network_hash(network: &str) -> String {
    hash_with_prefix(16, "", network)
}

/// `<network hash>-<hash of ifname:containerID>` (`hashForInstance`): unlike
/// the iptables chain, the nftables layout tells two interfaces of one
/// container apart.
pub fn nft_instance_hash(network: &str, ifname: &str, container_id: &str) -> String {
    format!(
        "{}-{}",
        nft_network_hash(network),
        hash_with_prefix(16, "", &format!("{ifname}:{container_id}"))
    )
}

/// The comment on each nftables masquerade rule (`commentForInstance`): the
/// instance hash, then a readable description, cut to 128 bytes.
pub fn nft_comment(network: &str, ifname: &str, container_id: &str) -> String {
    let mut c = format!(
        "{}, net: {}, if: {}, id: {}",
        nft_instance_hash(network, ifname, container_id),
        network.replace('"', ""),
        ifname.replace('"', ""),
        container_id.replace('"', "")
    );
    if c.len() > NFT_COMMENT_MAX {
        // Go cuts bytes; we stop at the last character boundary so the
        // string stays valid UTF-8. Both agree for ASCII names, the only
        // ones the skel lets through for network and container ID.
        let mut end = NFT_COMMENT_MAX;
        while !c.is_char_boundary(end) {
            end -= 1;
        }
        c.truncate(end);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_name_is_the_references() {
        // Made by /usr/lib/cni/bridge (v1.1.1) with ipMasq for network
        // "mynet", container "ctr1".
        assert_eq!(chain_name("mynet", "ctr1"), "CNI-5145007e2a8415ce07579739");
        assert_eq!(chain_name("a", "b").len(), 28);
        // Made by /usr/lib/cni/portmap (v1.1.1) for the same attachment.
        assert_eq!(
            chain_name_with_prefix("DN-", "mynet", "ctr1"),
            "CNI-DN-5145007e2a8415ce07579"
        );
    }

    #[test]
    fn comments() {
        let c = iptables_comment("mynet", "ctr1");
        assert_eq!(c, r#"name: "mynet" id: "ctr1""#);
        assert_eq!(parse_iptables_comment(&c), Some(("mynet", "ctr1")));
        assert_eq!(parse_iptables_comment("name: \"x\""), None);
        assert_eq!(parse_iptables_comment("something else"), None);

        let n = nft_comment("mynet", "eth0", "ctr1");
        let h = nft_instance_hash("mynet", "eth0", "ctr1");
        // hashForInstance computed independently (Python hashlib, same formula).
        assert_eq!(h, "d23676b4f2d9fe04-7883a6f9ce71eedb");
        assert!(h.starts_with(&nft_network_hash("mynet")));
        assert_eq!(n, format!("{h}, net: mynet, if: eth0, id: ctr1"));
        assert_ne!(h, nft_instance_hash("mynet", "eth1", "ctr1"));

        let long_id = "c".repeat(200);
        let n = nft_comment("mynet", "eth0", &long_id);
        assert_eq!(n.len(), NFT_COMMENT_MAX);
        assert!(n.starts_with(&nft_instance_hash("mynet", "eth0", &long_id)));
    }

    #[test]
    fn hashes_are_sha512() {
        // The FIPS 180-2 test vector.
        assert_eq!(
            sha512_hex("abc"),
            "ddaf35a193617abacc417349ae20413112e6fa4e89a97ea20a9eeee64b55d39a\
             2192992a274fc1a836ba3c23a3feebbd454d4423643ce80e2a9ac94fa54ca49f"
        );
    }
}
