//! `attn_prep`, `qsa_index`, `qsa_score`, `qsa_topk` and `attention`: a QSA
//! attention layer after its input projections.

use super::*;
use crate::cpu::ops::Rope;
use crate::cpu::qsa::{self, AttnState};
use crate::model::weights::{Attention, Indexer};
use crate::vulkan::pipelines::{attention_head_floats, attention_splits, AttentionPush, AttnPrepPush, QsaIndexPush, QsaScorePush, QsaTopkPush};

/// Indexer heads and head dim (the real ones).
const IH: usize = 4;
const ID: usize = 128;

/// One attention token at position `t` on the CPU (`qsa::forward`), with
/// an identity out projection so its output is the attention's.
struct Case {
    cfg: Config,
    w: Attention,
    rope: Rope,
    ratio: usize,
    t: usize,
    /// Positions the GPU caches hold (as `GpuState`'s `n_ctx`).
    n_ctx: usize,
    x: Vec<f32>,
    before: AttnState,
    after: AttnState,
    y: Vec<f32>,
}

/// `nh` query heads over `nkv` KV heads of `hd`; `ratio` 0 is dense
/// attention, otherwise QSA blocks of `ratio` with a `budget` of tokens.
/// The caches before `t` hold random unit-RMS keys and values.
fn case(nh: usize, nkv: usize, hd: usize, ratio: usize, budget: usize, t: usize) -> Case {
    let hidden = nh * hd;
    let cfg = Config {
        hidden,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        rope_dims: hd / 4,
        layers: vec![LayerKind::Attention { compress_ratio: ratio }],
        qsa: Some(QsaConfig { n_heads: IH, head_dim: ID, budget }),
        ..Config::published_one_layer()
    };
    let mut r = Rng::new((nh * 100_000 + hd * 1000 + t) as u64);
    let indexer = (ratio > 0).then(|| Indexer {
        q_proj: r.matrix(IH * ID, hidden),
        k_proj: r.matrix(ID, hidden),
        q_norm: r.gamma(ID),
        k_norm: r.gamma(ID),
    });
    let w = Attention {
        q: r.matrix(2 * nh * hd, hidden),
        k: r.matrix(nkv * hd, hidden),
        v: r.matrix(nkv * hd, hidden),
        o: identity(hidden),
        q_norm: r.gamma(hd),
        k_norm: r.gamma(hd),
        indexer,
    };
    let kv = nkv * hd;
    let id = if ratio > 0 { ID } else { 0 };
    let blocks = t.checked_div(ratio).unwrap_or(0);
    let before = AttnState {
        keys: r.unit(t * kv),
        values: r.unit(t * kv),
        index_keys: r.unit(t * id),
        block_keys: r.unit(blocks * id),
    };
    let x = r.unit(hidden);
    let rope = Rope::new(cfg.rope_dims, cfg.rope_theta);
    let mut after = before.clone();
    let y = qsa::forward(&w, &cfg, ratio, &rope, &mut after, &x, t);
    Case { cfg, w, rope, ratio, t, n_ctx: t + 3, x, before, after, y }
}

fn project(w: &Tensor, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; w.rows()];
    w.matvec(x, &mut y);
    y
}

/// `v` followed by zeros up to `n` (a cache reserved for `n_ctx` positions).
fn padded(v: &[f32], n: usize) -> Vec<f32> {
    let mut p = v.to_vec();
    p.resize(n, 0.0);
    p
}

/// The attention queries, by `qsa::prep` (on a scratch copy of the caches).
fn queries(c: &Case, qg: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
    qsa::prep(&c.w, &c.cfg, &c.rope, &mut c.before.clone(), qg, k, v, c.t)
}

/// The indexer queries, by `qsa::index` (on a scratch copy of the caches).
fn index_queries(c: &Case, raw: &[f32], iq: &[f32]) -> Vec<f32> {
    let ix = c.w.indexer.as_ref().expect("a QSA case");
    let mut q = iq.to_vec();
    qsa::index(ix, &c.cfg, c.ratio, &c.rope, &mut c.before.clone(), raw, &mut q, c.t);
    q
}

/// Block ids as the shaders store them (u32 bits in a float).
fn ids_as_floats(ids: &[usize]) -> Vec<f32> {
    ids.iter().map(|&b| f32::from_bits(b as u32)).collect()
}

fn ids_of(v: &[f32]) -> Vec<usize> {
    v.iter().map(|f| f.to_bits() as usize).collect()
}

