//! How weight matrices are laid out in device memory: the file's blocks,
//! regrouped at upload so that every shader load of quantized values is an
//! aligned 16-byte load.
//!
//! A *part* (one uploaded chunk of a matrix, or one matrix of an arena slot)
//! of `rows` rows of `nb` blocks stores:
//!
//! * the **payload**: for each block, in row-major block order, the bytes
//!   listed by [`TypeLayout::payload`] (a multiple of 16 per block), so row
//!   `r` starts at `r * row_bytes` and every block at a 16-byte boundary;
//! * up to two **field arrays** (block scales, minima, high bits; listed by
//!   [`TypeLayout::fields`]), each a flat array over all blocks of the part
//!   (block `g = r * nb + b`), starting at a 16-byte boundary.
//!
//! | type | file block | payload per block | field 0 | field 1 | items per block |
//! |---|---|---|---|---|---|
//! | F32 / F16 / BF16 | - | the row, zero-padded to 16 bytes | - | - | one per 16 bytes |
//! | Q4_0 | 18 | qs (16) | d (2) | - | 1 |
//! | Q4_1 | 20 | qs (16) | d, m (4) | - | 1 |
//! | Q5_0 | 22 | qs (16) | qh (4) | d (2) | 1 |
//! | Q5_1 | 24 | qs (16) | qh (4) | d, m (4) | 1 |
//! | Q8_0 | 34 | qs (32) | d (2) | - | 2 |
//! | Q2_K | 84 | scales, qs (80) | d, dmin (4) | - | 4 |
//! | Q3_K | 110 | hmask, qs (96) | scales (12) | d (2) | 4 |
//! | Q4_K | 144 | qs (128) | d, dmin, scales (16) | - | 4 |
//! | Q5_K | 176 | qh, qs (160) | d, dmin, scales (16) | - | 4 |
//! | Q6_K | 210 | ql, qh, scales (208) | d (2) | - | 8 |
//!
//! The byte order inside each piece is the file's, so the shaders decode
//! exactly what the CPU's dequantizers decode (`src/quant/`). An *item* is
//! what one shader invocation handles at a time (16 bytes of quants, 16 to
//! 64 weights; 32 bytes and 64 weights for Q4_K and Q5_K, whose per-item
//! scale decoding then serves twice the weights); shaders/weights.glsl
//! documents each type's.

use crate::gguf::GgmlType;

/// The device layout of one weight type.
pub(crate) struct TypeLayout {
    /// (offset, length) of the pieces of a file block that form its payload, in order.
    pub payload: &'static [(usize, usize)],
    /// (offset, length) of the file block's bytes that go to each field array.
    pub fields: &'static [(usize, usize)],
    /// Work items per block (see shaders/weights.glsl).
    pub items_per_block: usize,
}

impl TypeLayout {
    fn payload_bytes(&self) -> usize {
        self.payload.iter().map(|p| p.1).sum()
    }
}

/// The layout of a quantized type; `None` for the float types (rows padded to 16 bytes).
pub(crate) fn type_layout(ty: GgmlType) -> Option<TypeLayout> {
    let l = |payload, fields, items_per_block| Some(TypeLayout { payload, fields, items_per_block });
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
        GgmlType::Q4_0 => l(&[(2, 16)], &[(0, 2)], 1),
        GgmlType::Q4_1 => l(&[(4, 16)], &[(0, 4)], 1),
        GgmlType::Q5_0 => l(&[(6, 16)], &[(2, 4), (0, 2)], 1),
        GgmlType::Q5_1 => l(&[(8, 16)], &[(4, 4), (0, 4)], 1),
        GgmlType::Q8_0 => l(&[(2, 32)], &[(0, 2)], 2),
        GgmlType::Q2K => l(&[(0, 80)], &[(80, 4)], 4),
        GgmlType::Q3K => l(&[(0, 96)], &[(96, 12), (108, 2)], 4),
        GgmlType::Q4K => l(&[(16, 128)], &[(0, 16)], 4),
        GgmlType::Q5K => l(&[(16, 160)], &[(0, 16)], 4),
        GgmlType::Q6K => l(&[(0, 208)], &[(208, 2)], 8),
    }
}

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Where a part's payload and field arrays lie (byte offsets from the part's start).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PartLayout {
    pub ty: Option<GgmlType>,
    pub rows: usize,
    pub cols: usize,
    /// Payload bytes per row (a multiple of 16).
    pub row_bytes: usize,
    /// Offsets of the field arrays (0 when the type has fewer).
    pub fields: [usize; 2],
    /// Bytes of the whole part (a multiple of 16).
    pub bytes: usize,
    /// Work items per row.
    pub items: usize,
}

