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

use super::prof;
use super::ops::{l2_normalize, rms_norm, sigmoid, silu, softplus};
use crate::error::Result;
use crate::model::config::{Config, GateActivation};
use crate::error::zeros;
use crate::model::weights::Gdn;
use crate::quant::kernels::Isa;
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
    conv_batch(taps, kc, ring, pos, qkv)
}

/// [`conv`] for the `T` tokens at `pos, pos + 1, ..` (inputs `qkv`:
/// [T][Dc]): [T][Dc]. Each token's taps read the inputs before it from the
/// batch or, before the batch, from the ring; the tokens run in parallel,
/// then the ring takes the batch's inputs (its last `rows`).
pub fn conv_batch(taps: &[f32], kc: usize, ring: &mut [f32], pos: usize, qkv: &[f32]) -> Vec<f32> {
    let dc = taps.len() / kc;
    assert!(dc > 0 && qkv.len().is_multiple_of(dc) && ring.len().is_multiple_of(dc), "conv inputs of {dc} channels");
    let (rows, t) = (ring.len() / dc, qkv.len() / dc);
    let mut out = vec![0f32; qkv.len()];
    let history = &*ring;
    super::per_chunk(&mut out, dc, |i, c| {
        // The input `b` positions back, for b = 1 .. Kc-1: index b - 1.
        let back: Vec<&[f32]> = (1..kc)
            .map(|b| match i.checked_sub(b) {
                Some(j) => &qkv[j * dc..(j + 1) * dc],
                None => {
                    let r = ring_row((pos + i) as isize - b as isize, rows);
                    &history[r * dc..(r + 1) * dc]
                }
            })
            .collect();
        let x = &qkv[i * dc..(i + 1) * dc];
        for ch in 0..dc {
            let taps = &taps[ch * kc..(ch + 1) * kc];
            let mut acc = taps[kc - 1] * x[ch];
            // Tap k reads the input `kc - 1 - k` positions back.
            for (k, tap) in taps[..kc - 1].iter().enumerate() {
                acc += tap * back[kc - 2 - k][ch];
            }
            c[ch] = silu(acc);
        }
    });
    for i in t.saturating_sub(rows)..t {
        let r = ring_row((pos + i) as isize, rows);
        ring[r * dc..(r + 1) * dc].copy_from_slice(&qkv[i * dc..(i + 1) * dc]);
    }
    out
}

/// One token's decay and beta per value head, after normalising its
/// query and key heads in `c` (q | k | v; l2 norm, the query scaled by
/// `1/sqrt(dk)`).
fn prepare(w: &Gdn, cfg: &Config, c: &mut [f32], b: &[f32], a: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (nk, nv, d) = (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_dim);
    let qscale = 1.0 / (d as f32).sqrt();
    let (q_all, rest) = c.split_at_mut(nk * d);
    for (qh, kh) in q_all.chunks_mut(d).zip(rest[..nk * d].chunks_mut(d)) {
        l2_normalize(qh, L2_EPS);
        l2_normalize(kh, L2_EPS);
        qh.iter_mut().for_each(|v| *v *= qscale);
    }
    let decay = (0..nv).map(|h| (w.a[h] * softplus(a[h] + w.dt_bias[h])).exp()).collect();
    let beta = (0..nv).map(|h| sigmoid(b[h])).collect();
    (decay, beta)
}

/// Value head `h`'s q, k and v in a prepared conv output `c`.
fn head_qkv<'a>(cfg: &Config, c: &'a [f32], h: usize) -> [&'a [f32]; 3] {
    let (nk, d) = (cfg.ssm_k_heads, cfg.ssm_head_dim);
    let kh = h % nk;
    [&c[kh * d..(kh + 1) * d], &c[(nk + kh) * d..(nk + kh + 1) * d], &c[(2 * nk + h) * d..(2 * nk + h + 1) * d]]
}

