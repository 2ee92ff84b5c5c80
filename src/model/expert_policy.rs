//! The expert cache's placement policy, one layer at a time, without any
//! device: which chosen experts hit, which misses are admitted (uploaded)
//! and which slot each evicts. The Vulkan backend's expert cache
//! (`vulkan::cache`, whose module docs give the reasons) runs it on the live
//! routing; offline tools replay recorded routing through the same code.
//!
//! * Hits refresh their slot's last use (LRU).
//! * Each expert's misses are counted with a decay (half-life [`HALF_LIFE`]
//!   tokens); a miss is admitted when that count, rounded, reaches
//!   [`Split::admit_at`], at most [`MAX_UPLOADS`] per layer and token; it
//!   evicts the emptiest, then least recently used slot this token does not
//!   use (nor one being filled).
//! * An admitted expert is either uploaded now and run on the GPU
//!   ([`Place::Upload`]: the upload sits on the token's critical path) or,
//!   with [`Split::background`], computed on the host this once while its
//!   bytes go into the slot in time the host would otherwise spend waiting
//!   ([`Place::Fill`]); the slot then serves hits once the backend
//!   [`LayerSlots::commit`]s it, and until then the expert is a miss that is
//!   not admitted again.

/// Tokens after which an expert's miss count has halved.
pub const HALF_LIFE: f32 = 64.0;

/// Most experts one layer uploads in one token.
pub const MAX_UPLOADS: usize = 2;

/// Where one chosen expert (index `i` of the token's top-k) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Resident in this layer's local slot.
    Hit(usize),
    /// Uploaded into this local slot now, then run on the GPU.
    Upload(usize),
    /// Computed on the host; its bytes go into this local slot in the
    /// background, which serves hits once committed.
    Fill(usize),
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
    /// The admission count, forced (`None`: from the speeds, or 2 in the background).
    pub forced: Option<f32>,
    /// Whether admitted experts are filled in the background ([`Place::Fill`])
    /// rather than uploaded on the critical path ([`Place::Upload`]).
    pub background: bool,
}

impl Split {
    /// The decayed miss count at which an expert is worth admitting: forced,
    /// or 2 in the background (a fill costs the token nothing: the host
    /// computes the expert anyway and moves its bytes while it would wait),
    /// or else the host's speed over the upload's (an upload costs that many
    /// host computations of it), at least 2 (a first sighting never churns
    /// the cache); never without upload bandwidth.
    pub fn admit_at(&self) -> f32 {
        if self.upload_bytes_per_s <= 0.0 {
            return f32::INFINITY;
        }
        let count = match (self.forced, self.background) {
            (Some(n), _) => n,
            (None, true) => 2.0,
            (None, false) => (self.host_bytes_per_s / self.upload_bytes_per_s) as f32,
        };
        count.max(2.0)
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
    /// Misses admitted into the arena (uploaded now or filled in the background).
    pub uploads: u64,
    /// Of those, filled in the background.
    pub fills: u64,
    pub upload_bytes: u64,
    /// Decode steps (tokens) that went through the cache.
    pub tokens: u64,
    /// Host time computing experts, repacking uploads, and waiting for the
    /// GPU at the routers (nanoseconds).
    pub host_ns: u64,
    pub upload_ns: u64,
    pub wait_ns: u64,
    /// While the host computed its experts: the time the pass recorded on
    /// (to the next router), and the time it then waited for them.
    pub recorded_ns: u64,
    pub join_ns: u64,
    /// Bytes of predicted misses the host's threads read ahead while they
    /// waited for the GPU (see `vulkan::blocks`' prefetch).
    pub prefetch_bytes: u64,
    /// With prediction measured (`FNX_MEASURE_PREDICTION=1`): experts of
    /// layer l+1 that its router, run on layer l's MoE input, put in its
    /// top-k, and how many were chosen in all.
    pub predicted: u64,
    pub predicted_of: u64,
}

/// One layer's plan for a pass of several tokens ([`LayerSlots::stream`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stream {
    /// Each (token, choice) pair's local slot, in pass order (`t * k + j`).
    pub pair_slot: Vec<u32>,
    /// The pairs, round by round, each round's grouped by slot.
    pub order: Vec<u32>,
    pub rounds: Vec<Round>,
}

