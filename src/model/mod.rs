//! The qwen4exp model (transformers 5.23.0 `Qwen4ExpForCausalLM`):
//! configuration, weights, the one layer walk, and the per-sequence state.
//!
//! One token flows through: embedding, repeated into `C` hyper-connection
//! streams; per layer an optional PLE injection, then two gated residual
//! blocks (token mixer: Gated DeltaNet or QSA attention; then the MoE), each
//! reading a mix of the streams and writing back with per-stream weights;
//! finally the output mixer and the LM head. [`forward`] is that walk, over
//! the block interface of [`backend`]; the backends (`cpu`, `vulkan`)
//! compute the blocks. Nothing here knows which backend runs.

pub mod backend;
pub mod config;
pub(crate) mod expert_policy;
pub mod forward;
pub mod ple;
pub mod profile;
pub mod snapshot;
pub mod state;
pub mod weights;

pub use backend::{BackendKind, ExpertCacheReport, LogitsFor, PassStats};
pub use config::{Config, GateActivation, LayerKind};
pub use snapshot::SnapshotError;
pub use state::State;
pub use weights::Weights;

use crate::gguf::{GgmlType, Metadata};
use crate::quant::kernels::{with_kernels, Kernels};
use backend::BackendModel;

/// A loaded model: immutable, shareable across threads (`Arc<Model>`).
/// Made by `crate::load` (`Model::load` and friends).
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    pub metadata: Metadata,
    /// Positions a state may hold (after `LoadOptions::n_ctx`).
    pub n_ctx: usize,
    /// Positions a state can step back without a copy (see [`backend`]).
    pub rewind_window: usize,
    /// Most tokens one backend pass takes (`LoadOptions::micro_batch`).
    pub micro_batch: usize,
    /// Host threads for this model's work; `None` = rayon's global pool.
    pub(crate) pool: Option<rayon::ThreadPool>,
    /// The kernels of the quantized weights' products on the host.
    pub cpu_kernels: Kernels,
    /// Identity of the model file, for state snapshots (see [`snapshot`]).
    pub(crate) fingerprint: u64,
    /// Bytes of the model image.
    pub(crate) file_size: u64,
    /// Number of tensors of each type in the file, most common first.
    pub(crate) tensor_types: Vec<(GgmlType, usize)>,
    /// The weights where the backend reads them.
    pub(crate) backend: Box<dyn BackendModel>,
    /// Where the model computes and why (see [`Model::backend_note`]).
    pub(crate) backend_note: String,
    /// Called with every routing decision the host sees (see [`Model::observe_routing`]).
    pub(crate) routing_observer: std::sync::RwLock<Option<RoutingObserver>>,
}

/// Receives `(layer, chosen expert ids in rank order)` for each token.
pub type RoutingObserver = std::sync::Arc<dyn Fn(usize, &[u32]) + Send + Sync>;

impl Model {
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

    /// Which backend computes.
    pub fn backend_kind(&self) -> BackendKind {
        self.backend.kind()
    }

    /// The device the backend computes on, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> String {
        self.backend.device_name()
    }

    /// Bytes of device memory in use (weights and every live state); 0 on the CPU.
    pub fn device_bytes_used(&self) -> u64 {
        self.backend.device_bytes_used()
    }

    /// The expert cache's figures, when the backend keeps routed experts in one.
    pub fn expert_cache(&self) -> Option<ExpertCacheReport> {
        self.backend.expert_cache()
    }

    /// How often each layer chose each expert since load, when the backend
    /// keeps an expert cache (save it to warm a later load's cache).
    pub fn routing_profile(&self) -> Option<profile::RoutingProfile> {
        self.backend.routing_profile()
    }

    /// Restarts the expert cache's counts (e.g. after a warm-up).
    pub fn reset_expert_cache_counts(&self) {
        self.backend.reset_expert_cache_counts()
    }

    /// Microseconds one empty dependent step costs the device (a dispatch
    /// that does nothing and its barrier), measured now; `None` on the CPU.
    pub fn empty_dispatch_us(&self) -> crate::error::Result<Option<f64>> {
        self.backend.empty_dispatch_us()
    }

    /// Bytes the load moved to the device and the seconds that took.
    pub fn load_transfer(&self) -> Option<(u64, f64)> {
        self.backend.load_transfer()
    }

    /// The GPU's kernels for the quantized matvecs (`None` on the CPU).
    pub fn gpu_kernels(&self) -> Option<Kernels> {
        self.backend.gpu_kernels()
    }

    /// Whether the GPU runs a prompt pass's quantized matrices on its
    /// cooperative matrices (tensor cores; f16 inputs, error stated in
    /// shaders/mm.comp): see [`crate::LoadOptions::gpu_coopmat`].
    pub fn gpu_coopmat(&self) -> bool {
        self.backend.gpu_coopmat()
    }

    /// Where the model computes and why, e.g. `vulkan on NVIDIA H200 (auto)`
    /// or `cpu (auto: no hardware GPU among llvmpipe (Cpu))`.
    pub fn backend_note(&self) -> &str {
        &self.backend_note
    }

    /// Number of tensors of each type in the file, most common first.
    pub fn tensor_types(&self) -> &[(GgmlType, usize)] {
        &self.tensor_types
    }

    /// A token id from the metadata (`tokenizer.ggml.*_token_id`), if present.
    pub fn metadata_token(&self, key: &str) -> Option<u32> {
        self.metadata.get(key).and_then(|v| v.as_u64()).and_then(|v| u32::try_from(v).ok())
    }

    /// Tokens of context the PLE hash reads before a token (`G - 1`; 0 without PLE).
    pub(crate) fn history_context(&self) -> usize {
        self.config.ple.as_ref().map_or(0, |p| p.ngram - 1)
    }

    /// The token history of an empty sequence: EOS for every context slot.
    pub(crate) fn start_history(&self) -> Vec<u32> {
        vec![self.config.ple.as_ref().map_or(0, |p| p.eos); self.history_context()]
    }

    /// Sets (or with `None` removes) a function called with every routing
    /// decision the host sees: on the CPU every layer of every token; on
    /// Vulkan with an expert cache likewise (the router's choice is read
    /// back); with every expert resident the choice never leaves the GPU and
    /// nothing is reported. For routing traces (benchmarks, cache studies).
    pub fn observe_routing(&self, observer: Option<RoutingObserver>) {
        *self.routing_observer.write().unwrap_or_else(|e| e.into_inner()) = observer;
    }

    /// Reports a routing decision to the observer, if one is set.
    pub(crate) fn report_routing(&self, layer: usize, ids: &[u32]) {
        if let Some(f) = &*self.routing_observer.read().unwrap_or_else(|e| e.into_inner()) {
            f(layer, ids);
        }
    }

    /// Runs `f` on this model's host threads (its pool, or rayon's global
    /// one), its matrix products on this model's CPU kernels.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let kernels = self.cpu_kernels;
        let f = move || with_kernels(kernels, f);
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// Runs `f` on this thread with a scope whose spawned jobs run on the
    /// model's threads (each should set the model's kernels itself, as
    /// [`Model::install`] does); returns once they have all finished.
    pub(crate) fn in_place_scope<'scope, R>(&self, f: impl FnOnce(&rayon::Scope<'scope>) -> R) -> R {
        match &self.pool {
            Some(p) => p.in_place_scope(f),
            None => rayon::in_place_scope(f),
        }
    }
}
