//! The firewalld backend, as the reference's: each address of the
//! attachment (`/32` or `/128`) becomes a source of the zone
//! `firewalldZone` (default `trusted`) through firewalld's D-Bus API, so
//! firewalld's own forward filtering lets the pod through. firewalld keeps
//! these in its runtime configuration only; a restart of firewalld drops
//! them, as it does the reference's.
//!
//! The system bus is the one `DBUS_SYSTEM_BUS_ADDRESS` names, else
//! `/run/dbus/system_bus_socket` (zbus's rule, libdbus's too).

use rcni_cni::CniError;
use rcni_cni::error::ErrorCode;
use std::future::Future;
use zbus::Connection;

const NAME: &str = "org.fedoraproject.FirewallD1";
const PATH: &str = "/org/fedoraproject/FirewallD1";
const ZONE_IFACE: &str = "org.fedoraproject.FirewallD1.zone";
const BUS_ENV: &str = "DBUS_SYSTEM_BUS_ADDRESS";
const BUS_SOCKETS: &[&str] = &[
    "/run/dbus/system_bus_socket",
    "/var/run/dbus/system_bus_socket",
];

/// A connection to the system bus where firewalld owns its name.
pub struct Firewalld {
    rt: tokio::runtime::Runtime,
    /// Always `Some` until dropped (inside the runtime, where zbus's
    /// teardown of its tasks expects to be).
    conn: Option<Connection>,
}

impl Drop for Firewalld {
    fn drop(&mut self) {
        let _in_rt = self.rt.enter();
        self.conn.take();
    }
}

fn failed(what: impl std::fmt::Display) -> CniError {
    CniError::new(ErrorCode::Netfilter, format!("firewalld: {what}"))
}

/// Whether a system bus can exist at all, without connecting: most nodes
/// without firewalld have no bus socket, and then no command pays for a
/// connection.
fn bus_may_exist() -> bool {
    std::env::var_os(BUS_ENV).is_some_and(|v| !v.is_empty())
        || BUS_SOCKETS.iter().any(|p| std::path::Path::new(p).exists())
}

/// The name of a firewalld error (`ZONE_ALREADY_SET`, ...): firewalld puts
/// it first in the message of its `org.fedoraproject.FirewallD1.Exception`.
fn firewalld_code(e: &zbus::Error) -> Option<&str> {
    match e {
        zbus::Error::MethodError(_, Some(msg), _) => msg.split(':').next().map(str::trim),
        _ => None,
    }
}

impl Firewalld {
    fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    fn conn(&self) -> &Connection {
        self.conn.as_ref().expect("connected until dropped")
    }

    /// Connects to the system bus; `Ok(None)` when firewalld does not own
    /// its name there (not running), as the reference's
    /// `isFirewalldRunning` decides. A bus that cannot be reached counts as
    /// firewalld not running.
    pub fn running() -> Result<Option<Firewalld>, CniError> {
        if !bus_may_exist() {
            return Ok(None);
        }
        let rt = rcni_netlink::runtime().map_err(|e| CniError::internal(e.to_string()))?;
        let Ok(conn) = rt.block_on(Connection::system()) else {
            return Ok(None);
        };
        let fw = Firewalld {
            rt,
            conn: Some(conn),
        };
        Ok(fw.owned().unwrap_or(false).then_some(fw))
    }

    /// Like [`Firewalld::running`], but firewalld missing is an error: the
    /// config names the backend.
    pub fn required() -> Result<Firewalld, CniError> {
        Firewalld::running()?.ok_or_else(|| {
            failed(format!(
                "not running ({NAME} has no owner on the system bus)"
            ))
        })
    }

    fn owned(&self) -> zbus::Result<bool> {
        self.block_on(async {
            let dbus = zbus::fdo::DBusProxy::new(self.conn()).await?;
            Ok(dbus.name_has_owner(NAME.try_into()?).await?)
        })
    }

    fn call_zone<R>(&self, method: &str, zone: &str, source: &str) -> zbus::Result<R>
    where
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d>,
    {
        self.block_on(async {
            let reply = self
                .conn()
                .call_method(Some(NAME), PATH, Some(ZONE_IFACE), method, &(zone, source))
                .await?;
            reply.body().deserialize::<R>()
        })
    }

    /// Binds `source` to `zone`; already bound there is success.
    pub fn add_source(&self, zone: &str, source: &str) -> Result<(), CniError> {
        match self.call_zone::<String>("addSource", zone, source) {
            Ok(_) => Ok(()),
            Err(e) => match firewalld_code(&e) {
                Some("ZONE_ALREADY_SET") => Ok(()),
                Some("INVALID_ZONE") => Err(CniError::config(format!(
                    "firewalldZone {zone:?}: firewalld has no such zone"
                ))),
                _ => Err(failed(format!(
                    "failed to add the address {source} to {zone} zone: {e}"
                ))),
            },
        }
    }

    /// Unbinds `source` from `zone`. A source not in the zone (not in any,
    /// in another one) or a zone that does not exist is success: there is
    /// nothing of this attachment to remove.
    pub fn remove_source(&self, zone: &str, source: &str) -> Result<(), CniError> {
        match self.call_zone::<String>("removeSource", zone, source) {
            Ok(_) => Ok(()),
            Err(e) => match firewalld_code(&e) {
                Some("UNKNOWN_SOURCE" | "ZONE_CONFLICT" | "INVALID_ZONE") => Ok(()),
                _ => Err(failed(format!(
                    "failed to remove the address {source} from {zone} zone: {e}"
                ))),
            },
        }
    }

    /// Whether `source` is bound to `zone`.
    pub fn has_source(&self, zone: &str, source: &str) -> Result<bool, CniError> {
        match self.call_zone::<bool>("querySource", zone, source) {
            Ok(b) => Ok(b),
            Err(e) if firewalld_code(&e) == Some("INVALID_ZONE") => Ok(false),
            Err(e) => Err(failed(format!(
                "failed to query the address {source} in {zone} zone: {e}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_names() {
        let msg = zbus::message::Message::method_call("/", "m")
            .unwrap()
            .build(&())
            .unwrap();
        let e = zbus::Error::MethodError(
            "org.fedoraproject.FirewallD1.Exception".try_into().unwrap(),
            Some("ZONE_ALREADY_SET: '10.88.0.5/32' already bound to 'trusted'".into()),
            msg,
        );
        assert_eq!(firewalld_code(&e), Some("ZONE_ALREADY_SET"));
        assert_eq!(firewalld_code(&zbus::Error::InvalidReply), None);
    }
}
