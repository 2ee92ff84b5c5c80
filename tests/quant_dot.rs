//! The integer ("fast") CPU kernels of `flashnext::quant::dot`:
//!
//! * the SIMD levels against the scalar integer reference, on every type and
//!   every level this CPU has, on random and extreme blocks (all-max levels,
//!   zero and negative scales, negative mins) and activations (zero blocks,
//!   saturated blocks, outliers), rows of 1..=5 blocks and 640/2560 wide:
//!   both within `(n_blocks + 16) 2^-22 S` of the exact value of the same
//!   integer formula (only f32 summation order differs; `S` below);
//! * the fast path against the exact dot product of the dequantized row with
//!   the unrounded activations, within the activation-rounding bound
//!   `sum_b (amax_b / 254) sum_{i in b} |w_i|` (module docs of `quant::dot`);
//! * the activation rounding itself, and `matvec_batch` scheduling (chunks,
//!   shared inputs) giving the same numbers as single rows;
//! * `glu_batch` (gate, up and down of several experts in one region) giving
//!   the numbers of its two `matvec_batch` stages, on 1, 2 and 5 threads.

use flashnext::gguf::GgmlType;
use flashnext::quant::dot::{dot_row, ActKind, Activation};
use flashnext::quant::kernels::{glu_batch_with, matvec_batch_with, Glu, Isa, Kernels, MatVec, Rows};
use flashnext::quant::{dequantize_row, quantize_row, QUANT_TYPES};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-0.5, 0.5).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 32) as u8
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() >> 33) as usize % n
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Byte ranges of the levels (quants) inside one block of `ty`.
fn level_bytes(ty: GgmlType) -> std::ops::Range<usize> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 => 2..ty.block_bytes(),
        GgmlType::Q4_1 | GgmlType::Q5_1 => 4..ty.block_bytes(),
        GgmlType::Q8_0 => 2..34,
        GgmlType::Q2K => 16..80,
        GgmlType::Q3K => 0..96,
        GgmlType::Q4K | GgmlType::Q5K => 16..ty.block_bytes(),
        GgmlType::Q6K => 0..192,
        _ => unreachable!(),
    }
}


/// A row of `n` values of `ty`, block by block one of several kinds.
fn make_row(ty: GgmlType, n: usize, rng: &mut Rng, kind: usize) -> Vec<u8> {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    let mut row = vec![0u8; ty.row_bytes(n).unwrap()];
    if bs == 1 {
        let x: Vec<f32> = (0..n).map(|_| rng.f()).collect();
        quantize_row(ty, &x, &mut row).unwrap();
        return row;
    }
    for b in row.chunks_exact_mut(bb) {
        match (kind + rng.below(3)) % 6 {
            // Quantized random values (what files hold).
            0 | 1 => {
                let scale = [0.01, 1.0, 300.0][rng.below(3)];
                let x: Vec<f32> = (0..bs).map(|_| scale * rng.f()).collect();
                quantize_row(ty, &x, b).unwrap();
            }
            // Random bytes with finite scales of either sign.
            2 => {
                b.iter_mut().for_each(|v| *v = rng.byte());
                for &o in flashnext::quant::scale_fields(ty) {
                    b[o..o + 2].copy_from_slice(&f16_bytes(4.0 * rng.f()));
                }
            }
            // All levels and scale bytes at their maximum.
            3 => {
                b.fill(0xff);
                if ty == GgmlType::Q8_0 {
                    b[2..].fill(0x80); // -128, the extreme signed level
                }
                for &o in flashnext::quant::scale_fields(ty) {
                    b[o..o + 2].copy_from_slice(&f16_bytes(if o == 0 { 1.5 } else { -2.0 }));
                }
            }
            // Zero scales over random levels.
            4 => {
                b.iter_mut().for_each(|v| *v = rng.byte());
                for &o in flashnext::quant::scale_fields(ty) {
                    b[o..o + 2].fill(0);
                }
            }
            // Negative mins / scales over random levels.
            _ => {
                b.iter_mut().for_each(|v| *v = rng.byte());
                for &o in flashnext::quant::scale_fields(ty) {
                    b[o..o + 2].copy_from_slice(&f16_bytes(-0.75 - rng.f()));
                }
            }
        }
    }
    row
}

