//! netkit's own BPF hooks (Linux 6.7+): a program attached to a netkit
//! primary with attach type BPF_NETKIT_PEER runs when the pod's end (the
//! peer) transmits, before the packet is handed to the node; one with
//! BPF_NETKIT_PRIMARY when the node's end transmits towards the pod. aya
//! 0.14 names the link type but cannot create such links, so BPF_LINK_CREATE,
//! BPF_OBJ_PIN and BPF_PROG_QUERY are raw bpf(2) calls here.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `enum bpf_attach_type` (uapi/linux/bpf.h).
pub const BPF_NETKIT_PRIMARY: u32 = 54;
pub const BPF_NETKIT_PEER: u32 = 55;
/// bpf_mprog: in front of every program already on the hook.
const BPF_F_BEFORE: u32 = 1 << 3;

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_LINK_CREATE: libc::c_long = 28;

/// `link_create` of `union bpf_attr`, with its `netkit` member.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
    relative_fd: u32,
    _pad: u32,
    expected_revision: u64,
}

/// `query` of `union bpf_attr` (the fields up to `revision`).
#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_ifindex: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    count: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// `obj_pin` of `union bpf_attr`.
#[repr(C)]
struct ObjPinAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// bpf(2) with `attr`; the result or the errno.
///
/// # Safety
/// `attr` must be the struct `cmd` reads, with every pointer in it valid
/// for the call.
unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: the caller passes the struct `cmd` expects; the kernel reads
    // (and for a query writes) at most size_of::<T>() bytes of it.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Attaches `prog` (a SCHED_CLS program) to netkit primary `ifindex` with
/// `attach_type`, first on the hook with `first`, else last; returns the
/// link's fd. EINVAL where `ifindex` is no netkit device, EACCES where it
/// is a peer.
pub fn link_create(
    prog: BorrowedFd<'_>,
    ifindex: u32,
    attach_type: u32,
    first: bool,
) -> io::Result<OwnedFd> {
    let mut attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_ifindex: ifindex,
        attach_type,
        flags: if first { BPF_F_BEFORE } else { 0 },
        ..Default::default()
    };
    // SAFETY: `attr` is `link_create`'s layout and holds no pointer. A
    // non-negative result is a new link fd nothing else owns.
    unsafe {
        let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
        Ok(OwnedFd::from_raw_fd(fd as i32))
    }
}

/// Pins the BPF object `fd` at `path` (on a bpffs).
pub fn pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    let mut attr = ObjPinAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    // SAFETY: `attr` is `obj_pin`'s layout; its path points to `c`, a
    // NUL-terminated string alive until the end of the function.
    unsafe { bpf(BPF_OBJ_PIN, &mut attr) }.map(|_| ())
}

/// The ids of the programs on `ifindex`'s netkit hook `attach_type`; none
/// where the device is no netkit primary (ENXIO from a kernel with netkit,
/// netkit_dev_fetch's answer for a veth) or the kernel has no netkit
/// (EINVAL).
pub fn programs(ifindex: u32, attach_type: u32) -> io::Result<Vec<u32>> {
    // bpf_mprog holds at most 64 programs per hook.
    let mut ids = [0u32; 64];
    let mut attr = QueryAttr {
        target_ifindex: ifindex,
        attach_type,
        prog_ids: ids.as_mut_ptr() as u64,
        count: ids.len() as u32,
        ..Default::default()
    };
    // SAFETY: `attr` is `query`'s layout; the kernel writes at most
    // `count` ids to `ids`, alive until the end of the function.
    match unsafe { bpf(BPF_PROG_QUERY, &mut attr) } {
        Ok(_) => Ok(ids[..(attr.count as usize).min(ids.len())].to_vec()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL) | Some(libc::ENODEV) | Some(libc::EACCES) | Some(libc::ENXIO)
            ) =>
        {
            Ok(vec![])
        }
        Err(e) => Err(e),
    }
}