/// One token through one value head's state ([dk][dv], row `i` for key
/// feature `i`): `to = decay from`, `delta = beta (v - to^T k)`,
/// `to += k delta^T`, `o += to^T q` (`o` zeroed by the caller). In runs of
/// up to 64 value columns, two passes over the run's rows each, its sums
/// kept in registers and formed in row order; the token-by-token and the
/// batched delta rule both step through here.
///
/// Each value column is independent of the others, so `from`/`to` may hold
/// a band of the head's columns ([dk][w], `v`, `delta` and `o` the band's
/// `w`): every number of the band is the one the whole head gives it.
///
/// Element-wise products and sums only (no fused multiply-add, no sums
/// across lanes), so the levels below give the same bits; the wider ones
/// are the same code compiled for wider vectors.
#[allow(clippy::too_many_arguments)]
fn step(from: &[f32], to: &mut [f32], qkv: [&[f32]; 3], decay: f32, beta: f32, delta: &mut [f32], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        #[allow(clippy::too_many_arguments)]
        fn avx2(from: &[f32], to: &mut [f32], qkv: [&[f32]; 3], decay: f32, beta: f32, delta: &mut [f32], o: &mut [f32]) {
            step_portable(from, to, qkv, decay, beta, delta, o)
        }
        #[target_feature(enable = "avx512f")]
        #[allow(clippy::too_many_arguments)]
        fn avx512(from: &[f32], to: &mut [f32], qkv: [&[f32]; 3], decay: f32, beta: f32, delta: &mut [f32], o: &mut [f32]) {
            step_portable(from, to, qkv, decay, beta, delta, o)
        }
        match Isa::detect() {
            // SAFETY: `Isa::detect` reports only levels this CPU runs.
            Isa::Avx2 => return unsafe { avx2(from, to, qkv, decay, beta, delta, o) },
            Isa::Avx512 | Isa::Avx512Vnni => return unsafe { avx512(from, to, qkv, decay, beta, delta, o) },
            Isa::Scalar => {}
        }
    }
    step_portable(from, to, qkv, decay, beta, delta, o)
}

#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::int_plus_one)]
fn step_portable(from: &[f32], to: &mut [f32], [q, k, v]: [&[f32]; 3], decay: f32, beta: f32, delta: &mut [f32], o: &mut [f32]) {
    let w = v.len();
    debug_assert!(from.len() == k.len() * w && to.len() == from.len() && delta.len() == w && o.len() == w);
    // Columns in runs whose sums stay in registers through the rows (with
    // whole rows, `delta` and `o` were loaded and stored at every row); every
    // column's numbers are formed as when the rows were walked whole.
    let mut j = 0;
    macro_rules! runs {
        ($($c:literal)*) => {$(
            while j + $c <= w {
                step_columns::<$c>(from, to, [q, k, v], decay, beta, delta, o, j);
                j += $c;
            }
        )*};
    }
    runs!(64 32 16 8 1);
}

/// [`step`] for value columns `j..j + C` of a state of `v.len()` columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn step_columns<const C: usize>(from: &[f32], to: &mut [f32], [q, k, v]: [&[f32]; 3], decay: f32, beta: f32, delta: &mut [f32], o: &mut [f32], j: usize) {
    let w = v.len();
    let mut d = [0f32; C];
    for (i, &ki) in k.iter().enumerate() {
        let (row_in, row) = (&from[i * w + j..][..C], &mut to[i * w + j..][..C]);
        for c in 0..C {
            row[c] = row_in[c] * decay;
            d[c] += row[c] * ki;
        }
    }
    for c in 0..C {
        d[c] = (v[j + c] - d[c]) * beta;
    }
    delta[j..j + C].copy_from_slice(&d);
    let mut out: [f32; C] = o[j..j + C].try_into().expect("C columns");
    for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
        let row = &mut to[i * w + j..][..C];
        for c in 0..C {
            row[c] += ki * d[c];
            out[c] += row[c] * qi;
        }
    }
    o[j..j + C].copy_from_slice(&out);
}

/// The gated RMSNorm per head of one token's delta-rule output `o` with its
/// gate projection `z`: [nv*d].
pub(crate) fn gated_norm(w: &Gdn, cfg: &Config, o: &[f32], z: &[f32]) -> Vec<f32> {
    let d = cfg.ssm_head_dim;
    let mut normed = vec![0f32; o.len()];
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

/// The delta rule for the token at `pos` (reading recurrent plane
/// `pos mod planes`, writing plane `pos + 1`), then the gated RMSNorm per
/// head: [nv*d]. `c` is the conv output (q | k | v), `z`, `b`, `a` the
/// gate, beta and decay projections.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(w: &Gdn, cfg: &Config, planes: &mut [f32], pos: usize, c: &mut [f32], z: &[f32], b: &[f32], a: &[f32]) -> Vec<f32> {
    let o = delta_rule_unnormed(w, cfg, planes, pos, c, b, a);
    gated_norm(w, cfg, &o, z)
}

