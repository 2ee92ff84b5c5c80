//! `moe_route` and `moe_combine`: the MoE around its expert matvecs.

use super::*;
use crate::cpu::hyper;
use crate::cpu::moe;
use crate::cpu::ops::sigmoid;
use crate::model::weights::{ExpertGateUp, Moe};
use crate::vulkan::pipelines::{MoeCombinePush, MoeRoutePush, MAX_TOP_K, NO_PARTIAL};

/// MoE weights with `router` and `shared_gate`; `moe::route` reads only the
/// router, so the experts are 1x1 placeholders.
fn weights(router: Tensor, shared_gate: Vec<f32>) -> Moe {
    let tiny = || matrix(1, 1, &[0.0]);
    Moe {
        router,
        gate_up: ExpertGateUp::Fused(tiny()),
        down: tiny(),
        shared_gate,
        shared_gate_proj: tiny(),
        shared_up: tiny(),
        shared_down: tiny(),
    }
}

/// The smallest gap between consecutive ones of the `n` largest logits
/// (softmax keeps their order; a gap far above rounding is no near-tie).
fn min_gap(logits: &[f32], n: usize) -> f32 {
    let mut s = logits.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    s[..n].windows(2).map(|w| w[0] - w[1]).fold(f32::INFINITY, f32::min)
}

/// Routes `x` on the GPU and with `moe::route`; ids must be equal (in rank order), weights within 1e-5.
fn route(g: &Gpu, what: &str, router: Tensor, x: &[f32], k: usize, shared_in_arena: bool, r: &mut Rng) {
    let (n, h) = (router.rows(), x.len());
    let cfg = Config { hidden: h, n_experts: n, n_experts_used: k, ..Config::published_one_layer() };
    let w = weights(router, r.vec(h, (3.0 / h as f32).sqrt()));
    let routes = moe::route(&w, &cfg, x);
    // The logits: the router matvec `moe::route` makes first.
    let mut logits = vec![0f32; n];
    w.router.matvec(x, &mut logits);
    let mut want_ids: Vec<usize> = routes.iter().map(|&(e, _)| e).collect();
    let mut want_w: Vec<f32> = routes.iter().map(|&(_, p)| p).collect();
    if shared_in_arena {
        // The shared expert runs as expert `k` (its slot-table entry is
        // `n_experts`), weighted by its gate.
        want_ids.push(n);
        want_w.push(moe::shared_gate(&w, x));
    }
    let m = want_ids.len();
    let mut b = Bufs::default();
    let logits_off = b.s.put(&logits);
    let ids_off = b.s.out(m);
    let w_off = b.s.out(m);
    let x_off = b.s.put(x);
    let push = MoeRoutePush {
        logits_off,
        ids_off,
        w_off,
        n_experts: n as u32,
        k: k as u32,
        shared_in_arena: shared_in_arena as u32,
        x_off,
        shared_gate: b.prm.put(&w.shared_gate),
        h: h as u32,
        tok_stride: 0,
    };
    // The shader leaves probabilities (and -1 for the chosen) in the logits.
    let written = [(logits_off, n), (ids_off, m), (w_off, m)];
    let out = g.run(Pipe::MoeRoute, &push, Groups::Fixed([1, 1, 1]), &b, &written, &[]);
    let what = format!("moe_route {what} E={n} k={k} shared_in_arena={shared_in_arena}");
    let ids: Vec<usize> = out.s(ids_off, m).iter().map(|f| f.to_bits() as usize).collect();
    assert_eq!(ids, want_ids, "{what}: GPU and CPU choose different experts");
    check(&format!("{what}: ids equal, weights"), out.s(w_off, m), &want_w, 1e-5);
}

