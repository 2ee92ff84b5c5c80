//! Offline replay of routing traces ([`super::trace`]) through per-layer
//! expert caches: the hit rate each cache policy would have had, per slot
//! count, without a GPU or a model.
//!
//! Every layer has its own cache of `slots` experts, as in the engine. A
//! token's chosen experts are looked up together (all hits first), then its
//! misses are placed; a miss never evicts an expert the same token uses. A
//! hit rate is hits over routed expert uses, summed over layers (and
//! windows). Policies:
//!
//! * `lru`: every miss is inserted, evicting the least recently used expert;
//!   the cache starts empty.
//! * `lfu`: every miss is inserted, evicting the least often used expert
//!   (uses since the window started; ties to the least recently used).
//! * `pin-frequent`: each layer's `slots` most chosen experts by a routing
//!   profile are loaded at their first use and never evicted; nothing else
//!   is ever cached. With windows, a window's profile is the other windows' choices (a
//!   profile of another run); a single window is replayed with its own
//!   profile (an oracle that knows which experts the run will choose).
//! * `engine[:A]`: the engine's own policy, the very code of the Vulkan
//!   expert cache ([`crate::model::expert_policy`]): slots filled at load
//!   with the first experts (as without a routing profile), LRU eviction,
//!   a miss admitted once its decayed miss count reaches `A` (default 2, the
//!   least the engine uses: uploads as fast as the host computes), at most
//!   two uploads per layer and token. `engine-profile[:A]` fills the slots
//!   with the profile's most chosen experts instead (`--routing-profile`).
//! * `opt`: Belady's optimum with bypass: a miss evicts the resident expert
//!   used again farthest in the future, or is not cached when it is itself
//!   the farthest: the bound for caches that start empty.
//!
//! With `window`, the trace is cut into consecutive windows of that many
//! tokens, each replayed from a fresh cache (the published figures are
//! single runs of a few hundred tokens from a cold cache).

use super::trace::Trace;
use crate::error::{Error, Result};
use crate::model::expert_policy::{CacheStats, LayerSlots, Split};
use serde::Serialize;
use std::fmt;

/// A cache policy to replay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    Lru,
    Lfu,
    PinFrequent,
    /// The engine's policy with this admission threshold; warm from the
    /// trace's own profile when `profile`.
    Engine {
        admit_at: f32,
        profile: bool,
    },
    Optimal,
}

impl std::str::FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Policy> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let admit_at = || match arg {
            None => Ok(2.0),
            Some(a) => a
                .parse::<f32>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 2.0)
                .ok_or_else(|| Error::arg(format!("policy {s:?}: the engine admits at 2 misses or more"))),
        };
        match (name, arg) {
            ("lru", None) => Ok(Policy::Lru),
            ("lfu", None) => Ok(Policy::Lfu),
            ("pin-frequent", None) => Ok(Policy::PinFrequent),
            ("opt", None) => Ok(Policy::Optimal),
            ("engine", _) => Ok(Policy::Engine {
                admit_at: admit_at()?,
                profile: false,
            }),
            ("engine-profile", _) => Ok(Policy::Engine {
                admit_at: admit_at()?,
                profile: true,
            }),
            _ => Err(Error::arg(format!(
                "unknown policy {s:?}: expected lru, lfu, pin-frequent, engine[:A], engine-profile[:A] or opt"
            ))),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Lru => write!(f, "lru"),
            Policy::Lfu => write!(f, "lfu"),
            Policy::PinFrequent => write!(f, "pin-frequent"),
            Policy::Engine { admit_at, profile } => {
                write!(f, "engine{}", if *profile { "-profile" } else { "" })?;
                if *admit_at != 2.0 {
                    write!(f, ":{admit_at}")?;
                }
                Ok(())
            }
            Policy::Optimal => write!(f, "opt"),
        }
    }
}

/// What to replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Slots per layer; empty = the published sizes (93, 186, 279, 372 of
    /// 512) scaled to the trace's expert count.
    pub slots: Vec<usize>,
    pub policies: Vec<Policy>,
    /// Tokens per window replayed from a fresh cache; `None` = the whole trace.
    pub window: Option<usize>,
    /// Tokens dropped from the start (e.g. a prompt).
    pub skip: usize,
    /// Tokens over which distinct experts are counted.
    pub distinct_over: usize,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            slots: Vec::new(),
            policies: vec![
                Policy::Lru,
                Policy::Engine {
                    admit_at: 2.0,
                    profile: false,
                },
                Policy::Lfu,
                Policy::PinFrequent,
                Policy::Optimal,
            ],
            window: None,
            skip: 0,
            distinct_over: 300,
        }
    }
}

