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

use super::config::{Config, GateActivation};
use super::ops::{l2_normalize, rms_norm, sigmoid, silu, softplus};
use super::weights::Gdn;
use super::state::zeros;
use crate::error::Result;
use crate::tensor::matvec_all;
use rayon::prelude::*;

/// Recurrent state of one GDN layer.
#[derive(Clone)]
pub struct GdnState {
    /// Previous `Kc-1` conv inputs, oldest first: [Kc-1][Dc]
    pub conv: Vec<f32>,
    /// Delta-rule state per value head: [nv][dk][dv]
    pub recurrent: Vec<f32>,
}

impl GdnState {
    pub fn new(cfg: &Config) -> Result<Self> {
        let d = cfg.ssm_head_dim;
        Ok(Self {
            conv: zeros((cfg.ssm_conv - 1).checked_mul(cfg.ssm_conv_dim()), "GDN conv state")?,
            recurrent: zeros(cfg.ssm_v_heads.checked_mul(d).and_then(|x| x.checked_mul(d)), "GDN recurrent state")?,
        })
    }
}

/// The l2norm epsilon transformers uses (fixed, not `rms_norm_eps`).
const L2_EPS: f32 = 1e-6;

pub fn forward(w: &Gdn, cfg: &Config, st: &mut GdnState, x: &[f32]) -> Vec<f32> {
    let (nk, nv, d, kc) = (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_dim, cfg.ssm_conv);
    let dc = cfg.ssm_conv_dim();
    let mut qkv = vec![0f32; dc];
    let mut z = vec![0f32; nv * d];
    let mut b = vec![0f32; nv];
    let mut a = vec![0f32; nv];
    matvec_all(&mut [
        w.qkv.matvec_job(0, x, &mut qkv),
        w.z.matvec_job(0, x, &mut z),
        w.beta.matvec_job(0, x, &mut b),
        w.alpha.matvec_job(0, x, &mut a),
    ]);

    // Depthwise causal conv over [history..., current], then SiLU.
    let mut c = vec![0f32; dc];
    for ch in 0..dc {
        let taps = &w.conv[ch * kc..(ch + 1) * kc];
        let mut acc = taps[kc - 1] * qkv[ch];
        for (k, tap) in taps[..kc - 1].iter().enumerate() {
            acc += tap * st.conv[k * dc + ch];
        }
        c[ch] = silu(acc);
    }
    if kc > 1 {
        st.conv.copy_within(dc.., 0);
        let last = (kc - 2) * dc;
        st.conv[last..last + dc].copy_from_slice(&qkv);
    }

    let (q_all, rest) = c.split_at_mut(nk * d);
    let (k_all, v_all) = rest.split_at_mut(nk * d);
    let qscale = 1.0 / (d as f32).sqrt();
    for (qh, kh) in q_all.chunks_mut(d).zip(k_all.chunks_mut(d)) {
        l2_normalize(qh, L2_EPS);
        l2_normalize(kh, L2_EPS);
        qh.iter_mut().for_each(|v| *v *= qscale);
    }
    let (q_all, k_all, v_all) = (&*q_all, &*k_all, &*v_all);

    let mut o = vec![0f32; nv * d];
    let head = |(h, (s, oh)): (usize, (&mut [f32], &mut [f32]))| {
        let kh = h % nk;
        let q = &q_all[kh * d..(kh + 1) * d];
        let k = &k_all[kh * d..(kh + 1) * d];
        let v = &v_all[h * d..(h + 1) * d];
        let decay = (w.a[h] * softplus(a[h] + w.dt_bias[h])).exp();
        let beta = sigmoid(b[h]);
        s.iter_mut().for_each(|x| *x *= decay);
        // kv_mem[j] = sum_i S[i][j] k[i]
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
    let pairs = st.recurrent.chunks_mut(d * d).zip(o.chunks_mut(d));
    if nv * d * d >= 1 << 15 {
        pairs.collect::<Vec<_>>().into_par_iter().enumerate().for_each(head);
    } else {
        pairs.enumerate().for_each(head);
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
    let mut out = vec![0f32; cfg.hidden];
    w.out.matvec(&normed, &mut out);
    out
}
