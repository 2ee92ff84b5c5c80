//! `gdn_conv`, `gdn_recurrent` and `gdn_norm`: the Gated DeltaNet after its
//! input projections; `gdn_token`, the three in one dispatch for one token.

use super::*;
use crate::cpu::gdn::{self, GdnState};
use crate::model::weights::Gdn;
use crate::vulkan::pipelines::{GdnConvPush, GdnNormPush, GdnRecurrentPush, GdnTokenPush};

/// One GDN token at position `pos` on the CPU, stage by stage.
struct Case {
    cfg: Config,
    w: Gdn,
    before: GdnState,
    /// After the conv stage (its ring) and the delta rule (its planes).
    after: GdnState,
    /// The input projections, by `gdn::project`.
    p: gdn::Projections,
    /// `gdn::conv`'s output, which the delta rule reads.
    conv_out: Vec<f32>,
    /// `gdn::delta_rule`'s output before its gated norm (gdn_recurrent's).
    o: Vec<f32>,
    /// `gdn::delta_rule`'s output (before the out projection; gdn_norm's).
    y: Vec<f32>,
}

fn case(nk: usize, nv: usize, d: usize, kc: usize, window: usize, pos: usize, gate: GateActivation) -> Case {
    let hidden = 64;
    let cfg = Config { hidden, ssm_k_heads: nk, ssm_v_heads: nv, ssm_head_dim: d, ssm_conv: kc, ssm_gate: gate, ..Config::published_one_layer() };
    let dc = cfg.ssm_conv_dim();
    let mut r = Rng::new((nk * 1000 + nv * 100 + d + kc + pos) as u64);
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
        out: r.matrix(hidden, nv * d),
    };
    let x = r.unit(hidden);
    let empty = GdnState::new(&cfg, window).unwrap();
    let before = GdnState { conv: r.unit(empty.conv.len()), planes: r.vec(empty.planes.len(), 0.5) };
    let p = gdn::project(&w, &cfg, &x);
    let mut after = before.clone();
    let conv_out = gdn::conv(&w.conv, kc, &mut after.conv, pos, &p.qkv);
    let mut c = conv_out.clone();
    let o = gdn::delta_rule_unnormed(&w, &cfg, &mut after.planes, pos, &mut c, &p.beta, &p.alpha);
    let y = gdn::gated_norm(&w, &cfg, &o, &p.z);
    // The whole layer is these stages and the out projection.
    let mut whole = before.clone();
    let mut projected = vec![0f32; hidden];
    w.out.matvec(&y, &mut projected);
    assert_eq!(gdn::forward(&w, &cfg, &mut whole, pos, &x), projected);
    Case { cfg, w, before, after, p, conv_out, o, y }
}

/// The delta rule's push for `c` from position `pos`: the activations at
/// `offs` (conv output, beta, alpha, output; token 0's), `n` tokens `tok`
/// floats apart, the planes at `planes`, the parameters put into `b`.
fn recurrent_push(b: &mut Bufs, c: &Case, planes: u32, pos: usize, offs: [u32; 4], n: usize, tok: usize) -> GdnRecurrentPush {
    let (cfg, w) = (&c.cfg, &c.w);
    let [conv_off, b_off, a_off, y_off] = offs;
    let (nv, d) = (cfg.ssm_v_heads, cfg.ssm_head_dim);
    GdnRecurrentPush {
        conv_off,
        b_off,
        a_off,
        y_off,
        nk: cfg.ssm_k_heads as u32,
        nv: nv as u32,
        d: d as u32,
        planes_off: planes,
        planes: (c.before.planes.len() / (nv * d * d)) as u32,
        pos: pos as u32,
        n: n as u32,
        tok_stride: tok as u32,
        decay_a: b.prm.put(&w.a),
        dt_bias: b.prm.put(&w.dt_bias),
    }
}

/// The gated norm's push for `c`: the delta rule's output at `y_off` and
/// the gates at `z_off` (token 0's, `tok` floats apart), the parameters put
/// into `b`.
fn norm_push(b: &mut Bufs, c: &Case, y_off: u32, z_off: u32, tok: usize) -> GdnNormPush {
    let gate_silu = (c.cfg.ssm_gate == GateActivation::Silu) as u32;
    GdnNormPush { y_off, z_off, d: c.cfg.ssm_head_dim as u32, norm: b.prm.put(&c.w.norm), gate_silu, eps: EPS, tok_stride: tok as u32 }
}

