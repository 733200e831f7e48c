//! The two system calls behind the hot upgrade's port handover ([`crate::handover`]) that no
//! safe API offers: binding a ZMQ socket on a listening socket we already hold
//! (`ZMQ_USE_FD`), and taking ownership of descriptors received with `SCM_RIGHTS`. This is
//! the crate's only unsafe code.

use std::net::TcpListener;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};

/// Binds `router` to `endpoint` on a duplicate of `listener` (ZMQ closes it with the socket)
/// instead of a socket of its own: the port stays the listener's, with whatever is queued on
/// it. The duplicate is closed here if the bind fails.
pub(crate) fn bind_zmq_on(
    router: &mut zmq::Socket,
    endpoint: &str,
    listener: &TcpListener,
) -> Result<(), zmq::Error> {
    let dup = listener.try_clone().map_err(|_| zmq::Error::EMFILE)?;
    let fd: RawFd = dup.into_raw_fd();
    let bound = set_use_fd(router, fd).and_then(|()| router.bind(endpoint));
    // The option applies to the next bind only; clear it whatever happened.
    let _ = set_use_fd(router, -1);
    if bound.is_err() {
        // SAFETY: `fd` came from `into_raw_fd` above and ZMQ did not take it (the bind
        // failed), so this is its only owner.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    bound
}

fn set_use_fd(router: &mut zmq::Socket, value: RawFd) -> Result<(), zmq::Error> {
    // SAFETY: `as_mut_ptr` is the live ZMQ socket `router` owns; the option value is a C int
    // read for `size_of::<RawFd>()` bytes from a local that outlives the call, as
    // zmq_setsockopt(3) documents for ZMQ_USE_FD.
    let rc = unsafe {
        zmq_sys::zmq_setsockopt(
            router.as_mut_ptr(),
            zmq_sys::ZMQ_USE_FD as std::os::raw::c_int,
            (&value as *const RawFd).cast(),
            std::mem::size_of::<RawFd>(),
        )
    };
    if rc == 0 { Ok(()) } else { Err(zmq::Error::EINVAL) }
}

/// Owns descriptors the kernel just installed in this process from an `SCM_RIGHTS` message.
///
/// Only for the `Vec` of a `ControlMessageOwned::ScmRights` of a message received by this
/// process (nothing else knows these numbers yet).
pub(crate) fn own_received(fds: Vec<RawFd>) -> Vec<OwnedFd> {
    fds.into_iter()
        .filter(|&fd| fd >= 0)
        // SAFETY: each number is a descriptor `recvmsg` created for us from SCM_RIGHTS; no
        // other owner exists, so wrapping it once gives it exactly one owner that closes it.
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zmq_socket_bound_on_a_listener_serves_its_port_and_closes_only_its_copy() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let ctx = zmq::Context::new();
        let mut router = ctx.socket(zmq::ROUTER).unwrap();
        bind_zmq_on(&mut router, &format!("tcp://127.0.0.1:{port}"), &listener).unwrap();
        assert_eq!(router.get_last_endpoint().unwrap().unwrap(), format!("tcp://127.0.0.1:{port}"));
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        dealer.send("ping", 0).unwrap();
        router.set_rcvtimeo(5000).unwrap();
        let frames = router.recv_multipart(0).unwrap();
        assert_eq!(frames.last().unwrap(), b"ping");
        drop(router);
        drop(dealer);
        // Our own copy still listens: a connection is queued, not refused.
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    }

    #[test]
    fn a_failed_bind_leaves_the_listener_usable() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ctx = zmq::Context::new();
        let mut router = ctx.socket(zmq::ROUTER).unwrap();
        assert!(bind_zmq_on(&mut router, "nonsense://x", &listener).is_err());
        // The option was cleared: an ordinary bind makes its own socket.
        router.bind("tcp://127.0.0.1:0").unwrap();
        assert_ne!(
            router.get_last_endpoint().unwrap().unwrap(),
            format!("tcp://{}", listener.local_addr().unwrap())
        );
    }
}
