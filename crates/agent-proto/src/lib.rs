//! The two formats `rcni-node` shares with the policy plugin, defined once
//! for both sides: the agent socket's request and answer lines
//! ([`socket`]) and the remote pods' file `k8s-pods.json` ([`pods`]).
//!
//! Field order is the order on the wire (serde_json keeps insertion order
//! in this workspace), so what the agent writes stays byte for byte what
//! it wrote before these types existed; the tests pin it.

pub mod ipam;
pub mod pods;
pub mod socket;
