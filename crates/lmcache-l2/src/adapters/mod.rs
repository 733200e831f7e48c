//! The adapters, one file each.

pub mod fault_inject;
pub mod fs;
pub mod mock;
pub mod raw_block;
pub mod redis;
pub mod s3;

use crate::error::L2Error;

/// Runs blocking I/O on tokio's blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, L2Error> {
    tokio::task::spawn_blocking(f).await.map_err(|e| L2Error::Transient(format!("i/o task: {e}")))
}
