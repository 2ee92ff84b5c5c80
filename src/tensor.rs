//! Weight tensors as zero-copy views into the memory-mapped model file, and
//! the row-parallel matrix-vector products the CPU forward pass is built on.
//!
//! The products run on [`crate::quant::kernels`]: for the quantized types by
//! default the integer kernels against an 8-bit rounding of `x` (ggml's
//! scheme, within `amax / 254` per activation: see [`crate::quant::dot`]),
//! else (F32/F16/BF16 always, quantized types with `Kernels::Exact`) by
//! decoding each row bit-exactly and accumulating in f32, which differs from
//! PyTorch's BLAS only by rounding, ~1e-7 relative. SIMD is picked at run
//! time. Products that share a layer step go through [`matvec_all`] together.

use crate::gguf::{GgmlType, Storage, TensorInfo};
use crate::quant::kernels::{matvec_batch, MatVec, Rows};
use crate::quant::matmul::{matmul_batch, MatMul};

/// A tensor in the mapped file. `dims` are in ggml order (`dims[0]` contiguous):
/// a linear layer `out x in` is `dims = [in, out]`.
#[derive(Clone)]
pub struct Tensor {
    map: Storage,
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<usize>,
    offset: usize,
    nbytes: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}; {:?}]", self.name, self.ty, self.dims)
    }
}

impl Tensor {
    pub(crate) fn new(map: Storage, info: &TensorInfo) -> Self {
        Self {
            map,
            name: info.name.clone(),
            ty: info.ty,
            dims: info.dims.clone(),
            offset: info.offset,
            nbytes: info.nbytes,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &(*self.map).as_ref()[self.offset..self.offset + self.nbytes]
    }

    /// Length of one row (the contiguous axis).
    pub fn cols(&self) -> usize {
        self.dims[0]
    }

    /// Number of rows across all outer axes.
    pub fn rows(&self) -> usize {
        self.dims[1..].iter().product()
    }

    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols()).expect("row length checked at parse time")
    }

    fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[r * rb..(r + 1) * rb]
    }

    /// Dequantizes row `r` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        crate::quant::dequantize_row(self.ty, self.row(r), out);
    }

    /// The whole tensor as f32 (for small vectors such as norm weights).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n_elements()];
        for (r, chunk) in out.chunks_mut(self.cols()).enumerate() {
            self.dequantize_row(r, chunk);
        }
        out
    }

    /// `y = W[rows] · x` for the `y.len()` rows starting at `first_row`.
    pub fn matvec_rows(&self, first_row: usize, x: &[f32], y: &mut [f32]) {
        matvec_batch(&mut [self.matvec_job(first_row, x, y)]);
    }

    /// The product `y = W[rows] · x` (rows from `first_row`) as a job for
    /// [`matvec_all`].
    pub fn matvec_job<'a>(&'a self, first_row: usize, x: &'a [f32], y: &'a mut [f32]) -> MatVec<'a> {
        assert_eq!(x.len(), self.cols(), "{}: input length", self.name);
        assert!(first_row + y.len() <= self.rows(), "{}: rows out of range", self.name);
        let rb = self.row_bytes();
        let rows = &self.bytes()[first_row * rb..(first_row + y.len()) * rb];
        MatVec { ty: self.ty, rows, x, y }
    }

    /// `y = W · x` over all rows.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!(y.len(), self.rows(), "{}: output length", self.name);
        self.matvec_rows(0, x, y);
    }

    /// Rows `first_row..first_row + n` (for [`crate::quant::kernels::glu_batch`]).
    pub fn rows_at(&self, first_row: usize, n: usize) -> Rows<'_> {
        assert!(first_row + n <= self.rows(), "{}: rows out of range", self.name);
        let rb = self.row_bytes();
        Rows { ty: self.ty, bytes: &self.bytes()[first_row * rb..(first_row + n) * rb] }
    }

    /// The product over a batch, `ys[t] = W[rows] · xs[t]` (`xs`: [T][cols],
    /// `ys`: [T][n], rows from `first_row`), as a job for [`matmul_all`].
    pub fn matmul_job<'a>(&'a self, first_row: usize, xs: &'a [f32], ys: &'a mut [f32]) -> MatMul<'a> {
        self.matmul_job_picked(first_row, xs, None, ys)
    }

    /// [`Tensor::matmul_job`] over the tokens of `xs` that `pick` names
    /// (every token when `None`), in its order: `ys` is [pick.len()][n].
    pub fn matmul_job_picked<'a>(&'a self, first_row: usize, xs: &'a [f32], pick: Option<&'a [usize]>, ys: &'a mut [f32]) -> MatMul<'a> {
        let cols = self.cols();
        assert_eq!(xs.len() % cols, 0, "{}: inputs are not rows of {cols}", self.name);
        let t = pick.map_or(xs.len() / cols, <[usize]>::len);
        let n = ys.len().checked_div(t).unwrap_or(0);
        assert_eq!(ys.len(), n * t, "{}: outputs for {t} tokens", self.name);
        assert!(first_row + n <= self.rows(), "{}: rows out of range", self.name);
        let rb = self.row_bytes();
        MatMul { ty: self.ty, rows: &self.bytes()[first_row * rb..(first_row + n) * rb], cols, xs, pick, ys }
    }

    /// `ys[t] = W · xs[t]` over all rows, for every token of the batch.
    pub fn matmul(&self, xs: &[f32], ys: &mut [f32]) {
        assert_eq!(ys.len() * self.cols(), xs.len() * self.rows(), "{}: output length", self.name);
        matmul_batch(&mut [self.matmul_job(0, xs, ys)]);
    }
}

/// Runs several batched products in one parallel region (inputs shared
/// between jobs are rounded once per token on the fast path); the numbers are
/// those of the matrix-vector products token by token.
pub fn matmul_all(jobs: &mut [MatMul<'_>]) {
    matmul_batch(jobs);
}

/// Runs several products in one parallel region (inputs shared between jobs
/// are rounded once on the fast path); the numbers are those of separate
/// [`Tensor::matvec_rows`] calls.
pub fn matvec_all(jobs: &mut [MatVec<'_>]) {
    matvec_batch(jobs);
}