/// An activation vector of `n` values whose blocks differ in scale, with
/// zero blocks, saturated blocks (all `+-amax`) and outliers.
fn make_x(n: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = vec![0f32; n];
    for c in x.chunks_mut(32) {
        let scale = [1.0, 1e-3, 50.0, 0.0][rng.below(4)];
        match rng.below(5) {
            0 => c.iter_mut().for_each(|v| *v = if rng.below(2) == 0 { scale } else { -scale }),
            1 => {
                c.iter_mut().for_each(|v| *v = scale * rng.f());
                c[rng.below(c.len())] = 100.0 * scale + 1.0;
            }
            _ => c.iter_mut().for_each(|v| *v = scale * rng.f()),
        }
    }
    x
}

/// `S = sum_i (|w_i - z_i| + |z_i|) |x_i|`: the magnitudes the kernels add,
/// with the offset / min part `z` (the value of level 0) counted apart.
fn magnitude(ty: GgmlType, row: &[u8], x: &[f32]) -> f64 {
    let n = x.len();
    let mut w = vec![0f32; n];
    dequantize_row(ty, row, &mut w);
    let mut zeroed = row.to_vec();
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    let mut z = vec![0f32; n];
    if ty == GgmlType::Q8_0 {
        // The VNNI kernel offsets the signed levels by 128.
        for (zb, b) in z.chunks_exact_mut(bs).zip(row.chunks_exact(bb)) {
            let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            zb.fill(128.0 * d);
        }
    } else {
        for b in zeroed.chunks_exact_mut(bb) {
            b[level_bytes(ty)].fill(0);
        }
        dequantize_row(ty, &zeroed, &mut z);
    }
    (0..n).map(|i| ((w[i] - z[i]).abs() as f64 + z[i].abs() as f64) * x[i].abs() as f64).sum()
}

fn exact(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum()
}

fn lengths(ty: GgmlType) -> Vec<usize> {
    let bs = ty.block_size();
    [bs, 2 * bs, 3 * bs, 4 * bs, 5 * bs, 640, 2560].into_iter().filter(|&n| ty.row_bytes(n).is_some()).collect()
}

#[test]
fn simd_levels_match_the_scalar_reference() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let isas = Isa::available();
    println!("levels: {:?}", isas);
    for ty in QUANT_TYPES {
        let kind = ActKind::of(ty).unwrap();
        let mut worst = 0f64;
        for n in lengths(ty) {
            for trial in 0..12 {
                let row = make_row(ty, n, &mut rng, trial);
                let x = make_x(n, &mut rng);
                let act = Activation::new(Isa::Scalar, kind, &x);
                let xr = act.dequantize();
                let mut w = vec![0f32; n];
                dequantize_row(ty, &row, &mut w);
                let want = exact(&w, &xr);
                let nb = n / ty.block_size();
                let tol = (nb as f64 + 16.0) * 2f64.powi(-22) * magnitude(ty, &row, &xr);
                let reference = dot_row(Isa::Scalar, ty, &row, &act) as f64;
                assert!((reference - want).abs() <= tol, "{ty} n={n} trial {trial} scalar: {reference} vs {want} (tol {tol})");
                for &isa in &isas[1..] {
                    let got = dot_row(isa, ty, &row, &act) as f64;
                    let err = (got - want).abs();
                    assert!(err <= tol, "{ty} n={n} trial {trial} {}: {got} vs {want}, scalar {reference} (tol {tol})", isa.name());
                    assert!((got - reference).abs() <= 2.0 * tol);
                    if tol > 0.0 {
                        worst = worst.max(err / tol);
                    }
                }
            }
        }
        println!("{ty}: worst SIMD error {worst:.3} of the bound");
    }
}

