//! Output tensors as row recipes, and the streaming producer that turns a
//! recipe into encoded bytes.
//!
//! Every transform the format needs is expressible row by row on the tensor
//! viewed as `[rows, ne0]` (`ne0` = the contiguous GGUF dimension):
//!
//! * which source row feeds output row `i` ([`RowMap`]): a plain range (also
//!   used for the indexer split and the conv-kernel squeeze), a permutation (the
//!   V-head reorder of qkv-V / z / a / b rows and conv V channels), a strided
//!   pick (gate and up halves of fused `gate_up_proj`), one source per expert
//!   (per-expert checkpoints, stacked on the fly) or a concatenation (PLE shards);
//! * an optional permutation inside the row (V-head reorder of `out_proj`
//!   columns, and of the 1-D `dt_bias` / `A_log`);
//! * an element-wise op (`1 + w`, `-exp(w)`).
//!
//! [`OutTensor::write`] walks the rows in chunks of a few million values, decodes
//! each source row to `f32` from the memory map, applies the transforms, encodes
//! the row in parallel (rayon) into a chunk buffer and streams the chunk to the
//! GGUF writer. Nothing larger than one chunk is ever materialised, so a 512-expert
//! stack or the 320M-row PLE table costs the same memory as a norm vector.

use super::source::{SourceSet, SrcId};
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use rayon::prelude::*;
use std::io::Write;

/// Values per streamed chunk (16 MiB of f32 output at most).
const CHUNK_VALUES: usize = 1 << 22;

/// Element-wise transform applied after the row is gathered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ElemOp {
    None,
    /// Stored gammas of the zero-centred RMSNorms: `1 + w`.
    OnePlus,
    /// `ssm_a = -exp(A_log)`.
    NegExp,
}

/// Which source row produces output row `i` (rows are `ne0` values wide on both sides).
#[derive(Clone, Debug)]
pub(crate) enum RowMap {
    /// Row `start + i` of `src`.
    Range { src: SrcId, start: usize },
    /// Row `perm[i]` of `src`.
    Perm { src: SrcId, perm: Vec<usize> },
    /// Expert `e = i / rows_each` of a fused 3-D source: row `e * stride + start + i % rows_each`.
    Strided { src: SrcId, rows_each: usize, stride: usize, start: usize },
    /// Expert `e = i / rows_each` from its own 2-D source `srcs[e]`: row `i % rows_each`.
    PerSource { srcs: Vec<SrcId>, rows_each: usize },
    /// Sources stacked along rows; `ends[k]` = total rows of `srcs[..=k]`.
    Concat { srcs: Vec<SrcId>, ends: Vec<usize> },
}

impl RowMap {
    fn locate(&self, i: usize) -> (SrcId, usize) {
        match self {
            RowMap::Range { src, start } => (*src, start + i),
            RowMap::Perm { src, perm } => (*src, perm[i]),
            RowMap::Strided { src, rows_each, stride, start } => {
                (*src, (i / rows_each) * stride + start + i % rows_each)
            }
            RowMap::PerSource { srcs, rows_each } => (srcs[i / rows_each], i % rows_each),
            RowMap::Concat { srcs, ends } => {
                let k = ends.partition_point(|&e| e <= i);
                (srcs[k], i - if k == 0 { 0 } else { ends[k - 1] })
            }
        }
    }
}

/// One tensor of the output file and how to produce it.
#[derive(Clone, Debug)]
pub(crate) struct OutTensor {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous row length.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    pub rows: RowMap,
    /// Output value `c` of a row = source value `col_perm[c]` of that row.
    pub col_perm: Option<Vec<usize>>,
    pub op: ElemOp,
}

