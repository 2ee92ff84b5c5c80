//! `gdn_conv` and `gdn_recurrent`: the Gated DeltaNet after its input projections.

use super::*;
use crate::model::gdn::{self, GdnState};
use crate::model::ops::silu;
use crate::model::weights::Gdn;
use crate::vulkan::pipelines::{GdnConvPush, GdnRecurrentPush};

/// One GDN token on the CPU, with what the shaders read.
struct Case {
    cfg: Config,
    w: Gdn,
    before: GdnState,
    after: GdnState,
    /// `gdn::forward`'s output: the gated norm itself when the out
    /// projection is the identity (`hidden == nv * d`).
    out: Vec<f32>,
    /// The input projections, by the calls `gdn::forward` makes first.
    qkv: Vec<f32>,
    z: Vec<f32>,
    beta: Vec<f32>,
    alpha: Vec<f32>,
    /// The conv output the delta rule reads (see [`conv`]).
    conv_out: Vec<f32>,
}

/// `gdn::forward`'s depthwise causal conv + SiLU, which it computes inline:
/// its loop, verbatim (lint and all).
#[allow(clippy::needless_range_loop)]
fn conv(w: &Gdn, st: &GdnState, qkv: &[f32], dc: usize, kc: usize) -> Vec<f32> {
    let mut c = vec![0f32; dc];
    for ch in 0..dc {
        let taps = &w.conv[ch * kc..(ch + 1) * kc];
        let mut acc = taps[kc - 1] * qkv[ch];
        for k in 0..kc - 1 {
            acc += taps[k] * st.conv[k * dc + ch];
        }
        c[ch] = silu(acc);
    }
    c
}

fn case(nk: usize, nv: usize, d: usize, kc: usize, hidden: usize, gate: GateActivation) -> Case {
    let cfg = Config { hidden, ssm_k_heads: nk, ssm_v_heads: nv, ssm_head_dim: d, ssm_conv: kc, ssm_gate: gate, ..config() };
    let dc = cfg.ssm_conv_dim();
    let mut r = Rng::new((nk * 1000 + nv * 100 + d + kc) as u64);
    let w = Gdn {
        qkv: r.matrix(dc, hidden),
        z: r.matrix(nv * d, hidden),
        beta: r.matrix(nv, hidden),
        alpha: r.matrix(nv, hidden),
        conv: r.vec(dc * kc, 0.7),
        dt_bias: r.vec(nv, 1.0),
        // -exp(A_log), A_log in [-2, 2]
        a: (0..nv).map(|_| -(2.0 * r.uniform()).exp()).collect(),
        norm: r.gamma(d),
        out: if hidden == nv * d { identity(hidden) } else { r.matrix(hidden, nv * d) },
    };
    let x = r.unit(hidden);
    let before = GdnState { conv: r.unit((kc - 1) * dc), recurrent: r.vec(nv * d * d, 0.5) };
    let mut after = before.clone();
    let out = gdn::forward(&w, &cfg, &mut after, &x);
    let project = |t: &Tensor| {
        let mut y = vec![0f32; t.rows()];
        t.matvec(&x, &mut y);
        y
    };
    let (qkv, z, beta, alpha) = (project(&w.qkv), project(&w.z), project(&w.beta), project(&w.alpha));
    let conv_out = conv(&w, &before, &qkv, dc, kc);
    Case { cfg, w, before, after, out, qkv, z, beta, alpha, conv_out }
}

/// The layer state as the decode lays it out: conv history at 0, then
/// (after a guard) the recurrent state. Returns the recurrent offset.
fn state(b: &mut Bufs, c: &Case) -> u32 {
    assert_eq!(b.st.put(&c.before.conv), 0);
    b.st.put(&c.before.recurrent)
}

#[test]
fn gdn_conv() {
    let Some(g) = gpu() else { return };
    // (nk, nv, d, kernel): the real 16/48 heads of 128 (10240 channels), a
    // small odd channel count, and a kernel of 2.
    for (nk, nv, d, kc) in [(16, 48, 128, 4), (2, 3, 20, 4), (1, 2, 24, 2)] {
        let c = case(nk, nv, d, kc, 64, GateActivation::Sigmoid);
        let dc = c.cfg.ssm_conv_dim();
        let mut b = Bufs::default();
        let rec_off = state(&mut b, &c);
        let x_off = b.s.put(&c.qkv);
        let y_off = b.s.out(dc);
        let taps = b.prm.put(&c.w.conv);
        let push = GdnConvPush { x_off, y_off, taps, dc: dc as u32, kc: kc as u32 };
        let n_hist = (kc - 1) * dc;
        let out = g.run(Pipe::GdnConv, &push, Groups::Threads(dc), &b, &[(y_off, dc)], &[(0, n_hist)]);
        let what = format!("gdn_conv Dc={dc} Kc={kc}");
        check(&what, out.s(y_off, dc), &c.conv_out, 4e-6);
        check_exact(&format!("{what} history"), out.st(0, n_hist), &c.after.conv);
        assert_eq!(out.st(rec_off, 1)[0].to_bits(), c.before.recurrent[0].to_bits());
    }
}

#[test]
fn gdn_recurrent() {
    let Some(g) = gpu() else { return };
    // (nk, nv, d, hidden, gate): head dim 128 (the real one) with an identity
    // out projection; a head dim of 48 (invocations idle); and the real 48
    // heads over 16 key heads, whose output is compared through a random out
    // projection (an identity one would need hidden = 6144).
    let cases = [
        (2, 6, 128, 768, GateActivation::Sigmoid),
        (3, 6, 48, 288, GateActivation::Silu),
        (16, 48, 128, 64, GateActivation::Sigmoid),
    ];
    for (nk, nv, d, hidden, gate) in cases {
        let c = case(nk, nv, d, 4, hidden, gate);
        let mut b = Bufs::default();
        let rec_off = state(&mut b, &c);
        let conv_off = b.s.put(&c.conv_out);
        let z_off = b.s.put(&c.z);
        let b_off = b.s.put(&c.beta);
        let a_off = b.s.put(&c.alpha);
        let y_off = b.s.out(nv * d);
        let push = GdnRecurrentPush {
            conv_off,
            z_off,
            b_off,
            a_off,
            y_off,
            nk: nk as u32,
            nv: nv as u32,
            d: d as u32,
            rec_off,
            decay_a: b.prm.put(&c.w.a),
            dt_bias: b.prm.put(&c.w.dt_bias),
            norm: b.prm.put(&c.w.norm),
            gate_silu: (gate == GateActivation::Silu) as u32,
            eps: EPS,
        };
        let n_rec = nv * d * d;
        let out = g.run(Pipe::GdnRecurrent, &push, Groups::Fixed([nv as u32, 1, 1]), &b, &[(y_off, nv * d)], &[(rec_off, n_rec)]);
        let what = format!("gdn_recurrent nk={nk} nv={nv} d={d} {gate:?}");
        check(&format!("{what} state"), out.st(rec_off, n_rec), &c.after.recurrent, 2e-5);
        let y = out.s(y_off, nv * d);
        if hidden == nv * d {
            check(&format!("{what} output"), y, &c.out, 2e-5);
        } else {
            let mut projected = vec![0f32; hidden];
            c.w.out.matvec(y, &mut projected);
            check(&format!("{what} output (projected)"), &projected, &c.out, 2e-5);
        }
    }
}

