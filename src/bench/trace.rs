//! Routing traces: which experts every layer chose for every token of a
//! run, kept in a compact file that offline tools replay through expert
//! cache policies (`flashnext replay`, [`super::replay`]).
//!
//! A [`TraceRecorder`] listens to [`Model::observe_routing`] (every routing
//! decision the host sees: the CPU backend always, Vulkan with an expert
//! cache) and turns the calls into a [`Trace`]; [`Trace::generate`] draws a
//! synthetic one from a stated routing law, for tests and calibration without
//! a model.
//!
//! # File format (version 1, little-endian)
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `FNXTRACE` |
//! | 8 | 4 | `u32` version, 1 |
//! | 12 | 4 | `u32` layers `L` |
//! | 16 | 4 | `u32` experts per layer `E` (at most 65 536) |
//! | 20 | 4 | `u32` experts chosen per token and layer `k` |
//! | 24 | 8 | `u64` tokens `T` |
//! | 32 | `2·T·L·k` | `u16` expert ids: token by token, in each token layer by layer, in each layer the router's ranking (best first) |
//!
//! Tokens are in decode order: a benchmark's prompt, then its warm-up and
//! timed tokens. 300 tokens of the real model (48 layers, top 10) take 288 KB.

use crate::error::{Error, Result};
use crate::model::{Model, RoutingObserver};
use std::path::Path;
use std::sync::{Arc, Mutex};

const MAGIC: &[u8; 8] = b"FNXTRACE";
const VERSION: u32 = 1;
const HEADER: usize = 32;

/// The routing of a run: `tokens x layers x k` expert ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    pub layers: usize,
    pub experts: usize,
    pub k: usize,
    /// `[token][layer][rank]`
    ids: Vec<u16>,
}

impl Trace {
    /// An empty trace of `layers` layers choosing `k` of `experts` experts.
    pub fn new(layers: usize, experts: usize, k: usize) -> Result<Trace> {
        if layers == 0 || k == 0 || k > experts || experts > 1 << 16 {
            return Err(Error::arg(format!(
                "a trace needs at least one layer and 1 <= k <= experts <= 65536 (got {layers} layers, k {k}, {experts} experts)"
            )));
        }
        Ok(Trace {
            layers,
            experts,
            k,
            ids: Vec::new(),
        })
    }

    pub fn tokens(&self) -> usize {
        self.ids.len() / (self.layers * self.k)
    }

    /// Layer `layer`'s choice for token `t`, best first.
    pub fn ids(&self, t: usize, layer: usize) -> &[u16] {
        let at = (t * self.layers + layer) * self.k;
        &self.ids[at..at + self.k]
    }

    /// Appends a token: `k` ids for each layer, concatenated layer by layer.
    pub fn push_token(&mut self, ids: &[u16]) -> Result<()> {
        if ids.len() != self.layers * self.k {
            return Err(Error::arg(format!(
                "a token of this trace has {} ids, not {}",
                self.layers * self.k,
                ids.len()
            )));
        }
        if let Some(e) = ids.iter().find(|&&e| e as usize >= self.experts) {
            return Err(Error::arg(format!(
                "expert {e} is out of range (the trace has {} experts)",
                self.experts
            )));
        }
        self.ids.extend_from_slice(ids);
        Ok(())
    }