/// One policy at one slot count.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    pub slots: usize,
    pub hits: u64,
    pub uses: u64,
    pub hit_rate: f64,
    /// Hit rate of each layer.
    pub per_layer: Vec<f64>,
}

/// Everything a replay found.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    pub layers: usize,
    pub experts: usize,
    pub k: usize,
    /// Tokens replayed (after `skip`, whole windows only).
    pub tokens: usize,
    pub windows: usize,
    pub window_tokens: usize,
    /// Distinct experts each layer chose in the first `distinct_tokens`
    /// replayed tokens, and what uniform routing would choose on average.
    pub distinct_tokens: usize,
    pub distinct_per_layer: Vec<usize>,
    pub distinct_uniform: f64,
    /// Hit rate of a cache that never evicts (100% minus first sightings).
    pub unbounded_hit_rate: f64,
    /// Whether the routing profile of `pin-frequent` and `engine-profile`
    /// came from the replayed tokens themselves (a single window).
    pub profile_is_oracle: bool,
    pub results: Vec<PolicyResult>,
}

/// Replays `trace` per `opts`.
pub fn replay(trace: &Trace, opts: &ReplayOptions) -> Result<ReplayReport> {
    let trace = trace.slice(opts.skip..trace.tokens());
    let total = trace.tokens();
    let window = opts.window.unwrap_or(total).min(total);
    if window == 0 {
        return Err(Error::arg(format!(
            "nothing to replay: the trace has {total} tokens after skipping {}",
            opts.skip
        )));
    }
    let windows = total / window;
    let (e, k) = (trace.experts, trace.k);
    let slots: Vec<usize> = if opts.slots.is_empty() {
        [93, 186, 279, 372].iter().map(|s| (s * e).div_ceil(512)).collect()
    } else {
        opts.slots.clone()
    };
    if let Some(s) = slots.iter().find(|&&s| s == 0 || s > e) {
        return Err(Error::arg(format!("{s} slots per layer: expected 1..={e}")));
    }
    let ranges: Vec<std::ops::Range<usize>> = (0..windows).map(|w| w * window..(w + 1) * window).collect();
    let count = |l: usize, r: std::ops::Range<usize>| {
        let mut c = vec![0u32; e];
        r.for_each(|t| trace.ids(t, l).iter().for_each(|&x| c[x as usize] += 1));
        c
    };
    // The profile each window is replayed with: the other windows' choices
    // (a profile of another run), or its own when it is the only one.
    let profiles: Vec<Vec<Vec<u32>>> = (0..trace.layers)
        .map(|l| {
            let all = count(l, 0..windows * window);
            ranges
                .iter()
                .map(|r| {
                    if windows == 1 {
                        all.clone()
                    } else {
                        all.iter().zip(count(l, r.clone())).map(|(a, w)| a - w).collect()
                    }
                })
                .collect()
        })
        .collect();

    let mut results = Vec::new();
    for &policy in &opts.policies {
        for &s in &slots {
            let per_layer: Vec<(u64, u64)> = (0..trace.layers)
                .map(|l| {
                    ranges.iter().zip(&profiles[l]).fold((0, 0), |(h, u), (r, profile)| {
                        let hits = replay_layer(&trace, l, r.clone(), policy, s, profile);
                        (h + hits, u + (r.len() * k) as u64)
                    })
                })
                .collect();
            let (hits, uses) = per_layer.iter().fold((0, 0), |(h, u), (a, b)| (h + a, u + b));
            results.push(PolicyResult {
                policy: policy.to_string(),
                slots: s,
                hits,
                uses,
                hit_rate: hits as f64 / uses.max(1) as f64,
                per_layer: per_layer.iter().map(|(h, u)| *h as f64 / (*u).max(1) as f64).collect(),
            });
        }
    }

    let n = opts.distinct_over.min(total);
    let distinct_per_layer: Vec<usize> = (0..trace.layers)
        .map(|l| {
            let mut seen = vec![false; e];
            (0..n).for_each(|t| trace.ids(t, l).iter().for_each(|&x| seen[x as usize] = true));
            seen.iter().filter(|&&b| b).count()
        })
        .collect();
    let first_sightings: usize = (0..trace.layers)
        .map(|l| {
            ranges
                .iter()
                .map(|r| {
                    let mut seen = vec![false; e];
                    r.clone()
                        .flat_map(|t| trace.ids(t, l).iter())
                        .filter(|&&x| !std::mem::replace(&mut seen[x as usize], true))
                        .count()
                })
                .sum::<usize>()
        })
        .sum();
    let uses = (windows * window * k * trace.layers).max(1);
    Ok(ReplayReport {
        layers: trace.layers,
        experts: e,
        k,
        tokens: windows * window,
        windows,
        window_tokens: window,
        distinct_tokens: n,
        distinct_per_layer,
        distinct_uniform: e as f64 * (1.0 - (1.0 - k as f64 / e as f64).powi(n as i32)),
        unbounded_hit_rate: 1.0 - first_sightings as f64 / uses as f64,
        profile_is_oracle: windows == 1,
        results,
    })
}

