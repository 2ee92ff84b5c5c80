//! Token sampling: a fixed chain of logit transforms, then a seeded draw.
//! Works on logits from any source (`&[f32]`, one per token id).
//!
//! The chain, in order (the order of transformers' and vLLM's processors):
//!
//! 0. **Constraint** (structured output, optional): tokens the grammar
//!    forbids get `-inf` ([`crate::constraint`] explains why the mask comes
//!    first: a forbidden token can never be drawn, and every later stage
//!    renormalises over the allowed tokens only).
//! 1. **Repetition penalty** `r` over the distinct tokens among the last
//!    `penalty_last_n` accepted ones (llama.cpp / CTRL semantics): a positive
//!    logit is divided by `r`, a negative one multiplied by `r`.
//! 2. **Presence and frequency penalties** (OpenAI semantics), over every token
//!    accepted since the last reset: `logit -= count * frequency + (count > 0) * presence`.
//! 3. **Temperature** `T`: 0 means greedy (the argmax of the penalised logits,
//!    lowest id on ties). Otherwise probabilities are `softmax(logit / T)`.
//! 4. **Top-k**: the `k` highest logits survive (exactly `k`; ties broken by lower id).
//! 5. **Top-p**: the smallest set of the most likely survivors whose
//!    probability (renormalised over the survivors) reaches `p`.
//! 6. **Min-p**: survivors whose probability is at least `min_p` times the
//!    most likely one's.
//! 7. **Draw** from the softmax of the survivors with a xoshiro256** generator
//!    seeded through SplitMix64.
//!
//! The generator is written here (a few lines) rather than taken from a crate
//! so a seed gives the same tokens on every platform and in every future
//! version: crates such as `rand` do not promise stable output streams.
//!
//! Logits of `-inf` mark banned tokens and never survive; NaN or `+inf`
//! logits are refused. The penalties keep finite logits finite (saturating at
//! `±f32::MAX`), so every later stage works on finite numbers and the chain
//! always keeps at least its most likely candidate.

use crate::constraint::Constraint;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};

/// The seed value meaning "pick a random seed" (`FNX_SEED_RANDOM` in C).
pub const RANDOM_SEED: u64 = u64::MAX;

/// Settings of a [`Sampler`]. `SamplerParams::default()` leaves the model's
/// distribution untouched (temperature 1, no truncation, no penalties).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// Seed of the draw; [`RANDOM_SEED`] picks one from the system.
    pub seed: u64,
    /// 0 = greedy; otherwise a finite value > 0.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// In (0, 1]; 1 = off.
    pub top_p: f32,
    /// In [0, 1]; 0 = off.
    pub min_p: f32,
    /// > 0; 1 = off.
    pub repetition_penalty: f32,
    /// Accepted tokens the repetition penalty looks back over; 0 = off,
    /// `usize::MAX` = every token since the last reset.
    pub penalty_last_n: usize,
    /// OpenAI presence penalty (0 = off).
    pub presence_penalty: f32,
    /// OpenAI frequency penalty (0 = off).
    pub frequency_penalty: f32,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            seed: RANDOM_SEED,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            penalty_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// Names accepted by [`SamplerParams::preset`].
pub const PRESETS: [&str; 3] = ["thinking", "instruct", "greedy"];

impl SamplerParams {
    /// The recommended settings for thinking mode: temperature 1.0, top-p 0.95, top-k 20, min-p 0.
    pub fn thinking() -> Self {
        SamplerParams {
            temperature: 1.0,
            top_p: 0.95,
            top_k: 20,
            min_p: 0.0,
            ..Default::default()
        }
    }

    /// The recommended settings for instruct (non-thinking) mode: temperature
    /// 0.7, top-p 0.8, top-k 20, min-p 0, presence penalty 1.5.
    pub fn instruct() -> Self {
        SamplerParams {
            temperature: 0.7,
            top_p: 0.8,
            top_k: 20,
            min_p: 0.0,
            presence_penalty: 1.5,
            ..Default::default()
        }
    }

