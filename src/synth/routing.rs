//! Routing that looks real, built into a synthetic model's weights.
//!
//! The default synthetic model routes uniformly: with pseudo-random tokens
//! every token's top-k is a fresh draw, the worst case for an expert cache.
//! A real model's routing is skewed (some experts are chosen more often) and
//! local (consecutive tokens share experts). [`RouteOptions`] asks for both,
//! and the weights are drawn so that the router of every layer, reading the
//! model's own hidden state, produces them: nothing in the engine overrides
//! a routing decision, and any token stream (`flashnext bench --tokens
//! random` included) drives the forward pass as usual.
//!
//! # The mechanism
//!
//! The router of layer `l` computes `logit_e = w_e . x` where `x` is the
//! RMS-normalised residual. With routing options the residual of every
//! token at every layer is made of three parts, and each router row reads
//! them in known proportions:
//!
//! * **fast**: the token's embedding row, `N(0, 1)` per coordinate: new
//!   with every pseudo-random token;
//! * **constant**: `c * d` with `c = 1` and `d` a fixed +-1 direction (a
//!   32-value pattern, tiled) that every embedding row also carries;
//! * **slow**: a context vector written by layer 0's Gated DeltaNet, set up
//!   as a leaky integrator: its query and key projections read only `d`
//!   (so `q` and `k` are the same constant vector and the delta rule keeps a
//!   rank-one state `S = k m^T`), the conv is the identity, the output gate is
//!   constant (`z = 0`), the decay is 1 and the write strength `beta =
//!   sigmoid(b . x) = 1/memory` (`b` also reads `d`), so `m_t = (1 - beta)
//!   m_{t-1} + beta v_t`: an exponential moving average of the value
//!   projection of the token embeddings, with a time constant of `memory`
//!   tokens. Value channels come in pairs `(u, -u)` and the output
//!   projection takes their difference, so `silu(u) - silu(-u) = u` leaves a
//!   zero-mean vector (no constant part, which would act as a skew of its
//!   own). The output projection's gain makes the slow part's spread `s`
//!   times the fast part's, `s = sqrt(locality / (1 - locality))`.
//!
//! Every other block writes into the residual with 1/20 of its usual gain,
//! and the hyper-connections' mixing and injection weights are nearly zero
//! (mix `sigmoid(0) = 1/2`, injection `2 sigmoid(0) = 1`): the residual is
//! the sum above within about 2% at every depth, so every layer routes with
//! the same statistics and a model cut to a few layers (or shrunk to
//! `--dims narrow`) routes like the full one.
//!
//! Router row `e` of every layer is `2/sqrt(H)` times a Gaussian vector with
//! its component along `d` removed, plus `beta_e d`: the random part sees the
//! fast and slow parts alike (logit spreads 1 and `s`, in units of the fast
//! one), the `d` part adds a constant bias `-skew * ln(rank_e)` (centred)
//! where `rank_e` is a random ranking of the layer's experts: a Zipf-like
//! popularity. So the logits follow the law that `flashnext replay
//! --generate zipf:S,locality:L,memory:T` draws from directly
//! (`bench::trace::RoutingLaw`): `-S ln(rank_e) + s (slow) + (fast)`.
//!
//! The model still decodes like any other (the same shapes, types and bytes
//! per token); its greedy continuation is a function of the current token
//! and soon cycles, so benchmarks of routing use `--tokens random`.

use super::fill::{small_values, Rng};
use super::shapes::{Init, TensorPlan};
use crate::convert::HfConfig;
use crate::error::{Error, Result};

/// Skew and locality of the routing a synthetic model is drawn to produce.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteOptions {
    /// Zipf-like exponent of the experts' popularity (0 = none).
    pub skew: f32,
    /// Share of the routers' variable input that varies slowly (0 = none, < 1).
    pub locality: f32,
    /// Time constant of the slowly varying part, in tokens (>= 1).
    pub memory: f32,
}

/// The default time constant of `--route-memory`.
pub const DEFAULT_MEMORY: f32 = 8.0;

impl Default for RouteOptions {
    fn default() -> Self {
        RouteOptions {
            skew: 0.0,
            locality: 0.0,
            memory: DEFAULT_MEMORY,
        }
    }
}

impl RouteOptions {
    /// Calibrated so that per-layer LRU caches replaying the routing of 300
    /// pseudo-random tokens hit as often as on a published trace of the
    /// real model (docs/BENCHMARKS.md, "Routing that looks real").
    pub const REAL: RouteOptions = RouteOptions {
        skew: 0.25,
        locality: 0.25,
        memory: 18.0,
    };

