//! The crate's one error type. Every message names what was wrong in words a
//! user can act on; the C boundary maps each kind to an `fnx_status`.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is not a well-formed GGUF container.
    #[error("invalid GGUF: {0}")]
    Format(String),
    /// The container is fine but does not describe a usable qwen4exp model.
    #[error("invalid model: {0}")]
    Model(String),
    /// A caller passed a bad argument.
    #[error("{0}")]
    InvalidArgument(String),
    /// A token id outside the vocabulary.
    #[error("{0}")]
    TokenOutOfRange(String),
    /// The state has no room for another token.
    #[error("{0}")]
    ContextFull(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// Conversion from a Hugging Face checkpoint failed.
    #[error("conversion: {0}")]
    Convert(String),
    /// The requested compute backend cannot be used.
    #[error("backend unavailable: {0}")]
    Backend(String),
    /// Memory for weights or state could not be obtained.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A device failed part way through work on a state: the state is
    /// unusable until it is reset or a snapshot is loaded into it.
    #[error("the state is lost: {0}")]
    StateLost(String),
    /// A bug inside flashnext (a caught panic); the call was undone.
    #[error("internal error: {0}")]
    Internal(String),
    /// The caller's abort callback asked to stop; nothing was changed.
    #[error("aborted by the abort callback; the state is unchanged")]
    Aborted,
    /// A state snapshot was refused (the state is unchanged).
    #[error(transparent)]
    Snapshot(#[from] crate::model::SnapshotError),
}

impl Error {
    pub fn format(msg: impl Into<String>) -> Self {
        Error::Format(msg.into())
    }
    pub fn model(msg: impl Into<String>) -> Self {
        Error::Model(msg.into())
    }
    pub fn arg(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
    pub fn convert(msg: impl Into<String>) -> Self {
        Error::Convert(msg.into())
    }
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// A zeroed buffer of `n` floats, or an error instead of an allocation abort
/// (sizes come from the model file, which may be hostile; `None` = overflowed).
pub fn zeros(n: Option<usize>, what: &str) -> Result<Vec<f32>> {
    let n = n.ok_or_else(|| Error::OutOfMemory(format!("{what}: size overflows")))?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory(format!("{what}: cannot allocate {n} floats")))?;
    v.resize(n, 0.0);
    Ok(v)
}

/// A copy of `v`, or an out-of-memory error instead of an allocation abort.
pub fn copy_of(v: &[f32], what: &str) -> Result<Vec<f32>> {
    let mut c = Vec::new();
    c.try_reserve_exact(v.len()).map_err(|_| Error::OutOfMemory(format!("{what}: cannot allocate {} floats", v.len())))?;
    c.extend_from_slice(v);
    Ok(c)
}

/// The message of a caught panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
