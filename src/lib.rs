//! flashnext: an embeddable engine for Qwen3.8-Flash-Next (`qwen4_exp`).
//!
//! # The parts and who may import whom
//!
//! Arrows point down only: a part imports the parts below it, never one
//! above, and never a sibling on its own level unless the table says so.
//!
//! | level | part | owns |
//! |---|---|---|
//! | faces | [`capi`] (the C ABI), the `flashnext` binary (`src/main.rs`, `src/cli`), [`bench`] | handles, argument checks, reports; they ask a [`Model`] and its [`State`]s, never a backend |
//! | serving | [`generate`], [`sampling`], [`chat`], [`perplexity`] | the generation loop, samplers, chat templates, scoring a text |
//! | text | [`tokenizer`], [`constraint`] | the vocabulary of a model file, beside the model (built from its metadata), not inside it; grammars over that vocabulary (structured output), whose token trie the tokenizer keeps once built |
//! | opening | [`load`] | [`LoadOptions`], the one place a backend is chosen and built |
//! | backends | [`cpu`], [`vulkan`] | the blocks of the network on the host's cores / on a GPU; `vulkan` may use `cpu`'s formulas (host-side tables, the twins that check its shaders), never the reverse |
//! | network | [`model`] | [`model::Config`], [`model::Weights`], the one layer walk ([`model::forward`]), the block interface ([`model::backend`]), [`State`] (position, token history, logits, one backend state), snapshots, routing profiles and the expert cache's placement policy (no device in it) |
//! | formats | [`quant`], [`tensor`], [`gguf`] | block formats and their kernels, weight views into the mapped file, the container |
//! | tools | [`convert`], [`synth`] | Hugging Face → GGUF, synthetic models; they sit beside the faces and use the formats below |
//!
//! `model` never imports `ash` or a backend; `vulkan` never reaches into
//! [`State`]; `quant` never imports `convert`. [`error`] is shared by all:
//! one enum whose variants carry what went wrong in words, mapped to C
//! status codes only in `capi`.

pub mod capi;
/// cbindgen:ignore
pub mod chat;
/// cbindgen:ignore
pub mod constraint;
/// cbindgen:ignore
pub mod convert;
/// cbindgen:ignore
pub mod cpu;
/// cbindgen:ignore
pub mod error;
/// cbindgen:ignore
pub mod generate;
/// cbindgen:ignore
pub mod gguf;
/// cbindgen:ignore
pub mod load;
/// cbindgen:ignore
pub mod model;
/// cbindgen:ignore
pub mod perplexity;
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
pub use load::{Backend, LoadOptions, ProgressFn};
pub use model::{Model, State};
