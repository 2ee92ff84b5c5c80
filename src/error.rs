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
