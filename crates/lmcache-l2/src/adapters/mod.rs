//! The adapters, one file each.

mod aligned;
pub mod dax;
pub mod fault_inject;
pub mod fs;
pub mod mock;
pub mod native_plugin;
pub mod raw_block;
pub mod redis;
mod resp_direct;
pub mod s3;
pub mod slab;

use crate::error::L2Error;

/// Runs blocking I/O on tokio's blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, L2Error> {
    tokio::task::spawn_blocking(f).await.map_err(|e| L2Error::transient(format!("i/o task: {e}")))
}

/// Runs `f` on every item on the blocking pool, in order. If the blocking task itself fails,
/// every item gets that failure (as transient).
pub(crate) async fn blocking_each<I, T, F>(items: Vec<I>, f: F) -> Vec<Result<T, L2Error>>
where
    I: Send + 'static,
    T: Send + 'static,
    F: Fn(&I) -> Result<T, L2Error> + Send + 'static,
{
    let n = items.len();
    blocking(move || items.iter().map(&f).collect()).await.unwrap_or_else(|e| {
        let msg = e.to_string();
        (0..n).map(|_| Err(L2Error::transient(msg.clone()))).collect()
    })
}
