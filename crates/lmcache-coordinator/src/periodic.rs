//! [`Periodic`]: a task run every period on a thread of its own, until its handle stops it.
//!
//! The thread sleeps on a stop channel, not in a polling loop: it wakes only to run the task
//! or because the handle was stopped or dropped (the channel's sender goes with the handle),
//! and a stop is seen at once however long the period. The handle is RAII: dropping it stops
//! the thread and waits for it.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running periodic task.
#[derive(Debug)]
pub(crate) struct Periodic {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Periodic {
    /// Runs `task` every `period` (first after one period) on a thread named `name`.
    pub(crate) fn spawn(
        name: &str,
        period: Duration,
        mut task: impl FnMut() + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name(name.to_owned()).spawn(move || {
            let mut next = Instant::now() + period;
            loop {
                match rx.recv_timeout(next.saturating_duration_since(Instant::now())) {
                    Err(RecvTimeoutError::Timeout) => {
                        task();
                        next = Instant::now() + period;
                    }
                    // Stopped (a message, or the handle and its sender gone).
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        })?;
        Ok(Self { stop: Some(tx), thread: Some(thread) })
    }

    /// Stops the task (a run in progress finishes first) and waits for its thread.
    pub(crate) fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("a periodic task panicked");
        }
    }
}

impl Drop for Periodic {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn runs_every_period_and_stops_at_once() {
        let runs = Arc::new(AtomicU32::new(0));
        let r = Arc::clone(&runs);
        let mut p = Periodic::spawn("test-periodic", Duration::from_millis(20), move || {
            r.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        std::thread::sleep(Duration::from_millis(150));
        p.stop();
        let n = runs.load(Ordering::Relaxed);
        assert!((3..=8).contains(&n), "{n} runs in 150 ms at 20 ms");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(runs.load(Ordering::Relaxed), n, "ran after stop");
    }

    #[test]
    fn a_long_period_does_not_delay_the_stop() {
        let p = Periodic::spawn("test-periodic", Duration::from_secs(3600), || {}).unwrap();
        let t = Instant::now();
        drop(p);
        assert!(t.elapsed() < Duration::from_secs(1), "stop waited {:?}", t.elapsed());
    }
}