    /// Tokens `range` of this trace.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Trace {
        let per = self.layers * self.k;
        let end = range.end.min(self.tokens());
        let start = range.start.min(end);
        Trace {
            ids: self.ids[start * per..end * per].to_vec(),
            ..*self
        }
    }

    /// The file's bytes (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + 2 * self.ids.len());
        out.extend_from_slice(MAGIC);
        for v in [VERSION, self.layers as u32, self.experts as u32, self.k as u32] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.tokens() as u64).to_le_bytes());
        for id in &self.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    /// Parses a trace file's bytes, checking the header against the length.
    pub fn from_bytes(bytes: &[u8]) -> Result<Trace> {
        if bytes.len() < HEADER || &bytes[..8] != MAGIC {
            return Err(Error::format("not a flashnext routing trace (no FNXTRACE header)"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes")) as usize;
        let version = u32_at(8);
        if version != VERSION as usize {
            return Err(Error::format(format!(
                "routing trace version {version}; this build reads version {VERSION}"
            )));
        }
        let tokens = u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes"));
        let mut trace = Trace::new(u32_at(12), u32_at(16), u32_at(20))
            .map_err(|e| Error::format(format!("routing trace header: {e}")))?;
        let n = usize::try_from(tokens)
            .ok()
            .and_then(|t| t.checked_mul(trace.layers * trace.k))
            .filter(|&n| n.checked_mul(2) == Some(bytes.len() - HEADER))
            .ok_or_else(|| {
                Error::format(format!(
                    "routing trace of {tokens} tokens x {} layers x {} ids should be {} bytes after the header, is {}",
                    trace.layers,
                    trace.k,
                    tokens as u128 * trace.layers as u128 * trace.k as u128 * 2,
                    bytes.len() - HEADER
                ))
            })?;
        trace.ids = bytes[HEADER..]
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        debug_assert_eq!(trace.ids.len(), n);
        if let Some(e) = trace.ids.iter().find(|&&e| e as usize >= trace.experts) {
            return Err(Error::format(format!(
                "routing trace names expert {e} of {}",
                trace.experts
            )));
        }
        Ok(trace)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes())
            .map_err(|e| Error::io(format!("writing the routing trace {}", path.display()), e))
    }

    pub fn load(path: &Path) -> Result<Trace> {
        let bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("reading the routing trace {}", path.display()), e))?;
        Trace::from_bytes(&bytes).map_err(|e| Error::format(format!("{}: {e}", path.display())))
    }
}

/// Collects the routing decisions a model reports into a [`Trace`].
///
/// Calls arrive per layer in the order the model walks them (for a batch,
/// layer 0 for every token of the batch, then layer 1, ...), so each
/// layer's choices are queued on their own and a token is complete once
/// every layer has reported it.
pub struct TraceRecorder {
    trace: Mutex<Recording>,
}

struct Recording {
    trace: Trace,
    /// Per layer, ids reported beyond the complete tokens.
    pending: Vec<Vec<u16>>,
    error: Option<String>,
}

impl TraceRecorder {
    /// A recorder for `model`'s shape.
    pub fn new(model: &Model) -> Result<Arc<TraceRecorder>> {
        let cfg = &model.config;
        Self::with_shape(cfg.n_layers, cfg.n_experts, cfg.n_experts_used)
    }

    /// A recorder for `layers` layers choosing `k` of `experts`.
    pub fn with_shape(layers: usize, experts: usize, k: usize) -> Result<Arc<TraceRecorder>> {
        let trace = Trace::new(layers, experts, k)?;
        let pending = vec![Vec::new(); layers];
        Ok(Arc::new(TraceRecorder {
            trace: Mutex::new(Recording {
                trace,
                pending,
                error: None,
            }),
        }))
    }

    /// The function to give [`Model::observe_routing`].
    pub fn observer(self: &Arc<Self>) -> RoutingObserver {
        let me = Arc::clone(self);
        Arc::new(move |layer, ids| me.record(layer, ids))
    }

    fn record(&self, layer: usize, ids: &[u32]) {
        let mut r = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        let (layers, k, experts) = (r.trace.layers, r.trace.k, r.trace.experts);
        if layer >= layers || ids.len() != k || ids.iter().any(|&e| e as usize >= experts) {
            r.error
                .get_or_insert_with(|| format!("layer {layer} reported {ids:?}, not {k} of {experts} experts"));
            return;
        }
        r.pending[layer].extend(ids.iter().map(|&e| e as u16));
        while r.pending.iter().all(|p| p.len() >= k) {
            let token: Vec<u16> = (0..layers).flat_map(|l| r.pending[l][..k].to_vec()).collect();
            r.pending.iter_mut().for_each(|p| {
                p.drain(..k);
            });
            r.trace.push_token(&token).expect("checked above");
        }
    }

    /// The complete tokens so far; an error if a report was malformed.
    pub fn trace(&self) -> Result<Trace> {
        let r = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        match &r.error {
            Some(e) => Err(Error::model(format!("routing trace: {e}"))),
            None => Ok(r.trace.clone()),
        }
    }
}

