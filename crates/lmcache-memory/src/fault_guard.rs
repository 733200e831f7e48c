//! Surviving a client that truncates a segment we mapped.
//!
//! A [`ForeignSegment`](crate::ForeignSegment) maps another process's shared memory. If that
//! process shrinks the segment (`ftruncate`) after we mapped it, touching a page past the new
//! end raises SIGBUS, which by default kills the server. The segment's size is checked when it
//! is mapped, but a client can shrink it at any moment after.
//!
//! So every foreign mapping is registered here, and a SIGBUS handler (installed once, chained
//! to any handler that was there before) checks the faulting address: inside a registered
//! mapping, it maps a private zero page over the faulting page (`MAP_FIXED`), marks the
//! mapping faulted and returns, so the interrupted copy completes on that page; the copy
//! routine then sees the mark and fails the request. Any other SIGBUS is passed on (to the
//! previous handler, or the default action, which kills the process as before).
//!
//! The handler touches only atomics and makes two system calls (`mmap`, and `sigaction` when
//! passing a fault on), all async-signal-safe.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

use nix::libc;

/// How many foreign mappings can be guarded at once (one per distinct client segment).
const SLOTS: usize = 1024;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

static TABLE: [Slot; SLOTS] = [const {
    Slot { start: AtomicUsize::new(0), len: AtomicUsize::new(0), faulted: AtomicBool::new(false) }
}; SLOTS];
static INSTALL: Once = Once::new();
/// The handler that was installed before ours, to pass faults that are not ours on to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A registered mapping; unregistered on drop (before the mapping goes away).
#[derive(Debug)]
pub struct Guard {
    slot: Option<usize>,
}

impl Guard {
    /// True once a SIGBUS hit this mapping: some of its pages are now private zeros and
    /// nothing read or written through it can be trusted.
    pub fn faulted(&self) -> bool {
        self.slot.is_some_and(|i| TABLE[i].faulted.load(Ordering::Acquire))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            TABLE[i].faulted.store(false, Ordering::Release);
            TABLE[i].len.store(0, Ordering::Release);
            TABLE[i].start.store(0, Ordering::Release);
        }
    }
}

/// Registers `[start, start + len)` (a mapping of a foreign segment). Without a free slot or
/// a handler the guard is inactive, and a truncation would still kill the process: both are
/// logged.
pub fn guard(start: *const u8, len: usize) -> Guard {
    INSTALL.call_once(install);
    let start = start as usize;
    for (i, s) in TABLE.iter().enumerate() {
        if s.start.compare_exchange(0, start, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            s.faulted.store(false, Ordering::Release);
            s.len.store(len, Ordering::Release);
            return Guard { slot: Some(i) };
        }
    }
    tracing::warn!(limit = SLOTS, "too many client segments to guard against truncation");
    Guard { slot: None }
}

fn install() {
    // SAFETY: a zeroed `sigaction` is a valid "no handler, empty mask" value; we fill in our
    // handler and flags. `sigaction` is called with valid pointers to live locals. Until
    // PREVIOUS is set just after, a fault that is not ours takes the default action, which
    // is what it would have done anyway unless another handler was installed.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigbus as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut act.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, &act, &mut old) != 0 {
            tracing::error!(error = %std::io::Error::last_os_error(), "cannot install the SIGBUS handler; a client truncating its segment would kill the server");
            return;
        }
        let _ = PREVIOUS.set(old);
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers; `si_addr` is the
    // faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = 4096usize;
    for s in TABLE.iter() {
        let start = s.start.load(Ordering::Acquire);
        let len = s.len.load(Ordering::Acquire);
        if start != 0 && addr >= start && addr - start < len {
            let at = addr - addr % page;
            // SAFETY: `at` is a page inside a live mapping of ours (registered, and guards
            // unregister before unmapping); MAP_FIXED replaces just that page of it with a
            // private anonymous one, which the interrupted copy then completes on.
            let p = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                s.faulted.store(true, Ordering::Release);
                return;
            }
            break;
        }
    }
    // Not ours (or we could not patch it): pass it on.
    // SAFETY: PREVIOUS was fully written before this handler was installed; calling the
    // previous SA_SIGINFO handler or restoring the default action is what the kernel would
    // have done without us. After SIG_DFL, returning re-executes the faulting access, which
    // then takes the default action (terminate with a core dump).
    unsafe {
        let prev = PREVIOUS.get().copied().unwrap_or_else(|| std::mem::zeroed());
        let h = prev.sa_sigaction;
        if h == libc::SIG_DFL || h == libc::SIG_IGN {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
        } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}