impl PartLayout {
    /// The layout of `rows` rows of `cols` values of `ty`; `None` if a row is
    /// not a whole number of blocks.
    pub fn new(ty: GgmlType, rows: usize, cols: usize) -> Option<PartLayout> {
        let file_row = ty.row_bytes(cols)?;
        let mut p = PartLayout { ty: Some(ty), rows, cols, ..Default::default() };
        match type_layout(ty) {
            None => {
                p.row_bytes = align16(file_row);
                p.items = p.row_bytes / 16;
                p.bytes = rows * p.row_bytes;
            }
            Some(t) => {
                let nb = cols / ty.block_size();
                p.row_bytes = nb * t.payload_bytes();
                p.items = nb * t.items_per_block;
                let mut at = rows * p.row_bytes;
                for (i, f) in t.fields.iter().enumerate() {
                    p.fields[i] = at;
                    at = align16(at + rows * nb * f.1);
                }
                p.bytes = at;
            }
        }
        p.bytes = align16(p.bytes.max(16));
        Some(p)
    }

    /// The part's bytes from whole file-format rows (`srcs`, concatenated:
    /// `rows` rows in all), into `out` (`self.bytes` long; padding is
    /// zeroed), rows spread over the rayon pool: each task writes its rows'
    /// payload and their stretch of every field array.
    pub fn repack_into(&self, srcs: &[&[u8]], out: &mut [u8]) {
        use rayon::prelude::*;
        let ty = self.ty.expect("a layout made by PartLayout::new");
        let file_row = ty.row_bytes(self.cols).expect("checked in new");
        assert_eq!(out.len(), self.bytes, "repack: output size");
        assert_eq!(srcs.iter().map(|s| s.len()).sum::<usize>(), self.rows * file_row, "repack: row count");
        let rows: Vec<&[u8]> = srcs.iter().flat_map(|s| s.chunks_exact(file_row)).collect();
        // About 32 KiB of rows per task: an expert's part (~1 MB) is then
        // ~30 tasks, so one expert admitted during decode spreads over all
        // the threads (at 256 KiB, four: ~0.18 ms an expert on an H100 host).
        let per_task = ((32 << 10) / file_row.max(1)).max(1);
        let layout = type_layout(ty);
        // The output's regions: the payload, then each field array (then padding).
        let (payload, mut rest) = out.split_at_mut(self.rows * self.row_bytes);
        let mut fields: Vec<&mut [u8]> = Vec::new();
        let mut at = self.rows * self.row_bytes;
        for (i, f) in layout.iter().flat_map(|t| t.fields.iter()).enumerate() {
            let (gap, tail) = rest.split_at_mut(self.fields[i] - at);
            gap.fill(0);
            let nb = self.cols / ty.block_size();
            let (field, tail) = tail.split_at_mut(self.rows * nb * f.1);
            fields.push(field);
            rest = tail;
            at = self.fields[i] + self.rows * nb * f.1;
        }
        rest.fill(0);
        match layout {
            None => payload.par_chunks_mut(per_task * self.row_bytes).zip(rows.par_chunks(per_task)).for_each(|(out, rows)| {
                for (o, row) in out.chunks_exact_mut(self.row_bytes).zip(rows) {
                    o[..file_row].copy_from_slice(row);
                    o[file_row..].fill(0);
                }
            }),
            Some(t) => {
                let nb = self.cols / ty.block_size();
                let per_block = t.payload_bytes();
                let mut f0: &mut [u8] = &mut [];
                let mut f1: &mut [u8] = &mut [];
                let mut it = fields.into_iter();
                if let Some(f) = it.next() {
                    f0 = f;
                }
                if let Some(f) = it.next() {
                    f1 = f;
                }
                let lens = [t.fields.first().map_or(0, |f| f.1), t.fields.get(1).map_or(0, |f| f.1)];
                let chunk = |n: usize| (per_task * nb * n).max(1);
                let f0_chunks: Vec<&mut [u8]> = if lens[0] > 0 { f0.chunks_mut(chunk(lens[0])).collect() } else { Vec::new() };
                let f1_chunks: Vec<&mut [u8]> = if lens[1] > 0 { f1.chunks_mut(chunk(lens[1])).collect() } else { Vec::new() };
                let mut f0_it = f0_chunks.into_iter();
                let mut f1_it = f1_chunks.into_iter();
                let tasks: Vec<_> = payload
                    .chunks_mut(per_task * self.row_bytes)
                    .zip(rows.chunks(per_task))
                    .map(|(p, r)| (p, r, f0_it.next(), f1_it.next()))
                    .collect();
                tasks.into_par_iter().for_each(|(out, rows, a, b)| {
                    let blocks = rows.iter().flat_map(|row| row.chunks_exact(ty.block_bytes()));
                    let mut fa = a.map(|a| a.chunks_exact_mut(lens[0]));
                    let mut fb = b.map(|b| b.chunks_exact_mut(lens[1].max(1)));
                    if let ([(po, pl)], [(fo, fl)], Some(fa)) = (t.payload, t.fields, fa.as_mut()) {
                        // One payload piece and one field (most types).
                        for ((block, out), f) in blocks.zip(out.chunks_exact_mut(per_block)).zip(fa) {
                            copy_piece(out, &block[*po..po + pl]);
                            copy_piece(f, &block[*fo..fo + fl]);
                        }
                        return;
                    }
                    for (block, out) in blocks.zip(out.chunks_exact_mut(per_block)) {
                        let mut at = 0;
                        for &(off, len) in t.payload {
                            copy_piece(&mut out[at..at + len], &block[off..off + len]);
                            at += len;
                        }
                        for (i, &(off, len)) in t.fields.iter().enumerate() {
                            let dst = if i == 0 { fa.as_mut() } else { fb.as_mut() };
                            copy_piece(dst.and_then(|d| d.next()).expect("a field chunk per task"), &block[off..off + len]);
                        }
                    }
                });
            }
        }
    }
}

