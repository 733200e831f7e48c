//! The background maintenance thread: every `maintenance_interval` it runs
//! [`L1Cache::run_maintenance`] (quotas, watermark, lease expiry).
//!
//! Stops when its [`Maintenance`] handle is dropped: the drop signals the thread and joins it,
//! so no pass runs after the handle is gone.

use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;

use crate::set::L1Cache;

/// Owns the background thread; dropping it stops the thread.
#[derive(Debug)]
pub struct Maintenance {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Maintenance {
    /// Starts the thread.
    pub fn spawn(cache: L1Cache) -> std::io::Result<Self> {
        let (stop, rx) = mpsc::channel::<()>();
        let interval = cache.config().maintenance_interval;
        let thread =
            std::thread::Builder::new().name("l1-maintenance".into()).spawn(move || {
                // A message or a dropped sender ends the loop.
                while let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(interval) {
                    let r = cache.run_maintenance();
                    if r != Default::default() {
                        tracing::debug!(?r, "l1 maintenance pass");
                    }
                }
            })?;
        Ok(Self { stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for Maintenance {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("l1 maintenance thread panicked");
        }
    }
}
