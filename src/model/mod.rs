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
pub(crate) mod ple;
mod qsa;
pub mod snapshot;
pub mod state;
pub mod weights;

pub use config::{Config, GateActivation, LayerKind};
pub use snapshot::SnapshotError;
pub use state::State;
pub use weights::Weights;

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, Metadata};
use crate::quant::kernels::{with_kernels, Kernels};
use std::path::Path;
use std::sync::Arc;

/// Load progress callback: receives a fraction in [0, 1] (0 at the start,
/// then after parsing, after each layer's tensors, and 1 at the end) and
/// returns `false` to cancel the load.
pub type ProgressFn = Arc<dyn Fn(f32) -> bool + Send + Sync>;

/// Message of the error a cancelled load returns (an `Error::InvalidArgument`).
pub const LOAD_CANCELLED: &str = "loading cancelled by the progress callback";

/// Where a model computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// The CPU for now. Choosing Vulkan here needs a device probe, which
    /// loads a driver into every process (lavapipe's own allocations then
    /// show as leaks under LeakSanitizer) and must pick a GPU that beats the
    /// CPU; until that policy exists, ask for `Vulkan` explicitly.
    #[default]
    Auto,
    Cpu,
    Vulkan,
}

/// Options for [`Model::load`].
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Compute backend; the environment's `FNX_BACKEND=auto|cpu|vulkan` wins.
    pub backend: Backend,
    /// Vulkan device index; `FNX_DEVICE=N` wins.
    pub device_index: usize,
    /// Device memory the Vulkan backend may use, in MiB (0 = no limit); `FNX_VRAM_BUDGET_MB=N` wins.
    pub vram_budget_mb: u64,
    /// Largest number of positions a state may hold; 0 = the model's `context_length`.
    pub n_ctx: usize,
    /// Worker threads for this model's matrix products; 0 = rayon's global pool (all cores).
    pub n_threads: usize,
    /// Called as the load advances; returning `false` cancels it (see [`ProgressFn`]).
    pub progress: Option<ProgressFn>,
    /// CPU kernels for the quantized weights (see `quant::kernels`): `None`
    /// takes the environment's `FNX_CPU_KERNELS=exact|fast`, else fast (8-bit
    /// activations, integer dot products) where the CPU has AVX2; an
    /// explicit choice wins.
    pub cpu_kernels: Option<crate::quant::kernels::Kernels>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("n_ctx", &self.n_ctx)
            .field("n_threads", &self.n_threads)
            .field("backend", &self.backend)
            .field("device_index", &self.device_index)
            .field("vram_budget_mb", &self.vram_budget_mb)
            .field("cpu_kernels", &self.cpu_kernels)
            .field("progress", &self.progress.as_ref().map(|_| "Fn(f32) -> bool"))
            .finish()
    }
}

impl LoadOptions {
    /// These options with the environment's overrides applied (they win, so
    /// any program can be switched without a rebuild).
    pub fn with_env_overrides(&self) -> Result<LoadOptions> {
        let mut o = self.clone();
        if let Some(v) = env_value("FNX_BACKEND") {
            o.backend = match v.as_str() {
                "auto" => Backend::Auto,
                "cpu" => Backend::Cpu,
                "vulkan" => Backend::Vulkan,
                other => return Err(Error::arg(format!("FNX_BACKEND={other:?}: expected auto, cpu or vulkan"))),
            };
        }
        if let Some(v) = env_value("FNX_DEVICE") {
            o.device_index = v.parse().map_err(|_| Error::arg(format!("FNX_DEVICE={v:?}: expected a device index")))?;
        }
        if let Some(v) = env_value("FNX_VRAM_BUDGET_MB") {
            o.vram_budget_mb = v.parse().map_err(|_| Error::arg(format!("FNX_VRAM_BUDGET_MB={v:?}: expected MiB")))?;
        }
        if let Some(v) = env_value("FNX_CPU_KERNELS") {
            let k = Kernels::parse(&v).ok_or_else(|| Error::arg(format!("FNX_CPU_KERNELS={v:?}: expected exact or fast")))?;
            o.cpu_kernels = o.cpu_kernels.or(Some(k));
        }
        Ok(o)
    }

    /// Reports `fraction` to the progress callback; `Err` when it cancels.
    fn report(&self, fraction: f32) -> Result<()> {
        match &self.progress {
            Some(f) if !f(fraction.clamp(0.0, 1.0)) => Err(Error::arg(LOAD_CANCELLED)),
            _ => Ok(()),
        }
    }
}

fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Loads the weights onto a Vulkan device when `opts` asks for it; an error
/// when Vulkan was requested and cannot be used.
fn load_gpu(config: &Config, weights: &Weights, opts: &LoadOptions) -> Result<Option<crate::vulkan::GpuModel>> {
    let choice =
        crate::vulkan::DeviceChoice { index: opts.device_index, budget: opts.vram_budget_mb.saturating_mul(1 << 20) };
    match opts.backend {
        Backend::Cpu | Backend::Auto => Ok(None),
        Backend::Vulkan => crate::vulkan::GpuModel::load(config, weights, &choice).map(Some),
    }
}

