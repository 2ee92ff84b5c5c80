//! flashnext: an embeddable engine for Qwen3.8-Flash-Next (`qwen4_exp`).

pub mod capi;
/// cbindgen:ignore
pub mod chat;
/// cbindgen:ignore
pub mod convert;
/// cbindgen:ignore
pub mod error;
/// cbindgen:ignore
pub mod generate;
/// cbindgen:ignore
pub mod gguf;
/// cbindgen:ignore
pub mod model;
/// cbindgen:ignore
pub mod quant;
/// cbindgen:ignore
pub mod sampling;
/// cbindgen:ignore
pub mod tensor;
/// cbindgen:ignore
pub mod tokenizer;
/// cbindgen:ignore
pub mod synth;
/// cbindgen:ignore
pub mod bench;
/// cbindgen:ignore
pub mod vulkan;

pub use error::{Error, Result};
