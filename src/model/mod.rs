//! The qwen4exp model: configuration, weights, per-sequence decode state and
//! the exact CPU forward pass (transformers 5.23.0 `Qwen4ExpForCausalLM`).
//!
//! One token flows through: embedding, repeated into `C` hyper-connection
//! streams; per layer an optional PLE injection, then two gated residual
//! blocks (token mixer: Gated DeltaNet or QSA attention; then the MoE), each
//! reading a mix of the streams and writing back with per-stream weights;
//! finally the output mixer and the LM head. See each submodule for its math.

pub mod config;
mod forward;
mod gdn;
mod hyper;
mod moe;
pub mod ops;
mod ple;
mod qsa;
pub mod state;
pub mod weights;

pub use config::{Config, GateActivation, LayerKind};
pub use state::State;
pub use weights::Weights;

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Metadata};
use std::path::Path;
use std::sync::Arc;

/// Options for [`Model::load`].
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Largest number of positions a state may hold; 0 = the model's `context_length`.
    pub n_ctx: usize,
    /// Worker threads for this model's matrix products; 0 = rayon's global pool (all cores).
    pub n_threads: usize,
}

/// A loaded model: immutable, shareable across threads (`Arc<Model>`).
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    pub metadata: Metadata,
    /// Positions a state may hold (after `LoadOptions::n_ctx`).
    pub n_ctx: usize,
    pool: Option<rayon::ThreadPool>,
}

impl Model {
    /// Maps and validates a GGUF file.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Arc<Model>> {
        let file = GgufFile::open(path)?;
        Self::from_gguf(file, opts)
    }

    /// Parses a model image held in memory (e.g. one embedded in the program).
    pub fn from_bytes(bytes: crate::gguf::Storage, opts: &LoadOptions) -> Result<Arc<Model>> {
        Self::from_gguf(GgufFile::from_storage(bytes)?, opts)
    }

    pub fn from_gguf(file: GgufFile, opts: &LoadOptions) -> Result<Arc<Model>> {
        let mut config = Config::from_metadata(&file.metadata)?;
        let weights = Weights::load(&file, &mut config)?;
        let n_ctx = if opts.n_ctx == 0 { config.context_length } else { opts.n_ctx.min(config.context_length) };
        let pool = if opts.n_threads > 0 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(opts.n_threads)
                    .build()
                    .map_err(|e| Error::arg(format!("cannot start {} threads: {e}", opts.n_threads)))?,
            )
        } else {
            None
        };
        Ok(Arc::new(Model {
            config,
            weights,
            metadata: file.metadata,
            n_ctx,
            pool,
        }))
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab
    }

    /// Runs `f` on this model's thread pool (or the global one).
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}
