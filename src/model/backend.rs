//! The boundary between the network and the hardware that computes it.
//!
//! [`super::forward`] walks the network once, for every backend, through
//! [`Blocks`]: the work of one batch of tokens at block granularity
//! (embedding, PLE, hyper-connection pre step, Gated DeltaNet, QSA
//! attention, the MoE as route → experts by id → combine, final mix and LM
//! head). The CPU backend computes each block when it is called; the Vulkan
//! backend records commands and submits them at the end (or wherever a block
//! needs the host, e.g. to read the router's choice). Each backend's
//! activations are its own ([`Blocks`]' associated types): the walk only
//! passes them from block to block.
//!
//! A backend is two objects: a [`BackendModel`] (the weights where the
//! backend reads them; one per loaded model, shared by its states) and a
//! [`BackendState`] per sequence (recurrent states, caches, scratch). The
//! per-sequence parts every backend shares (position, PLE token history,
//! logits) live in [`super::State`].
//!
//! # Recurrent state across positions: rings
//!
//! Every fixed-size state that a token updates is kept for the last `W + 1`
//! positions (`W` = [`super::Model::rewind_window`]), so a state can step
//! back up to `W` positions without copying anything:
//!
//! * the Gated DeltaNet recurrent state has `W + 1` planes; the state after
//!   `n` tokens is plane `n mod (W + 1)`, and the token at position `q` reads
//!   plane `q mod (W + 1)` and writes plane `(q + 1) mod (W + 1)`;
//! * the causal-conv histories (GDN inputs, PLE normed values) are rings
//!   indexed by position: the row of position `q` is `q mod R`, with `R` the
//!   conv's reach plus `W`;
//! * attention and indexer caches are indexed by position already: rewinding
//!   forgets the positions past the new end.
//!
//! A [`Checkpoint`] covers any distance: it copies the current plane and the
//! rings (on the device for the GPU) and the caches' lengths.

use super::Model;
use crate::error::Result;

/// Which hyper-connection reads the streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// The one in front of layer `l`'s token mixer (GDN or attention).
    Mixer(usize),
    /// The one in front of layer `l`'s MoE.
    Moe(usize),
}

/// Which positions of a batch get logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogitsFor {
    /// The last token only (decoding, prompt processing).
    #[default]
    Last,
    /// Every token (scoring, speculative verification).
    All,
}

/// Tokens decoded together: `tokens[i]` at position `pos + i`.
#[derive(Clone, Copy)]
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    pub pos: usize,
    /// The tokens before `pos`, oldest first (at least the PLE n-gram's
    /// context; EOS stands in for positions before the sequence start).
    pub history: &'a [u32],
    pub logits: LogitsFor,
    /// Asked between layers of a pass of more than one token; `true` ends
    /// the pass with [`crate::Error::Aborted`], the backend state part way
    /// (the caller undoes it, as any failed pass of a prompt).
    pub abort: Option<&'a dyn PollAbort>,
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("tokens", &self.tokens)
            .field("pos", &self.pos)
            .field("history", &self.history.len())
            .field("logits", &self.logits)
            .field("abort", &self.abort.is_some())
            .finish()
    }
}

/// A caller's request to stop, asked by the layer walk from whichever thread
/// runs it (the CPU backend's walk runs on the model's threads).
pub trait PollAbort: Sync {
    fn aborted(&self) -> bool;
}

/// A caller's abort poll lent to one pass: the pass asks it from its own
/// thread while the caller waits for the pass, one call at a time.
pub struct LentAbort<'a>(std::sync::Mutex<&'a mut dyn FnMut() -> bool>);

impl<'a> LentAbort<'a> {
    pub fn new(poll: &'a mut dyn FnMut() -> bool) -> Self {
        Self(std::sync::Mutex::new(poll))
    }
}

// SAFETY: the poll is only called under the mutex, by the one thread that
// runs the pass, while the thread that lent it is blocked in the pass; the
// callers' polls are C callbacks (a function pointer and its user data, which
// the C API documents as called from the model's threads) and flags.
unsafe impl Sync for LentAbort<'_> {}

impl PollAbort for LentAbort<'_> {
    fn aborted(&self) -> bool {
        let mut poll = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (*poll)()
    }
}

impl Batch<'_> {
    /// Tokens that get logits.
    pub fn n_logits(&self) -> usize {
        match self.logits {
            LogitsFor::Last => 1,
            LogitsFor::All => self.tokens.len(),
        }
    }
}

/// One batch's work, block by block. Shapes are per token (`T` tokens,
/// `C` streams of `H`); every block reads and writes all `T` tokens, in
/// position order where a block carries state from one token to the next.
pub trait Blocks {
    /// The residual streams: [T][C*H].
    type Streams;
    /// A hyper-connection's output: the block input [T][H] and the
    /// injection weights [T][C] its output is added back with.
    type Branch;
    /// The router's choice: [T][k] expert ids and weights, and the shared
    /// expert's gate [T].
    type Routes;
    /// Expert outputs waiting to be combined.
    type Experts;