#[test]
fn moe_route() {
    let Some(g) = gpu() else { return };
    // (experts, k, hidden, shared in arena): the real 10 of 512 over hidden
    // 2560, the largest k, and an expert count off the 256-wide workgroup.
    for (n, k, h, shared) in [(512, 10, 2560, false), (512, 10, 2560, true), (512, MAX_TOP_K, 64, true), (100, 8, 64, false)] {
        let mut r = Rng::new((n * k + h) as u64);
        let router = r.matrix(n, h);
        let x = r.unit(h);
        let mut logits = vec![0f32; n];
        router.matvec(&x, &mut logits);
        // Inputs built without near-ties: a logit gap of 1e-4 is far above
        // the rounding of either softmax.
        assert!(min_gap(&logits, k + 1) > 1e-4, "precondition: no near-tie in the top {}", k + 1);
        route(g, "random", router, &x, k, shared, &mut r);
    }
    // Exact ties, on purpose: a one-hot input makes the logits the router's
    // first column, where experts tie for ranks 0-1 and 8-10; both sides must
    // rank the lower id first (the 10th place goes to the lower two of three).
    let (n, k, h) = (512, 10, 64);
    let mut r = Rng::new(99);
    let mut rank: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        rank.swap(i, r.below(i + 1));
    }
    let logit = |rk: usize| 2.0 - 0.01 * rk as f32;
    let mut column: Vec<f32> = rank.iter().map(|&rk| logit(rk)).collect();
    for (rk, e) in rank.iter().zip(&mut column) {
        match rk {
            1 => *e = logit(0),
            9 | 10 => *e = logit(8),
            _ => {}
        }
    }
    let mut sorted = column.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    assert!(sorted[0] == sorted[1] && sorted[k - 1] == sorted[k], "precondition: ties at the top and across the cut");
    let mut values = r.vec(n * h, 1.0);
    (0..n).for_each(|e| values[e * h] = column[e]);
    let mut x = vec![0f32; h];
    x[0] = 1.0;
    for shared in [false, true] {
        route(g, "ties", matrix(n, h, &values), &x, k, shared, &mut r);
    }
}

#[test]
fn moe_combine() {
    let Some(g) = gpu() else { return };
    // (hidden, experts combined, streams, shared expert separate, host sum):
    // the real 10 experts over hidden 2560 with the shared expert run apart,
    // the same with the shared expert as an 11th from the arena, the largest
    // k, a hidden off the 256-wide workgroup; with the expert cache, 3 on the
    // GPU and the host's weighted sum of the rest, and none on the GPU.
    let cases = [
        (2560, 10, 4, true, false),
        (2560, 11, 4, false, false),
        (64, MAX_TOP_K, 4, true, false),
        (300, 9, 2, false, false),
        (2560, 3, 4, true, true),
        (300, 0, 2, true, true),
    ];
    for (h, k, c, separate, host) in cases {
        let mut r = Rng::new((h * k * c) as u64);
        let y = r.unit(k.max(1) * h);
        let (x, shared, shared_gate) = (r.unit(h), r.unit(h), r.vec(h, (3.0 / h as f32).sqrt()));
        let gate = moe::shared_gate(&weights(matrix(1, 1, &[0.0]), shared_gate.clone()), &x);
        let routed = if separate { k } else { k - 1 };
        let p: Vec<f32> = (0..routed).map(|_| r.uniform() + 1.5).collect();
        let mut w: Vec<f32> = p.iter().map(|v| v / p.iter().sum::<f32>()).collect();
        if !separate {
            w.push(gate);
        }
        let residual = r.vec(c * h, 2.0);
        let inject: Vec<f32> = (0..c).map(|_| 2.0 * sigmoid(r.uniform())).collect();
        // `moe::combine` over the routed experts (the shared one, when it
        // runs in the arena, is the last of them with its gate as weight),
        // then `hyper::post`.
        let routes: Vec<(usize, f32)> = w.iter().map(|&p| (0, p)).collect();
        let mut moe_out = if separate { moe::combine(&routes, &y, &shared, gate) } else { moe::combine(&routes, &y, &vec![0.0; h], 0.0) };
        // The host's share, added as `moe_experts` sums it.
        let partial = r.unit(h);
        if host {
            moe_out.iter_mut().zip(&partial).for_each(|(o, p)| *o += p);
        }
        let mut want = residual.clone();
        hyper::post(&mut want, &moe_out, &inject);

        let mut b = Bufs::default();
        let y_off = b.s.put(&y);
        let w_off = b.s.put(&w);
        let shared_off = b.s.put(&shared);
        let x_off = b.s.put(&x);
        let res_off = b.s.put(&residual);
        let inject_off = b.s.put(&inject);
        let partial_off = b.s.put(&partial);
        let push = MoeCombinePush {
            y_off,
            w_off,
            shared_off,
            x_off,
            shared_gate: b.prm.put(&shared_gate),
            res_off,
            inject_off,
            h: h as u32,
            k: k as u32,
            streams: c as u32,
            shared_separate: separate as u32,
            partial_off: if host { partial_off } else { NO_PARTIAL },
            tok_stride: 0,
        };
        let out = g.run(Pipe::MoeCombine, &push, Groups::Threads(h), &b, &[(res_off, c * h)], &[]);
        check(&format!("moe_combine H={h} k={k} C={c} shared_separate={separate} host sum {host}"), out.s(res_off, c * h), &want, 1e-5);
    }
}
