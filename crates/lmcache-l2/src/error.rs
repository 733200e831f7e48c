//! Errors of the L2 tier.

/// An L2 operation that did not succeed. Every variant ends in a miss for the reader: the tier
/// never serves bytes it could not verify.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum L2Error {
    /// A failure that may pass (timeouts, a dropped connection, a busy server): worth a retry.
    #[error("transient: {reason}")]
    Transient {
        /// What failed.
        reason: String,
    },
    /// The adapter's backend cannot be reached or refuses service.
    #[error("unavailable: {reason}")]
    Unavailable {
        /// What failed.
        reason: String,
    },
    /// Stored bytes failed verification (torn, stale, foreign or misplaced blob).
    #[error("corrupt blob: {source}")]
    Corrupt {
        /// What the check expected and got.
        #[from]
        source: crate::blob::BlobError,
    },
    /// The adapter has no room for the object.
    #[error("full: {what}: {needed} bytes needed, {limit} allowed")]
    Full {
        /// Which limit (`capacity`, `slot_bytes`, `free slots`, ...).
        what: &'static str,
        /// What the write needs.
        needed: u64,
        /// What the limit allows.
        limit: u64,
    },
    /// The adapter's settings do not fit its device or file (geometry, alignment).
    #[error("invalid layout: {reason}")]
    Invalid {
        /// What does not fit.
        reason: String,
    },
    /// The adapter does not implement the operation.
    #[error("{operation} is not supported by this adapter")]
    Unsupported {
        /// The operation.
        operation: &'static str,
    },
    /// A local I/O failure.
    #[error("i/o: {source}")]
    Io {
        /// The OS error.
        #[from]
        source: std::io::Error,
    },
}

impl L2Error {
    /// A [`Self::Transient`] failure.
    pub fn transient(reason: impl Into<String>) -> Self {
        Self::Transient { reason: reason.into() }
    }

    /// A [`Self::Unavailable`] backend.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::Unavailable { reason: reason.into() }
    }

    /// An [`Self::Unsupported`] operation.
    pub fn unsupported(operation: &'static str) -> Self {
        Self::Unsupported { operation }
    }

    /// Whether retrying the same operation later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient { .. } | Self::Unavailable { .. })
            || matches!(self, Self::Io { source } if matches!(source.kind(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_what_failed_and_say_whether_to_retry() {
        let full = L2Error::Full { what: "slot_bytes", needed: 40 << 20, limit: 32 << 20 };
        assert_eq!(full.to_string(), "full: slot_bytes: 41943040 bytes needed, 33554432 allowed");
        assert!(!full.is_transient());
        assert!(L2Error::transient("timed out").is_transient());
        assert!(L2Error::unavailable("down").is_transient());
        assert!(!L2Error::unsupported("listing").is_transient());
        let io: L2Error = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        assert!(io.is_transient());
        let io: L2Error = std::io::Error::from(std::io::ErrorKind::PermissionDenied).into();
        assert!(!io.is_transient());
        let corrupt: L2Error = crate::blob::BlobError::Truncated { got: 10, need: 64 }.into();
        assert!(matches!(corrupt, L2Error::Corrupt { .. }) && !corrupt.is_transient());
        assert!(corrupt.to_string().starts_with("corrupt blob: "), "{corrupt}");
    }
}
