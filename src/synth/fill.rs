//! Producing tensor bytes at disk speed.
//!
//! Quantizing 40 GB of Gaussian values with the real quantizers would take
//! far longer than writing them. Instead each storage type gets a pool of a
//! few thousand blocks of unit-variance Gaussian values, quantized once with
//! the real encoder; a tensor of standard deviation `s` gets a copy of the
//! pool with every block's f16 scale fields (`d`, and `dmin`/`m` where the
//! type has one) multiplied by `s` — every value of a block is linear in
//! them — and is then filled with pool blocks picked by a fast PRNG. The
//! result is valid blocks of the right statistics, produced by memcpy.
//!
//! Filling runs on rayon in pieces of about 1 MiB, each seeded from (seed,
//! tensor name, piece index), so the bytes do not depend on the thread
//! count; a chunk is filled on a helper thread while the previous one is
//! written.

use super::shapes::Init;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::quant::quantize_row as quantize;
use rayon::prelude::*;
use std::io::Write;

/// Blocks per pool.
const POOL_UNITS: usize = 4096;
/// Bytes filled per parallel piece (rounded down to whole units).
const PIECE_BYTES: usize = 1 << 20;
/// Pieces per chunk written at once.
const PIECES_PER_CHUNK: usize = 64;

/// wyrand (Wang Yi): a small, fast, well-mixed 64-bit generator.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        let mut s = seed;
        Rng(crate::sampling::splitmix64(&mut s))
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128) * ((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) as u64) ^ (t as u64)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [0, n) (Lemire's multiply-shift, bias below 2^-32 for small n).
    fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }

    /// Standard normal (Box-Muller).
    pub(crate) fn gauss(&mut self) -> f32 {
        let u = 1.0 - self.unit();
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// A stable 64-bit hash of a tensor name mixed with the file seed.
pub(crate) fn tensor_seed(seed: u64, name: &str) -> u64 {
    let fnv = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut s = seed ^ fnv;
    crate::sampling::splitmix64(&mut s)
}


/// Pool units of a type: one block for block types, 32 values for float types
/// (or 1 when a row is shorter than that).
fn unit_elems(ty: GgmlType, ne0: usize) -> usize {
    match ty.block_size() {
        1 if ne0.is_multiple_of(32) => 32,
        b => b,
    }
}

/// Unit-variance pools, one per (type, unit size), built on first use.
#[derive(Default)]
pub(crate) struct Pools {
    pools: Vec<(GgmlType, usize, Vec<f32>, Vec<u8>)>,
}

impl Pools {
    /// The encoded pool of `ty` in units of `unit` values: (normals, encoded bytes).
    fn get(&mut self, ty: GgmlType, unit: usize) -> Result<(&[f32], &[u8])> {
        let i = match self.pools.iter().position(|p| p.0 == ty && p.1 == unit) {
            Some(i) => i,
            None => {
                let mut rng = Rng::new(0x5eed ^ ty.id() as u64);
                let values: Vec<f32> = (0..POOL_UNITS * unit).map(|_| rng.gauss()).collect();
                let ub = ty.row_bytes(unit).expect("a unit is whole blocks");
                let mut bytes = vec![0u8; POOL_UNITS * ub];
                for (src, dst) in values.chunks_exact(unit).zip(bytes.chunks_exact_mut(ub)) {
                    quantize(ty, src, dst)?;
                }
                self.pools.push((ty, unit, values, bytes));
                self.pools.len() - 1
            }
        };
        let p = &self.pools[i];
        Ok((&p.2, &p.3))
    }

    /// The unit-variance pool of `ty` for rows of `ne0` with `shift` (a
    /// pattern whose length divides a unit) added to every unit's values:
    /// (encoded units, bytes per unit).
    pub(crate) fn shifted(&mut self, ty: GgmlType, ne0: usize, shift: &[f32]) -> Result<(Vec<u8>, usize)> {
        let unit = unit_elems(ty, ne0);
        if !unit.is_multiple_of(shift.len()) {
            return Err(Error::arg(format!("{ty}: a shift of {} values does not tile a unit of {unit}", shift.len())));
        }
        let ub = ty.row_bytes(unit).expect("a unit is whole blocks");
        let (values, _) = self.get(ty, unit)?;
        let shifted: Vec<f32> = values.iter().enumerate().map(|(i, v)| v + shift[i % shift.len()]).collect();
        let mut out = vec![0u8; POOL_UNITS * ub];
        for (src, dst) in shifted.chunks_exact(unit).zip(out.chunks_exact_mut(ub)) {
            quantize(ty, src, dst)?;
        }
        Ok((out, ub))
    }

    /// The pool of `ty` for a tensor with rows of `ne0` and standard deviation `std`:
    /// (encoded units, bytes per unit).
    pub(crate) fn scaled(
        &mut self,
        ty: GgmlType,
        ne0: usize,
        std: f32,
    ) -> Result<(Vec<u8>, usize)> {
        let unit = unit_elems(ty, ne0);
        let ub = ty.row_bytes(unit).expect("a unit is whole blocks");
        let (values, bytes) = self.get(ty, unit)?;
        let fields = crate::quant::scale_fields(ty);
        if fields.is_empty() {
            let scaled: Vec<f32> = values.iter().map(|v| v * std).collect();
            let mut out = vec![0u8; bytes.len()];
            quantize(ty, &scaled, &mut out)?;
            return Ok((out, ub));
        }
        let mut out = bytes.to_vec();
        for block in out.chunks_exact_mut(ub) {
            for &f in fields {
                let d = half::f16::from_le_bytes([block[f], block[f + 1]]).to_f32() * std;
                block[f..f + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            }
        }
        Ok((out, ub))
    }
}

/// Writes `n_units` units drawn from `pool` (units of `ub` bytes), calling
/// `progress(bytes)` after each chunk.
pub(crate) fn write_pooled(
    w: &mut dyn Write,
    pool: &[u8],
    ub: usize,
    n_units: usize,
    seed: u64,
    progress: &dyn Fn(u64),
) -> Result<()> {
    let io = |e| Error::io("writing the synthetic model", e);
    let piece_units = (PIECE_BYTES / ub).max(1);
    let chunk_units = piece_units * PIECES_PER_CHUNK;
    let n_pool = pool.len() / ub;
    let fill = |chunk: usize, buf: &mut Vec<u8>| {
        let first = chunk * chunk_units;
        let units = chunk_units.min(n_units - first);
        buf.resize(units * ub, 0);
        buf.par_chunks_mut(piece_units * ub)
            .enumerate()
            .for_each(|(i, piece)| {
                let mut rng = Rng::new(
                    seed ^ ((chunk * PIECES_PER_CHUNK + i) as u64)
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15),
                );
                for dst in piece.chunks_exact_mut(ub) {
                    let k = rng.below(n_pool);
                    dst.copy_from_slice(&pool[k * ub..(k + 1) * ub]);
                }
            });
    };
    let n_chunks = n_units.div_ceil(chunk_units);
    let (mut cur, mut next) = (Vec::new(), Vec::new());
    if n_chunks > 0 {
        fill(0, &mut cur);
    }
    for c in 0..n_chunks {
        let written = std::thread::scope(|s| {
            let filler = (c + 1 < n_chunks).then(|| s.spawn(|| fill(c + 1, &mut next)));
            let r = w.write_all(&cur);
            if let Some(f) = filler {
                f.join().expect("the fill thread does not panic");
            }
            r
        });
        written.map_err(io)?;
        progress(cur.len() as u64);
        std::mem::swap(&mut cur, &mut next);
    }
    Ok(())
}

/// `n` values of a small tensor drawn per `init` (not `Gauss`, which is
/// pooled, nor `Route`, which `synth::routing` draws).
pub(crate) fn small_values(init: Init, n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| match init {
            Init::Gauss(s) => s * rng.gauss(),
            Init::Gamma => 1.0 + 0.02 * rng.gauss(),
            Init::Decay => -(0.01 + 15.99 * rng.unit()),
            Init::DtBias => {
                let dt = (1e-3f32.ln() + rng.unit() * (0.1f32.ln() - 1e-3f32.ln())).exp();
                dt + (-(-dt).exp_m1()).ln()
            }
            Init::Conv => rng.unit() - 0.5,
            Init::Route(_) => unreachable!("routing tensors are drawn by synth::routing"),
        })
        .collect()
}

