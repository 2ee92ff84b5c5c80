//! GGUF container: a bounds-checked parser over a byte slice, a memory-mapped
//! file whose tensors are zero-copy views, and a streaming writer.
//!
//! The parser trusts nothing in the file. Every length, count and offset is
//! checked against the bytes actually present before anything is allocated
//! or sliced, so a truncated or hostile file is refused with a message that
//! names the problem (see `tests/hostile_gguf.rs` and `fuzz/`).

mod reader;
mod types;
mod writer;

pub use reader::parse;
pub use reader::{GgufFile, Metadata, Storage, TensorInfo, Value};
pub use types::GgmlType;
pub use writer::{GgufWriter, TensorSource};

/// `"GGUF"` as it appears in the first four bytes.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// The only version read and written.
pub(crate) const VERSION: u32 = 3;
/// Data alignment when `general.alignment` is absent.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// Longest tensor name llama.cpp accepts (64 bytes including the NUL).
pub(crate) const MAX_NAME_LEN: usize = 63;