/// [`delta_rule`]'s output before its gated RMSNorm ([`gated_norm`]): the
/// GPU runs the two as separate stages (shaders/gdn_recurrent.comp,
/// shaders/gdn_norm.comp), which its twins check one by one.
pub(crate) fn delta_rule_unnormed(w: &Gdn, cfg: &Config, planes: &mut [f32], pos: usize, c: &mut [f32], b: &[f32], a: &[f32]) -> Vec<f32> {
    let (nv, d) = (cfg.ssm_v_heads, cfg.ssm_head_dim);
    let (decay, beta) = prepare(w, cfg, c, b, a);
    let c = &*c;

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
        let mut delta = vec![0f32; d];
        step(s_in, s, head_qkv(cfg, c, h), decay[h], beta[h], &mut delta, oh);
    };
    let heads = src.chunks(d * d).zip(dst.chunks_mut(d * d)).zip(o.chunks_mut(d));
    if nv * d * d >= 1 << 15 {
        heads.collect::<Vec<_>>().into_par_iter().enumerate().for_each(head);
    } else {
        heads.enumerate().for_each(head);
    }
    o
}

/// [`delta_rule`] for the `T` tokens at `pos, pos + 1, ..` (conv outputs
/// `cs`: [T][Dc], gates `zs` [T][nv*d], `bs` and `as_` [T][nv]): [T][nv*d].
///
/// Head-major: each value head, or band of a head's value columns where the
/// heads are too few to keep every thread busy ([`column_bands`]), carries
/// its state through the batch in two buffers of the thread's cache (64 KB
/// a head at the real shapes, where the token-by-token walk streams every
/// head's plane, 3 MB a layer, in and out for each token), in parallel;
/// only the states of the last `planes` positions are written to their
/// planes, the ones token-by-token decoding leaves. Every number is
/// [`step`]'s, in the same order, so the outputs and the planes are those
/// of `T` calls of [`delta_rule`].
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_batch(w: &Gdn, cfg: &Config, planes: &mut [f32], pos: usize, cs: &mut [f32], zs: &[f32], bs: &[f32], as_: &[f32]) -> Vec<f32> {
    let (nv, d, dc) = (cfg.ssm_v_heads, cfg.ssm_head_dim, cfg.ssm_conv_dim());
    let t = cs.len() / dc;
    let prepare_token = |(i, c): (usize, &mut [f32])| prepare(w, cfg, c, &bs[i * nv..(i + 1) * nv], &as_[i * nv..(i + 1) * nv]);
    let gates: Vec<(Vec<f32>, Vec<f32>)> = if t > 1 {
        cs.par_chunks_exact_mut(dc).enumerate().map(prepare_token).collect()
    } else {
        cs.chunks_exact_mut(dc).enumerate().map(prepare_token).collect()
    };
    let cs = &*cs;
    let plane = nv * d * d;
    let n_planes = planes.len() / plane;
    // The states kept: those after the batch's last `keep` tokens.
    let keep = n_planes.min(t);
    let bands = column_bands(nv, d, t);
    let bw = d / bands;
    // Band `b` of head `h` (task `h * bands + b`): its outputs [T][bw] and kept states [keep][d][bw].
    let start = &planes[(pos % n_planes) * plane..(pos % n_planes + 1) * plane];
    let band = |task: usize| -> (Vec<f32>, Vec<f32>) {
        let (h, j0) = (task / bands, (task % bands) * bw);
        let mut s: Vec<f32> = start[h * d * d..(h + 1) * d * d].chunks_exact(d).flat_map(|row| &row[j0..j0 + bw]).copied().collect();
        let (mut next, mut delta) = (vec![0f32; d * bw], vec![0f32; bw]);
        let mut o = vec![0f32; t * bw];
        let mut kept = Vec::with_capacity(keep * d * bw);
        for (i, oi) in o.chunks_exact_mut(bw).enumerate() {
            let (decay, beta) = (gates[i].0[h], gates[i].1[h]);
            let [q, k, v] = head_qkv(cfg, &cs[i * dc..(i + 1) * dc], h);
            step(&s, &mut next, [q, k, &v[j0..j0 + bw]], decay, beta, &mut delta, oi);
            std::mem::swap(&mut s, &mut next);
            if t - 1 - i < keep {
                kept.extend_from_slice(&s);
            }
        }
        (o, kept)
    };
    let outs: Vec<(Vec<f32>, Vec<f32>)> = if t * nv * d * d >= 1 << 15 { (0..nv * bands).into_par_iter().map(band).collect() } else { (0..nv * bands).map(band).collect() };
    // Kept state `m` is the one after token `t - keep + m`, position `pos + t - keep + m + 1`.
    let first_kept = pos + t - keep + 1;
    super::per_chunk(planes, d * d, |i, head_plane| {
        let (p, h) = (i / nv, i % nv);
        let m = (p + n_planes - first_kept % n_planes) % n_planes;
        if m >= keep {
            return;
        }
        for b in 0..bands {
            let kept = &outs[h * bands + b].1[m * d * bw..(m + 1) * d * bw];
            for (row, src) in head_plane.chunks_exact_mut(d).zip(kept.chunks_exact(bw)) {
                row[b * bw..(b + 1) * bw].copy_from_slice(src);
            }
        }
    });
    let mut normed = vec![0f32; t * nv * d];
    super::per_chunk(&mut normed, nv * d, |i, out| {
        let o: Vec<f32> = outs.iter().flat_map(|(ob, _)| &ob[i * bw..(i + 1) * bw]).copied().collect();
        out.copy_from_slice(&gated_norm(w, cfg, &o, &zs[i * nv * d..(i + 1) * nv * d]));
    });
    normed
}