/// Layer index of a tensor named `blk.N.*`, if any.
fn tensor_layer(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// A loaded model: immutable, shareable across threads (`Arc<Model>`).
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    pub metadata: Metadata,
    /// Positions a state may hold (after `LoadOptions::n_ctx`).
    pub n_ctx: usize,
    pool: Option<rayon::ThreadPool>,
    /// The tokenizer, built on first use by [`Model::tokenizer`] (see `crate::tokenizer`).
    pub tokenizer: std::sync::OnceLock<std::result::Result<crate::tokenizer::Tokenizer, String>>,
    /// Identity of the model file, for state snapshots (see [`snapshot`]).
    fingerprint: u64,
    /// Bytes of the model image.
    file_size: u64,
    /// The weights on a Vulkan device, when the model was loaded for one.
    pub gpu: Option<crate::vulkan::GpuModel>,
    /// Number of tensors of each type in the file, most common first.
    tensor_types: Vec<(GgmlType, usize)>,
    /// The CPU kernels of the quantized weights.
    pub cpu_kernels: Kernels,
}

impl Model {
    /// Maps and validates a GGUF file.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Arc<Model>> {
        opts.report(0.0)?;
        let file = GgufFile::open(path)?;
        Self::build(file, opts)
    }

    /// Parses a model image held in memory (e.g. one embedded in the program).
    pub fn from_bytes(bytes: crate::gguf::Storage, opts: &LoadOptions) -> Result<Arc<Model>> {
        opts.report(0.0)?;
        Self::build(GgufFile::from_storage(bytes)?, opts)
    }

    pub fn from_gguf(file: GgufFile, opts: &LoadOptions) -> Result<Arc<Model>> {
        opts.report(0.0)?;
        Self::build(file, opts)
    }

    fn build(file: GgufFile, opts: &LoadOptions) -> Result<Arc<Model>> {
        let opts = &opts.with_env_overrides()?;
        let mut config = Config::from_metadata(&file.metadata)?;
        opts.report(0.05)?;
        // One pass over the tensors, layer by layer: the fingerprint and the
        // type census. Tensors outside `blk.N` go first.
        let file_size = file.bytes().len() as u64;
        let mut fp = snapshot::Fingerprinter::new(file_size, &file.metadata);
        let mut groups: Vec<Vec<&crate::gguf::TensorInfo>> = vec![Vec::new(); config.n_layers + 1];
        for t in &file.tensors {
            let g = tensor_layer(&t.name).filter(|&l| l < config.n_layers).map_or(0, |l| l + 1);
            groups[g].push(t);
        }
        let mut census: Vec<(GgmlType, usize)> = Vec::new();
        for (g, tensors) in groups.iter().enumerate() {
            for t in tensors {
                let data = file.bytes().get(t.offset..t.offset.saturating_add(t.nbytes)).unwrap_or(&[]);
                fp.tensor(t, data);
                match census.iter_mut().find(|(ty, _)| *ty == t.ty) {
                    Some((_, n)) => *n += 1,
                    None => census.push((t.ty, 1)),
                }
            }
            if g > 0 {
                opts.report(0.05 + 0.85 * g as f32 / config.n_layers as f32)?;
            }
        }
        census.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.id().cmp(&b.0.id())));
        let fingerprint = fp.finish();
        let weights = Weights::load(&file, &mut config)?;
        opts.report(0.95)?;
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
        let gpu = load_gpu(&config, &weights, opts)?;
        opts.report(1.0)?;
        Ok(Arc::new(Model {
            gpu,
            config,
            weights,
            metadata: file.metadata,
            n_ctx,
            pool,
            tokenizer: std::sync::OnceLock::new(),
            fingerprint,
            file_size,
            tensor_types: census,
            cpu_kernels: opts.cpu_kernels.unwrap_or_else(Kernels::from_env),
        }))
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab
    }

    /// Identity of the model file (file size, metadata, tensor layout and
    /// sampled tensor bytes, hashed); snapshots carry it.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Size of the model image in bytes.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// Number of tensors of each type in the file, most common first.
    pub fn tensor_types(&self) -> &[(GgmlType, usize)] {
        &self.tensor_types
    }

    /// The end-of-sequence token from the tokenizer metadata, if any.
    pub fn eos_token(&self) -> Option<u32> {
        self.metadata_token("tokenizer.ggml.eos_token_id")
    }

    /// Tokens that end a generated reply: the end-of-sequence and
    /// end-of-turn tokens the tokenizer metadata names, then the control
    /// tokens `<|im_end|>` and `<|endoftext|>` when the vocabulary has them
    /// (deduplicated; ids outside the vocabulary, which can never be
    /// generated, are left out). A GGUF file holds one EOS id, while
    /// transformers stops on `generation_config.eos_token_id`, which for Qwen
    /// lists both of those tokens; llama.cpp adds them by text the same way.
    pub fn end_of_generation_tokens(&self) -> Vec<u32> {
        let mut v: Vec<u32> = Vec::new();
        let named = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"].map(|k| self.metadata_token(k));
        let by_text = self.tokenizer().ok().map(|tok| {
            ["<|im_end|>", "<|endoftext|>"]
                .map(|text| tok.token_id(text).filter(|&id| tok.kind(id) == Some(crate::tokenizer::TokenKind::Control)))
        });
        for t in named.into_iter().chain(by_text.into_iter().flatten()).flatten() {
            if (t as usize) < self.config.vocab && !v.contains(&t) {
                v.push(t);
            }
        }
        v
    }

    fn metadata_token(&self, key: &str) -> Option<u32> {
        self.metadata.get(key).and_then(|v| v.as_u64()).and_then(|v| u32::try_from(v).ok())
    }

    /// Runs `f` on this model's thread pool (or the global one), its
    /// matrix products on this model's CPU kernels.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let kernels = self.cpu_kernels;
        let f = move || with_kernels(kernels, f);
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}