    /// A named set: `real` ([`Self::REAL`]) or `uniform` (the default).
    pub fn preset(name: &str) -> Result<RouteOptions> {
        match name {
            "real" => Ok(Self::REAL),
            "uniform" => Ok(Self::default()),
            _ => Err(Error::arg(format!(
                "unknown routing preset {name:?}: expected real or uniform"
            ))),
        }
    }

    /// No routing options: the weights are drawn as they always were.
    pub fn is_uniform(&self) -> bool {
        self.skew == 0.0 && self.locality == 0.0
    }

    pub fn check(&self) -> Result<()> {
        if !(self.skew.is_finite() && self.skew >= 0.0) {
            return Err(Error::arg(format!(
                "--route-skew {}: expected a number >= 0",
                self.skew
            )));
        }
        if !(0.0..1.0).contains(&self.locality) {
            return Err(Error::arg(format!(
                "--route-locality {}: expected 0 <= L < 1",
                self.locality
            )));
        }
        if !(self.memory.is_finite() && self.memory >= 1.0) {
            return Err(Error::arg(format!(
                "--route-memory {}: expected a number of tokens >= 1",
                self.memory
            )));
        }
        Ok(())
    }
}

/// A tensor drawn for routing (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouteTensor {
    /// `N(0, 1) + c d`: every row carries the constant direction.
    Embedding,
    /// A router: Gaussian rows without their `d` component, plus the skew bias along `d`.
    Router,
    /// Layer 0's GDN input projection: q and k rows read `d`, value rows in pairs `(u, -u)`.
    IntegratorQkv,
    /// The identity conv (the current token only).
    IntegratorConv,
    /// Write strength rows: `sigmoid(.) = 1/memory` on the constant direction.
    IntegratorBeta,
    /// Output projection taking each value pair's difference.
    IntegratorOut,
    Const(f32),
    /// A depthwise conv at 1/20 of its usual taps (the PLE's).
    QuietConv,
}

/// Size of the constant direction in the embeddings (`c`).
const CONSTANT: f32 = 1.0;
/// Gain of every other block's writes into the residual.
const QUIET: f32 = 0.05;
/// Spread of the integrator's value inputs `u` (unit: silu is far from linear there).
const VALUE_STD: f64 = 1.0;
/// `|q|`, `|k|` pre-activations of the integrator: silu(8) is 8 to 3e-3.
const QK_PREACT: f32 = 8.0;
/// Decay of the integrator per token, `exp(ssm_a * softplus(0))`: 1 - 7e-5.
const INTEGRATOR_A: f32 = -1e-4;

/// Gives the tensors of `inv` the draws of a model routing per `r` (no-op when uniform).
pub(crate) fn apply(inv: &mut [TensorPlan], cfg: &HfConfig, r: &RouteOptions) -> Result<()> {
    r.check()?;
    if r.is_uniform() {
        return Ok(());
    }
    if cfg.output_gate != "sigmoid" || !cfg.lin_v_dim.is_multiple_of(2) || !cfg.is_linear.first().copied().unwrap_or(false) {
        return Err(Error::arg(
            "routing options need layer 0 to be a Gated DeltaNet with a sigmoid gate and even head width",
        ));
    }
    for t in inv.iter_mut() {
        let (layer, what) = match t.name.strip_prefix("blk.").and_then(|s| s.split_once('.')) {
            Some((l, what)) => (l.parse::<usize>().ok(), what),
            None => (None, t.name.as_str()),
        };
        let integrator = r.locality > 0.0 && layer == Some(0);
        let quiet = |init: Init| match init {
            Init::Gauss(s) => Init::Gauss(s * QUIET),
            other => other,
        };
        t.init = match what {
            "token_embd.weight" => Init::Route(RouteTensor::Embedding),
            "ffn_gate_inp.weight" => Init::Route(RouteTensor::Router),
            "attn_qkv.weight" if integrator => Init::Route(RouteTensor::IntegratorQkv),
            "ssm_conv1d.weight" if integrator => Init::Route(RouteTensor::IntegratorConv),
            "ssm_beta.weight" if integrator => Init::Route(RouteTensor::IntegratorBeta),
            "ssm_out.weight" if integrator => Init::Route(RouteTensor::IntegratorOut),
            "attn_gate.weight" | "ssm_alpha.weight" if integrator => Init::Gauss(0.0),
            "ssm_a" if integrator => Init::Route(RouteTensor::Const(INTEGRATOR_A)),
            "ssm_dt.bias" if integrator => Init::Route(RouteTensor::Const(0.0)),
            "ple_conv1d.weight" => Init::Route(RouteTensor::QuietConv),
            "ssm_out.weight"
            | "attn_output.weight"
            | "ffn_down_exps.weight"
            | "ffn_down_shexp.weight"
            | "ple_value.weight" => quiet(t.init),
            _ if layer.is_some()
                && (what.starts_with("hc_attn_") || what.starts_with("hc_ffn_"))
                && !what.ends_with("_norm.weight") =>
            {
                quiet(t.init)
            }
            _ => t.init,
        };
    }
    Ok(())
}

