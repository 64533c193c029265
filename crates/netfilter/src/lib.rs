//! Everything the plugins do with netfilter, in one place:
//!
//! * [`nfnl`]: the `NETLINK_NETFILTER` socket and the one way to write
//!   nftables, all-or-nothing transactions of [`nfnl::NftOp`]s
//!   ([`nfnl::Nfnl::nft_apply`]), and listings of tables, chains and rules;
//! * [`expr`]: rule expressions as nft encodes them, and [`expr::Term`] to
//!   compare listed rules;
//! * [`conntrack`]: listing and deleting conntrack entries;
//! * [`nflog`]: reading the packets `log group` rules send to NFLOG;
//! * [`iptables`]: `iptables-save` parsing and `iptables-restore` writing,
//!   for the reference's iptables layouts;
//! * [`exec`]: running the tools (iptables, nft) inside a namespace;
//! * [`names`]: the reference's chain names, hashes and comments, which
//!   let either implementation find the other's rules;
//! * [`ipmasq`]: `ipMasq` of bridge and ptp in both reference layouts
//!   (re-exported at the top: [`setup`], [`check`], [`teardown`], [`gc`]).
//!
//! Users: ipMasq (bridge, ptp), bridge's macspoofchk, portmap, firewall,
//! bandwidth (names), fastpath, policy and the node agent's masquerade.

pub mod conntrack;
mod error;
pub mod exec;
pub mod expr;
pub mod ipmasq;
pub mod iptables;
pub mod names;
pub mod nflog;
pub mod nfnl;
pub mod nftset;

pub use error::Error;
pub use ipmasq::nftables::TABLE as NFT_TABLE;
pub use ipmasq::{Backend, Masq, check, gc, setup, teardown};
pub use names::{
    chain_name, chain_name_with_prefix, go_quote, hash_with_prefix, iptables_comment, nft_comment,
    nft_instance_hash, nft_network_hash, parse_iptables_comment,
};
