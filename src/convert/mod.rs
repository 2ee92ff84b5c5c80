//! Hugging Face checkpoint to GGUF conversion.