/// The constant direction's pattern, `c * (+-1)`, 32 values (tiled along rows).
pub(crate) fn embedding_shift(seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed ^ 0xd1ec_7104);
    (0..32)
        .map(|_| if rng.next() >> 63 == 0 { CONSTANT } else { -CONSTANT })
        .collect()
}

/// The unit vector along the constant direction, length `h`.
fn direction(h: usize, seed: u64) -> Vec<f32> {
    let p = embedding_shift(seed);
    let norm = (h as f32).sqrt() * CONSTANT;
    (0..h).map(|i| p[i % p.len()] / norm).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `scale * (g - (g . d) d)` for a fresh Gaussian `g`: a random row blind to `d`.
fn row_without(d: &[f32], scale: f32, rng: &mut Rng) -> Vec<f32> {
    let g: Vec<f32> = (0..d.len()).map(|_| rng.gauss()).collect();
    let along = dot(&g, d);
    g.iter().zip(d).map(|(x, y)| scale * (x - along * y)).collect()
}

/// The constant direction's coordinate in layer 0's mixer input
/// `x = rms(embedding) / 2` (hyper-connection mix 1/2): `c sqrt(H) / (2 sqrt(1 + c^2))`.
fn mixer_constant(h: usize) -> f32 {
    0.5 * CONSTANT * (h as f32).sqrt() / (1.0 + CONSTANT * CONSTANT).sqrt()
}

/// `E[silu(s z)]` and `E[silu(s z)^2]` for `z ~ N(0, 1)` (Simpson's rule on [-10, 10]).
fn silu_moments(s: f64) -> (f64, f64) {
    let n = 4000;
    let step = 20.0 / n as f64;
    let (mut m1, mut m2) = (0.0, 0.0);
    for i in 0..=n {
        let z = -10.0 + i as f64 * step;
        let w = if i == 0 || i == n {
            1.0
        } else if i % 2 == 1 {
            4.0
        } else {
            2.0
        };
        let p = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
        let y = s * z / (1.0 + (-s * z).exp());
        m1 += w * p * y;
        m2 += w * p * y * y;
    }
    (m1 * step / 3.0, m2 * step / 3.0)
}

/// Gain of the integrator's output projection for a slow part `s` times
/// the fast part: the projection (entries `N(0, g^2 / (nv dv))`, in pairs)
/// of the gated (1/2), head-normalised state differences.
fn output_gain(r: &RouteOptions) -> f64 {
    let s = (r.locality as f64 / (1.0 - r.locality as f64)).sqrt();
    let beta = 1.0 / r.memory as f64;
    let ema = beta / (2.0 - beta);
    let (mean, square) = silu_moments(VALUE_STD);
    // A pair's difference is the EMA of u; the head's RMS is that of silu(u)'s EMA.
    let diff = ema * VALUE_STD * VALUE_STD / (mean * mean + ema * (square - mean * mean));
    s * (8.0 / diff).sqrt()
}

/// The values of a routing tensor of shape `dims` (not [`RouteTensor::Embedding`], which is pooled).
pub(crate) fn values(
    rt: RouteTensor,
    dims: &[usize],
    cfg: &HfConfig,
    r: &RouteOptions,
    file_seed: u64,
    seed: u64,
) -> Vec<f32> {
    let n: usize = dims.iter().product();
    let h = cfg.hidden_size;
    let d = direction(h, file_seed);
    let mut rng = Rng::new(seed);
    match rt {
        RouteTensor::Embedding => unreachable!("the embedding is drawn from a shifted pool"),
        RouteTensor::Const(v) => vec![v; n],
        RouteTensor::QuietConv => small_values(Init::Conv, n, seed).iter().map(|v| v * QUIET).collect(),
        RouteTensor::IntegratorConv => {
            let k = dims[0];
            (0..n).map(|i| if i % k == k - 1 { 1.0 } else { 0.0 }).collect()
        }
        RouteTensor::Router => {
            let e = dims[1];
            // A random ranking of the experts; the bias is centred (top-k ignores a common shift).
            let mut rank: Vec<usize> = (1..=e).collect();
            for i in (1..e).rev() {
                rank.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
            let mean_ln = rank.iter().map(|&x| (x as f64).ln()).sum::<f64>() / e as f64;
            let gain = 2.0 / (h as f32).sqrt();
            // The fast logit spreads `2 |x_fast|`, and `d . x = c sqrt(H) |x_fast|`: a bias of `b`
            // fast spreads is `2 b / (c sqrt(H))` along d.
            (0..e)
                .flat_map(|x| {
                    let b = -(r.skew as f64) * ((rank[x] as f64).ln() - mean_ln);
                    let along = 2.0 * b as f32 / (CONSTANT * (h as f32).sqrt());
                    let mut row = row_without(&d, gain, &mut rng);
                    row.iter_mut().zip(&d).for_each(|(v, y)| *v += along * y);
                    row
                })
                .collect()
        }
        RouteTensor::IntegratorQkv => {
            let qk = 2 * cfg.lin_k_heads * cfg.lin_k_dim;
            let (nv, dv) = (cfg.lin_v_heads, cfg.lin_v_dim);
            let lambda = QK_PREACT / mixer_constant(h);
            // u = w . x has spread VALUE_STD: the fast part of x is N(0, 1) / (2 sqrt(1 + c^2)).
            let gain = (VALUE_STD as f32) * 2.0 * (1.0 + CONSTANT * CONSTANT).sqrt() / (h as f32).sqrt();
            let mut out: Vec<f32> = (0..qk).flat_map(|_| d.iter().map(|y| lambda * y)).collect();
            for _ in 0..nv {
                let half: Vec<Vec<f32>> = (0..dv / 2).map(|_| row_without(&d, gain, &mut rng)).collect();
                half.iter().for_each(|row| out.extend_from_slice(row));
                half.iter().for_each(|row| out.extend(row.iter().map(|v| -v)));
            }
            debug_assert_eq!(out.len(), n);
            out
        }
        RouteTensor::IntegratorBeta => {
            let beta = (1.0 / r.memory).min(1.0 - 1e-6);
            let scale = (beta / (1.0 - beta)).ln() / mixer_constant(h);
            (0..dims[1])
                .flat_map(|_| d.iter().map(|y| scale * y).collect::<Vec<_>>())
                .collect()
        }
        RouteTensor::IntegratorOut => {
            let (nv, dv) = (cfg.lin_v_heads, cfg.lin_v_dim);
            let std = (output_gain(r) / ((nv * dv) as f64).sqrt()) as f32;
            let mut out = Vec::with_capacity(n);
            for _ in 0..dims[1] {
                for _ in 0..nv {
                    let half: Vec<f32> = (0..dv / 2).map(|_| std * rng.gauss()).collect();
                    out.extend_from_slice(&half);
                    out.extend(half.iter().map(|v| -v));
                }
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_moments_match_known_values() {
        let (m1, m2) = silu_moments(1.0);
        assert!((m1 - 0.2066).abs() < 1e-3, "{m1}");
        assert!(m2 > m1 * m1 && m2 < 1.0, "{m2}");
        // Near zero silu is u/2: E = s^2/4, E[silu^2] = s^2/4.
        let (m1, m2) = silu_moments(0.01);
        assert!((m1 - 0.25e-4).abs() < 1e-7 && (m2 - 0.25e-4).abs() < 1e-7, "{m1} {m2}");
    }

    #[test]
    fn router_rows_are_blind_to_the_constant_direction_but_for_the_bias() {
        let cfg = HfConfig::from_json(&super::super::shapes::config_json(super::super::Dims::Narrow, Some(1)).unwrap())
            .unwrap();
        let r = RouteOptions {
            skew: 1.0,
            locality: 0.5,
            memory: 4.0,
        };
        let (h, e) = (cfg.hidden_size, cfg.n_expert);
        let w = values(RouteTensor::Router, &[h, e], &cfg, &r, 3, 9);
        let d = direction(h, 3);
        // Along d: the biases, 2 b / (c sqrt(H)), spread like ln(rank).
        let along: Vec<f32> = w.chunks_exact(h).map(|row| dot(row, &d)).collect();
        let mean = along.iter().sum::<f32>() / e as f32;
        assert!(mean.abs() < 1e-4, "centred: {mean}");
        let max = along.iter().cloned().fold(f32::MIN, f32::max);
        // The most popular expert (rank 1): -1 * (0 - mean ln rank) = 5.24 fast spreads.
        let expect = 5.246 * 2.0 / (CONSTANT * (h as f32).sqrt());
        assert!((max - expect).abs() < 0.02 * expect, "{max} vs {expect}");
        // Without skew, nothing along d.
        let w0 = values(
            RouteTensor::Router,
            &[h, e],
            &cfg,
            &RouteOptions { skew: 0.0, ..r },
            3,
            9,
        );
        assert!(w0.chunks_exact(h).all(|row| dot(row, &d).abs() < 1e-5));
    }
}