    /// Always the most likely token.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// A named preset (see [`PRESETS`]), or `None`.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "thinking" => Some(Self::thinking()),
            "instruct" => Some(Self::instruct()),
            "greedy" => Some(Self::greedy()),
            _ => None,
        }
    }

    /// Checks every field's range; the message names the field.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::arg(format!(
                "sampler temperature {t} must be finite and >= 0 (0 = greedy)"
            )));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(Error::arg(format!(
                "sampler top_p {p} must be in (0, 1] (1 = off)"
            )));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(Error::arg(format!(
                "sampler min_p {m} must be in [0, 1] (0 = off)"
            )));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(Error::arg(format!(
                "sampler repetition_penalty {r} must be finite and > 0 (1 = off)"
            )));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return Err(Error::arg(format!(
                    "sampler {name} {v} must be finite (0 = off)"
                )));
            }
        }
        Ok(())
    }
}

/// One surviving token and its (penalised, untempered) logit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub logit: f32,
}

/// Higher logit first; equal logits: lower id first.
fn by_logit_desc(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Divides positive logits by `penalty` and multiplies the others by it, once
/// for each distinct id in `tokens` (ids beyond `logits` are ignored). A
/// finite logit stays finite: a result beyond the f32 range saturates at
/// `±f32::MAX` (`-inf`, a banned token, stays banned).
pub fn apply_repetition_penalty(
    logits: &mut [f32],
    tokens: impl IntoIterator<Item = u32>,
    penalty: f32,
) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = std::collections::HashSet::new();
    for t in tokens {
        if !seen.insert(t) {
            continue;
        }
        if let Some(l) = logits.get_mut(t as usize) {
            let v = if *l > 0.0 { *l / penalty } else { *l * penalty };
            *l = if v.is_finite() || !l.is_finite() {
                v
            } else if *l > 0.0 {
                saturate(*l as f64 / penalty as f64)
            } else {
                saturate(*l as f64 * penalty as f64)
            };
        }
    }
}

/// `x` rounded to the nearest finite f32 (the largest magnitude on overflow).
fn saturate(x: f64) -> f32 {
    x.clamp(-(f32::MAX as f64), f32::MAX as f64) as f32
}

/// OpenAI presence/frequency penalties: `logit -= count * frequency + presence`
/// for each `(id, count)` with `count > 0`. A finite logit stays finite (the
/// result saturates at `±f32::MAX`).
pub fn apply_presence_frequency(
    logits: &mut [f32],
    counts: impl IntoIterator<Item = (u32, u32)>,
    presence: f32,
    frequency: f32,
) {
    if presence == 0.0 && frequency == 0.0 {
        return;
    }
    for (t, c) in counts {
        if c == 0 {
            continue;
        }
        if let Some(l) = logits.get_mut(t as usize) {
            let v = *l - (c as f32 * frequency + presence);
            *l = if v.is_finite() || !l.is_finite() {
                v
            } else {
                saturate(*l as f64 - (c as f64 * frequency as f64 + presence as f64))
            };
        }
    }
}

/// Keeps the `k` highest logits (all when `k` is 0 or at least the count),
/// sorted highest first.
pub fn top_k(cands: &mut Vec<Candidate>, k: usize) {
    if k > 0 && k < cands.len() {
        cands.select_nth_unstable_by(k - 1, by_logit_desc);
        cands.truncate(k);
    }
    cands.sort_by(by_logit_desc);
}

/// Unnormalised weights `exp((logit - max) / T)` of `cands`, in f64.
fn weights(cands: &[Candidate], temperature: f32) -> Vec<f64> {
    let max = cands
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let t = temperature as f64;
    cands
        .iter()
        .map(|c| ((c.logit as f64 - max) / t).exp())
        .collect()
}

/// Softmax of `cands` at `temperature` (> 0), in their order.
pub fn softmax(cands: &[Candidate], temperature: f32) -> Vec<f64> {
    let w = weights(cands, temperature);
    let sum: f64 = w.iter().sum();
    w.into_iter().map(|x| x / sum).collect()
}

/// Keeps the smallest prefix of the most likely candidates whose probability
/// at `temperature` reaches `p` (at least one). Leaves `cands` sorted.
pub fn top_p(cands: &mut Vec<Candidate>, p: f32, temperature: f32) {
    if p >= 1.0 || cands.len() <= 1 {
        return;
    }
    cands.sort_by(by_logit_desc);
    let probs = softmax(cands, temperature);
    let mut cum = 0.0;
    let mut keep = cands.len();
    for (i, q) in probs.iter().enumerate() {
        cum += q;
        if cum >= p as f64 {
            keep = i + 1;
            break;
        }
    }
    cands.truncate(keep);
}