    /// `rows` ([T][H], gathered on the host) repeated over the `C` streams.
    fn embed(&mut self, rows: &[f32]) -> Result<Self::Streams>;
    /// `x += ple(x, e)` on the layer that carries PLE; `rows` ([T][H]) are the
    /// tokens' n-gram table rows.
    fn ple(&mut self, layer: usize, rows: &[f32], x: &mut Self::Streams) -> Result<()>;
    /// The hyper-connection at `site` reads the streams.
    fn hyper_pre(&mut self, site: Site, x: &Self::Streams) -> Result<Self::Branch>;
    /// `x += inject * gdn(input)`: layer `layer`'s Gated DeltaNet.
    fn gdn(&mut self, layer: usize, branch: &Self::Branch, x: &mut Self::Streams) -> Result<()>;
    /// `x += inject * attention(input)`: layer `layer`'s (QSA) attention.
    fn attention(&mut self, layer: usize, branch: &Self::Branch, x: &mut Self::Streams) -> Result<()>;
    /// Router softmax, top-k, renormalised weights, shared-expert gate.
    fn moe_route(&mut self, layer: usize, branch: &Self::Branch) -> Result<Self::Routes>;
    /// The chosen experts (and the shared one), by id.
    fn moe_experts(&mut self, layer: usize, branch: &Self::Branch, routes: &Self::Routes) -> Result<Self::Experts>;
    /// `x += inject * (sum_e w_e y_e + gate * shared)`.
    fn moe_combine(
        &mut self,
        layer: usize,
        branch: &Self::Branch,
        routes: &Self::Routes,
        experts: Self::Experts,
        x: &mut Self::Streams,
    ) -> Result<()>;
    /// The output mixer and the LM head, for the tokens the batch wants logits of.
    fn head(&mut self, x: &Self::Streams) -> Result<()>;
}

/// What a backend is: the choice [`crate::load::Backend`] resolved to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Vulkan,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Vulkan => "vulkan",
        }
    }
}

/// Runs a piece of host work on the model's own threads (its rayon pool),
/// so a backend's load-time measurements see the threads decoding will use.
pub type OnModelThreads<'a> = dyn Fn(&mut (dyn FnMut() + Send)) + Sync + 'a;

/// A model's weights on a backend; shared by every state of the model.
pub trait BackendModel: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// The device, e.g. "NVIDIA H200"; the CPU's model name on the CPU.
    fn device_name(&self) -> String;
    /// Bytes of device memory in use (weights and every live state); 0 on the CPU.
    fn device_bytes_used(&self) -> u64 {
        0
    }
    /// An empty sequence state.
    fn new_state(&self, model: &Model) -> Result<Box<dyn BackendState>>;
    /// The expert cache's figures, when the backend keeps routed experts in one.
    fn expert_cache(&self) -> Option<ExpertCacheReport> {
        None
    }
    /// Restarts the expert cache's counts.
    fn reset_expert_cache_counts(&self) {}
    /// The expert cache's routing profile (see `model::profile`).
    fn routing_profile(&self) -> Option<super::profile::RoutingProfile> {
        None
    }
    /// Bytes the load moved to the device and the seconds it took (`None` on the CPU).
    fn load_transfer(&self) -> Option<(u64, f64)> {
        None
    }
    /// The device's kernels for the quantized matvecs (`None` on the CPU,
    /// whose kernels are the model's `cpu_kernels`).
    fn gpu_kernels(&self) -> Option<crate::quant::kernels::Kernels> {
        None
    }
    /// Whether a pass's quantized matrices run on the device's cooperative
    /// matrices (f16 inputs; shaders/mm.comp); `false` on the CPU.
    fn gpu_coopmat(&self) -> bool {
        false
    }
    /// Microseconds one dependent step costs the device when it does
    /// nothing (an empty dispatch and its barrier), measured now; `None` on
    /// the CPU.
    fn empty_dispatch_us(&self) -> Result<Option<f64>> {
        Ok(None)
    }
}

/// Device time of a pass spent on one kind of work: every dispatch of one
/// matrix role (`ssm_out (matvec_q8_0)`, across layers) or of one pipeline.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DispatchTime {
    pub label: String,
    pub dispatches: u32,
    /// Milliseconds, each dispatch counted from the end of the one before
    /// (its barrier and launch included).
    pub ms: f64,
    /// Weight bytes those dispatches read.
    pub bytes: u64,
}