#[test]
fn attn_prep() {
    let Some(g) = gpu() else { return };
    // (nh, nkv, hd, t): head dims 256 (real, the full workgroup), 128 and 64; GQA groups 2, 3, 12.
    for (nh, nkv, hd, t) in [(4, 2, 256, 37), (6, 2, 128, 21), (12, 1, 64, 0)] {
        let c = case(nh, nkv, hd, 0, 0, t);
        let kv = nkv * hd;
        let (qg, k, v) = (project(&c.w.q, &c.x), project(&c.w.k, &c.x), project(&c.w.v, &c.x));
        let mut b = Bufs::default();
        let keys_off = b.st.put(&padded(&c.before.keys, c.n_ctx * kv));
        let values_off = b.st.put(&padded(&c.before.values, c.n_ctx * kv));
        let qg_off = b.s.put(&qg);
        let k_off = b.s.put(&k);
        let v_off = b.s.put(&v);
        let q_off = b.s.out(nh * hd);
        let rope = b.s.put(&rope_table(&c.rope, c.cfg.rope_dims, t));
        let push = AttnPrepPush {
            qg_off,
            k_off,
            v_off,
            q_off,
            q_norm: b.prm.put(&c.w.q_norm),
            k_norm: b.prm.put(&c.w.k_norm),
            rope,
            half_dims: (c.cfg.rope_dims / 2) as u32,
            hd: hd as u32,
            nh: nh as u32,
            nkv: nkv as u32,
            keys_off,
            values_off,
            pos: t as u32,
            eps: EPS,
            tok_stride: 0,
        };
        let (key_at, value_at) = (keys_off + (t * kv) as u32, values_off + (t * kv) as u32);
        let written = [(key_at, kv), (value_at, kv)];
        let out = g.run(Pipe::AttnPrep, &push, Groups::Fixed([(nh + nkv) as u32, 1, 1]), &b, &[(q_off, nh * hd)], &written);
        let what = format!("attn_prep nh={nh} nkv={nkv} hd={hd} t={t}");
        check(&format!("{what} queries"), out.s(q_off, nh * hd), &queries(&c, &qg, &k, &v), 4e-6);
        check(&format!("{what} cached key"), out.st(key_at, kv), &c.after.keys[t * kv..], 4e-6);
        check_exact(&format!("{what} cached value"), out.st(value_at, kv), &c.after.values[t * kv..]);
    }
}

#[test]
fn qsa_index() {
    let Some(g) = gpu() else { return };
    // Blocks of 4: no complete block yet (no query heads), a token completing
    // block 2, one inside block 3, and one completing block 649.
    for t in [2, 11, 13, 2599] {
        let ratio = 4;
        let c = case(2, 1, 64, ratio, 2048, t);
        let ix = c.w.indexer.as_ref().unwrap();
        let (raw, iq) = (project(&ix.k_proj, &c.x), project(&ix.q_proj, &c.x));
        let n_complete = (t + 1) / ratio;
        let completes = (t + 1) % ratio == 0;
        assert_eq!(c.after.block_keys.len(), n_complete * ID);
        let mut b = Bufs::default();
        let raw_keys = b.st.put(&padded(&c.before.index_keys, c.n_ctx * ID));
        let block_keys = b.st.put(&padded(&c.before.block_keys, c.n_ctx * ID));
        let key_off = b.s.put(&raw);
        let query_off = b.s.put(&iq);
        let rope = b.s.put(&rope_table(&c.rope, c.cfg.rope_dims, t));
        let block_rope = b.s.put(&rope_table(&c.rope, c.cfg.rope_dims, (t + 1).saturating_sub(ratio)));
        let push = QsaIndexPush {
            key_off,
            query_off,
            q_norm: b.prm.put(&ix.q_norm),
            k_norm: b.prm.put(&ix.k_norm),
            rope,
            block_rope,
            half_dims: (c.cfg.rope_dims / 2) as u32,
            id: ID as u32,
            heads: IH as u32,
            ratio: ratio as u32,
            raw_keys,
            block_keys,
            pos: t as u32,
            tok_stride: 0,
            eps: EPS,
        };
        let raw_at = raw_keys + (t * ID) as u32;
        let block_at = block_keys + (n_complete.saturating_sub(1) * ID) as u32;
        let mut st_written = vec![(raw_at, ID)];
        if completes {
            st_written.push((block_at, ID));
        }
        let s_written: &[(u32, usize)] = if n_complete > 0 { &[(query_off, IH * ID)] } else { &[] };
        let out = g.run(Pipe::QsaIndex, &push, Groups::Fixed([1, 1, 1]), &b, s_written, &st_written);
        let what = format!("qsa_index t={t}");
        check_exact(&format!("{what} raw key"), out.st(raw_at, ID), &c.after.index_keys[t * ID..]);
        if completes {
            check(&format!("{what} block key"), out.st(block_at, ID), &c.after.block_keys[(n_complete - 1) * ID..], 4e-6);
        }
        if n_complete > 0 {
            check(&format!("{what} queries"), out.s(query_off, IH * ID), &index_queries(&c, &raw, &iq), 4e-6);
        }
    }
}

