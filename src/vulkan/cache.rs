//! The expert cache: when the routed experts do not all fit the device
//! (or the VRAM budget), the expert arena holds `slots` experts per layer
//! and this decides, layer by layer and token by token, where each chosen
//! expert runs.
//!
//! * **Per-layer floor.** Each layer owns its slots: a global LRU would let
//!   the sweep over layers 0..47 evict every early layer's experts right
//!   before its next visit.
//! * **Hits** run on the GPU from their slot.
//! * **Misses** run on the host's cores from the mapped file (the CPU
//!   backend's expert function, concurrently with the GPU's hits) and are
//!   added in the combine, or are uploaded into a slot and run on the GPU.
//! * **Admission.** An upload sits on the token's critical path (the host
//!   repacks the expert before the GPU can run it), so it pays only when the
//!   expert comes back often: each expert's misses are counted with a decay
//!   (half-life [`HALF_LIFE`](crate::model::expert_policy::HALF_LIFE) tokens), and a miss is admitted when that count,
//!   rounded, reaches the host-to-upload speed ratio measured at load ([`Split`]; at
//!   least 2: a first sighting never churns the cache: routing is flat), at
//!   most [`MAX_UPLOADS`](crate::model::expert_policy::MAX_UPLOADS) per layer and token. An admitted expert evicts the
//!   least recently used slot that this token does not use.
//! * **Fills in the background** (`FNX_EXPERT_FILL=1`, a load option; off
//!   by default). An admitted expert is computed on the host like any miss
//!   and its slot reserved; at the next router the host repacks it into
//!   cached staging memory while the GPU runs that layer's dense part, and
//!   the next segment of the GPU's experts copies it into the slot, which
//!   serves hits from then on (`commit`; a step that fails `cancel`s what
//!   it had not copied, and a step copies all its fills before it ends, so
//!   states sharing the cache never see a half-filled slot). Admission is
//!   then at the second miss: it brings the hit rate to plain LRU's. Off by
//!   default: measured twice on the GPU machines' hosts with real routing,
//!   the hits it buys (57 -> 70 % at 27 GB, 27 -> 40 % at 11 GB) cost about
//!   as much host time as they save: an expert's repack into staging runs at
//!   ~12.5 GB/s even on every thread (0.16 ms an expert, on the host's time
//!   at the router waits), so 27 GB went 35.5 -> 36.7 tok/s and 11 GB 30.0
//!   -> 28.1 (docs/BENCHMARKS.md, "Background fills, measured again").
//! * The placement itself (hits, admission, eviction) is
//!   [`crate::model::expert_policy`], shared with offline replays.
//! * **Passes of several tokens** (prompts) run every chosen expert on the
//!   GPU: a batch of 512 tokens chooses most of a layer's experts, each for
//!   ~10 tokens, so moving an expert across the bus once beats computing it
//!   on the host for each of its tokens. The resident ones hit; the others
//!   are streamed through the layer's slots in rounds
//!   ([`crate::model::expert_policy`]'s `stream`), which leaves the slots
//!   holding the last round's experts.
//! * Every slot is filled at load (a routing profile's most used experts,
//!   else the first ones).
//! * The shared experts, which every token uses, stay resident outside the
//!   arena (pinned).
//!
//! The cache is the model's: every state of the model uses it, one token at
//! a time ([`ExpertCache::token`] is held for a whole decode step, so a slot
//! is never rewritten while another state's work reads it).

use std::sync::{Mutex, MutexGuard};

use crate::model::expert_policy::LayerSlots;
pub(crate) use crate::model::expert_policy::Place;
pub use crate::model::expert_policy::{CacheStats, Split};

struct Inner {
    /// Decode steps so far (starts at 1: 0 marks "never").
    tick: u64,
    layers: Vec<LayerSlots>,
    stats: CacheStats,
    /// The experts predicted for the next layer (measurement only).
    predicted: Option<(usize, Vec<u32>)>,
}

/// The model's expert cache (see the module docs).
pub(crate) struct ExpertCache {
    pub slots: usize,
    pub split: Split,
    inner: Mutex<Inner>,
}

/// One decode step's hold on the cache.
pub(crate) struct Token<'a> {
    inner: MutexGuard<'a, Inner>,
    split: Split,
}

impl ExpertCache {
    pub fn new(layers: usize, slots: usize, experts: usize, split: Split) -> ExpertCache {
        let inner = Inner {
            tick: 1,
            layers: (0..layers).map(|_| LayerSlots::new(slots, experts)).collect(),
            stats: CacheStats::default(),
            predicted: None,
        };
        ExpertCache { slots, split, inner: Mutex::new(inner) }
    }

