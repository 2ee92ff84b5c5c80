//! flashnext: an embeddable engine for Qwen3.8-Flash-Next (`qwen4_exp`).

pub mod error;
pub mod convert;
pub mod gguf;

pub use error::{Error, Result};