/// Writes a small tensor of `values` (rows of `ne0`) as `ty`.
pub(crate) fn write_values(
    w: &mut dyn Write,
    ty: GgmlType,
    ne0: usize,
    values: &[f32],
) -> Result<()> {
    let rb = ty.row_bytes(ne0).expect("row length checked by the writer");
    let mut out = vec![0u8; values.len() / ne0 * rb];
    // Row by row, in parallel: the bytes do not depend on the thread count.
    values.par_chunks_exact(ne0).zip(out.par_chunks_exact_mut(rb)).try_for_each(|(src, dst)| quantize(ty, src, dst))?;
    w.write_all(&out)
        .map_err(|e| Error::io("writing the synthetic model", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dt_bias_is_inverse_softplus_of_a_small_step() {
        for b in small_values(Init::DtBias, 1000, 7) {
            let dt = b.exp().ln_1p();
            assert!((0.99e-3..=0.101).contains(&dt), "softplus({b}) = {dt}");
        }
    }

    #[test]
    fn scaled_pools_have_the_requested_spread() {
        let mut pools = Pools::default();
        for (ty, ne0) in [
            (GgmlType::Q8_0, 2560),
            (GgmlType::Q4K, 2560),
            (GgmlType::Q2K, 2560),
            (GgmlType::Q5_0, 640),
        ] {
            let (bytes, ub) = pools.scaled(ty, ne0, 0.02).unwrap();
            assert_eq!(ub, ty.block_bytes());
            let mut vals = vec![0f32; ty.block_size()];
            let mut sum2 = 0f64;
            for block in bytes.chunks_exact(ub) {
                crate::quant::dequantize_row(ty, block, &mut vals);
                sum2 += vals.iter().map(|v| (*v as f64).powi(2)).sum::<f64>();
            }
            let std = (sum2 / (POOL_UNITS * ty.block_size()) as f64).sqrt();
            // Quantization noise adds to the variance (most for 2-bit blocks).
            assert!((std - 0.02).abs() < 0.002, "{ty}: std {std}");
        }
    }

    #[test]
    fn pooled_bytes_do_not_depend_on_the_thread_count() {
        let pool: Vec<u8> = (0..=255).collect();
        let run = |threads| {
            let tp = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut out = Vec::new();
            tp.install(|| write_pooled(&mut out, &pool, 4, 300_000, 42, &|_| {}))
                .unwrap();
            out
        };
        let one = run(1);
        assert_eq!(one.len(), 1_200_000);
        assert_eq!(one, run(3));
    }
}
