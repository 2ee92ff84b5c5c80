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
//!   Only a miss seen before within [`ADMIT_WINDOW`] tokens is admitted into
//!   the cache (a first sighting would only churn it: routing is flat), and
//!   of those at most as many as keep the upload no slower than the host's
//!   share (the split follows the bandwidths measured at load: see
//!   [`Split`]). An admitted expert evicts the least recently used slot that
//!   this token does not use.
//! * The shared experts, which every token uses, stay resident outside the
//!   arena (pinned).
//!
//! The cache is the model's: every state of the model uses it, one token at
//! a time ([`ExpertCache::token`] is held for a whole decode step, so a slot
//! is never rewritten while another state's work reads it).

use std::sync::{Mutex, MutexGuard};

/// Tokens within which a second sighting of a missed expert admits it.
pub const ADMIT_WINDOW: u64 = 256;

/// Where one chosen expert (index `i` of the token's top-k) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Resident in this layer's local slot.
    Hit(usize),
    /// Uploaded into this local slot now, then run on the GPU.
    Upload(usize),
    /// Computed on the host.
    Host,
}

/// The host's and the bus's measured speeds, for splitting misses.
#[derive(Clone, Copy, Debug)]
pub struct Split {
    /// Bytes of expert weights per second the host's cores compute.
    pub host_bytes_per_s: f64,
    /// Bytes per second an upload moves into the arena.
    pub upload_bytes_per_s: f64,
}

impl Split {
    /// Of `misses` misses, how many to upload so that the upload and the
    /// host's share take about as long: `u = m * up / (host + up)`, rounded.
    pub fn uploads(&self, misses: usize) -> usize {
        let (h, u) = (self.host_bytes_per_s.max(0.0), self.upload_bytes_per_s.max(0.0));
        if h + u <= 0.0 {
            return 0;
        }
        ((misses as f64 * u / (h + u)).round() as usize).min(misses)
    }
}

/// Counts since load (or the last [`ExpertCache::reset_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Routed expert uses served from the arena.
    pub hits: u64,
    /// Routed expert uses not in the arena (computed on the host or uploaded).
    pub misses: u64,
    /// Misses computed on the host.
    pub host_experts: u64,
    /// Misses uploaded into the arena.
    pub uploads: u64,
    pub upload_bytes: u64,
    /// Decode steps (tokens) that went through the cache.
    pub tokens: u64,
}

/// One layer's slots.
struct LayerSlots {
    /// Expert in each local slot.
    expert: Vec<Option<u32>>,
    /// Token of each slot's last use (LRU).
    used: Vec<u64>,
    /// Local slot of each expert, when resident.
    slot_of: Vec<Option<u32>>,
    /// Token each expert was last missed at (0 = never).
    seen: Vec<u64>,
    /// Times each expert was chosen (the routing profile).
    chosen: Vec<u32>,
}

impl LayerSlots {
    fn new(slots: usize, experts: usize) -> LayerSlots {
        LayerSlots {
            expert: vec![None; slots],
            used: vec![0; slots],
            slot_of: vec![None; experts],
            seen: vec![0; experts],
            chosen: vec![0; experts],
        }
    }

    /// Places the token's chosen experts (`ids`, in route order) at token `tick`.
    fn place(&mut self, tick: u64, ids: &[u32], split: &Split, stats: &mut CacheStats) -> Vec<Place> {
        for &e in ids {
            if let Some(c) = self.chosen.get_mut(e as usize) {
                *c = c.saturating_add(1);
            }
        }
        let mut places: Vec<Place> = ids
            .iter()
            .map(|&e| match self.slot_of.get(e as usize).copied().flatten() {
                Some(s) => {
                    self.used[s as usize] = tick;
                    Place::Hit(s as usize)
                }
                None => Place::Host,
            })
            .collect();
        let misses: Vec<usize> = (0..ids.len()).filter(|&i| places[i] == Place::Host).collect();
        stats.hits += (ids.len() - misses.len()) as u64;
        stats.misses += misses.len() as u64;
        let mut budget = split.uploads(misses.len());
        for &i in &misses {
            let e = ids[i] as usize;
            let admit = self.seen[e] > 0 && tick - self.seen[e] <= ADMIT_WINDOW;
            self.seen[e] = tick;
            if !admit || budget == 0 {
                continue;
            }
            // The emptiest, then least recently used slot this token does not use.
            let victim = (0..self.expert.len()).filter(|&s| self.used[s] < tick).min_by_key(|&s| (self.expert[s].is_some(), self.used[s]));
            let Some(s) = victim else { break };
            if let Some(old) = self.expert[s] {
                self.slot_of[old as usize] = None;
            }
            self.expert[s] = Some(e as u32);
            self.slot_of[e] = Some(s as u32);
            self.used[s] = tick;
            places[i] = Place::Upload(s);
            budget -= 1;
        }
        places
    }