#[test]
fn qsa_score() {
    let Some(g) = gpu() else { return };
    // (heads, dim, blocks): the real indexer over 3000 tokens in blocks of 4,
    // a block count off the 64-wide workgroup, and small odd ones.
    for (heads, id, n_blocks) in [(4, 128, 750), (4, 128, 63), (1, 32, 5), (2, 100, 130)] {
        let mut r = Rng::new((heads * id * n_blocks) as u64);
        let (q, keys) = (r.unit(heads * id), r.unit(n_blocks * id));
        let want = qsa::score_blocks(&q, &keys, id);
        let mut b = Bufs::default();
        let block_keys = b.st.put(&keys);
        let query_off = b.s.put(&q);
        let score_off = b.s.out(n_blocks);
        let push = QsaScorePush {
            query_off,
            block_keys,
            score_off,
            n_blocks: n_blocks as u32,
            heads: heads as u32,
            id: id as u32,
            scale: 1.0 / (id as f32).sqrt(),
            ..Default::default()
        };
        let out = g.run(Pipe::QsaScore, &push, Groups::Fixed([n_blocks as u32, 1, 1]), &b, &[(score_off, n_blocks)], &[]);
        let zeros = want.iter().filter(|s| **s == 0.0).count();
        check(&format!("qsa_score heads={heads} id={id} blocks={n_blocks} ({zeros} all-ReLU'd)"), out.s(score_off, n_blocks), &want, 1e-5);
    }
}

#[test]
fn qsa_topk() {
    let Some(g) = gpu() else { return };
    let mut r = Rng::new(7);
    // Scores as sums of ReLUs are: distinct positives, and exact ties (often 0).
    let distinct: Vec<f32> = (0..750).map(|_| 5.0 * (r.uniform() + 1.0)).collect();
    let tied: Vec<f32> = (0..750).map(|_| if r.below(3) == 0 { 0.0 } else { r.below(24) as f32 * 0.125 }).collect();
    // A long context: 262144 tokens are 65536 blocks; many invocations' ranges, many ties.
    let long: Vec<f32> = (0..65536).map(|_| r.below(4096) as f32 * 0.01).collect();
    // Past MAX_KEEP blocks (the radix select's path): 8000 tokens, a tie across the cut.
    let tied_long: Vec<f32> = (0..2000).map(|_| if r.below(3) == 0 { 0.0 } else { r.below(24) as f32 * 0.125 }).collect();
    let cases: [(&str, Vec<f32>, usize); 8] = [
        // 3000 tokens in blocks of 4 at the real budget of 2048 tokens: 512 of 750 blocks.
        ("distinct, 512 of 750", distinct, 512),
        ("long context with ties, 512 of 65536", long, 512),
        ("signed zeros and a 1e-38 (total order), 2 of 4", vec![-0.0, 0.0, 1e-38, -0.0], 2),
        ("ties across the cut, 512 of 750", tied, 512),
        ("ties across the cut, 512 of 2000", tied_long, 512),
        ("all zero, 16 of 100", vec![0.0; 100], 16),
        ("every block, 3 of 3", vec![0.5, 2.0, 0.5], 3),
        ("64 of 65", (0..65).map(|i| (i % 7) as f32).collect(), 64),
    ];
    for (what, scores, keep) in cases {
        let n = scores.len();
        let mut sorted = scores.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if what.starts_with("distinct") {
            assert!(sorted.windows(2).all(|w| w[0] > w[1]), "precondition: no ties");
        }
        if what.starts_with("ties") {
            assert_eq!(sorted[keep - 1], sorted[keep], "precondition: a tie across the cut");
        }
        let want = qsa::top_blocks(&scores, keep);
        let mut b = Bufs::default();
        let score_off = b.s.put(&scores);
        let sel_off = b.s.out(n);
        let push = QsaTopkPush { score_off, sel_off, n_blocks: n as u32, keep: keep as u32, ..Default::default() };
        // One workgroup, as the decode dispatches it.
        let out = g.run(Pipe::QsaTopk, &push, Groups::Fixed([1, 1, 1]), &b, &[(sel_off, keep)], &[]);
        assert_eq!(ids_of(out.s(sel_off, keep)), want, "qsa_topk {what}: GPU and CPU choose different blocks");
        println!("qsa_topk {what}: equal");
    }
}

