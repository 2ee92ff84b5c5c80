//! Gated DeltaNet, one token (transformers `Qwen3_5GatedDeltaNet` with the
//! recurrent rule):
//!
//! ```text
//! c      = silu(causal_conv(qkv))             (history: previous Kc-1 inputs)
//! q, k   = l2norm per head (eps 1e-6);  q /= sqrt(dk)
//! beta   = sigmoid(b);   g = -exp(A_log) * softplus(a + dt_bias)
//! S_h    = exp(g_h) S_h;  d = beta_h (v_h - S_h^T k);  S_h += k d^T;  o_h = S_h^T q
//! out    = out_proj( rms(o_h) * norm  *  act(z_h) )
//! ```
//! Value head `h` (tiled order in the file) reads key head `h % nk`.
//!
//! In stages, as the Vulkan backend runs them: [`project`] (matvecs),
//! [`conv`] (`gdn_conv`), [`delta_rule`] (`gdn_recurrent`), the out
//! projection. The conv history is a ring and the recurrent state has a
//! plane per position of the rewind window (`model::backend`).

use super::ops::{l2_normalize, rms_norm, sigmoid, silu, softplus};
use crate::error::Result;
use crate::model::config::{Config, GateActivation};
use crate::error::zeros;
use crate::model::weights::Gdn;
use crate::tensor::{matmul_all, matvec_all};
use rayon::prelude::*;

/// Recurrent state of one GDN layer, kept for a window of positions.
#[derive(Clone)]
pub struct GdnState {
    /// Conv inputs by position: position `q` in row `q mod rows`: [rows][Dc]
    pub conv: Vec<f32>,
    /// Delta-rule state per plane and value head: [planes][nv][dk][dv]; the
    /// state after `n` tokens is plane `n mod planes`.
    pub planes: Vec<f32>,
}

/// Rows of a conv history ring: the conv's reach plus the rewind window.
pub fn conv_rows(reach: usize, window: usize) -> usize {
    reach + window
}

impl GdnState {
    pub fn new(cfg: &Config, window: usize) -> Result<Self> {
        let d = cfg.ssm_head_dim;
        let rows = conv_rows(cfg.ssm_conv - 1, window);
        let plane = cfg.ssm_v_heads.checked_mul(d).and_then(|x| x.checked_mul(d));
        Ok(Self {
            conv: zeros(rows.checked_mul(cfg.ssm_conv_dim()), "GDN conv state")?,
            planes: zeros(plane.and_then(|p| p.checked_mul(window + 1)), "GDN recurrent state")?,
        })
    }

    /// Floats of one recurrent plane.
    pub fn plane_len(cfg: &Config) -> usize {
        cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim
    }
}

/// The l2norm epsilon transformers uses (fixed, not `rms_norm_eps`).
const L2_EPS: f32 = 1e-6;

/// The input projections of one token.
pub struct Projections {
    /// [2*nk*d + nv*d]: q | k | v
    pub qkv: Vec<f32>,
    /// [nv*d]
    pub z: Vec<f32>,
    /// [nv]
    pub beta: Vec<f32>,
    /// [nv]
    pub alpha: Vec<f32>,
}

pub fn project(w: &Gdn, cfg: &Config, x: &[f32]) -> Projections {
    let (nv, d) = (cfg.ssm_v_heads, cfg.ssm_head_dim);
    let mut p = Projections { qkv: vec![0f32; cfg.ssm_conv_dim()], z: vec![0f32; nv * d], beta: vec![0f32; nv], alpha: vec![0f32; nv] };
    matvec_all(&mut [
        w.qkv.matvec_job(0, x, &mut p.qkv),
        w.z.matvec_job(0, x, &mut p.z),
        w.beta.matvec_job(0, x, &mut p.beta),
        w.alpha.matvec_job(0, x, &mut p.alpha),
    ]);
    p
}

/// Row of the ring of `rows` rows that holds position `q` (which may be
/// before the sequence start: those rows hold zeros).
pub fn ring_row(q: isize, rows: usize) -> usize {
    q.rem_euclid(rows as isize) as usize
}

/// Depthwise causal conv over the inputs of positions `pos - Kc + 1 ..= pos`,
/// then SiLU; stores `qkv` as position `pos`'s input in the `ring`.
pub fn conv(taps: &[f32], kc: usize, ring: &mut [f32], pos: usize, qkv: &[f32]) -> Vec<f32> {
    let dc = qkv.len();
    let rows = ring.len() / dc;
    let mut c = vec![0f32; dc];
    for ch in 0..dc {
        let taps = &taps[ch * kc..(ch + 1) * kc];
        let mut acc = taps[kc - 1] * qkv[ch];
        // Tap k reads the input `kc - 1 - k` positions back.
        for (k, tap) in taps[..kc - 1].iter().enumerate() {
            let row = ring_row(pos as isize - (kc - 1 - k) as isize, rows);
            acc += tap * ring[row * dc + ch];
        }
        c[ch] = silu(acc);
    }
    let row = ring_row(pos as isize, rows);
    ring[row * dc..(row + 1) * dc].copy_from_slice(qkv);
    c
}