    /// Marks `experts` resident in the first slots (a warm start).
    fn fill(&mut self, experts: &[u32]) {
        for (s, &e) in experts.iter().take(self.expert.len()).enumerate() {
            if let Some(old) = self.expert[s] {
                self.slot_of[old as usize] = None;
            }
            self.expert[s] = Some(e);
            self.slot_of[e as usize] = Some(s as u32);
        }
    }
}

struct Inner {
    /// Decode steps so far (starts at 1: 0 marks "never").
    tick: u64,
    layers: Vec<LayerSlots>,
    stats: CacheStats,
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
        let inner = Inner { tick: 1, layers: (0..layers).map(|_| LayerSlots::new(slots, experts)).collect(), stats: CacheStats::default() };
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
    /// Places layer `layer`'s chosen experts.
    pub fn place(&mut self, layer: usize, ids: &[u32]) -> Vec<Place> {
        let Inner { tick, layers, stats } = &mut *self.inner;
        let places = layers[layer].place(*tick, ids, &self.split, stats);
        stats.host_experts += places.iter().filter(|p| **p == Place::Host).count() as u64;
        stats.uploads += places.iter().filter(|p| matches!(p, Place::Upload(_))).count() as u64;
        places
    }

    /// Counts `bytes` uploaded.
    pub fn uploaded(&mut self, bytes: u64) {
        self.inner.stats.upload_bytes += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_UPLOADS: Split = Split { host_bytes_per_s: 1.0, upload_bytes_per_s: 0.0 };
    const ALL_UPLOADS: Split = Split { host_bytes_per_s: 0.0, upload_bytes_per_s: 1e12 };

    #[test]
    fn second_sightings_are_admitted_and_lru_evicts() {
        let mut l = LayerSlots::new(2, 8);
        let mut st = CacheStats::default();
        // First sightings run on the host.
        assert_eq!(l.place(1, &[3, 4], &ALL_UPLOADS, &mut st), [Place::Host, Place::Host]);
        // Seen again: uploaded into the two empty slots.
        assert_eq!(l.place(2, &[3, 4], &ALL_UPLOADS, &mut st), [Place::Upload(0), Place::Upload(1)]);
        assert_eq!(l.place(3, &[4, 3], &ALL_UPLOADS, &mut st), [Place::Hit(1), Place::Hit(0)]);
        // 5 seen twice while 3 is in use: evicts 4 (not used this token), not 3.
        l.place(4, &[3, 5], &ALL_UPLOADS, &mut st);
        assert_eq!(l.place(5, &[3, 5], &ALL_UPLOADS, &mut st), [Place::Hit(0), Place::Upload(1)]);
        assert_eq!(l.slot_of[4], None);
        assert_eq!(st, CacheStats { hits: 4, misses: 6, ..Default::default() });
        // Without upload bandwidth nothing is admitted.
        let mut l = LayerSlots::new(2, 8);
        l.place(1, &[3], &NO_UPLOADS, &mut st);
        assert_eq!(l.place(2, &[3], &NO_UPLOADS, &mut st), [Place::Host]);
        // A sighting older than the window does not count.
        let mut l = LayerSlots::new(2, 8);
        l.place(1, &[3], &ALL_UPLOADS, &mut st);
        assert_eq!(l.place(2 + ADMIT_WINDOW, &[3], &ALL_UPLOADS, &mut st), [Place::Host]);
        assert_eq!(l.place(3 + ADMIT_WINDOW, &[3], &ALL_UPLOADS, &mut st), [Place::Upload(0)]);
    }

    #[test]
    fn a_full_token_never_evicts_its_own_experts() {
        let mut l = LayerSlots::new(1, 8);
        let mut st = CacheStats::default();
        l.place(1, &[1, 2], &ALL_UPLOADS, &mut st);
        assert_eq!(l.place(2, &[1, 2], &ALL_UPLOADS, &mut st), [Place::Upload(0), Place::Host]);
        assert_eq!(l.place(3, &[2, 1], &ALL_UPLOADS, &mut st), [Place::Host, Place::Hit(0)]);
    }

    #[test]
    fn uploads_split_by_bandwidth() {
        let s = Split { host_bytes_per_s: 30e9, upload_bytes_per_s: 10e9 };
        assert_eq!([0, 1, 3, 4, 10].map(|m| s.uploads(m)), [0, 0, 1, 1, 3]);
        assert_eq!(NO_UPLOADS.uploads(10), 0);
        assert_eq!(ALL_UPLOADS.uploads(10), 10);
    }
}