#[test]
fn fast_path_is_within_the_activation_rounding_bound() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let isa = Isa::detect();
    for ty in QUANT_TYPES {
        let kind = ActKind::of(ty).unwrap();
        let (mut worst, mut typical) = (0f64, 0f64);
        for n in lengths(ty) {
            for trial in 0..12 {
                // Weights as files hold them; activations of every shape.
                let row = make_row(ty, n, &mut rng, 6 * (trial % 2));
                let x = make_x(n, &mut rng);
                let mut w = vec![0f32; n];
                dequantize_row(ty, &row, &mut w);
                let want = exact(&w, &x);
                let act = Activation::new(isa, kind, &x);
                let xr = act.dequantize();
                let bs = if kind == ActKind::Q8 { 32 } else { 256 };
                let rounding: f64 = x
                    .chunks(bs)
                    .zip(w.chunks(bs))
                    .map(|(xb, wb)| {
                        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                        amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
                    })
                    .sum();
                let nb = n / ty.block_size();
                let float = (nb as f64 + 16.0) * 2f64.powi(-22) * (magnitude(ty, &row, &xr) + magnitude(ty, &row, &x));
                let bound = rounding * (1.0 + 1e-4) + float;
                let got = dot_row(isa, ty, &row, &act) as f64;
                let err = (got - want).abs();
                assert!(err <= bound, "{ty} n={n} trial {trial}: {got} vs exact {want}, bound {bound}");
                if bound > 0.0 {
                    worst = worst.max(err / bound);
                }
                let scale = exact(&w.iter().map(|v| v.abs()).collect::<Vec<_>>(), &x.iter().map(|v| v.abs()).collect::<Vec<_>>());
                if scale > 0.0 {
                    typical = typical.max(err / scale);
                }
            }
        }
        println!("{ty}: worst error {worst:.3} of the bound, {typical:.1e} of sum |w x|");
    }
}