/// gdn_recurrent's workgroups for `c` with `lanes` invocations per column.
fn recurrent_groups(c: &Case, lanes: u32) -> Groups {
    let d = c.cfg.ssm_head_dim as u32;
    Groups::Fixed([c.cfg.ssm_v_heads as u32, (d * lanes).div_ceil(128), 1])
}

/// The layer state as the decode lays it out: the conv ring at 0, then (after
/// a guard) the planes. Returns the planes' offset.
fn state(b: &mut Bufs, c: &Case) -> u32 {
    assert_eq!(b.st.put(&c.before.conv), 0);
    b.st.put(&c.before.planes)
}

#[test]
fn gdn_conv() {
    let Some(g) = gpu() else { return };
    // (nk, nv, d, kernel, window, pos): the real 16/48 heads of 128 (10240
    // channels), small odd channel counts, a kernel of 2, positions before
    // the ring first wraps and after.
    for (nk, nv, d, kc, window, pos) in [(16, 48, 128, 4, 4, 1234), (2, 3, 20, 4, 1, 2), (1, 2, 24, 2, 3, 7), (2, 3, 20, 4, 2, 0)] {
        let c = case(nk, nv, d, kc, window, pos, GateActivation::Sigmoid);
        let dc = c.cfg.ssm_conv_dim();
        let mut b = Bufs::default();
        let planes = state(&mut b, &c);
        let x_off = b.s.put(&c.p.qkv);
        let y_off = b.s.out(dc);
        let taps = b.prm.put(&c.w.conv);
        let rows = c.before.conv.len() / dc;
        let push = GdnConvPush { x_off, y_off, taps, dc: dc as u32, kc: kc as u32, rows: rows as u32, pos: pos as u32, n: 1, tok_stride: 0 };
        let row = pos % rows;
        let out = g.run(Pipe::GdnConv, &push, Groups::Threads(dc), &b, &[(y_off, dc)], &[((row * dc) as u32, dc)]);
        let what = format!("gdn_conv Dc={dc} Kc={kc} ring {rows} pos {pos}");
        check(&what, out.s(y_off, dc), &c.conv_out, 4e-6);
        check_exact(&format!("{what} ring"), out.st(0, rows * dc), &c.after.conv);
        assert_eq!(out.st(planes, 1)[0].to_bits(), c.before.planes[0].to_bits());
    }
}

#[test]
fn gdn_recurrent() {
    let Some(g) = gpu() else { return };
    // Every width of a column's invocations (the default, then the others).
    recurrent_cases(g);
    for lanes in [2, 4, 8].into_iter().filter(|&l| l != g.pipes.gdn_lanes) {
        let pipes = Pipelines::with_gdn_lanes(&g.ctx, lanes).unwrap();
        assert_eq!(pipes.gdn_lanes, lanes, "the device's subgroups hold {lanes} lanes");
        recurrent_cases(&Gpu { ctx: g.ctx.clone(), pipes });
    }
}

fn recurrent_cases(g: &Gpu) {
    // (nk, nv, d, window, pos, gate): head dim 128 (the real one); a head dim
    // of 48 (invocations idle); the real 48 heads over 16 key heads; the
    // state read from the last plane and written to the first.
    let cases = [
        (2, 6, 128, 4, 10, GateActivation::Sigmoid),
        (3, 6, 48, 1, 3, GateActivation::Silu),
        (16, 48, 128, 2, 5, GateActivation::Sigmoid),
        (2, 4, 32, 3, 3, GateActivation::Sigmoid),
    ];
    for (nk, nv, d, window, pos, gate) in cases {
        let c = case(nk, nv, d, 4, window, pos, gate);
        let mut b = Bufs::default();
        let planes = state(&mut b, &c);
        let conv_off = b.s.put(&c.conv_out);
        let b_off = b.s.put(&c.p.beta);
        let a_off = b.s.put(&c.p.alpha);
        let y_off = b.s.out(nv * d);
        let plane = nv * d * d;
        let at = |n: usize| planes + ((n % (window + 1)) * plane) as u32;
        let push = recurrent_push(&mut b, &c, planes, pos, [conv_off, b_off, a_off, y_off], 1, 0);
        let groups = recurrent_groups(&c, g.pipes.gdn_lanes);
        let out = g.run(Pipe::GdnRecurrent, &push, groups, &b, &[(y_off, nv * d)], &[(at(pos + 1), plane)]);
        let what = format!("gdn_recurrent lanes {} nk={nk} nv={nv} d={d} window {window} pos {pos} {gate:?}", g.pipes.gdn_lanes);
        let all = out.st(planes, c.after.planes.len());
        check(&format!("{what} state"), all, &c.after.planes, 2e-5);
        check(&format!("{what} output"), out.s(y_off, nv * d), &c.o, 2e-5);
    }
}

