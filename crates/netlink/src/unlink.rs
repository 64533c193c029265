//! Link deletion that returns when the link is gone from view, not when the
//! kernel has finished freeing it.

use crate::{Error, Netlink, Result, detach};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;
use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::link::LinkMessage;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

/// How long to wait for the kernel to unlist a link before waiting for the
/// child's answer instead (rtnl held by someone else for that long).
const UNLIST_WAIT: Duration = Duration::from_secs(5);

impl Netlink {
    /// Deletes link `index` (with its veth peer, wherever that is) and
    /// returns once the kernel has unlisted it: no dump shows it and its name
    /// and index are free, in every namespace. A link already gone is
    /// success.
    ///
    /// Why a child: RTM_DELLINK answers only after `netdev_run_todo`, which
    /// after unlisting the links and releasing rtnl waits in `rcu_barrier()`
    /// and for the last references, 15-30 ms per deletion on this kernel:
    /// most of a DEL. A forked child makes the request and waits for that;
    /// the plugin waits only until the link is unlisted, as a runtime that
    /// destroys a netns doesn't wait for its links to be freed either. The
    /// child reports the kernel's answer through a pipe, so a refused delete
    /// is still the caller's error. Without fork, a plain delete.
    pub async fn delete_link_unlisted(&self, index: u32) -> Result<()> {
        let op = || format!("delete link {index}");
        let Some((answer, pid)) = self.spawn_delete(index)? else {
            return self.delete_link(index).await;
        };
        let t0 = Instant::now();
        let mut wait = Duration::from_micros(100);
        loop {
            match read_answer(&answer, t0.elapsed() > UNLIST_WAIT) {
                Answer::Pending => {}
                Answer::Errno(errno) => {
                    // Our own child, which has answered and exits: reaped
                    // here, it leaves no zombie behind for the plugin's life.
                    let _ = waitpid(pid, None);
                    return match errno {
                        0 => Ok(()),
                        e => Err(Error::io(op(), std::io::Error::from_raw_os_error(e))),
                    };
                }
                // The child died without answering: do it here.
                Answer::Lost => return self.delete_link(index).await,
            }
            match self.link_by_index(index).await {
                Err(e) if e.is_not_found() => return Ok(()),
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(2));
        }
    }

    /// Forks the child that deletes `index`: its socket is created in this
    /// connection's namespace, and it writes the kernel's errno (0 for
    /// success) to the returned pipe.
    fn spawn_delete(&self, index: u32) -> Result<Option<(OwnedFd, Pid)>> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        let mut req = NetlinkMessage::from(RouteNetlinkMessage::DelLink(msg));
        req.header.flags = NLM_F_REQUEST | NLM_F_ACK;
        req.header.sequence_number = 1;
        req.finalize();
        let mut buf = vec![0u8; req.buffer_len()];
        req.serialize(&mut buf);
        let sock =
            detach::netlink_socket(self.netns(), libc::NETLINK_ROUTE, "open rtnetlink socket")?;
        let (r, w) = detach::pipe().map_err(|e| Error::io("make a pipe", e))?;
        let pid = detach::spawn_send_and_report(&sock, &buf, &w);
        Ok(pid.map(|pid| (r, pid)))
    }
}

enum Answer {
    Pending,
    Errno(i32),
    Lost,
}

/// The child's errno, if it has written it; `block` waits for it.
fn read_answer(r: &OwnedFd, block: bool) -> Answer {
    let mut pfd = [PollFd::new(r.as_fd(), PollFlags::POLLIN)];
    let timeout = if block {
        PollTimeout::NONE
    } else {
        PollTimeout::ZERO
    };
    if !matches!(poll(&mut pfd, timeout), Ok(n) if n > 0) {
        return Answer::Pending;
    }
    let mut b = [0u8; 4];
    match nix::unistd::read(r, &mut b) {
        Ok(4) => Answer::Errno(i32::from_ne_bytes(b)),
        _ => Answer::Lost,
    }
}
