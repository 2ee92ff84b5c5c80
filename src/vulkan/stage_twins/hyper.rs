//! `hc_norm` and `hc_combine`: the hyper-connection pre step around its matvecs.

use super::*;
use crate::model::hyper;
use crate::model::ops::{rms_norm_grouped, silu};
use crate::model::weights::HyperConnection;
use crate::vulkan::pipelines::{HcCombinePush, HcNormPush};

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
        // `hyper::pre` norms the streams with exactly this call.
        let mut want = vec![0f32; c * h];
        rms_norm_grouped(&x, &gamma, h, EPS, &mut want);

        let mut b = Bufs::default();
        let x_off = b.s.put(&x);
        let y_off = b.s.out(c * h);
        let gamma_off = b.prm.put(&gamma);
        let push = HcNormPush { x_off, gamma: gamma_off, y_off, n: h as u32, eps: EPS };
        let out = g.run(Pipe::HcNorm, &push, Groups::Fixed([c as u32, 1, 1]), &b, &[(y_off, c * h)], &[]);
        check(&format!("hc_norm C={c} H={h} |x|<{scale}"), out.s(y_off, c * h), &want, 4e-6);
    }
}

#[test]
fn hc_combine() {
    let Some(g) = gpu() else { return };
    // (streams, hidden, low rank): the real sizes, and hiddens off the 64-wide workgroup.
    for (c, h, rank) in [(4, 2560, 320), (4, 64, 16), (4, 100, 8), (2, 130, 4)] {
        let mut r = Rng::new((c * h + rank) as u64);
        let hc = HyperConnection {
            norm: r.gamma(c * h),
            down: r.matrix(rank, c * h),
            up: r.matrix(c * h, rank),
            inject: Some(r.matrix(c, c * h)),
        };
        let residual = r.vec(c * h, 2.0);
        let want = hyper::pre(&hc, &residual, c, EPS).input;
        // The shader's inputs: the normed streams and the mix logits, by the
        // calls `hyper::pre` makes before its combine loop.
        let mut xn = vec![0f32; c * h];
        rms_norm_grouped(&residual, &hc.norm, h, EPS, &mut xn);
        let mut low = vec![0f32; rank];
        hc.down.matvec(&xn, &mut low);
        low.iter_mut().for_each(|v| *v = silu(*v / c as f32));
        let mut mix = vec![0f32; c * h];
        hc.up.matvec(&low, &mut mix);

        let mut b = Bufs::default();
        let mix_off = b.s.put(&mix);
        let xn_off = b.s.put(&xn);
        let y_off = b.s.out(h);
        let push = HcCombinePush { mix_off, xn_off, y_off, n: h as u32, streams: c as u32 };
        let out = g.run(Pipe::HcCombine, &push, Groups::Threads(h), &b, &[(y_off, h)], &[]);
        check(&format!("hc_combine C={c} H={h} R={rank}"), out.s(y_off, h), &want, 4e-6);
    }
}