/// Keeps the candidates whose probability at `temperature` is at least
/// `p` times the largest one's. Order is preserved.
pub fn min_p(cands: &mut Vec<Candidate>, p: f32, temperature: f32) {
    if p <= 0.0 || cands.len() <= 1 {
        return;
    }
    let w = weights(cands, temperature);
    // The most likely candidate has weight 1, so it always survives; a NaN
    // weight (only possible from non-finite logits) must not empty the set.
    if !w.iter().any(|&x| x >= p as f64) {
        return;
    }
    let mut i = 0;
    cands.retain(|_| {
        let keep = w[i] >= p as f64;
        i += 1;
        keep
    });
}

/// Refuses what no sampler accepts: no logits at all, a NaN or a `+inf`.
fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::arg("sampler: no logits (length 0)"));
    }
    if let Some(bad) = logits.iter().position(|l| l.is_nan() || *l == f32::INFINITY) {
        return Err(Error::arg(format!(
            "sampler: logit {bad} is {} (NaN and +inf are refused)",
            logits[bad]
        )));
    }
    Ok(())
}

/// The greedy choice: the highest logit, lowest id on ties. The same rule
/// as a temperature-0 [`Sampler`] without penalties: NaN or `+inf` logits
/// are refused, and so are logits that are all `-inf`.
pub fn greedy(logits: &[f32]) -> Result<u32> {
    check_logits(logits)?;
    match argmax(logits) {
        Some(i) if logits[i as usize] != f32::NEG_INFINITY => Ok(i),
        _ => Err(Error::arg("sampler: every logit is -inf (no token can be drawn)")),
    }
}

/// Index of the largest finite-or-infinite logit, lowest on ties; `None` when
/// empty. Unchecked: with NaN logits the answer is meaningless (see
/// [`greedy`] for the checked choice).
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// SplitMix64 step (Vigna): used to expand a seed into generator state.
pub fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256** (Blackman and Vigna), seeded from SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        Rng {
            s: [
                splitmix64(&mut x),
                splitmix64(&mut x),
                splitmix64(&mut x),
                splitmix64(&mut x),
            ],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    match h.finish() {
        RANDOM_SEED => 0,
        s => s,
    }
}