/// Hits of layer `layer` over tokens `range` under `policy` with `slots`
/// slots; `counts` is the layer's routing profile (choices per expert).
fn replay_layer(
    trace: &Trace,
    layer: usize,
    range: std::ops::Range<usize>,
    policy: Policy,
    slots: usize,
    counts: &[u32],
) -> u64 {
    let ids = |t: usize| trace.ids(t, layer);
    let e = trace.experts;
    let mut hits = 0u64;
    match policy {
        Policy::PinFrequent => {
            let mut top: Vec<usize> = (0..e).collect();
            top.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
            let mut pinned = vec![false; e];
            top[..slots].iter().for_each(|&x| pinned[x] = true);
            // Like every other cache here, it starts empty: a pinned expert is loaded at its first use.
            let mut loaded = vec![false; e];
            for t in range {
                for &x in ids(t) {
                    let x = x as usize;
                    hits += loaded[x] as u64;
                    loaded[x] |= pinned[x];
                }
            }
        }
        Policy::Engine { admit_at, profile } => {
            let mut cache = LayerSlots::new(slots, e);
            let warm: Vec<u32> = if profile {
                crate::model::profile::RoutingProfile::new(vec![counts.to_vec()]).top(0, slots)
            } else {
                (0..slots as u32).collect()
            };
            cache.fill(&warm);
            let split = Split { host_bytes_per_s: 1.0, upload_bytes_per_s: 1.0, forced: Some(admit_at), background: false };
            let mut stats = CacheStats::default();
            // The engine's ticks start at 1 and advance before each token.
            for (i, t) in range.enumerate() {
                let chosen: Vec<u32> = ids(t).iter().map(|&x| x as u32).collect();
                cache.place(i as u64 + 2, &chosen, &split, &mut stats);
            }
            hits = stats.hits;
        }
        Policy::Lru | Policy::Lfu | Policy::Optimal => {
            // Per expert: last use (0 = never), uses, next use (offset in the range); resident or not.
            let mut last = vec![0u64; e];
            let mut uses = vec![0u32; e];
            let mut next_of = vec![usize::MAX; e];
            let mut resident = vec![false; e];
            let mut n_resident = 0;
            let next = if policy == Policy::Optimal {
                next_uses(trace, layer, range.clone())
            } else {
                Vec::new()
            };
            for (i, t) in range.enumerate() {
                let tick = i as u64 + 1;
                let chosen = ids(t);
                for (r, &x) in chosen.iter().enumerate() {
                    let x = x as usize;
                    hits += resident[x] as u64;
                    last[x] = tick;
                    uses[x] += 1;
                    if let Some(n) = next.get(i * trace.k + r) {
                        next_of[x] = *n;
                    }
                }
                for &x in chosen {
                    let x = x as usize;
                    if resident[x] {
                        continue;
                    }
                    if n_resident < slots {
                        resident[x] = true;
                        n_resident += 1;
                        continue;
                    }
                    // A victim among the residents this token does not use.
                    let candidates = (0..e).filter(|&y| resident[y] && last[y] < tick);
                    let victim = match policy {
                        Policy::Lru => candidates.min_by_key(|&y| last[y]),
                        Policy::Lfu => candidates.min_by_key(|&y| (uses[y], last[y])),
                        _ => candidates
                            .max_by_key(|&y| (next_of[y], std::cmp::Reverse(y)))
                            .filter(|&y| next_of[y] > next_of[x]),
                    };
                    if let Some(v) = victim {
                        resident[v] = false;
                        resident[x] = true;
                    }
                }
            }
        }
    }
    hits
}

