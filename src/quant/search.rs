//! The scale searches of ggml's K-quant reference quantizers
//! (`make_qx_quants`, `make_q3_quants`, `make_qkx2_quants` in
//! `ggml-quants.c`), reproduced operation for operation in f32 so the chosen
//! levels, and therefore the bytes, are the same.

/// Groups whose largest magnitude is below this are stored as all zero.
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest (ties to even) through the `1.5 * 2^23` trick, as
/// ggml's `nearest_int`; valid for `|x| <= 2^22`.
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The value of largest magnitude, with its sign, and that magnitude.
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// Symmetric levels in `[0, 2*nmax)` (stored with offset `nmax`) for one
/// group, weighting each value by `x^2` (`make_qx_quants` with
/// `rmse_type = 1` and no importance weights): tries 19 scales around
/// `nmax / max` and keeps the one with the best weighted fit. Returns the scale.
pub fn make_qx_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let clamp = |v: f32| nearest_int(v).clamp(-nmax, nmax - 1);
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let l = clamp(iscale * v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let store = |iscale: f32, levels: &mut [i8]| {
        for (q, &v) in levels.iter_mut().zip(x) {
            *q = (nmax + clamp(iscale * v)) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    store(iscale, levels);
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&i| i != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, levels);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Symmetric 3-bit levels for one group (`make_q3_quants` with
/// `do_rmse = true`): start from `nmax / max`, then up to five passes that
/// move single levels when that improves the `x^2`-weighted fit. Levels are
/// stored with offset `nmax`. Returns the scale.
pub fn make_q3_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (q, &v) in levels.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *q = l as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (q, &v) in levels.iter_mut().zip(x) {
            let w = v * v;
            let cur = *q as f32;
            let mut slx = sumlx - w * v * cur;
            // Not positive, or NaN.
            if slx.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                continue;
            }
            let mut sl2 = suml2 - w * cur * cur;
            let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
            if new_l != *q as i32 {
                slx += w * v * new_l as f32;
                sl2 += w * new_l as f32 * new_l as f32;
                if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                    *q = new_l as i8;
                    sumlx = slx;
                    suml2 = sl2;
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    for q in levels.iter_mut() {
        *q += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Parameters of the asymmetric search [`make_qkx2_quants`].
pub struct Qkx2 {
    pub nmax: i32,
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    /// Minimize the weighted absolute error instead of the squared one.
    pub use_mad: bool,
}

/// Asymmetric levels `0..=nmax` for one group, `x ≈ scale * l - min`
/// (`make_qkx2_quants`): least-squares `scale`/`min` fits over `nstep + 1`
/// candidate level assignments, keeping the best weighted error. Returns
/// `(scale, min)`.
pub fn make_qkx2_quants(p: &Qkx2, x: &[f32], weights: &[f32], levels: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = if x[i] < min { x[i] } else { min };
        max = if x[i] > max { x[i] } else { max };
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    let nmax = p.nmax as f32;
    let error = |scale: f32, min: f32, levels: &[u8]| {
        let mut e = 0f32;
        for i in 0..n {
            let diff = scale * levels[i] as f32 + min - x[i];
            e += weights[i] * if p.use_mad { diff.abs() } else { diff * diff };
        }
        e
    };
    let assign = |iscale: f32, min: f32, levels: &mut [u8]| {
        for (q, &v) in levels.iter_mut().zip(x) {
            *q = nearest_int(iscale * (v - min)).clamp(0, p.nmax) as u8;
        }
    };
    let iscale = nmax / (max - min);
    let mut scale = 1.0 / iscale;
    assign(iscale, min, levels);
    let mut best_error = error(scale, min, levels);
    if p.nstep < 1 {
        return (scale, -min);
    }
    let mut aux = [0u8; 32];
    let aux = &mut aux[..n];
    for is in 0..=p.nstep {
        let iscale = (p.rmin + p.rdelta * is as f32 + nmax) / (max - min);
        assign(iscale, min, aux);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let (w, l) = (weights[i], aux[i] as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur_error = error(this_scale, this_min, aux);
            if cur_error < best_error {
                levels.copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

#[cfg(test)]
mod tests {
    use super::nearest_int;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-0.4), 0);
        assert_eq!(nearest_int(7.6), 8);
    }
}
