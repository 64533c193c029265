//! The kernel sync: what the kernel should hold for the cluster
//! ([`desired`]), and one reconcile that makes it so ([`agent`]).

pub mod agent;
pub mod desired;
pub mod forward;
pub mod masq;
pub mod xnode;
