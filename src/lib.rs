//! flashnext: an embeddable engine for Qwen3.8-Flash-Next (`qwen4_exp`).

pub mod error;
pub mod capi;
pub mod convert;
pub mod gguf;
pub mod model;
pub mod tensor;

pub use error::{Error, Result};