/// The delta rule for the token at `pos` (reading recurrent plane
/// `pos mod planes`, writing plane `pos + 1`), then the gated RMSNorm per
/// head: [nv*d]. `c` is the conv output (q | k | v), `z`, `b`, `a` the
/// gate, beta and decay projections.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(w: &Gdn, cfg: &Config, planes: &mut [f32], pos: usize, c: &mut [f32], z: &[f32], b: &[f32], a: &[f32]) -> Vec<f32> {
    let (nk, nv, d) = (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_dim);
    let (q_all, rest) = c.split_at_mut(nk * d);
    let (k_all, v_all) = rest.split_at_mut(nk * d);
    let qscale = 1.0 / (d as f32).sqrt();
    for (qh, kh) in q_all.chunks_mut(d).zip(k_all.chunks_mut(d)) {
        l2_normalize(qh, L2_EPS);
        l2_normalize(kh, L2_EPS);
        qh.iter_mut().for_each(|v| *v *= qscale);
    }
    let (q_all, k_all, v_all) = (&*q_all, &*k_all, &*v_all);

    let plane = nv * d * d;
    let n_planes = planes.len() / plane;
    let (from, to) = (pos % n_planes, (pos + 1) % n_planes);
    let (src, dst): (&[f32], &mut [f32]) = if from < to {
        let (lo, hi) = planes.split_at_mut(to * plane);
        (&lo[from * plane..(from + 1) * plane], &mut hi[..plane])
    } else {
        let (lo, hi) = planes.split_at_mut(from * plane);
        (&hi[..plane], &mut lo[to * plane..(to + 1) * plane])
    };

    let mut o = vec![0f32; nv * d];
    // One value head: (index, ((state before, state after), output)).
    type Head<'a> = (usize, ((&'a [f32], &'a mut [f32]), &'a mut [f32]));
    let head = |(h, ((s_in, s), oh)): Head| {
        let kh = h % nk;
        let q = &q_all[kh * d..(kh + 1) * d];
        let k = &k_all[kh * d..(kh + 1) * d];
        let v = &v_all[h * d..(h + 1) * d];
        let decay = (w.a[h] * softplus(a[h] + w.dt_bias[h])).exp();
        let beta = sigmoid(b[h]);
        // S = decay * S_in; kv_mem[j] = sum_i S[i][j] k[i]
        for (x, x_in) in s.iter_mut().zip(s_in) {
            *x = x_in * decay;
        }
        let mut delta = vec![0f32; d];
        for (i, row) in s.chunks(d).enumerate() {
            for j in 0..d {
                delta[j] += row[j] * k[i];
            }
        }
        for j in 0..d {
            delta[j] = (v[j] - delta[j]) * beta;
        }
        for (i, row) in s.chunks_mut(d).enumerate() {
            for j in 0..d {
                row[j] += k[i] * delta[j];
            }
        }
        for (i, row) in s.chunks(d).enumerate() {
            for j in 0..d {
                oh[j] += row[j] * q[i];
            }
        }
    };
    let heads = src.chunks(d * d).zip(dst.chunks_mut(d * d)).zip(o.chunks_mut(d));
    if nv * d * d >= 1 << 15 {
        heads.collect::<Vec<_>>().into_par_iter().enumerate().for_each(head);
    } else {
        heads.enumerate().for_each(head);
    }

    // Gated RMSNorm per head.
    let mut normed = vec![0f32; nv * d];
    for ((oh, zh), nh) in o.chunks(d).zip(z.chunks(d)).zip(normed.chunks_mut(d)) {
        rms_norm(oh, &w.norm, cfg.eps, nh);
        for (v, &g) in nh.iter_mut().zip(zh) {
            *v *= match cfg.ssm_gate {
                GateActivation::Sigmoid => sigmoid(g),
                GateActivation::Silu => silu(g),
            };
        }
    }
    normed
}

/// The token at `pos` through the whole layer: [H].
pub fn forward(w: &Gdn, cfg: &Config, st: &mut GdnState, pos: usize, x: &[f32]) -> Vec<f32> {
    let p = project(w, cfg, x);
    let mut c = conv(&w.conv, cfg.ssm_conv, &mut st.conv, pos, &p.qkv);
    let normed = delta_rule(w, cfg, &mut st.planes, pos, &mut c, &p.z, &p.beta, &p.alpha);
    let mut out = vec![0f32; cfg.hidden];
    w.out.matvec(&normed, &mut out);
    out
}

/// The tokens at `pos, pos + 1, ..` (inputs `xs`: [T][H]) through the whole
/// layer: [T][H]. The projections read each matrix once for the batch; the
/// conv and the delta rule step token by token through the same functions
/// as [`forward`], so the outputs and the states left are the same.
pub fn forward_batch(w: &Gdn, cfg: &Config, st: &mut GdnState, pos: usize, xs: &[f32]) -> Vec<f32> {
    let (nv, d, h) = (cfg.ssm_v_heads, cfg.ssm_head_dim, cfg.hidden);
    let t = xs.len() / h;
    let dc = cfg.ssm_conv_dim();
    let (mut qkv, mut z, mut beta, mut alpha) = (vec![0f32; t * dc], vec![0f32; t * nv * d], vec![0f32; t * nv], vec![0f32; t * nv]);
    matmul_all(&mut [
        w.qkv.matmul_job(0, xs, &mut qkv),
        w.z.matmul_job(0, xs, &mut z),
        w.beta.matmul_job(0, xs, &mut beta),
        w.alpha.matmul_job(0, xs, &mut alpha),
    ]);
    let mut normed = vec![0f32; t * nv * d];
    for (i, out) in normed.chunks_exact_mut(nv * d).enumerate() {
        let mut c = conv(&w.conv, cfg.ssm_conv, &mut st.conv, pos + i, &qkv[i * dc..(i + 1) * dc]);
        let (zi, bi, ai) = (&z[i * nv * d..(i + 1) * nv * d], &beta[i * nv..(i + 1) * nv], &alpha[i * nv..(i + 1) * nv]);
        out.copy_from_slice(&delta_rule(w, cfg, &mut st.planes, pos + i, &mut c, zi, bi, ai));
    }
    let mut out = vec![0f32; t * h];
    w.out.matmul(&normed, &mut out);
    out
}