/// For each (token, rank) of the layer over `range`, the offset in `range`
/// of the token that next chooses the same expert (`usize::MAX` if none).
fn next_uses(trace: &Trace, layer: usize, range: std::ops::Range<usize>) -> Vec<usize> {
    let k = trace.k;
    let mut next = vec![usize::MAX; range.len() * k];
    let mut seen = vec![usize::MAX; trace.experts];
    for i in (0..range.len()).rev() {
        for (r, &x) in trace.ids(range.start + i, layer).iter().enumerate() {
            next[i * k + r] = seen[x as usize];
        }
        for &x in trace.ids(range.start + i, layer) {
            seen[x as usize] = i;
        }
    }
    next
}

impl ReplayReport {
    /// A table: hit rates in percent, one row per slot count, one column per policy.
    pub fn summary(&self) -> String {
        let mut lines = Vec::new();
        lines.push(format!(
            "{} layers of {} experts, top {}; {} tokens replayed as {} window{} of {} from a fresh cache",
            self.layers,
            self.experts,
            self.k,
            self.tokens,
            self.windows,
            if self.windows == 1 { "" } else { "s" },
            self.window_tokens
        ));
        let d = &self.distinct_per_layer;
        let mean = d.iter().sum::<usize>() as f64 / d.len().max(1) as f64;
        lines.push(format!(
            "distinct experts per layer in the first {} tokens: mean {:.1} ({:.1}%), min {}, max {}; uniform routing: {:.1}",
            self.distinct_tokens,
            mean,
            100.0 * mean / self.experts as f64,
            d.iter().min().unwrap_or(&0),
            d.iter().max().unwrap_or(&0),
            self.distinct_uniform
        ));
        lines.push(format!(
            "a cache that never evicts: {:.1}% (the rest are first sightings)",
            100.0 * self.unbounded_hit_rate
        ));
        lines.push(
            if self.profile_is_oracle {
                "routing profiles (pin-frequent, engine-profile): the replayed tokens' own (an oracle)"
            } else {
                "routing profiles (pin-frequent, engine-profile): the other windows' choices"
            }
            .to_string(),
        );
        let mut policies: Vec<&str> = Vec::new();
        let mut slots: Vec<usize> = Vec::new();
        for r in &self.results {
            if !policies.contains(&r.policy.as_str()) {
                policies.push(&r.policy);
            }
            if !slots.contains(&r.slots) {
                slots.push(r.slots);
            }
        }
        let width = policies.iter().map(|p| p.len()).max().unwrap_or(0).max(6);
        let mut head = format!("{:>12}", "hit rate %");
        policies.iter().for_each(|p| head += &format!("  {p:>width$}"));
        lines.push(head);
        for s in &slots {
            let mut row = format!("{:>6} slots", s);
            for p in &policies {
                let r = self
                    .results
                    .iter()
                    .find(|r| r.slots == *s && r.policy == *p)
                    .expect("every pair replayed");
                row += &format!("  {:>width$.1}", 100.0 * r.hit_rate);
            }
            lines.push(row);
        }
        lines.join("\n")
    }