/// A routing law to draw a synthetic trace from: per layer and token,
/// `logit_e = -zipf * ln(rank_e) + s * (u_e . m_t) + n_e`, top `k`, where
/// `rank_e` is a random ranking of the experts (1..E), `m_t` a 64-dimensional
/// context of unit variance that follows an AR(1) process with coefficient
/// `1 - 1/memory` (an exponential moving average with a time constant of
/// `memory` tokens), `u_e ~ N(0, I/64)`, `n_e ~ N(0, 1)` fresh each token,
/// and `s = sqrt(locality / (1 - locality))`: `locality` is the share of the
/// variable part of the logits that the slowly varying context carries.
/// The same law `flashnext synth --route-*` builds into a model's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingLaw {
    pub zipf: f64,
    pub locality: f64,
    pub memory: f64,
    pub tokens: usize,
    pub layers: usize,
    pub experts: usize,
    pub k: usize,
    pub seed: u64,
}

impl Default for RoutingLaw {
    fn default() -> Self {
        RoutingLaw {
            zipf: 0.0,
            locality: 0.0,
            memory: 8.0,
            tokens: 300,
            layers: 4,
            experts: 512,
            k: 10,
            seed: 0,
        }
    }
}

impl std::str::FromStr for RoutingLaw {
    type Err = Error;
    /// `zipf:S,locality:L,memory:T,tokens:N,layers:N,experts:E,k:K,seed:X`, any subset.
    fn from_str(s: &str) -> Result<RoutingLaw> {
        let mut law = RoutingLaw::default();
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once(':')
                .ok_or_else(|| Error::arg(format!("{part:?}: expected KEY:VALUE")))?;
            let bad = || Error::arg(format!("{part:?}: {value:?} is not a valid {key}"));
            let float = || value.parse::<f64>().ok().filter(|v| v.is_finite()).ok_or_else(bad);
            let int = || value.parse::<usize>().map_err(|_| bad());
            match key {
                "zipf" => law.zipf = float()?,
                "locality" => {
                    law.locality = float().and_then(|v| if (0.0..1.0).contains(&v) { Ok(v) } else { Err(bad()) })?
                }
                "memory" => law.memory = float().and_then(|v| if v >= 1.0 { Ok(v) } else { Err(bad()) })?,
                "tokens" => law.tokens = int()?,
                "layers" => law.layers = int()?,
                "experts" => law.experts = int()?,
                "k" => law.k = int()?,
                "seed" => law.seed = value.parse().map_err(|_| bad())?,
                _ => {
                    return Err(Error::arg(format!(
                        "{key:?}: expected zipf, locality, memory, tokens, layers, experts, k or seed"
                    )))
                }
            }
        }
        Ok(law)
    }
}

/// Dimensions of the generator's slowly varying context.
const CONTEXT_DIMS: usize = 64;

/// splitmix64 draws: uniform and standard normal.
struct Draws(u64);

