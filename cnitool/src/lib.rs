//! cnitool: run CNI network configurations against namespaces, as a
//! container runtime would (libcni's behaviour), for testers and admins.

pub mod cache;
pub mod cli;
pub mod conf;
pub mod runtime;
