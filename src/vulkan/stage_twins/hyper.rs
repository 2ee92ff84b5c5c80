//! `hc_norm` and `hc_combine`: the hyper-connection pre step around its matvecs.

use super::*;
use crate::cpu::hyper;
use crate::vulkan::pipelines::{ActInt8Push, HcCombinePush, HcNormPush, XQ_FLOATS};

/// (streams, hidden, input scale): the real 4 x 2560; the same with inputs
/// so small that the epsilon's place matters; hiddens that leave the
/// 256-wide workgroup partly idle.
const NORM_CASES: [(usize, usize, f32); 5] = [(4, 2560, 3.0), (4, 2560, 3e-3), (4, 64, 3.0), (4, 100, 3.0), (1, 300, 3.0)];

#[test]
fn hc_norm() {
    let Some(g) = gpu() else { return };
    for (c, h, scale) in NORM_CASES {
        let mut r = Rng::new(h as u64);
        let x = r.vec(c * h, scale);
        let gamma = r.gamma(c * h);
        let want = hyper::norm(&gamma, &x, c, EPS);

        let mut b = Bufs::default();
        let x_off = b.s.put(&x);
        let y_off = b.s.out(c * h);
        let gamma_off = b.prm.put(&gamma);
        let push = HcNormPush { x_off, gamma: gamma_off, y_off, n: h as u32, eps: EPS, tok_stride: 0, q_off: 0 };
        let out = g.run(Pipe::HcNorm, &push, Groups::Fixed(push.groups(c as u32, 1)), &b, &[(y_off, c * h)], &[]);
        check(&format!("hc_norm C={c} H={h} |x|<{scale}"), out.s(y_off, c * h), &want, 4e-6);
        if !h.is_multiple_of(32) {
            continue;
        }
        // With the rounded copy: the same floats, and the region act_int8
        // writes from them, bit for bit.
        let q_off = b.s.out(XQ_FLOATS);
        let push = HcNormPush { q_off, ..push };
        let rounded = g.run(Pipe::HcNorm, &push, Groups::Fixed(push.groups(c as u32, 1)), &b, &[(y_off, c * h), (q_off, XQ_FLOATS)], &[]);
        check_exact(&format!("hc_norm C={c} H={h} |x|<{scale} rounding too"), rounded.s(y_off, c * h), out.s(y_off, c * h));
        let mut a = Bufs::default();
        let xn_off = a.s.put(out.s(y_off, c * h));
        let aq = a.s.out(XQ_FLOATS);
        let act = ActInt8Push { x_off: xn_off, x_stride: 0, tok_stride: 0, cols: (c * h) as u32, count: 1, q_off: aq };
        let groups = ((c * h / 32).div_ceil(Pipe::ActInt8.spec().workgroup as usize / 4)) as u32;
        let by_act = g.run(Pipe::ActInt8, &act, Groups::Fixed([groups, 1, 1]), &a, &[(aq, XQ_FLOATS)], &[]);
        // (Entries past c * h values keep their sentinels in both.)
        check_exact(&format!("hc_norm C={c} H={h} rounded as act_int8 rounds"), rounded.s(q_off, XQ_FLOATS), by_act.s(aq, XQ_FLOATS));
    }
}

#[test]
fn hc_combine() {
    let Some(g) = gpu() else { return };
    // (streams, hidden, low rank): the real sizes, and hiddens off the 64-wide workgroup.
    for (c, h, rank) in [(4, 2560, 320), (4, 64, 16), (4, 100, 8), (2, 130, 4)] {
        let mut r = Rng::new((c * h + rank) as u64);
        let (gamma, down, up) = (r.gamma(c * h), r.matrix(rank, c * h), r.matrix(c * h, rank));
        let hc = crate::model::weights::HyperConnection { norm: gamma, down, up, inject: None };
        let residual = r.vec(c * h, 2.0);
        // The shader's inputs, by the stages before it.
        let xn = hyper::norm(&hc.norm, &residual, c, EPS);
        let mix = hyper::mix_logits(&hc, &xn, c);
        let want = hyper::combine(&mix, &xn, c);

        let mut b = Bufs::default();
        let mix_off = b.s.put(&mix);
        let xn_off = b.s.put(&xn);
        let y_off = b.s.out(h);
        let push = HcCombinePush { mix_off, xn_off, y_off, n: h as u32, streams: c as u32, tok_stride: 0 };
        let out = g.run(Pipe::HcCombine, &push, Groups::Threads(h), &b, &[(y_off, h)], &[]);
        check(&format!("hc_combine C={c} H={h} R={rank}"), out.s(y_off, h), &want, 4e-6);
    }
}
