//! `ple_mix`: the PLE injection after its key/value projections.

use super::*;
use crate::cpu::ple;
use crate::model::config::PleConfig;
use crate::model::weights::Ple;
use crate::vulkan::pipelines::PleMixPush;

#[test]
fn ple_mix() {
    let Some(g) = gpu() else { return };
    // (streams, hidden, heads per n-gram): the real 4 x 2560 with 8 heads of
    // 160, and a small hidden below the 256-wide workgroup.
    // (streams, hidden, heads per n-gram, rewind window, position): the real
    // 4 x 2560 with 8 heads of 160, and a small hidden below the 256-wide
    // workgroup; positions at the start and where the ring has wrapped.
    for (c, h, per_ngram, window, pos) in [(4, 2560, 8, 4, 77), (4, 64, 2, 1, 3), (2, 300, 3, 2, 0)] {
        let mut r = Rng::new((c * h) as u64);
        let (ngram, kernel) = (3, 4);
        let heads = (ngram - 1) * per_ngram;
        let head_vocab: Vec<u64> = (0..heads as u64).map(|i| 5 + i).collect();
        let head_offsets = head_vocab.iter().scan(0, |at, v| Some(std::mem::replace(at, *at + v))).collect();
        let p = PleConfig {
            layer: 0,
            ngram,
            heads_per_ngram: per_ngram,
            conv_kernel: kernel,
            eos: 1,
            row_dim: h / heads,
            multipliers: (0..ngram).map(|_| r.u64() | 1).collect(),
            head_offsets,
            head_vocab: head_vocab.clone(),
        };
        let table = r.matrix(head_vocab.iter().sum::<u64>() as usize, p.row_dim);
        let cfg = Config { hidden: h, hc: c, ple: Some(p.clone()), ..Config::published_one_layer() };
        let ch = c * h;
        let w = Ple {
            key: r.matrix(ch, h),
            value: r.matrix(h, h),
            norm_key: r.gamma(ch),
            norm_query: r.gamma(ch),
            norm_conv: r.gamma(ch),
            conv: r.vec(ch * kernel, 0.7),
        };
        let rows = ple::conv_rows(&p, window);
        let before = r.unit(rows * ch);
        let residual = r.vec(ch, 2.0);
        // The token's table rows, as the walk gathers them, and their projections.
        let e = crate::model::ple::gather_rows(&table, &p, h, &[17, 23], &[42]);
        let (key, value) = ple::project(&w, &e);
        let (mut after, mut want) = (before.clone(), residual.clone());
        ple::mix(&w, &p, &cfg, &mut after, pos, &key, &value, &mut want);
        let (mut whole, mut whole_res) = (before.clone(), residual.clone());
        ple::forward(&w, &p, &cfg, &mut whole, pos, &e, &mut whole_res);
        assert_eq!((whole, whole_res), (after.clone(), want.clone()), "ple::forward is ple::project + ple::mix");

        let mut b = Bufs::default();
        let hist = b.st.put(&before);
        let key_off = b.s.put(&key);
        let value_off = b.s.put(&value);
        let res_off = b.s.put(&residual);
        let tmp_off = b.s.out(ch);
        let push = PleMixPush {
            key_off,
            value_off,
            res_off,
            tmp_off,
            norm_key: b.prm.put(&w.norm_key),
            norm_query: b.prm.put(&w.norm_query),
            norm_conv: b.prm.put(&w.norm_conv),
            conv: b.prm.put(&w.conv),
            h: h as u32,
            streams: c as u32,
            kernel: kernel as u32,
            dilation: ngram as u32,
            rows: rows as u32,
            pos: pos as u32,
            eps: EPS,
            phase: 3,
            n: 1,
            tok_stride: 0,
        };
        let row = hist + ((pos % rows) * ch) as u32;
        // (The key region holds the norms after: the ring row's values.)
        let out = g.run(Pipe::PleMix, &push, Groups::Fixed([c as u32, 1, 1]), &b, &[(res_off, ch), (tmp_off, ch), (key_off, ch)], &[(row, ch)]);
        let what = format!("ple_mix C={c} H={h} ring {rows} pos {pos}");
        check(&format!("{what} residual"), out.s(res_off, ch), &want, 2e-5);
        let at = (pos % rows) * ch;
        check(&format!("{what} new ring row"), out.st(row, ch), &after[at..at + ch], 2e-5);
        check_exact(&format!("{what} norms in the key region"), out.s(key_off, ch), out.st(row, ch));
    }
}