impl OutTensor {
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product()
    }

    /// Streams the encoded tensor into `w`; `on_rows(done)` after each chunk.
    pub fn write(&self, src: &SourceSet, w: &mut dyn Write, mut on_rows: impl FnMut(usize)) -> Result<()> {
        let ne0 = self.dims[0];
        let n_rows = self.n_rows();
        let row_bytes = self.ty.row_bytes(ne0).ok_or_else(|| {
            Error::convert(format!("{}: row of {ne0} is not a whole number of {} blocks", self.name, self.ty))
        })?;
        let chunk_rows = (CHUNK_VALUES / ne0.max(1)).clamp(1, n_rows.max(1));
        let min_len = (16384 / ne0.max(1)).max(1);
        let mut buf = vec![0u8; chunk_rows * row_bytes];
        let mut r0 = 0;
        while r0 < n_rows {
            let n = chunk_rows.min(n_rows - r0);
            let out = &mut buf[..n * row_bytes];
            out.par_chunks_mut(row_bytes).with_min_len(min_len).enumerate().try_for_each_init(
                || (vec![0f32; ne0], vec![0f32; if self.col_perm.is_some() { ne0 } else { 0 }]),
                |(raw, permuted), (k, dst)| {
                    let (s, r) = self.rows.locate(r0 + k);
                    src.row_f32(s, r, raw);
                    let vals: &mut [f32] = match &self.col_perm {
                        Some(p) => {
                            for (o, &c) in permuted.iter_mut().zip(p) {
                                *o = raw[c];
                            }
                            permuted
                        }
                        None => raw,
                    };
                    match self.op {
                        ElemOp::None => {}
                        ElemOp::OnePlus => vals.iter_mut().for_each(|v| *v += 1.0),
                        ElemOp::NegExp => vals.iter_mut().for_each(|v| *v = -v.exp()),
                    }
                    encode_row(self.ty, vals, dst)
                },
            )?;
            w.write_all(out).map_err(|e| Error::io(format!("writing tensor {}", self.name), e))?;
            self.release(src, r0, n, ne0);
            r0 += n;
            on_rows(r0);
        }
        Ok(())
    }
}

impl OutTensor {
    /// Drops the source pages behind output rows `[r0, r0 + n)` from memory,
    /// one `madvise` per run of consecutive source rows.
    fn release(&self, src: &SourceSet, r0: usize, n: usize, ne0: usize) {
        let mut run: Option<(SrcId, usize, usize)> = None; // (source, first row, count)
        for i in r0..r0 + n {
            let (s, r) = self.rows.locate(i);
            run = match run {
                Some((rs, first, cnt)) if rs == s && first + cnt == r => Some((rs, first, cnt + 1)),
                Some((rs, first, cnt)) => {
                    src.release_rows(rs, first, cnt, ne0);
                    Some((s, r, 1))
                }
                None => Some((s, r, 1)),
            };
        }
        if let Some((rs, first, cnt)) = run {
            src.release_rows(rs, first, cnt, ne0);
        }
    }
}

/// The V-head reorder of spec §3.5 (grouped → tiled) as a gather permutation
/// over `nv` blocks of `unit` elements: `out[k] = in[perm[k]]`, where new head
/// `j*nk + i` takes old head `i*r_v + j`.
pub(crate) fn v_head_perm(nk: usize, nv: usize, unit: usize) -> Vec<usize> {
    let r_v = nv / nk;
    let mut perm = Vec::with_capacity(nv * unit);
    for new_head in 0..nv {
        let (j, i) = (new_head / nk, new_head % nk);
        let old_head = i * r_v + j;
        perm.extend((0..unit).map(|t| old_head * unit + t));
    }
    perm
}

/// Encodes one row of `src` as `ty` into `dst`, which must be exactly
/// `ty.row_bytes(src.len())` long (see [`crate::quant::quantize_row`]).
fn encode_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    crate::quant::quantize_row(ty, src, dst).map_err(|e| Error::convert(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_perm_matches_spec() {
        // nk = 2, nv = 6 (r_v = 3): old heads grouped [k0: 0 1 2][k1: 3 4 5]
        // → tiled [0 3 1 4 2 5], so new head h pairs with key head h % 2.
        assert_eq!(v_head_perm(2, 6, 1), vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(v_head_perm(2, 4, 2), vec![0, 1, 4, 5, 2, 3, 6, 7]);
        assert_eq!(v_head_perm(3, 3, 1), vec![0, 1, 2]);
    }

    #[test]
    fn concat_locate() {
        let m = RowMap::Concat { srcs: vec![7, 8, 9], ends: vec![2, 5, 6] };
        let got: Vec<_> = (0..6).map(|i| m.locate(i)).collect();
        assert_eq!(got, vec![(7, 0), (7, 1), (8, 0), (8, 1), (8, 2), (9, 0)]);
        let s = RowMap::Strided { src: 1, rows_each: 2, stride: 4, start: 2 };
        assert_eq!((0..4).map(|i| s.locate(i).1).collect::<Vec<_>>(), vec![2, 3, 6, 7]);
    }
}