impl Draws {
    fn unit(&mut self) -> f64 {
        (crate::sampling::splitmix64(&mut self.0) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn gauss(&mut self) -> f64 {
        let (u, v) = (1.0 - self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

impl Trace {
    /// A trace drawn from `law` (deterministic in its seed).
    pub fn generate(law: &RoutingLaw) -> Result<Trace> {
        let (e, k, d) = (law.experts, law.k, CONTEXT_DIMS);
        let mut trace = Trace::new(law.layers, e, k)?;
        let s = (law.locality / (1.0 - law.locality)).sqrt();
        let rho = 1.0 - 1.0 / law.memory;
        let innovation = (1.0 - rho * rho).sqrt();
        let mut draw = Draws(law.seed ^ 0x7261_6e64_726f_7574);
        struct Layer {
            bias: Vec<f64>,
            u: Vec<f64>,
            m: Vec<f64>,
        }
        let mut layers: Vec<Layer> = (0..law.layers)
            .map(|_| {
                // A random ranking: Fisher-Yates over 1..=E.
                let mut rank: Vec<usize> = (1..=e).collect();
                for i in (1..e).rev() {
                    rank.swap(i, (draw.unit() * (i + 1) as f64) as usize % (i + 1));
                }
                Layer {
                    bias: rank.iter().map(|&r| -law.zipf * (r as f64).ln()).collect(),
                    u: (0..e * d).map(|_| draw.gauss() / (d as f64).sqrt()).collect(),
                    m: (0..d).map(|_| draw.gauss()).collect(),
                }
            })
            .collect();
        let mut logits = vec![0f64; e];
        let mut order: Vec<usize> = (0..e).collect();
        let mut token = Vec::with_capacity(law.layers * k);
        for _ in 0..law.tokens {
            token.clear();
            for layer in &mut layers {
                for m in &mut layer.m {
                    *m = rho * *m + innovation * draw.gauss();
                }
                for (x, (b, u)) in logits.iter_mut().zip(layer.bias.iter().zip(layer.u.chunks_exact(d))) {
                    let slow: f64 = u.iter().zip(&layer.m).map(|(a, b)| a * b).sum();
                    *x = b + s * slow + draw.gauss();
                }
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                token.extend(order[..k].iter().map(|&x| x as u16));
            }
            trace.push_token(&token)?;
        }
        Ok(trace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_round_trip_and_malformed_files() {
        let mut t = Trace::new(2, 8, 3).unwrap();
        t.push_token(&[1, 2, 3, 7, 6, 5]).unwrap();
        t.push_token(&[0, 1, 2, 3, 4, 5]).unwrap();
        assert!(t.push_token(&[1, 2, 3]).is_err());
        assert!(t.push_token(&[1, 2, 3, 4, 5, 8]).is_err());
        let bytes = t.to_bytes();
        assert_eq!(bytes.len(), 32 + 2 * 2 * 2 * 3);
        assert_eq!(&bytes[..8], b"FNXTRACE");
        let back = Trace::from_bytes(&bytes).unwrap();
        assert_eq!(back, t);
        assert_eq!(
            (back.tokens(), back.ids(0, 1), back.ids(1, 0)),
            (2, &[7u16, 6, 5][..], &[0u16, 1, 2][..])
        );
        assert_eq!(back.slice(1..5).ids(0, 1), &[3, 4, 5]);

        let path = std::env::temp_dir().join(format!("flashnext-trace-{}.bin", std::process::id()));
        t.save(&path).unwrap();
        assert_eq!(Trace::load(&path).unwrap(), t);
        let _ = std::fs::remove_file(&path);

        assert!(Trace::from_bytes(&bytes[..bytes.len() - 1]).is_err(), "short");
        assert!(Trace::from_bytes(b"FNXTRACX").is_err(), "magic");
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert!(Trace::from_bytes(&v2).is_err(), "version");
        let mut out_of_range = bytes.clone();
        out_of_range[32] = 9;
        assert!(Trace::from_bytes(&out_of_range).is_err(), "expert id");
        let mut huge = bytes;
        huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Trace::from_bytes(&huge).is_err(), "token count");
    }

    #[test]
    fn the_recorder_reassembles_batches_and_refuses_malformed_reports() {
        let r = TraceRecorder::with_shape(2, 8, 2).unwrap();
        let f = r.observer();
        // One token, then a batch of two: layer 0 for both, then layer 1 for both.
        f(0, &[1, 2]);
        f(1, &[3, 4]);
        f(0, &[5, 6]);
        f(0, &[7, 0]);
        assert_eq!(r.trace().unwrap().tokens(), 1, "the batch is incomplete");
        f(1, &[1, 3]);
        f(1, &[2, 4]);
        let t = r.trace().unwrap();
        assert_eq!(t.tokens(), 3);
        assert_eq!(
            [t.ids(1, 0), t.ids(1, 1), t.ids(2, 0), t.ids(2, 1)],
            [&[5, 6][..], &[1, 3], &[7, 0], &[2, 4]]
        );
        f(0, &[1, 9]);
        assert!(r.trace().is_err());
    }

    #[test]
    fn laws_parse_and_generate_deterministically() {
        let law: RoutingLaw = "zipf:0.5,locality:0.5,memory:4,tokens:20,layers:2,experts:64,k:4,seed:3"
            .parse()
            .unwrap();
        assert_eq!(
            (
                law.zipf,
                law.locality,
                law.memory,
                law.tokens,
                law.layers,
                law.experts,
                law.k
            ),
            (0.5, 0.5, 4.0, 20, 2, 64, 4)
        );
        for bad in ["zipf", "locality:1", "memory:0.5", "tokens:-1", "colour:3"] {
            assert!(bad.parse::<RoutingLaw>().is_err(), "{bad}");
        }
        let a = Trace::generate(&law).unwrap();
        assert_eq!((a.tokens(), a.layers, a.experts, a.k), (20, 2, 64, 4));
        assert_eq!(a, Trace::generate(&law).unwrap());
        assert_ne!(a, Trace::generate(&RoutingLaw { seed: 4, ..law.clone() }).unwrap());
        // Every token's choice is k distinct experts.
        for t in 0..a.tokens() {
            let mut ids = a.ids(t, 1).to_vec();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), 4);
        }
    }
}