/// Runs shaders/attention.comp for the `tokens` tokens of `push` twice:
/// its splits combined by their last workgroups (arrival counters, which it
/// must leave zero), and its splits alone then a combining dispatch. Both
/// must write the same bits; returns the scratch after the first. `written`:
/// the outputs besides the partials (at `push.tmp_off`) and the counters.
fn attention_both_ways(g: &Gpu, b: &mut Bufs, mut push: AttentionPush, tokens: usize, splits: usize, written: Regions, what: &str) -> Out {
    let nh = push.nh as usize;
    let counts = vec![0f32; nh * tokens];
    push.counts_off = b.s.put(&counts);
    let mut w = written.to_vec();
    w.push((push.tmp_off, tokens * push.tmp_tok as usize));
    let grid = [push.nh, tokens as u32, splits as u32];
    let out = g.run(Pipe::Attention, &push, Groups::Fixed(grid), b, &w, &[]);
    check_exact(&format!("{what}: arrival counters left zero"), out.s(push.counts_off, nh * tokens), &counts);
    push.counts_off = 0;
    let parts = g.run(Pipe::Attention, &push, Groups::Fixed(grid), b, &w, &[]);
    push.combine = 1;
    let after = Bufs { s: Image(parts.s), st: Image(b.st.0.clone()), prm: Image(b.prm.0.clone()) };
    let apart = g.run(Pipe::Attention, &push, Groups::Fixed([push.nh, tokens as u32, 1]), &after, &w, &[]);
    for &(at, n) in written {
        check_exact(&format!("{what}: combined by the last split and by a dispatch"), apart.s(at, n), out.s(at, n));
    }
    out
}

#[test]
fn attention() {
    let Some(g) = gpu() else { return };
    // (nh, nkv, hd, ratio, budget, t): dense over 301 tokens (five splits)
    // at head dim 256; dense with a GQA group of 12; QSA keeping 16 of 75
    // blocks plus a 2-token tail, and with no tail; QSA with every block
    // kept; QSA at the real budget (512 of 650 blocks, 2049 tokens: eleven
    // splits of 192) and head dim 256; dense over 5001 tokens (sixteen
    // splits of 320 keys, two tiles each: the softmax carried across tiles).
    let cases = [
        (4, 2, 256, 0, 0, 300),
        (12, 1, 64, 0, 0, 5),
        (6, 2, 128, 4, 64, 301),
        (6, 2, 128, 4, 64, 299),
        (2, 1, 128, 4, 2048, 42),
        (4, 2, 256, 4, 2048, 2600),
        (2, 1, 128, 0, 0, 5000),
    ];
    for (nh, nkv, hd, ratio, budget, t) in cases {
        let c = case(nh, nkv, hd, ratio, budget, t);
        let kv = nkv * hd;
        let (qg, k, v) = qsa::project(&c.w, &c.cfg, &c.x);
        let q = queries(&c, &qg, &k, &v);
        let n_tokens = t + 1;
        // The blocks the CPU attends: its scores and choice over the block
        // keys `qsa::forward` cached.
        let (keep, ratio_used, tail_start, sel) = match &c.w.indexer {
            Some(ix) => {
                let n_complete = n_tokens / c.ratio;
                let keep = (budget / c.ratio).min(n_complete);
                let iq = index_queries(&c, &project(&ix.k_proj, &c.x), &project(&ix.q_proj, &c.x));
                (keep, c.ratio, n_complete * c.ratio, qsa::top_blocks(&qsa::score_blocks(&iq, &c.after.block_keys, ID), keep))
            }
            None => (0, 1, 0, Vec::new()),
        };
        let selected: Vec<usize> = sel.iter().flat_map(|&b| b * ratio_used..(b + 1) * ratio_used).chain(tail_start..n_tokens).collect();
        let want = qsa::attend(&c.cfg, &q, &qg, &c.after.keys, &c.after.values, &selected);
        // `qsa::forward` is these stages and the (identity) out projection.
        assert_eq!(want, c.y);
        let mut b = Bufs::default();
        let keys_off = b.st.put(&padded(&c.after.keys, c.n_ctx * kv));
        let values_off = b.st.put(&padded(&c.after.values, c.n_ctx * kv));
        let q_off = b.s.put(&q);
        let qg_off = b.s.put(&qg);
        let sel_off = b.s.put(&padded(&ids_as_floats(&sel), c.n_ctx));
        let tmp_stride = attention_head_floats(c.n_ctx, hd);
        let tmp_off = b.s.out(nh * tmp_stride);
        let y_off = b.s.out(nh * hd);
        let push = AttentionPush {
            q_off,
            qg_off,
            keys_off,
            values_off,
            sel_off,
            tmp_off,
            tmp_stride: tmp_stride as u32,
            y_off,
            // The most blocks a token keeps (the shader takes its share of them).
            keep: if c.w.indexer.is_some() { (budget / c.ratio) as u32 } else { 0 },
            ratio: ratio_used as u32,
            n_first: n_tokens as u32,
            qsa: c.w.indexer.is_some() as u32,
            hd: hd as u32,
            nh: nh as u32,
            nkv: nkv as u32,
            scale: 1.0 / (hd as f32).sqrt(),
            tmp_tok: (nh * tmp_stride) as u32,
            ..Default::default()
        };
        let attended = keep * ratio_used + n_tokens - tail_start;
        let what = format!("attention nh={nh} nkv={nkv} hd={hd} ratio={ratio} t={t} ({attended} tokens, {} splits)", attention_splits(attended));
        let out = attention_both_ways(g, &mut b, push, 1, attention_splits(attended), &[(y_off, nh * hd)], &what);
        check(&what, out.s(y_off, nh * hd), &want, 2e-5);
    }
}