/// One round of a streamed pass: its pairs are `order[start..start + count]`,
/// run once `copies` (local slot, expert) are in their slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Round {
    pub start: usize,
    pub count: usize,
    pub copies: Vec<(usize, u32)>,
}

/// One layer's slots.
pub(crate) struct LayerSlots {
    /// Expert in each local slot.
    expert: Vec<Option<u32>>,
    /// Token of each slot's last use (LRU).
    used: Vec<u64>,
    /// Whether each slot is being filled (reserved; not yet serving hits).
    filling: Vec<bool>,
    /// Local slot of each expert, when resident or being filled.
    slot_of: Vec<Option<u32>>,
    /// Each expert's decayed miss count, and the token it was last updated at.
    score: Vec<f32>,
    seen: Vec<u64>,
    /// Times each expert was chosen (the routing profile).
    pub(crate) chosen: Vec<u32>,
}

impl LayerSlots {
    pub(crate) fn new(slots: usize, experts: usize) -> LayerSlots {
        LayerSlots {
            expert: vec![None; slots],
            used: vec![0; slots],
            filling: vec![false; slots],
            slot_of: vec![None; experts],
            score: vec![0.0; experts],
            seen: vec![0; experts],
            chosen: vec![0; experts],
        }
    }

    /// Whether expert `e` serves hits now (resident, not being filled).
    pub(crate) fn holds(&self, e: u32) -> bool {
        self.slot_of.get(e as usize).copied().flatten().is_some_and(|s| !self.filling[s as usize])
    }