    /// Starts a decode step: held until it ends, so steps of different states take turns.
    pub fn token(&self) -> Token<'_> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.tick += 1;
        inner.stats.tokens += 1;
        Token { inner, split: self.split }
    }

    pub fn stats(&self) -> CacheStats {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).stats
    }

    pub fn reset_stats(&self) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).stats = CacheStats::default();
    }

    /// How often each layer chose each expert since load: `[layer][expert]`.
    pub fn profile(&self) -> Vec<Vec<u32>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).layers.iter().map(|l| l.chosen.clone()).collect()
    }

    /// Marks each layer's `experts[l]` resident in its first slots (their
    /// bytes are uploaded by the caller).
    pub fn fill(&self, experts: &[Vec<u32>]) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (l, e) in inner.layers.iter_mut().zip(experts) {
            l.fill(e);
        }
    }
}

impl Token<'_> {
    /// Records a prediction of layer `layer`'s experts.
    pub fn predict(&mut self, layer: usize, ids: Vec<u32>) {
        self.inner.predicted = Some((layer, ids));
    }

    /// Whether layer `layer`'s expert `e` serves hits now.
    pub fn holds(&self, layer: usize, e: u32) -> bool {
        self.inner.layers[layer].holds(e)
    }

    /// Counts bytes of predicted misses read ahead.
    pub fn prefetched(&mut self, bytes: u64) {
        self.inner.stats.prefetch_bytes += bytes;
    }

    /// Places layer `layer`'s chosen experts.
    pub fn place(&mut self, layer: usize, ids: &[u32]) -> Vec<Place> {
        if self.inner.predicted.as_ref().is_some_and(|(l, _)| *l == layer) {
            let (_, p) = self.inner.predicted.take().expect("checked");
            self.inner.stats.predicted += ids.iter().filter(|e| p.contains(e)).count() as u64;
            self.inner.stats.predicted_of += ids.len() as u64;
        }
        let Inner { tick, layers, stats, .. } = &mut *self.inner;
        let places = layers[layer].place(*tick, ids, &self.split, stats);
        stats.host_experts += places.iter().filter(|p| matches!(p, Place::Host | Place::Fill(_))).count() as u64;
        stats.uploads += places.iter().filter(|p| matches!(p, Place::Upload(_) | Place::Fill(_))).count() as u64;
        stats.fills += places.iter().filter(|p| matches!(p, Place::Fill(_))).count() as u64;
        places
    }

    /// Plans layer `layer`'s experts for a pass of several tokens (`ids`:
    /// every token's choices), streamed through its slots in rounds of at
    /// most `per_round` copies.
    pub fn stream(&mut self, layer: usize, ids: &[u32], per_round: usize) -> crate::model::expert_policy::Stream {
        let Inner { tick, layers, stats, .. } = &mut *self.inner;
        layers[layer].stream(*tick, ids, per_round, stats)
    }

    /// Layer `layer`'s fill of local slot `slot` is ordered before any later
    /// read of the slot: it serves hits from now on.
    pub fn commit(&mut self, layer: usize, slot: usize) {
        self.inner.layers[layer].commit(slot);
    }

    /// Layer `layer`'s local slot `slot` holds nothing known (a streamed
    /// round that failed).
    pub fn forget(&mut self, layer: usize, slot: usize) {
        self.inner.layers[layer].forget(slot);
    }

    /// Layer `layer`'s fill of local slot `slot` will not happen.
    pub fn cancel(&mut self, layer: usize, slot: usize) {
        self.inner.layers[layer].cancel(slot);
    }

    /// Counts `bytes` uploaded, repacked in `ns`.
    pub fn uploaded(&mut self, bytes: u64, ns: u64) {
        self.inner.stats.upload_bytes += bytes;
        self.inner.stats.upload_ns += ns;
    }

    /// Counts a host share's time the pass recorded on meanwhile, and the
    /// time it then waited for the share.
    pub fn overlapped(&mut self, recorded_ns: u64, join_ns: u64) {
        self.inner.stats.recorded_ns += recorded_ns;
        self.inner.stats.join_ns += join_ns;
    }

    /// Counts host time computing experts, and waiting for the GPU.
    pub fn timed(&mut self, host_ns: u64, wait_ns: u64) {
        self.inner.stats.host_ns += host_ns;
        self.inner.stats.wait_ns += wait_ns;
    }
}