/// A run of tokens whose attended keys cross a change of split size (1020
/// to 1027 keys: splits of 64 keys up to 1024, of 128 after) attends as
/// each token alone, bit for bit, and within the CPU's bound.
#[test]
fn attention_over_a_run_equals_token_by_token() {
    let Some(g) = gpu() else { return };
    let (nh, nkv, hd, first, run) = (4, 2, 128, 1020, 8);
    let c = case(nh, nkv, hd, 0, 0, first + run);
    let kv = nkv * hd;
    let mut r = Rng::new(77);
    let (q, qg) = (r.unit(run * nh * hd), r.unit(run * 2 * nh * hd));
    let block = 4 * nh * hd;
    // Token y's block: its query, its query and gate rows, its output.
    let mut blocks = vec![0f32; run * block];
    for y in 0..run {
        blocks[y * block..][..nh * hd].copy_from_slice(&q[y * nh * hd..][..nh * hd]);
        blocks[y * block + nh * hd..][..2 * nh * hd].copy_from_slice(&qg[y * 2 * nh * hd..][..2 * nh * hd]);
    }
    let mut b = Bufs::default();
    let keys_off = b.st.put(&padded(&c.before.keys, c.n_ctx * kv));
    let values_off = b.st.put(&padded(&c.before.values, c.n_ctx * kv));
    let at = b.s.put(&blocks);
    let tmp_stride = attention_head_floats(c.n_ctx, hd);
    let tmp_off = b.s.out(run * nh * tmp_stride);
    let out_of = |y: usize| at + (y * block + 3 * nh * hd) as u32;
    let push = |y: usize, n_first: usize| AttentionPush {
        q_off: at + (y * block) as u32,
        qg_off: at + (y * block + nh * hd) as u32,
        keys_off,
        values_off,
        tmp_off,
        tmp_stride: tmp_stride as u32,
        y_off: out_of(y),
        ratio: 1,
        n_first: n_first as u32,
        hd: hd as u32,
        nh: nh as u32,
        nkv: nkv as u32,
        scale: 1.0 / (hd as f32).sqrt(),
        tok_stride: block as u32,
        tmp_tok: (nh * tmp_stride) as u32,
        ..Default::default()
    };
    let splits = (0..run).map(|y| attention_splits(first + y)).max().unwrap();
    assert!(attention_splits(first) == 16 && attention_splits(first + run - 1) == 9, "the run crosses a change of split size");
    let outs: Vec<(u32, usize)> = (0..run).map(|y| (out_of(y), nh * hd)).collect();
    let together = attention_both_ways(g, &mut b, push(0, first), run, splits, &outs, "attention over a run");
    for y in 0..run {
        let n = first + y;
        let alone = attention_both_ways(g, &mut b, push(y, n), 1, attention_splits(n), &outs[y..y + 1], &format!("attention of token {y} alone"));
        check_exact(&format!("attention of token {y} ({n} keys) in a run and alone"), together.s(out_of(y), nh * hd), alone.s(out_of(y), nh * hd));
        let selected: Vec<usize> = (0..n).collect();
        let want = qsa::attend(&c.cfg, &q[y * nh * hd..][..nh * hd], &qg[y * 2 * nh * hd..][..2 * nh * hd], &c.before.keys, &c.before.values, &selected);
        check(&format!("attention of token {y} ({n} keys)"), together.s(out_of(y), nh * hd), &want, 2e-5);
    }
}