/// A backend's expert cache: its size, what it measured at load, and its
/// counts since the load or the last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertCacheReport {
    pub slots_per_layer: usize,
    /// Expert weights the host's cores compute, and the bus uploads, per second.
    pub host_bytes_per_s: f64,
    pub upload_bytes_per_s: f64,
    /// Decode steps counted.
    pub tokens: u64,
    /// Routed expert uses served from the cache, and not.
    pub hits: u64,
    pub misses: u64,
    /// Misses computed on the host, and uploaded into the cache.
    pub host_experts: u64,
    pub uploads: u64,
    /// Of the uploads, those filled in the background (their expert computed
    /// on the host the token it was admitted).
    pub fills: u64,
    pub upload_bytes: u64,
    /// Host seconds computing experts, repacking uploads, and waiting for
    /// the device at the routers.
    pub host_seconds: f64,
    pub upload_seconds: f64,
    pub wait_seconds: f64,
    /// While the host computed its experts: seconds the pass recorded on
    /// meanwhile, and seconds it then waited for them (the host's time on
    /// the token's path).
    pub recorded_seconds: f64,
    pub join_seconds: f64,
    /// Bytes of predicted misses the host read ahead while it waited for the GPU.
    pub prefetch_bytes: u64,
    /// With prediction measured: chosen experts that layer l's MoE input,
    /// through layer l+1's router, predicted, and how many were chosen.
    pub predicted: u64,
    pub predicted_of: u64,
}

/// Counts of the last forward pass's device work (zero on the CPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassStats {
    pub dispatches: u32,
    pub barriers: u32,
    pub submits: u32,
    /// Bytes of weights the pass read (each matrix once).
    pub weight_bytes: u64,
    /// Host nanoseconds from the start of the pass to its last submission
    /// (recording, and the host's inputs), and then waited for the device.
    pub record_ns: u64,
    pub wait_ns: u64,
}

/// One sequence's state on a backend. Every method leaves the state as it
/// was when it returns an error, except where it says the state is lost
/// (then [`super::State`] refuses further use until a reset).
pub trait BackendState: Send {
    /// Most tokens one [`BackendState::forward`] takes.
    fn max_batch(&self) -> usize;
    /// Runs `batch` through the network (the walk of [`super::forward`])
    /// and returns the logits it asks for: [n][V]. An `Err` that is not
    /// [`crate::Error::StateLost`] changed nothing.
    fn forward(&mut self, model: &Model, batch: &Batch) -> Result<Vec<f32>>;
    /// Zeroes every recurrent state (the caches are then unread).
    fn reset(&mut self) -> Result<()>;
    /// Forgets the positions from `to` on (`pos - to` within the rewind window).
    fn rewind(&mut self, model: &Model, to: usize) -> Result<()>;
    /// Saves what [`BackendState::rollback`] needs to return to position `pos`.
    fn checkpoint(&self, model: &Model, pos: usize) -> Result<Checkpoint>;
    /// Returns to a checkpoint taken from this state.
    fn rollback(&mut self, model: &Model, checkpoint: &Checkpoint) -> Result<()>;
    /// An independent copy.
    fn try_clone(&self, model: &Model) -> Result<Box<dyn BackendState>>;
    /// The state after `pos` tokens in the host layout of snapshots.
    fn export(&self, model: &Model, pos: usize) -> Result<HostState>;
    /// Loads `host` (as [`BackendState::export`] gives it) as the state after `pos` tokens.
    fn import(&mut self, model: &Model, pos: usize, host: HostState) -> Result<()>;
    /// Device work of the last forward pass (`None` on the CPU).
    fn pass_stats(&self) -> Option<PassStats> {
        None
    }
    /// Times every stage of the following passes (an error where the
    /// backend cannot): the device's stages on a GPU, the wall time of the
    /// calling thread's stages on the CPU.
    fn enable_profiling(&mut self) -> Result<()> {
        Err(crate::Error::arg("profiling: this backend has no device stages to time"))
    }
    /// Milliseconds per device stage of the last pass, once profiling is enabled.
    fn stage_ms(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
    /// The last pass's device time by what each dispatch computed, once
    /// profiling is enabled (the CPU: every pass's wall time by stage since).
    fn dispatch_ms(&self) -> Vec<DispatchTime> {
        Vec::new()
    }
    /// Positions the caches hold now (they grow with the context).
    fn capacity(&self) -> usize;
}

/// A backend's saved state ([`BackendState::checkpoint`]); opaque to the model.
pub struct Checkpoint {
    pub(crate) pos: usize,
    pub(crate) inner: Box<dyn std::any::Any + Send>,
}

/// A layer's state in the host layout (snapshots; CPU and GPU alike).
#[derive(Clone, Debug, PartialEq)]
pub enum HostLayer {
    Gdn {
        /// The last `Kc - 1` conv inputs, oldest first: [Kc-1][Dc]
        conv: Vec<f32>,
        /// [nv][dk][dv]
        recurrent: Vec<f32>,
    },
    Attention {
        /// Roped, normed keys: [pos][nkv*hd]
        keys: Vec<f32>,
        /// [pos][nkv*hd]
        values: Vec<f32>,
        /// Raw indexer keys: [pos][id]
        index_keys: Vec<f32>,
        /// Pooled, normed, roped keys of complete blocks: [pos/r][id]
        block_keys: Vec<f32>,
    },
}

/// A sequence's backend state in the host layout.
#[derive(Clone, Debug, PartialEq)]
pub struct HostState {
    pub layers: Vec<HostLayer>,
    /// The PLE conv history, oldest first: [(Kp-1)*G][C*H]
    pub ple_conv: Option<Vec<f32>>,
}
