//! Route changes as the kernel announces them (the `RTNLGRP_IPV4_ROUTE`
//! and `RTNLGRP_IPV6_ROUTE` multicast groups), for an agent that mirrors a
//! table another daemon writes: it learns of a change when it happens
//! instead of at its next poll.

use futures::StreamExt;
use futures::channel::mpsc::UnboundedReceiver;
use rtnetlink::constants::{RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage};
use rtnetlink::sys::{AsyncSocket, SocketAddr};

use crate::{Error, Result};

type Messages = UnboundedReceiver<(NetlinkMessage<RouteNetlinkMessage>, SocketAddr)>;

/// The route changes of one table in the calling thread's namespace.
pub struct RouteWatch {
    rx: Messages,
    table: u32,
}

fn table_of(m: &RouteMessage) -> u32 {
    m.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(m.header.table))
}

impl RouteWatch {
    /// Subscribes; must be called within a tokio runtime (the socket's
    /// task is spawned on it).
    pub fn open(table: u32) -> Result<RouteWatch> {
        let op = "subscribe to route changes";
        let (mut conn, _handle, rx) = rtnetlink::new_connection().map_err(|e| Error::io(op, e))?;
        conn.socket_mut()
            .socket_mut()
            .bind(&SocketAddr::new(0, RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE))
            .map_err(|e| Error::io(op, e))?;
        tokio::spawn(conn);
        Ok(RouteWatch { rx, table })
    }

    fn about_table(&self, m: &NetlinkMessage<RouteNetlinkMessage>) -> bool {
        match &m.payload {
            NetlinkPayload::InnerMessage(
                RouteNetlinkMessage::NewRoute(r) | RouteNetlinkMessage::DelRoute(r),
            ) => table_of(r) == self.table,
            _ => false,
        }
    }

    /// Waits for a change of the table. A socket that ended (or lost
    /// messages: the kernel's buffer overran) never returns: the caller's
    /// periodic resync covers it.
    pub async fn changed(&mut self) {
        while let Some((m, _)) = self.rx.next().await {
            if self.about_table(&m) {
                return;
            }
        }
        std::future::pending::<()>().await
    }

    /// Forgets the changes announced so far (a full read of the table
    /// follows).
    pub fn drain(&mut self) {
        while self.rx.try_recv().is_ok() {}
    }
}