#[test]
fn gdn_norm() {
    let Some(g) = gpu() else { return };
    // (nv, d, gate): the real 48 heads of 128, a head dim of 48 (invocations idle), SiLU gates.
    for (nv, d, gate) in [(48, 128, GateActivation::Sigmoid), (6, 48, GateActivation::Silu), (4, 32, GateActivation::Sigmoid)] {
        let c = case(2, nv, d, 4, 1, 3, gate);
        let mut b = Bufs::default();
        let y_off = b.s.put(&c.o);
        let z_off = b.s.put(&c.p.z);
        let push = norm_push(&mut b, &c, y_off, z_off, 0);
        let out = g.run(Pipe::GdnNorm, &push, Groups::Fixed([nv as u32, 1, 1]), &b, &[(y_off, nv * d)], &[]);
        check(&format!("gdn_norm nv={nv} d={d} {gate:?}"), out.s(y_off, nv * d), &c.y, 4e-6);
    }
}

/// Both stages over a pass of tokens (one dispatch each, the tokens'
/// activations a block apart): every token's outputs against the CPU's
/// token-by-token stages, and the ring and planes after the pass (the
/// planes of the last `window + 1` positions; a window shorter than the
/// pass leaves the earlier ones overwritten).
#[test]
fn gdn_over_a_pass_of_tokens() {
    let Some(g) = gpu() else { return };
    // (nk, nv, d, kernel, window, pos, tokens): 21 tokens run over several of a
    // staging module's chunks of 8 (FNX_VK_SPIRV_DIR).
    for (nk, nv, d, kc, window, pos, n) in [(2, 4, 32, 4, 2, 5, 7), (1, 2, 24, 3, 6, 0, 4), (2, 6, 128, 4, 1, 9, 3), (2, 4, 64, 4, 3, 2, 21)] {
        let c = case(nk, nv, d, kc, window, pos, GateActivation::Sigmoid);
        let (cfg, w) = (&c.cfg, &c.w);
        let (dc, dv) = (cfg.ssm_conv_dim(), nv * d);
        let mut r = Rng::new(77 + n as u64);
        let xs: Vec<Vec<f32>> = (0..n).map(|_| r.unit(cfg.hidden)).collect();
        let ps: Vec<gdn::Projections> = xs.iter().map(|x| gdn::project(w, cfg, x)).collect();
        let mut after = c.before.clone();
        let (mut conv_outs, mut ys) = (Vec::new(), Vec::new());
        let mut os = Vec::new();
        for (t, p) in ps.iter().enumerate() {
            let conv_out = gdn::conv(&w.conv, kc, &mut after.conv, pos + t, &p.qkv);
            let mut cv = conv_out.clone();
            let o = gdn::delta_rule_unnormed(w, cfg, &mut after.planes, pos + t, &mut cv, &p.beta, &p.alpha);
            ys.push(gdn::gated_norm(w, cfg, &o, &p.z));
            os.push(o);
            conv_outs.push(conv_out);
        }
        // Token block: [qkv | z | beta | alpha | conv out | y (Dc: the conv's outputs too)], 64-float aligned.
        let (z, beta, alpha) = (dc, dc + dv, dc + dv + nv);
        let (conv, y) = (alpha + nv, alpha + nv + dc);
        let tok = (y + dc.max(dv)).div_ceil(64) * 64;
        let mut block = vec![SENTINEL; n * tok];
        for (t, p) in ps.iter().enumerate() {
            let b = &mut block[t * tok..];
            b[..dc].copy_from_slice(&p.qkv);
            b[z..z + dv].copy_from_slice(&p.z);
            b[beta..beta + nv].copy_from_slice(&p.beta);
            b[alpha..alpha + nv].copy_from_slice(&p.alpha);
            b[conv..conv + dc].copy_from_slice(&conv_outs[t]);
        }
        let what = format!("gdn over {n} tokens nk={nk} nv={nv} d={d} kernel {kc} window {window} pos {pos}");
        let rows = c.before.conv.len() / dc;
        // The conv: its outputs go to the y regions (the conv-out regions hold the CPU's, read below).
        let mut b = Bufs::default();
        let planes = state(&mut b, &c);
        let at = b.s.put(&block);
        let taps = b.prm.put(&w.conv);
        let push = GdnConvPush { x_off: at, y_off: at + y as u32, taps, dc: dc as u32, kc: kc as u32, rows: rows as u32, pos: pos as u32, n: n as u32, tok_stride: tok as u32 };
        let outs: Vec<(u32, usize)> = (0..n).map(|t| (at + (t * tok + y) as u32, dc)).collect();
        let out = g.run(Pipe::GdnConv, &push, Groups::Threads(dc), &b, &outs, &[(0, rows * dc)]);
        for (t, want) in conv_outs.iter().enumerate() {
            check(&format!("{what} conv token {t}"), out.s(at + (t * tok + y) as u32, dc), want, 4e-6);
        }
        check_exact(&format!("{what} conv ring"), out.st(0, rows * dc), &after.conv);
        assert_eq!(out.st(planes, 1)[0].to_bits(), c.before.planes[0].to_bits());
        // The delta rule on the CPU's conv outputs.
        let mut b = Bufs::default();
        let planes = state(&mut b, &c);
        let at = b.s.put(&block);
        let offs = [conv, beta, alpha, y].map(|o| at + o as u32);
        let push = recurrent_push(&mut b, &c, planes, pos, offs, n, tok);
        let outs: Vec<(u32, usize)> = (0..n).map(|t| (at + (t * tok + y) as u32, dv)).collect();
        let all = c.after.planes.len();
        let out = g.run(Pipe::GdnRecurrent, &push, recurrent_groups(&c, g.pipes.gdn_lanes), &b, &outs, &[(planes, all)]);
        for (t, want) in os.iter().enumerate() {
            check(&format!("{what} output token {t}"), out.s(at + (t * tok + y) as u32, dv), want, 2e-5);
        }
        check(&format!("{what} planes"), out.st(planes, all), &after.planes, 2e-5);
        // The gated norm over the pass, on the CPU's delta-rule outputs.
        for (t, o) in os.iter().enumerate() {
            block[t * tok + y..t * tok + y + dv].copy_from_slice(o);
        }
        let mut b = Bufs::default();
        let at = b.s.put(&block);
        let push = norm_push(&mut b, &c, at + y as u32, at + z as u32, tok);
        let outs: Vec<(u32, usize)> = (0..n).map(|t| (at + (t * tok + y) as u32, dv)).collect();
        let out = g.run(Pipe::GdnNorm, &push, Groups::Fixed([nv as u32, n as u32, 1]), &b, &outs, &[]);
        for (t, want) in ys.iter().enumerate() {
            check(&format!("{what} normed token {t}"), out.s(at + (t * tok + y) as u32, dv), want, 4e-6);
        }
    }
}