/// A sampler: the chain's settings, the generator, the accepted-token
/// history the penalties read and an optional [`Constraint`]. Use from one
/// thread at a time. A clone carries its own copy of the constraint's state.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplerParams,
    /// The seed in use (a drawn one when the params asked for a random seed).
    seed: u64,
    rng: Rng,
    /// The last `penalty_last_n` accepted tokens, oldest first.
    window: VecDeque<u32>,
    /// Occurrences of each token since the last reset.
    counts: HashMap<u32, u32>,
    /// Structured output: the grammar the sampled tokens must follow.
    constraint: Option<Constraint>,
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Result<Self> {
        params.validate()?;
        let seed = if params.seed == RANDOM_SEED {
            random_seed()
        } else {
            params.seed
        };
        Ok(Sampler {
            params,
            seed,
            rng: Rng::new(seed),
            window: VecDeque::new(),
            counts: HashMap::new(),
            constraint: None,
        })
    }

    /// Sets (or with `None` removes) the grammar the sampled tokens must
    /// follow. The constraint starts where it is (a fresh one at the start
    /// of its grammar); the other state of the sampler is kept.
    pub fn set_constraint(&mut self, constraint: Option<Constraint>) {
        self.constraint = constraint;
    }

    /// The constraint, if one is set.
    pub fn constraint(&self) -> Option<&Constraint> {
        self.constraint.as_ref()
    }

    /// Whether the constraint is complete (nothing but the end of the text
    /// may follow); false without a constraint.
    pub fn is_finished(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::is_finished)
    }

    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// The seed in use (the drawn one if the params asked for a random seed).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Records a token as part of the text (for the penalties) and advances
    /// the constraint by it (a token the constraint forbids makes the next
    /// [`sample`](Self::sample) fail, until [`reset`](Self::reset)).
    pub fn accept(&mut self, token: u32) {
        if let Some(c) = &mut self.constraint {
            c.accept(token);
        }
        *self.counts.entry(token).or_insert(0) += 1;
        let n = self.params.penalty_last_n;
        if n > 0 {
            self.window.push_back(token);
            while self.window.len() > n {
                self.window.pop_front();
            }
        }
    }

    /// Forgets the accepted tokens, restarts the generator from the seed and
    /// the constraint from the start of its grammar: the same logits then
    /// give the same tokens again.
    pub fn reset(&mut self) {
        if let Some(c) = &mut self.constraint {
            c.reset();
        }
        self.window.clear();
        self.counts.clear();
        self.rng = Rng::new(self.seed);
    }

    /// `logits` after both penalties (a copy; the input is not modified).
    pub fn penalized(&self, logits: &[f32]) -> Vec<f32> {
        let mut l = logits.to_vec();
        let p = &self.params;
        apply_repetition_penalty(&mut l, self.window.iter().copied(), p.repetition_penalty);
        apply_presence_frequency(
            &mut l,
            self.counts.iter().map(|(&t, &c)| (t, c)),
            p.presence_penalty,
            p.frequency_penalty,
        );
        l
    }

    /// The survivors of the whole chain (before the draw), with their
    /// penalised logits. Greedy (temperature 0) leaves only the argmax (of
    /// the tokens the constraint allows).
    pub fn candidates(&self, logits: &[f32]) -> Result<Vec<Candidate>> {
        check_logits(logits)?;
        let mut penalized = self.penalized(logits);
        // The penalties keep -inf as -inf, so masking after them is masking
        // before them.
        if let Some(c) = &self.constraint {
            c.apply(&mut penalized)?;
        }
        let mut cands: Vec<Candidate> = penalized
            .iter()
            .enumerate()
            .filter(|(_, l)| **l != f32::NEG_INFINITY)
            .map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
            })
            .collect();
        if cands.is_empty() {
            return Err(Error::arg(if self.constraint.is_some() {
                "sampler: every token the constraint allows has logit -inf (no token can be drawn)"
            } else {
                "sampler: every logit is -inf (no token can be drawn)"
            }));
        }
        let p = &self.params;
        if p.temperature == 0.0 {
            let best = *cands
                .iter()
                .min_by(|a, b| by_logit_desc(a, b))
                .expect("non-empty");
            return Ok(vec![best]);
        }
        if p.top_k > 0 {
            top_k(&mut cands, p.top_k);
        }
        top_p(&mut cands, p.top_p, p.temperature);
        min_p(&mut cands, p.min_p, p.temperature);
        Ok(cands)
    }

    /// The distribution the next draw samples from: `(token, probability)`
    /// for every survivor of the chain, in the order the draw walks them.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>> {
        let cands = self.candidates(logits)?;
        if cands.len() == 1 {
            return Ok(vec![(cands[0].id, 1.0)]);
        }
        let probs = softmax(&cands, self.params.temperature);
        Ok(cands.iter().map(|c| c.id).zip(probs).collect())
    }

    /// Draws the next token. Does not [`accept`](Self::accept) it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let cands = self.candidates(logits)?;
        if cands.is_empty() {
            // The chain keeps at least its most likely candidate; refuse rather than panic.
            return Err(Error::arg("sampler: no candidate survived the chain"));
        }
        if cands.len() == 1 {
            // Greedy or a single survivor: no randomness used, so the
            // generator's stream does not depend on how the chain truncates.
            return Ok(cands[0].id);
        }
        let w = weights(&cands, self.params.temperature);
        let total: f64 = w.iter().sum();
        let mut u = self.rng.next_f64() * total;
        for (c, x) in cands.iter().zip(&w) {
            if u < *x {
                return Ok(c.id);
            }
            u -= x;
        }
        // Rounding left `u` past the end: the last token with weight.
        Ok(cands
            .iter()
            .zip(&w)
            .rev()
            .find(|(_, x)| **x > 0.0)
            .map_or(cands[0].id, |(c, _)| c.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_stream() {
        // Published outputs of SplitMix64 for seed 1234567.
        let mut x = 1234567u64;
        let got: Vec<u64> = (0..5).map(|_| splitmix64(&mut x)).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821
            ]
        );
    }

    #[test]
    fn next_f64_is_in_unit_interval() {
        let mut r = Rng::new(7);
        for _ in 0..10_000 {
            let u = r.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
