//! The worker lanes both transports hand requests to: a shared pool for lookups and
//! management (every thread takes from one queue), and one queue per transfer thread, a
//! client always on the same one (by its identity), so one client's transfers run in order
//! and a slow client cannot hold up another's.

use std::hash::{BuildHasher, Hasher};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::TransportError;

/// The two pools' queues of jobs `J`.
pub(super) struct Lanes<J> {
    normal: Sender<J>,
    transfer: Vec<Sender<J>>,
    hasher: std::collections::hash_map::RandomState,
}

impl<J: Send + 'static> Lanes<J> {
    /// Starts `normal` shared-pool threads (`{prefix}-worker-i`) and `transfer` transfer
    /// threads (`{prefix}-transfer-i`), at least one each. `worker` makes each thread's job
    /// handler (it may own per-thread state, such as a socket).
    pub(super) fn start<W>(
        prefix: &str,
        normal: usize,
        transfer: usize,
        mut worker: impl FnMut() -> Result<W, TransportError>,
    ) -> Result<(Self, Vec<JoinHandle<()>>), TransportError>
    where
        W: FnMut(J) + Send + 'static,
    {
        let mut threads = Vec::new();
        let (normal_tx, normal_rx) = mpsc::channel::<J>();
        let normal_rx = Arc::new(Mutex::new(normal_rx));
        for i in 0..normal.max(1) {
            let rx = Arc::clone(&normal_rx);
            let next = move || rx.lock().ok().and_then(|r| r.recv().ok());
            threads.push(spawn(format!("{prefix}-worker-{i}"), next, worker()?)?);
        }
        let mut transfer_tx = Vec::new();
        for i in 0..transfer.max(1) {
            let (tx, rx) = mpsc::channel::<J>();
            transfer_tx.push(tx);
            threads.push(spawn(
                format!("{prefix}-transfer-{i}"),
                move || rx.recv().ok(),
                worker()?,
            )?);
        }
        let hasher = std::collections::hash_map::RandomState::new();
        Ok((Self { normal: normal_tx, transfer: transfer_tx, hasher }, threads))
    }

    /// The shared pool's queue.
    pub(super) fn normal(&self) -> &Sender<J> {
        &self.normal
    }

    /// The transfer queue of the client with this identity.
    pub(super) fn transfer_for(&self, identity: &[u8]) -> &Sender<J> {
        let mut h = self.hasher.build_hasher();
        h.write(identity);
        &self.transfer[(h.finish() % self.transfer.len() as u64) as usize]
    }
}

fn spawn<J: Send + 'static>(
    name: String,
    mut next: impl FnMut() -> Option<J> + Send + 'static,
    mut handle: impl FnMut(J) + Send + 'static,
) -> Result<JoinHandle<()>, TransportError> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            while let Some(job) = next() {
                handle(job);
            }
        })
        .map_err(|source| TransportError::Spawn { name, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn a_client_keeps_its_transfer_thread_and_the_shared_pool_serves_all() {
        let (done_tx, done_rx) = channel::<(String, u32)>();
        let (lanes, threads) = Lanes::<u32>::start("t", 3, 4, || {
            let done = done_tx.clone();
            Ok(move |j: u32| {
                let name = std::thread::current().name().unwrap_or("").to_owned();
                done.send((name, j)).unwrap();
            })
        })
        .unwrap();
        assert_eq!(threads.len(), 7);
        for j in 0..20 {
            lanes.transfer_for(b"client-a").send(j).unwrap();
        }
        let names: std::collections::HashSet<String> =
            (0..20).map(|_| done_rx.recv().unwrap().0).collect();
        assert_eq!(names.len(), 1, "one client, one transfer thread: {names:?}");
        assert!(names.iter().all(|n| n.starts_with("t-transfer-")));
        for j in 0..30 {
            lanes.normal().send(j).unwrap();
        }
        let got: Vec<(String, u32)> = (0..30).map(|_| done_rx.recv().unwrap()).collect();
        assert!(got.iter().all(|(n, _)| n.starts_with("t-worker-")));
        drop(lanes);
        for t in threads {
            t.join().unwrap();
        }
    }
}