    /// Per-layer hit rates of `policy`, one row per layer.
    pub fn per_layer(&self, policy: &str) -> String {
        let rows: Vec<&PolicyResult> = self.results.iter().filter(|r| r.policy == policy).collect();
        let mut lines = vec![format!(
            "{policy} per layer: {}",
            rows.iter()
                .map(|r| format!("{:>6}", r.slots))
                .collect::<Vec<_>>()
                .join(" ")
        )];
        for l in 0..self.layers {
            let vals: Vec<String> = rows
                .iter()
                .map(|r| format!("{:>6.1}", 100.0 * r.per_layer[l]))
                .collect();
            lines.push(format!(
                "{:>width$} {l:>5}: {}",
                "layer",
                vals.join(" "),
                width = policy.len() + 4
            ));
        }
        lines.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One layer, top 2 of 6 experts.
    fn trace(tokens: &[[u16; 2]]) -> Trace {
        let mut t = Trace::new(1, 6, 2).unwrap();
        tokens.iter().for_each(|ids| t.push_token(ids).unwrap());
        t
    }

    fn hits(t: &Trace, policy: &str, slots: usize) -> u64 {
        let opts = ReplayOptions {
            slots: vec![slots],
            policies: vec![policy.parse().unwrap()],
            ..Default::default()
        };
        replay(t, &opts).unwrap().results[0].hits
    }

    #[test]
    fn policies_on_a_known_trace() {
        let t = trace(&[[0, 1], [0, 2], [1, 3], [0, 1], [4, 5], [0, 1]]);
        // LRU, 3 slots: 0 1 miss | 0 hits, 2 in | 1 hits, 3 evicts 0 (0 and 2 last used at
        // token 2: the lower id goes) | 0 misses (evicts 2), 1 hits | 4 5 miss (evict 3, 0) | 0 misses, 1 hits.
        assert_eq!(hits(&t, "lru", 3), 4);
        // Everything fits: only first sightings miss.
        assert_eq!(hits(&t, "lru", 6), 12 - 6);
        assert_eq!(hits(&t, "opt", 6), 6);
        // Pinning the two most chosen (0: 4 times, 1: 4 times) hits 8 of 12, less their first uses.
        assert_eq!(hits(&t, "pin-frequent", 2), 6);
        // Belady never does worse than LRU or LFU from the same empty start.
        for s in 1..=6 {
            let opt = hits(&t, "opt", s);
            assert!(opt >= hits(&t, "lru", s) && opt >= hits(&t, "lfu", s), "{s} slots");
        }
    }

    #[test]
    fn lru_and_lfu_evict_differently() {
        // One expert per token, 2 slots.
        let mut t = Trace::new(1, 4, 1).unwrap();
        for x in [0u16, 0, 0, 1, 2, 0, 1] {
            t.push_token(&[x]).unwrap();
        }
        // LRU: 0 m, 0 h, 0 h, 1 m, 2 m (evicts 0), 0 m (evicts 1), 1 m -> 2 hits.
        assert_eq!(hits(&t, "lru", 2), 2);
        // LFU: 2 evicts 1 (1 use vs 3), 0 hits, 1 evicts 2 -> 3 hits.
        assert_eq!(hits(&t, "lfu", 2), 3);
        // Optimal: 2 bypasses (never used again) -> 0 and 1 hit: 4 hits.
        assert_eq!(hits(&t, "opt", 2), 4);
    }

    #[test]
    fn the_engine_policy_is_the_engines_code() {
        // Starts with the first experts resident; a second sighting is admitted (threshold 2).
        let t = trace(&[[0, 4], [4, 5], [4, 5], [1, 5]]);
        // Slots {0, 1}: 0 hits, 4 misses | 4 admitted at its second miss (evicting 1, the least
        // recently used), 5 misses | 4 hits, 5 admitted (evicting 0) | 1 misses, 5 hits.
        assert_eq!(hits(&t, "engine", 2), 1 + 1 + 1); // per token: 1, 0, 1, 1
        // A profile of the trace warms the cache with 4 and 5 (chosen three times each).
        assert_eq!(hits(&t, "engine-profile", 2), 1 + 2 + 2 + 1);
        // An admission threshold that is never reached keeps the first experts.
        assert_eq!(hits(&t, "engine:100", 2), 1 + 1);
        assert_eq!("engine:3".parse::<Policy>().unwrap().to_string(), "engine:3");
        assert!("engine:1".parse::<Policy>().is_err() && "lru:2".parse::<Policy>().is_err());
    }

    #[test]
    fn windows_restart_cold_and_report_distinct_experts() {
        let t = trace(&[[0, 1], [0, 1], [0, 1], [0, 1]]);
        let opts = ReplayOptions {
            slots: vec![2],
            policies: vec![Policy::Lru],
            window: Some(2),
            distinct_over: 3,
            ..Default::default()
        };
        let r = replay(&t, &opts).unwrap();
        assert_eq!(
            (r.windows, r.tokens, r.results[0].hits, r.results[0].uses),
            (2, 4, 4, 8)
        );
        assert_eq!(r.unbounded_hit_rate, 0.5);
        assert_eq!(r.distinct_per_layer, [2]);
        let skipped = replay(
            &t,
            &ReplayOptions {
                skip: 1,
                window: None,
                ..opts
            },
        )
        .unwrap();
        assert_eq!((skipped.tokens, skipped.results[0].hits), (3, 4));
        assert!(r.summary().contains("2 slots"), "{}", r.summary());
    }
}