    /// Places the token's chosen experts (`ids`, in route order) at token `tick`.
    pub(crate) fn place(&mut self, tick: u64, ids: &[u32], split: &Split, stats: &mut CacheStats) -> Vec<Place> {
        for &e in ids {
            if let Some(c) = self.chosen.get_mut(e as usize) {
                *c = c.saturating_add(1);
            }
        }
        let mut places: Vec<Place> = ids
            .iter()
            .map(|&e| match self.slot_of.get(e as usize).copied().flatten().filter(|&s| !self.filling[s as usize]) {
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
        let (threshold, mut budget) = (split.admit_at(), MAX_UPLOADS);
        for &i in &misses {
            let e = ids[i] as usize;
            if self.slot_of[e].is_some() {
                // Being filled.
                continue;
            }
            let age = tick.saturating_sub(self.seen[e]) as f32;
            self.score[e] = self.score[e] * (-age / HALF_LIFE).exp2() + 1.0;
            self.seen[e] = tick;
            if self.score[e].round() < threshold || budget == 0 || self.expert.is_empty() {
                continue;
            }
            // The emptiest, then least recently used slot this token does not use.
            let victim = (0..self.expert.len())
                .filter(|&s| self.used[s] < tick && !self.filling[s])
                .min_by_key(|&s| (self.expert[s].is_some(), self.used[s]));
            let Some(s) = victim else { break };
            if let Some(old) = self.expert[s] {
                self.slot_of[old as usize] = None;
            }
            self.expert[s] = Some(e as u32);
            self.slot_of[e] = Some(s as u32);
            self.used[s] = tick;
            self.score[e] = 0.0;
            self.filling[s] = split.background;
            places[i] = if split.background { Place::Fill(s) } else { Place::Upload(s) };
            budget -= 1;
        }
        places
    }

    /// A [`Place::Fill`]'s bytes are in slot `slot` (or ordered before any
    /// later read of it): it serves hits from now on.
    pub(crate) fn commit(&mut self, slot: usize) {
        self.filling[slot] = false;
    }

    /// Slot `slot` holds nothing known: it is empty.
    pub(crate) fn forget(&mut self, slot: usize) {
        if let Some(e) = self.expert[slot].take() {
            self.slot_of[e as usize] = None;
        }
        self.filling[slot] = false;
    }

    /// A [`Place::Fill`] that did not happen: the slot is empty.
    pub(crate) fn cancel(&mut self, slot: usize) {
        if self.filling[slot] {
            if let Some(e) = self.expert[slot].take() {
                self.slot_of[e as usize] = None;
            }
            self.filling[slot] = false;
        }
    }

    /// Plans a pass of several tokens (a prompt): every chosen expert runs
    /// on the GPU, the resident ones from their slots, the others streamed
    /// through the layer's slots in rounds of at most `per_round` copies
    /// (round 0 into the slots no chosen resident expert holds, later rounds
    /// into any). `ids` holds every token's choices, token after token. The slots end up
    /// holding what was streamed into them last (LRU-fresh).
    pub(crate) fn stream(&mut self, tick: u64, ids: &[u32], per_round: usize, stats: &mut CacheStats) -> Stream {
        assert!(!self.expert.is_empty() && per_round > 0, "a streamed pass needs slots");
        debug_assert!(!self.filling.iter().any(|&f| f), "a step's fills land within it");
        for &e in ids {
            if let Some(c) = self.chosen.get_mut(e as usize) {
                *c = c.saturating_add(1);
            }
        }
        let mut used: Vec<u32> = ids.to_vec();
        used.sort_unstable();
        used.dedup();
        let n_slots = self.expert.len();
        let mut slot_for = vec![u32::MAX; self.slot_of.len()];
        let mut held = vec![false; n_slots];
        let mut misses = Vec::new();
        for &e in &used {
            match self.slot_of[e as usize] {
                Some(s) => {
                    slot_for[e as usize] = s;
                    held[s as usize] = true;
                    self.used[s as usize] = tick;
                }
                None => misses.push(e),
            }
        }
        let hit_pairs = ids.iter().filter(|&&e| self.slot_of[e as usize].is_some()).count();
        stats.hits += hit_pairs as u64;
        stats.misses += (ids.len() - hit_pairs) as u64;
        // Each round's experts (with their slots) and which of them are copied.
        let free0: Vec<usize> = (0..n_slots).filter(|&s| !held[s]).collect();
        let first = misses.len().min(free0.len()).min(per_round);
        let mut rounds: Vec<Vec<(u32, usize, bool)>> = vec![used.iter().filter(|&&e| slot_for[e as usize] != u32::MAX).map(|&e| (e, slot_for[e as usize] as usize, false)).collect()];
        rounds[0].extend(misses[..first].iter().zip(&free0).map(|(&e, &s)| (e, s, true)));
        for chunk in misses[first..].chunks(n_slots.min(per_round)) {
            rounds.push(chunk.iter().enumerate().map(|(s, &e)| (e, s, true)).collect());
        }
        let mut round_of = vec![0usize; self.slot_of.len()];
        for (r, round) in rounds.iter().enumerate() {
            for &(e, s, copy) in round {
                (slot_for[e as usize], round_of[e as usize]) = (s as u32, r);
                if copy {
                    if let Some(old) = self.expert[s].replace(e) {
                        self.slot_of[old as usize] = None;
                    }
                    self.slot_of[e as usize] = Some(s as u32);
                    self.used[s] = tick;
                }
            }
        }
        // The pairs round by round, each round's grouped by slot (then pass order).
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&p| (round_of[ids[p as usize] as usize], slot_for[ids[p as usize] as usize], p));
        let mut start = 0;
        let rounds = rounds
            .iter()
            .enumerate()
            .map(|(r, x)| {
                let count = order[start..].iter().take_while(|&&p| round_of[ids[p as usize] as usize] == r).count();
                let round = Round { start, count, copies: x.iter().filter(|c| c.2).map(|&(e, s, _)| (s, e)).collect() };
                start += count;
                round
            })
            .collect::<Vec<_>>();
        stats.uploads += rounds.iter().map(|r| r.copies.len() as u64).sum::<u64>();
        debug_assert_eq!(start, ids.len());
        Stream { pair_slot: ids.iter().map(|&e| slot_for[e as usize]).collect(), order, rounds }
    }

    /// Marks `experts` resident in the first slots (a warm start).
    pub(crate) fn fill(&mut self, experts: &[u32]) {
        for (s, &e) in experts.iter().take(self.expert.len()).enumerate() {
            self.filling[s] = false;
            if let Some(old) = self.expert[s] {
                self.slot_of[old as usize] = None;
            }
            self.expert[s] = Some(e);
            self.slot_of[e as usize] = Some(s as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_UPLOADS: Split = Split { host_bytes_per_s: 1.0, upload_bytes_per_s: 0.0, forced: None, background: false };
    /// Uploads as fast as the host: a second sighting admits.
    const FAST_UPLOADS: Split = Split { host_bytes_per_s: 1e9, upload_bytes_per_s: 1e9, forced: None, background: false };
    /// Slow uploads, but fills in the background: a second sighting admits.
    const FILLS: Split = Split { host_bytes_per_s: 10e9, upload_bytes_per_s: 1e9, forced: None, background: true };

    #[test]
    fn second_sightings_are_admitted_and_lru_evicts() {
        let mut l = LayerSlots::new(2, 8);
        let mut st = CacheStats::default();
        // First sightings run on the host.
        assert_eq!(l.place(1, &[3, 4], &FAST_UPLOADS, &mut st), [Place::Host, Place::Host]);
        // Seen again: uploaded into the two empty slots.
        assert_eq!(l.place(2, &[3, 4], &FAST_UPLOADS, &mut st), [Place::Upload(0), Place::Upload(1)]);
        assert_eq!(l.place(3, &[4, 3], &FAST_UPLOADS, &mut st), [Place::Hit(1), Place::Hit(0)]);
        // 5 seen twice while 3 is in use: evicts 4 (not used this token), not 3.
        l.place(4, &[3, 5], &FAST_UPLOADS, &mut st);
        assert_eq!(l.place(5, &[3, 5], &FAST_UPLOADS, &mut st), [Place::Hit(0), Place::Upload(1)]);
        assert_eq!(l.slot_of[4], None);
        assert_eq!(st, CacheStats { hits: 4, misses: 6, ..Default::default() });
        // Without upload bandwidth nothing is admitted.
        let mut l = LayerSlots::new(2, 8);
        l.place(1, &[3], &NO_UPLOADS, &mut st);
        assert_eq!(l.place(2, &[3], &NO_UPLOADS, &mut st), [Place::Host]);
        // Sightings decay: one long ago counts for little.
        let mut l = LayerSlots::new(2, 8);
        l.place(1, &[3], &FAST_UPLOADS, &mut st);
        assert_eq!(l.place(2 + 4 * HALF_LIFE as u64, &[3], &FAST_UPLOADS, &mut st), [Place::Host]);
        assert_eq!(l.place(3 + 4 * HALF_LIFE as u64, &[3], &FAST_UPLOADS, &mut st), [Place::Upload(0)]);
    }

    #[test]
    fn slow_uploads_need_hot_experts() {
        // Uploads ten times slower than the host: ten recent misses admit.
        let slow = Split { host_bytes_per_s: 10e9, upload_bytes_per_s: 1e9, forced: None, background: false };
        assert_eq!(slow.admit_at(), 10.0);
        assert_eq!(Split { forced: Some(4.0), ..slow }.admit_at(), 4.0);
        assert_eq!(Split { forced: Some(4.0), ..FILLS }.admit_at(), 4.0);
        let mut l = LayerSlots::new(1, 8);
        let mut st = CacheStats::default();
        let places: Vec<Place> = (1..=10).map(|t| l.place(t, &[6], &slow, &mut st)[0]).collect();
        assert!(places[..9].iter().all(|p| *p == Place::Host), "{places:?}");
        assert_eq!(places[9], Place::Upload(0));
        // An expert seen once every few hundred tokens never is.
        let mut l = LayerSlots::new(1, 8);
        assert!((1..=20).all(|i| l.place(i * 300, &[2], &slow, &mut st)[0] == Place::Host));
    }

    #[test]
    fn a_full_token_never_evicts_its_own_experts() {
        let mut l = LayerSlots::new(1, 8);
        let mut st = CacheStats::default();
        l.place(1, &[1, 2], &FAST_UPLOADS, &mut st);
        assert_eq!(l.place(2, &[1, 2], &FAST_UPLOADS, &mut st), [Place::Upload(0), Place::Host]);
        assert_eq!(l.place(3, &[2, 1], &FAST_UPLOADS, &mut st), [Place::Host, Place::Hit(0)]);
        assert_eq!(MAX_UPLOADS, 2);
    }

    #[test]
    fn fills_serve_hits_once_committed() {
        assert_eq!(FILLS.admit_at(), 2.0);
        let mut l = LayerSlots::new(2, 8);
        let mut st = CacheStats::default();
        assert_eq!(l.place(1, &[3, 4], &FILLS, &mut st), [Place::Host, Place::Host]);
        // Seen again: computed on the host once more, its slot reserved.
        assert_eq!(l.place(2, &[3, 4], &FILLS, &mut st), [Place::Fill(0), Place::Fill(1)]);
        // Not committed yet: still misses, and not admitted a second time.
        assert_eq!(l.place(3, &[3, 4], &FILLS, &mut st), [Place::Host, Place::Host]);
        assert!(!l.holds(3) && !l.holds(4) && !l.holds(7) && !l.holds(99));
        l.commit(0);
        assert!(l.holds(3) && !l.holds(4));
        assert_eq!(l.place(4, &[3, 4], &FILLS, &mut st), [Place::Hit(0), Place::Host]);
        // A slot being filled is never a victim: 5 and 6 find no slot while 0 is
        // in use and 1 fills; once 1 is cancelled (empty), 5 takes it.
        l.place(5, &[5, 6], &FILLS, &mut st);
        assert_eq!(l.place(6, &[3, 5, 6], &FILLS, &mut st), [Place::Hit(0), Place::Host, Place::Host]);
        l.cancel(1);
        assert_eq!(l.place(7, &[4], &FILLS, &mut st), [Place::Host]);
        assert_eq!(l.place(8, &[3, 5], &FILLS, &mut st), [Place::Hit(0), Place::Fill(1)]);
        // Cancelling a committed slot changes nothing.
        l.cancel(0);
        assert_eq!(l.place(9, &[3], &FILLS, &mut st), [Place::Hit(0)]);
    }

    #[test]
    fn a_pass_streams_its_misses_through_the_slots() {
        let mut l = LayerSlots::new(2, 8);
        l.fill(&[1, 2]);
        let mut st = CacheStats::default();
        // Three tokens, two choices each; 1 resident, 3, 4 and 5 not.
        let plan = l.stream(5, &[1, 3, 4, 1, 5, 3], 8, &mut st);
        assert_eq!(plan.pair_slot, [0, 1, 0, 0, 1, 1]);
        assert_eq!(plan.order, [0, 3, 1, 5, 2, 4]);
        assert_eq!(plan.rounds, [Round { start: 0, count: 4, copies: vec![(1, 3)] }, Round { start: 4, count: 2, copies: vec![(0, 4), (1, 5)] }]);
        assert_eq!(st, CacheStats { hits: 2, misses: 4, uploads: 3, ..Default::default() });
        // The slots hold what was streamed last.
        assert_eq!(l.place(6, &[4, 5, 1], &FAST_UPLOADS, &mut st)[..2], [Place::Hit(0), Place::Hit(1)]);
        // Rounds of one copy.
        let mut l = LayerSlots::new(2, 8);
        let plan = l.stream(1, &[6, 7, 6], 1, &mut st);
        assert_eq!(plan.rounds.iter().map(|r| (r.count, r.copies.len())).collect::<Vec<_>>(), [(2, 1), (1, 1)]);
        assert_eq!(plan.order, [0, 2, 1]);
    }
}