/// Bands of value columns each head's delta rule is cut into for a batch
/// of `t` tokens: 1, or 2 or 4 where `nv` heads alone are fewer than four
/// tasks per thread (48 heads on 16 threads left each thread three, and
/// the longest of them set the stage's time), never narrower than 8 columns.
fn column_bands(nv: usize, d: usize, t: usize) -> usize {
    let want = 4 * rayon::current_num_threads();
    let mut bands = 1;
    while t > 1 && bands < 4 && nv * bands < want && d.is_multiple_of(2 * bands) && d / (2 * bands) >= 8 {
        bands *= 2;
    }
    bands
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
/// conv steps token by token through [`conv`], the delta rule head by head
/// through the batch ([`delta_rule_batch`]), so the outputs and the states
/// left are [`forward`]'s.
pub fn forward_batch(w: &Gdn, cfg: &Config, st: &mut GdnState, pos: usize, xs: &[f32]) -> Vec<f32> {
    let (nv, d, h) = (cfg.ssm_v_heads, cfg.ssm_head_dim, cfg.hidden);
    let t = xs.len() / h;
    let dc = cfg.ssm_conv_dim();
    let span = prof::span("gdn: in-projections");
    let (mut qkv, mut z, mut beta, mut alpha) = (vec![0f32; t * dc], vec![0f32; t * nv * d], vec![0f32; t * nv], vec![0f32; t * nv]);
    matmul_all(&mut [
        w.qkv.matmul_job(0, xs, &mut qkv),
        w.z.matmul_job(0, xs, &mut z),
        w.beta.matmul_job(0, xs, &mut beta),
        w.alpha.matmul_job(0, xs, &mut alpha),
    ]);
    drop(span);
    let span = prof::span("gdn: conv");
    let mut c = conv_batch(&w.conv, cfg.ssm_conv, &mut st.conv, pos, &qkv);
    drop(span);
    let span = prof::span("gdn: delta rule, gated norm");
    let normed = delta_rule_batch(w, cfg, &mut st.planes, pos, &mut c, &z, &beta, &alpha);
    drop(span);
    let _span = prof::span("gdn: out-projection");
    let mut out = vec![0f32; t * h];
    w.out.matmul(&normed, &mut out);
    out
}