/// On Gaussian weights and activations the fast path's error is the
/// rounding noise the module docs predict: relative RMS over many rows of
/// 0.5% (blocks of 32) to 0.7% (256); at most 1%.
#[test]
fn fast_path_typical_error_on_gaussian_activations() {
    let mut rng = Rng(99);
    let mut gauss = move || {
        let (u, v) = (rng.f() as f64 + 0.5, rng.f() as f64 + 0.5);
        ((-2.0 * (u + 1e-12).ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    };
    let isa = Isa::detect();
    let n = 2560;
    for ty in QUANT_TYPES {
        let kind = ActKind::of(ty).unwrap();
        let (mut err2, mut sig2) = (0f64, 0f64);
        for _ in 0..64 {
            let w: Vec<f32> = (0..n).map(|_| gauss()).collect();
            let x: Vec<f32> = (0..n).map(|_| gauss()).collect();
            let mut row = vec![0u8; ty.row_bytes(n).unwrap()];
            quantize_row(ty, &w, &mut row).unwrap();
            let mut wd = vec![0f32; n];
            dequantize_row(ty, &row, &mut wd);
            let want = exact(&wd, &x);
            let got = dot_row(isa, ty, &row, &Activation::new(isa, kind, &x)) as f64;
            err2 += (got - want).powi(2);
            // The output's variance: sum w_i^2 for unit-variance x.
            sig2 += wd.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
        }
        let rel = (err2 / sig2).sqrt();
        println!("{ty}: relative RMS error {:.2}%", 100.0 * rel);
        assert!(rel <= 0.01, "{ty}: relative RMS error {rel}");
    }
}

#[test]
fn activation_rounding() {
    let mut rng = Rng(77);
    for kind in [ActKind::Q8, ActKind::Q8K] {
        let bs = if kind == ActKind::Q8 { 32 } else { 256 };
        for _ in 0..20 {
            let x = make_x(2560, &mut rng);
            let a = Activation::new(Isa::Scalar, kind, &x);
            let xr = a.dequantize();
            for (xb, rb) in x.chunks(bs).zip(xr.chunks(bs)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (v, r) in xb.iter().zip(rb) {
                    assert!((v - r).abs() <= amax / 254.0 * (1.0 + 1e-4), "{kind:?}: {v} -> {r}, amax {amax}");
                }
            }
            for &isa in &Isa::available()[1..] {
                let b = Activation::new(isa, kind, &x);
                assert_eq!(format!("{a:?}"), format!("{b:?}"), "{kind:?} {}", isa.name());
            }
        }
        // Ties (amax 127: x * 127 / amax is x), signed zeros, a NaN block,
        // an infinite block, a zero block: the same bytes at every level.
        let mut x = vec![0f32; 1024];
        for (i, v) in x[..256].iter_mut().enumerate() {
            *v = [127.0, -0.5, 0.5, 1.5, 2.5, -2.5, -0.0, 126.5][i % 8];
        }
        x[300] = f32::NAN;
        x[600] = f32::INFINITY;
        let a = Activation::new(Isa::Scalar, kind, &x);
        for &isa in &Isa::available()[1..] {
            assert_eq!(format!("{a:?}"), format!("{:?}", Activation::new(isa, kind, &x)), "{kind:?} {}", isa.name());
        }
        let r = a.dequantize();
        assert_eq!(&r[..8], &[127.0, -0.0, 0.0, 2.0, 2.0, -2.0, 0.0, 126.0], "{kind:?}: halves round to even");
        assert!(r[300].is_nan(), "NaN reaches the products");
        assert!(r[600].is_nan(), "inf reaches the products (as NaN: d = inf, q = 0)");
        assert!(r[768..].iter().all(|&v| v == 0.0), "zero block stays zero");
    }
}

/// `matvec_batch_with` cuts jobs into chunks and shares rounded inputs: the
/// numbers must be those of the row kernels, for both kernel families.
#[test]
fn batch_scheduling_matches_single_rows() {
    let mut rng = Rng(5);
    let isa = Isa::detect();
    let x1 = make_x(2560, &mut rng);
    let x2 = make_x(2560, &mut rng);
    let x3 = make_x(640, &mut rng);
    let specs: Vec<(GgmlType, usize, &[f32])> = vec![
        (GgmlType::Q4K, 640, &x1),
        (GgmlType::Q4K, 640, &x1),
        (GgmlType::Q8_0, 300, &x1),
        (GgmlType::Q6K, 700, &x2),
        (GgmlType::Q5_0, 2560, &x3),
        (GgmlType::F16, 40, &x2),
        (GgmlType::Q2K, 0, &x2),
        (GgmlType::Q4_0, 1, &x3),
    ];
    let mats: Vec<Vec<u8>> = specs.iter().map(|&(ty, r, x)| make_row(ty, x.len() * r, &mut rng, 0)).collect();
    for kernels in [Kernels::Exact, Kernels::Fast] {
        let mut ys: Vec<Vec<f32>> = specs.iter().map(|s| vec![f32::NAN; s.1]).collect();
        let mut jobs: Vec<MatVec<'_>> = specs
            .iter()
            .zip(&mats)
            .zip(ys.iter_mut())
            .map(|((&(ty, _, x), rows), y)| MatVec { ty, rows, x, y })
            .collect();
        matvec_batch_with(kernels, isa, &mut jobs);
        for ((&(ty, r, x), rows), y) in specs.iter().zip(&mats).zip(&ys) {
            let rb = rows.len() / r.max(1);
            for (k, got) in y.iter().enumerate() {
                let row = &rows[k * rb..(k + 1) * rb];
                let want = match (kernels, ActKind::of(ty)) {
                    (Kernels::Fast, Some(kind)) => dot_row(isa, ty, row, &Activation::new(isa, kind, x)),
                    _ => flashnext::quant::kernels::dot_row_with(isa, ty, row, x),
                };
                assert_eq!(got.to_bits(), want.to_bits(), "{kernels:?} {ty} row {k}: {got} vs {want}");
            }
        }
    }
}

/// `glu_batch_with` runs gate/up and down of several units in one region,
/// each down product as soon as its unit's gate and up are done: the numbers
/// must be those of two `matvec_batch_with` calls with the gate step
/// between, for both kernel families, units of different widths and types
/// (routed experts, a shared one), on one thread (serial) and on pools of 2
/// and 5 (every interleaving of the chunks gives the same bits).
#[test]
fn glu_batch_matches_two_batches() {
    let mut rng = Rng(11);
    let isa = Isa::detect();
    let h = 512;
    let x = make_x(h, &mut rng);
    // (gate/up type, down type, width)
    let specs = [(GgmlType::Q2K, GgmlType::Q4_0, 640), (GgmlType::Q4K, GgmlType::Q5_0, 256), (GgmlType::Q8_0, GgmlType::Q8_0, 96), (GgmlType::Q2K, GgmlType::Q4_0, 640)];
    let mats: Vec<[Vec<u8>; 3]> = specs
        .iter()
        .map(|&(t, d, ff)| [make_row(t, h * ff, &mut rng, 0), make_row(t, h * ff, &mut rng, 0), make_row(d, ff * h, &mut rng, 0)])
        .collect();
    let glu = |g: &mut [f32], u: &[f32]| {
        for (gv, uv) in g.iter_mut().zip(u) {
            *gv = *gv / (1.0 + (-*gv).exp()) * uv;
        }
    };
    for kernels in [Kernels::Exact, Kernels::Fast] {
        // The reference: gate and up of all units, the gate step, then all downs.
        let mut gates: Vec<Vec<f32>> = specs.iter().map(|s| vec![f32::NAN; s.2]).collect();
        let mut ups = gates.clone();
        let mut jobs = Vec::new();
        for (((&(t, _, _), m), g), u) in specs.iter().zip(&mats).zip(gates.iter_mut()).zip(ups.iter_mut()) {
            jobs.push(MatVec { ty: t, rows: &m[0], x: &x, y: g });
            jobs.push(MatVec { ty: t, rows: &m[1], x: &x, y: u });
        }
        matvec_batch_with(kernels, isa, &mut jobs);
        for (g, u) in gates.iter_mut().zip(&ups) {
            glu(g, u);
        }
        let mut want = vec![f32::NAN; specs.len() * h];
        let mut jobs: Vec<MatVec<'_>> = specs
            .iter()
            .zip(&mats)
            .zip(gates.iter())
            .zip(want.chunks_mut(h))
            .map(|(((&(_, d, _), m), g), y)| MatVec { ty: d, rows: &m[2], x: g, y })
            .collect();
        matvec_batch_with(kernels, isa, &mut jobs);
        let units: Vec<Glu<'_>> = specs
            .iter()
            .zip(&mats)
            .map(|(&(t, d, _), m)| Glu { gate: Rows { ty: t, bytes: &m[0] }, up: Rows { ty: t, bytes: &m[1] }, down: Rows { ty: d, bytes: &m[2] } })
            .collect();
        for threads in [1, 2, 5] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for round in 0..3 {
                let mut got = vec![f32::NAN; specs.len() * h];
                pool.install(|| glu_batch_with(kernels, isa, &units, &x, glu, &mut got));
                let diff: Vec<usize> = (0..got.len()).filter(|&i| got[i].to_bits() != want[i].to_bits()).collect();
                assert!(diff.is_empty(), "{kernels:?}, {threads} threads, round {round}: {} of {} differ, first {:?}", diff.len(), got.len(), &diff[..diff.len().min(8)]);
            }
        }
    }
}
