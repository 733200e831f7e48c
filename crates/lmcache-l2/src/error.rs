//! Errors of the L2 tier.

/// An L2 operation that did not succeed. Every variant ends in a miss for the reader: the tier
/// never serves bytes it could not verify.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum L2Error {
    /// A failure that may pass (timeouts, a dropped connection, a busy server): worth a retry.
    #[error("transient: {0}")]
    Transient(String),
    /// The adapter's backend cannot be reached or refuses service.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Stored bytes failed verification (torn, stale, foreign or misplaced blob).
    #[error("corrupt blob: {0}")]
    Corrupt(#[from] crate::blob::BlobError),
    /// The adapter has no room for the object.
    #[error("full: {0}")]
    Full(String),
    /// The adapter does not implement the operation.
    #[error("{0} is not supported by this adapter")]
    Unsupported(&'static str),
    /// A local I/O failure.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl L2Error {
    /// Whether retrying the same operation later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient(_) | Self::Unavailable(_))
            || matches!(self, Self::Io(e) if matches!(e.kind(),
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::TimedOut
                | std::io::ErrorKind::WouldBlock))
    }
}

/// A bad adapter configuration, naming the field at fault.
#[derive(Debug, thiserror::Error)]
#[error("L2 adapter #{index} ({kind}): {field}: {reason}")]
pub struct ConfigError {
    /// Position of the adapter in the configuration (0-based).
    pub index: usize,
    /// The adapter type, or `?` when the type itself is at fault.
    pub kind: String,
    /// The field, dotted for nested fields (`serde.type`).
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    /// An error about `field`, for an adapter whose index and type are filled in later.
    pub fn field(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { index: 0, kind: "?".into(), field: field.into(), reason: reason.into() }
    }
}
