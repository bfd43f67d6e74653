//! Error type of the `ops` crate.

/// Errors returned by the kernels of this crate.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// A candle tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// The inputs have inconsistent shapes, ranks, dtypes or index values.
    #[error("{0}")]
    Shape(String),
}

/// Result type of the `ops` crate.
pub type Result<T> = std::result::Result<T, OpsError>;
