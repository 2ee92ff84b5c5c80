//! Element-wise building blocks, written to match the PyTorch reference
//! operation for operation (same epsilon placement, same activations).

/// `out = x / sqrt(mean(x^2) + eps) * gamma` over each group of `gamma.len()`
/// elements when `gamma` is shorter than `x` (grouped norm over streams),
/// or over the whole vector.
pub fn rms_norm(x: &[f32], gamma: &[f32], eps: f32, out: &mut [f32]) {
    let group = gamma.len().min(x.len());
    rms_norm_grouped(x, gamma, group, eps, out);
}

/// RMS-normalises each consecutive `group` of `x`; `gamma` spans all of `x`
/// or one group.
pub fn rms_norm_grouped(x: &[f32], gamma: &[f32], group: usize, eps: f32, out: &mut [f32]) {
    for (gi, (xs, os)) in x.chunks(group).zip(out.chunks_mut(group)).enumerate() {
        let ms = xs.iter().map(|v| v * v).sum::<f32>() / group as f32;
        let r = 1.0 / (ms + eps).sqrt();
        let g = if gamma.len() == x.len() { &gamma[gi * group..(gi + 1) * group] } else { gamma };
        for ((o, &v), &w) in os.iter_mut().zip(xs).zip(g) {
            *o = v * r * w;
        }
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// PyTorch's softplus with its default threshold 20 (linear above it).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(sum(x^2) + eps)` in place (the FLA-style l2norm of the GDN).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

/// Softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for (x, y) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let tail: f32 = a[n8..].iter().zip(&b[n8..]).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// Rotary position table for NeoX-style pairing `(i, i + dims/2)` on the first
/// `dims` features: `inv_freq[i] = theta^(-2i/dims)`.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(dims: usize, theta: f32) -> Self {
        let inv_freq =
            (0..dims / 2).map(|i| (1.0 / (theta as f64).powf((2 * i) as f64 / dims as f64)) as f32).collect();
        Self { inv_freq }
    }

    /// Rotates the first `2 * inv_freq.len()` features of `x` to position `pos`.
    /// Angles are formed in f32 (`pos * inv_freq`) as the reference does.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let angle = pos as f32 * f;
            let (s, c) = angle.sin_cos();
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}