/// One token's fused step (gdn_token: the conv where it is read, the delta
/// rule, the gated norm by each head's last workgroup) against the CPU's
/// stages, and bit for bit against the three stage modules run one after
/// another on the same device (what a pass runs): output, ring and planes;
/// the arrival counters back to zero. Every width of a column's invocations.
#[test]
fn gdn_token_equals_the_three_stages() {
    let Some(g) = gpu() else { return };
    token_cases(g);
    for lanes in [2, 4, 8].into_iter().filter(|&l| l != g.pipes.gdn_lanes) {
        token_cases(&Gpu { ctx: g.ctx.clone(), pipes: Pipelines::with_gdn_lanes(&g.ctx, lanes).unwrap() });
    }
}

fn token_cases(g: &Gpu) {
    // (nk, nv, d, kernel, window, pos, gate): the real 16/48 heads of 128
    // past the ring's first wrap; a head dim of 48 (invocations idle) and a
    // SiLU gate; position 0 (the ring's zeros); a kernel of 2.
    let cases = [
        (16, 48, 128, 4, 2, 1234, GateActivation::Sigmoid),
        (3, 6, 48, 4, 1, 3, GateActivation::Silu),
        (2, 4, 32, 4, 3, 0, GateActivation::Sigmoid),
        (1, 2, 24, 2, 2, 7, GateActivation::Silu),
    ];
    for (nk, nv, d, kc, window, pos, gate) in cases {
        let c = case(nk, nv, d, kc, window, pos, gate);
        let (dc, dv) = (c.cfg.ssm_conv_dim(), nv * d);
        let rows = c.before.conv.len() / dc;
        let plane = nv * d * d;
        let what = format!("gdn_token lanes {} nk={nk} nv={nv} d={d} kernel {kc} window {window} pos {pos} {gate:?}", g.pipes.gdn_lanes);
        let ring_row = [((pos % rows * dc) as u32, dc)];
        // The three stages, each on the one before's output.
        let mut b = Bufs::default();
        state(&mut b, &c);
        let x_off = b.s.put(&c.p.qkv);
        let conv_off = b.s.out(dc);
        let taps = b.prm.put(&c.w.conv);
        let conv = GdnConvPush { x_off, y_off: conv_off, taps, dc: dc as u32, kc: kc as u32, rows: rows as u32, pos: pos as u32, n: 1, tok_stride: 0 };
        let conv_out = g.run(Pipe::GdnConv, &conv, Groups::Threads(dc), &b, &[(conv_off, dc)], &ring_row);
        let mut b = Bufs::default();
        let planes = state(&mut b, &c);
        let at = |n: usize| planes + ((n % (window + 1)) * plane) as u32;
        let offs = [b.s.put(conv_out.s(conv_off, dc)), b.s.put(&c.p.beta), b.s.put(&c.p.alpha), b.s.out(dv)];
        let push = recurrent_push(&mut b, &c, planes, pos, offs, 1, 0);
        let rec = g.run(Pipe::GdnRecurrent, &push, recurrent_groups(&c, g.pipes.gdn_lanes), &b, &[(offs[3], dv)], &[(at(pos + 1), plane)]);
        let mut b = Bufs::default();
        let (y_off, z_off) = (b.s.put(rec.s(offs[3], dv)), b.s.put(&c.p.z));
        let push = norm_push(&mut b, &c, y_off, z_off, 0);
        let staged = g.run(Pipe::GdnNorm, &push, Groups::Fixed([nv as u32, 1, 1]), &b, &[(y_off, dv)], &[]);
        // One dispatch.
        let mut b = Bufs::default();
        let planes = state(&mut b, &c);
        let x_off = b.s.put(&c.p.qkv);
        let (b_off, a_off, z_off) = (b.s.put(&c.p.beta), b.s.put(&c.p.alpha), b.s.put(&c.p.z));
        let out = b.s.out(dv);
        let counts = b.s.put(&vec![0.0; nv]);
        let push = GdnTokenPush {
            x_off,
            taps: b.prm.put(&c.w.conv),
            dc: dc as u32,
            kc: kc as u32,
            rows: rows as u32,
            b_off,
            a_off,
            y_off: out,
            z_off,
            nk: nk as u32,
            nv: nv as u32,
            d: d as u32,
            planes_off: planes,
            planes: (window + 1) as u32,
            pos: pos as u32,
            decay_a: b.prm.put(&c.w.a),
            dt_bias: b.prm.put(&c.w.dt_bias),
            norm: b.prm.put(&c.w.norm),
            gate_silu: (gate == GateActivation::Silu) as u32,
            eps: EPS,
            counts_off: counts,
        };
        let groups = recurrent_groups(&c, g.pipes.gdn_lanes);
        let fused = g.run(Pipe::GdnToken, &push, groups, &b, &[(out, dv), (counts, nv)], &[ring_row[0], (at(pos + 1), plane)]);
        check(&format!("{what} output"), fused.s(out, dv), &c.y, 2e-5);
        check_exact(&format!("{what} output against the stages"), fused.s(out, dv), staged.s(y_off, dv));
        check_exact(&format!("{what} ring"), fused.st(0, rows * dc), &c.after.conv);
        let all = c.after.planes.len();
        check(&format!("{what} planes"), fused.st(planes, all), &c.after.planes, 2e-5);
        check_exact(&format!("{what} planes against the stages"), fused.st(planes, all), rec.st(planes, all));
        assert!(fused.s(counts, nv).iter().all(|v| v.to_bits() == 0), "{what}: the counters back to zero");
    }
}