/// `dst.copy_from_slice(src)` with the lengths of the layouts' pieces
/// known to the compiler (inline moves rather than a `memcpy` call per
/// piece of 2 to 208 bytes: repacking an expert went 2x faster).
#[inline(always)]
fn copy_piece(dst: &mut [u8], src: &[u8]) {
    macro_rules! fixed {
        ($($n:literal)*) => {
            match src.len() {
                $($n => dst[..$n].copy_from_slice(&src[..$n]),)*
                _ => dst.copy_from_slice(src),
            }
        };
    }
    fixed!(2 4 12 16 32 80 96 128 160 208)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QUANT_TYPES;

    #[test]
    fn payloads_are_16_byte_multiples_and_cover_each_block_once() {
        for ty in QUANT_TYPES {
            let t = type_layout(ty).unwrap();
            assert_eq!(t.payload_bytes() % 16, 0, "{ty}");
            let mut covered = vec![0u8; ty.block_bytes()];
            for &(off, len) in t.payload.iter().chain(t.fields) {
                covered[off..off + len].iter_mut().for_each(|c| *c += 1);
            }
            assert!(covered.iter().all(|&c| c == 1), "{ty}: every byte of a block lands once");
        }
    }

    #[test]
    fn field_arrays_are_aligned_and_inside_the_part() {
        for ty in QUANT_TYPES.into_iter().chain([GgmlType::F32, GgmlType::F16, GgmlType::BF16]) {
            for (rows, cols) in [(1, 256), (7, 512), (3, 2560)] {
                let p = PartLayout::new(ty, rows, cols).unwrap();
                assert_eq!(p.row_bytes % 16, 0);
                assert_eq!(p.bytes % 16, 0);
                let nb = cols / ty.block_size();
                if let Some(t) = type_layout(ty) {
                    for (i, f) in t.fields.iter().enumerate() {
                        assert_eq!(p.fields[i] % 16, 0);
                        assert!(p.fields[i] >= rows * p.row_bytes && p.fields[i] + rows * nb * f.1 <= p.bytes, "{ty}");
                    }
                }
            }
        }
    }
}
