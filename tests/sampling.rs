//! The sampler chain stage by stage against hand-computed expectations, its
//! determinism and its distribution (chi-square over 100k draws), then the
//! C API (`fnx_sampler_*`) including misuse.

mod util;

use flashnext::capi::*;
use flashnext::sampling::*;
use std::ffi::CString;
use std::ptr::{null, null_mut};
use util::*;

fn params(f: impl FnOnce(&mut SamplerParams)) -> SamplerParams {
    let mut p = SamplerParams {
        seed: 42,
        ..Default::default()
    };
    f(&mut p);
    p
}

fn ids(s: &Sampler, logits: &[f32]) -> Vec<u32> {
    s.candidates(logits).unwrap().iter().map(|c| c.id).collect()
}

fn ln(p: &[f64]) -> Vec<f32> {
    p.iter().map(|x| x.ln() as f32).collect()
}

// ---------------------------------------------------------------------------
// Stages

#[test]
fn top_k_keeps_exactly_k_breaking_ties_by_lower_id() {
    let logits = [1.0, 3.0, 3.0, 2.0, 3.0, 0.0];
    let s = Sampler::new(params(|p| p.top_k = 2)).unwrap();
    assert_eq!(ids(&s, &logits), [1, 2]);
    let s = Sampler::new(params(|p| p.top_k = 4)).unwrap();
    assert_eq!(ids(&s, &logits), [1, 2, 4, 3]);
    // k >= n or 0 keeps all.
    for k in [0, 6, 100] {
        let s = Sampler::new(params(|p| p.top_k = k)).unwrap();
        let mut got = ids(&s, &logits);
        got.sort();
        assert_eq!(got, [0, 1, 2, 3, 4, 5], "k = {k}");
    }
}

#[test]
fn top_p_keeps_the_minimal_nucleus() {
    // Probabilities 0.05, 0.5, 0.1, 0.2, 0.15 (shuffled ids).
    let logits = ln(&[0.05, 0.5, 0.1, 0.2, 0.15]);
    let nucleus = |p: f32| {
        let s = Sampler::new(params(|x| x.top_p = p)).unwrap();
        ids(&s, &logits)
    };
    assert_eq!(nucleus(0.45), [1]); // 0.5 alone reaches 0.45
    assert_eq!(nucleus(0.6), [1, 3]); // 0.7
    assert_eq!(nucleus(0.8), [1, 3, 4]); // 0.85: 0.7 is not enough
    assert_eq!(nucleus(0.9), [1, 3, 4, 2]); // 0.95
    assert_eq!(nucleus(0.97), [1, 3, 4, 2, 0]);
    assert_eq!(nucleus(1.0).len(), 5);
    // Temperature 2 flattens to p^(1/2): 0.224, 0.707, 0.316, 0.447, 0.387
    // (sum 2.081): normalised 0.107, 0.340, 0.152, 0.215, 0.186.
    let s = Sampler::new(params(|x| {
        x.top_p = 0.6;
        x.temperature = 2.0
    }))
    .unwrap();
    assert_eq!(ids(&s, &logits), [1, 3, 4]); // 0.340 + 0.215 = 0.555 < 0.6 <= 0.741
}

#[test]
fn top_p_is_computed_over_the_top_k_survivors() {
    // After top-k 2: 0.5 and 0.2 renormalise to 0.714 and 0.286.
    let logits = ln(&[0.05, 0.5, 0.1, 0.2, 0.15]);
    let s = Sampler::new(params(|x| {
        x.top_k = 2;
        x.top_p = 0.7
    }))
    .unwrap();
    assert_eq!(ids(&s, &logits), [1]);
    let s = Sampler::new(params(|x| {
        x.top_k = 2;
        x.top_p = 0.75
    }))
    .unwrap();
    assert_eq!(ids(&s, &logits), [1, 3]);
}

#[test]
fn min_p_threshold_is_relative_to_the_most_likely() {
    let logits = ln(&[0.05, 0.5, 0.1, 0.2, 0.15]);
    let keep = |m: f32, t: f32| {
        let s = Sampler::new(params(|x| {
            x.min_p = m;
            x.temperature = t
        }))
        .unwrap();
        let mut v = ids(&s, &logits);
        v.sort();
        v
    };
    assert_eq!(keep(0.25, 1.0), [1, 3, 4]); // threshold 0.125
    assert_eq!(keep(0.35, 1.0), [1, 3]); // 0.175
    assert_eq!(keep(0.09, 1.0), [0, 1, 2, 3, 4]); // 0.045
    assert_eq!(keep(1.0, 1.0), [1]);
    // Temperature 2: ratios become sqrt(p / 0.5): 0.316, 1, 0.447, 0.632, 0.548.
    assert_eq!(keep(0.5, 2.0), [1, 3, 4]);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let logits = [2.0, -1.0, 0.5, 3.0, 0.0];
    let mut s = Sampler::new(params(|p| p.repetition_penalty = 2.0)).unwrap();
    for t in [0, 1, 0, 4] {
        s.accept(t);
    }
    // Token 0 twice is penalised once; 0 stays 0; unseen tokens untouched.
    assert_eq!(s.penalized(&logits), [1.0, -2.0, 0.5, 3.0, 0.0]);

    // Only the last `penalty_last_n` accepted tokens count.
    let mut s = Sampler::new(params(|p| {
        p.repetition_penalty = 2.0;
        p.penalty_last_n = 2
    }))
    .unwrap();
    for t in [1, 0, 3] {
        s.accept(t);
    }
    assert_eq!(s.penalized(&logits), [1.0, -1.0, 0.5, 1.5, 0.0]);
    // 0 turns the penalty off; usize::MAX covers everything since the reset.
    let mut s = Sampler::new(params(|p| {
        p.repetition_penalty = 2.0;
        p.penalty_last_n = 0
    }))
    .unwrap();
    s.accept(0);
    assert_eq!(s.penalized(&logits), logits);
    let mut s = Sampler::new(params(|p| {
        p.repetition_penalty = 2.0;
        p.penalty_last_n = usize::MAX
    }))
    .unwrap();
    for t in [3].into_iter().chain(std::iter::repeat_n(4, 1000)) {
        s.accept(t);
    }
    assert_eq!(s.penalized(&logits), [2.0, -1.0, 0.5, 1.5, 0.0]);
    // A penalty below 1 rewards repetition.
    let mut s = Sampler::new(params(|p| p.repetition_penalty = 0.5)).unwrap();
    s.accept(0);
    s.accept(1);
    assert_eq!(s.penalized(&logits), [4.0, -0.5, 0.5, 3.0, 0.0]);
    // Ids outside the logits are ignored (logits from another source).
    s.accept(1_000_000);
    assert_eq!(s.penalized(&logits).len(), 5);
}

#[test]
fn presence_and_frequency_penalties_follow_openai() {
    let logits = [2.0, -1.0, 0.5, 3.0];
    let mut s = Sampler::new(params(|p| {
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.25
    }))
    .unwrap();
    for t in [0, 0, 1, 0] {
        s.accept(t);
    }
    // logit -= count * 0.25 + 0.5
    assert_eq!(s.penalized(&logits), [2.0 - 1.25, -1.0 - 0.75, 0.5, 3.0]);
    // The counts cover every accepted token, not only `penalty_last_n`.
    let mut s = Sampler::new(params(|p| {
        p.frequency_penalty = 1.0;
        p.penalty_last_n = 1
    }))
    .unwrap();
    for t in [2, 2, 2, 3] {
        s.accept(t);
    }
    assert_eq!(s.penalized(&logits), [2.0, -1.0, -2.5, 2.0]);
    // Reset forgets them.
    s.reset();
    assert_eq!(s.penalized(&logits), logits);
}

#[test]
fn repetition_penalty_applies_before_presence() {
    // (2 / 2) - 1 = 0, not (2 - 1) / 2 = 0.5.
    let mut s = Sampler::new(params(|p| {
        p.repetition_penalty = 2.0;
        p.presence_penalty = 1.0
    }))
    .unwrap();
    s.accept(0);
    assert_eq!(s.penalized(&[2.0, 1.0])[0], 0.0);
}

#[test]
fn greedy_is_the_argmax_of_the_penalised_logits() {
    let mut rng = Rng::new(9);
    let mut s = Sampler::new(SamplerParams::greedy()).unwrap();
    for _ in 0..200 {
        let logits: Vec<f32> = (0..257)
            .map(|_| (rng.next_f64() * 20.0 - 10.0) as f32)
            .collect();
        let best = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        assert_eq!(s.sample(&logits).unwrap(), best);
        assert_eq!(argmax(&logits), Some(best));
    }
    // Ties: the lowest id.
    assert_eq!(s.sample(&[1.0, 5.0, 5.0]).unwrap(), 1);
    // Penalties apply first.
    let mut s = Sampler::new(SamplerParams {
        presence_penalty: 3.0,
        ..SamplerParams::greedy()
    })
    .unwrap();
    s.accept(1);
    assert_eq!(s.sample(&[1.0, 3.0, 2.0]).unwrap(), 2);
    assert_eq!(s.distribution(&[1.0, 3.0, 2.0]).unwrap(), [(2, 1.0)]);
}

#[test]
fn presets_have_the_documented_values() {
    let t = SamplerParams::preset("thinking").unwrap();
    assert_eq!(
        (t.temperature, t.top_p, t.top_k, t.min_p),
        (1.0, 0.95, 20, 0.0)
    );
    assert_eq!((t.presence_penalty, t.repetition_penalty), (0.0, 1.0));
    let i = SamplerParams::preset("instruct").unwrap();
    assert_eq!(
        (i.temperature, i.top_p, i.top_k, i.min_p, i.presence_penalty),
        (0.7, 0.8, 20, 0.0, 1.5)
    );
    assert_eq!(SamplerParams::preset("greedy").unwrap().temperature, 0.0);
    assert!(SamplerParams::preset("Thinking").is_none());
    for name in PRESETS {
        Sampler::new(SamplerParams::preset(name).unwrap()).unwrap();
    }
}

#[test]
fn bad_settings_and_logits_are_refused() {
    let bad = [
        params(|p| p.temperature = -1.0),
        params(|p| p.temperature = f32::NAN),
        params(|p| p.temperature = f32::INFINITY),
        params(|p| p.top_p = 0.0),
        params(|p| p.top_p = 1.5),
        params(|p| p.min_p = -0.1),
        params(|p| p.min_p = 2.0),
        params(|p| p.repetition_penalty = 0.0),
        params(|p| p.presence_penalty = f32::NAN),
        params(|p| p.frequency_penalty = f32::INFINITY),
    ];
    for p in bad {
        let e = Sampler::new(p.clone()).unwrap_err().to_string();
        assert!(e.starts_with("sampler "), "{p:?}: {e}");
    }
    let mut s = Sampler::new(params(|_| {})).unwrap();
    assert!(s.sample(&[]).unwrap_err().to_string().contains("no logits"));
    assert!(s
        .sample(&[0.0, f32::NAN])
        .unwrap_err()
        .to_string()
        .contains("logit 1"));
    assert!(s.sample(&[f32::INFINITY, 0.0]).is_err());
    assert!(s
        .sample(&[f32::NEG_INFINITY; 3])
        .unwrap_err()
        .to_string()
        .contains("-inf"));
}

#[test]
fn banned_tokens_are_never_drawn() {
    let mut s = Sampler::new(params(|_| {})).unwrap();
    let logits = [0.0, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
    for _ in 0..2000 {
        let t = s.sample(&logits).unwrap();
        assert!(t == 0 || t == 2);
    }
    assert_eq!(
        Sampler::new(SamplerParams::greedy())
            .unwrap()
            .sample(&[f32::NEG_INFINITY, -5.0])
            .unwrap(),
        1
    );
}

// ---------------------------------------------------------------------------
// Determinism and distribution

fn draws(seed: u64, n: usize, logits: &[f32]) -> Vec<u32> {
    let mut s = Sampler::new(SamplerParams {
        seed,
        ..SamplerParams::thinking()
    })
    .unwrap();
    (0..n).map(|_| s.sample(logits).unwrap()).collect()
}

#[test]
fn same_seed_same_sequence_different_seeds_differ() {
    let logits: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32) / 16.0).collect();
    let a = draws(7, 500, &logits);
    assert_eq!(a, draws(7, 500, &logits));
    assert_ne!(a, draws(8, 500, &logits));
    assert_ne!(a, draws(0, 500, &logits));
    // Reset restarts the stream; a clone continues it identically.
    let mut s = Sampler::new(SamplerParams {
        seed: 7,
        ..SamplerParams::thinking()
    })
    .unwrap();
    let first: Vec<u32> = (0..100).map(|_| s.sample(&logits).unwrap()).collect();
    let mut c = s.clone();
    assert_eq!(s.sample(&logits).unwrap(), c.sample(&logits).unwrap());
    s.reset();
    let again: Vec<u32> = (0..100).map(|_| s.sample(&logits).unwrap()).collect();
    assert_eq!(first, again);
    assert_eq!(first, a[..100]);
    // A random seed is drawn once and reported; reset reuses it.
    let mut r = Sampler::new(SamplerParams {
        seed: RANDOM_SEED,
        ..SamplerParams::thinking()
    })
    .unwrap();
    assert_ne!(r.seed(), RANDOM_SEED);
    let x: Vec<u32> = (0..50).map(|_| r.sample(&logits).unwrap()).collect();
    r.reset();
    let y: Vec<u32> = (0..50).map(|_| r.sample(&logits).unwrap()).collect();
    assert_eq!(x, y);
    assert_eq!(x, draws(r.seed(), 50, &logits));
}

/// Chi-square statistic of `counts` against `probs` (expected = n * p).
fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            let e = n as f64 * p;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn draws_follow_the_softmax() {
    const N: usize = 100_000;
    let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7];
    let t = 0.8f32 as f64;
    // The softmax computed here, independently of the sampler.
    let w: Vec<f64> = logits.iter().map(|&l| (l as f64 / t).exp()).collect();
    let z: f64 = w.iter().sum();
    let probs: Vec<f64> = w.iter().map(|x| x / z).collect();
    let mut s = Sampler::new(SamplerParams {
        seed: 1234,
        temperature: 0.8,
        ..Default::default()
    })
    .unwrap();
    let mut counts = [0u64; 8];
    for _ in 0..N {
        counts[s.sample(&logits).unwrap() as usize] += 1;
    }
    let chi = chi_square(&counts, &probs);
    // 7 degrees of freedom: P(chi2 > 24.32) = 0.001.
    assert!(
        chi < 24.32,
        "chi-square {chi} for counts {counts:?} vs {probs:?}"
    );
    // The sampler's own distribution agrees with the formula.
    let mut d = s.distribution(&logits).unwrap();
    d.sort_by_key(|x| x.0);
    for ((_, p), q) in d.iter().zip(&probs) {
        assert!((p - q).abs() < 1e-12);
    }
}

#[test]
fn truncated_draws_follow_the_renormalised_survivors() {
    const N: usize = 100_000;
    // top-k 5 leaves ids 3, 5, 0, 7, 1; min-p 0.2 then drops those below
    // 0.2 x the best at temperature 1.
    let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7];
    let mut s = Sampler::new(SamplerParams {
        seed: 99,
        top_k: 5,
        min_p: 0.2,
        ..Default::default()
    })
    .unwrap();
    let survivors: Vec<usize> = vec![3, 5, 0, 7]; // exp(0.2 - 2) = 0.165 < 0.2 drops id 1
    let w: Vec<f64> = survivors
        .iter()
        .map(|&i| (logits[i] as f64).exp())
        .collect();
    let z: f64 = w.iter().sum();
    let probs: Vec<f64> = w.iter().map(|x| x / z).collect();
    let mut counts = vec![0u64; 4];
    for _ in 0..N {
        let t = s.sample(&logits).unwrap() as usize;
        let k = survivors
            .iter()
            .position(|&x| x == t)
            .unwrap_or_else(|| panic!("token {t} should not survive"));
        counts[k] += 1;
    }
    let chi = chi_square(&counts, &probs);
    // 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
    assert!(
        chi < 16.27,
        "chi-square {chi} for counts {counts:?} vs {probs:?}"
    );
}

// ---------------------------------------------------------------------------
// C API

fn c_sampler(p: &fnx_sampler_params) -> *mut fnx_sampler {
    let mut s = null_mut();
    // SAFETY: valid params and out pointer.
    assert_eq!(
        unsafe { fnx_sampler_new(p, &mut s) },
        FNX_OK,
        "{}",
        last_error()
    );
    s
}

fn c_sample(s: *mut fnx_sampler, logits: &[f32]) -> i32 {
    let mut t = -7;
    // SAFETY: live sampler, valid buffer.
    assert_eq!(
        unsafe { fnx_sampler_sample(s, logits.as_ptr(), logits.len(), &mut t) },
        FNX_OK,
        "{}",
        last_error()
    );
    t
}

#[test]
fn c_params_defaults_and_presets() {
    let d = fnx_sampler_params_default();
    assert_eq!(
        d.struct_size as usize,
        std::mem::size_of::<fnx_sampler_params>()
    );
    assert_eq!(
        (d.temperature, d.top_k, d.top_p, d.min_p),
        (1.0, 0, 1.0, 0.0)
    );
    assert_eq!(
        (
            d.repetition_penalty,
            d.penalty_last_n,
            d.presence_penalty,
            d.frequency_penalty
        ),
        (1.0, 64, 0.0, 0.0)
    );
    assert_eq!(d.seed, FNX_SEED_RANDOM);
    let mut p = fnx_sampler_params_default();
    unsafe {
        let name = CString::new("instruct").unwrap();
        assert_eq!(fnx_sampler_params_preset(name.as_ptr(), &mut p), FNX_OK);
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty),
            (0.7, 0.8, 20, 0.0, 1.5)
        );
        assert_eq!(
            p.struct_size as usize,
            std::mem::size_of::<fnx_sampler_params>()
        );
        let name = CString::new("thinking").unwrap();
        assert_eq!(fnx_sampler_params_preset(name.as_ptr(), &mut p), FNX_OK);
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty),
            (1.0, 0.95, 20, 0.0, 0.0)
        );
        let name = CString::new("greedy").unwrap();
        assert_eq!(fnx_sampler_params_preset(name.as_ptr(), &mut p), FNX_OK);
        assert_eq!(p.temperature, 0.0);

        let before = p;
        let name = CString::new("creative").unwrap();
        assert_eq!(
            fnx_sampler_params_preset(name.as_ptr(), &mut p),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("\"creative\"") && last_error().contains("thinking"),
            "{}",
            last_error()
        );
        assert_eq!(
            format!("{p:?}"),
            format!("{before:?}"),
            "out written on failure"
        );
        assert_eq!(
            fnx_sampler_params_preset(null(), &mut p),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_sampler_params_preset(name.as_ptr(), null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
    }
}

#[test]
fn c_sampler_new_checks_its_params() {
    let mut out = std::ptr::dangling_mut::<fnx_sampler>();
    unsafe {
        assert_eq!(fnx_sampler_new(null(), null_mut()), FNX_ERR_NULL_ARGUMENT);
        type Edit = Box<dyn Fn(&mut fnx_sampler_params)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|p| p.struct_size = 8), "struct_size"),
            (Box::new(|p| p.struct_size = 0), "struct_size"),
            (Box::new(|p| p.top_k = -1), "top_k"),
            (Box::new(|p| p.penalty_last_n = -2), "penalty_last_n"),
            (Box::new(|p| p.temperature = f32::NAN), "temperature"),
            (Box::new(|p| p.temperature = -0.5), "temperature"),
            (Box::new(|p| p.top_p = 0.0), "top_p"),
            (Box::new(|p| p.min_p = 1.5), "min_p"),
            (
                Box::new(|p| p.repetition_penalty = -1.0),
                "repetition_penalty",
            ),
            (
                Box::new(|p| p.presence_penalty = f32::INFINITY),
                "presence_penalty",
            ),
        ];
        for (f, field) in cases {
            let mut p = fnx_sampler_params_default();
            f(&mut p);
            assert_eq!(
                fnx_sampler_new(&p, &mut out),
                FNX_ERR_INVALID_ARGUMENT,
                "{field}"
            );
            assert!(last_error().contains(field), "{field}: {}", last_error());
            assert_eq!(out, std::ptr::dangling_mut::<fnx_sampler>(), "out written on failure");
        }
        // NULL params: the defaults.
        assert_eq!(fnx_sampler_new(null(), &mut out), FNX_OK);
        assert_eq!(c_sample(out, &[0.0, 1.0]) as u32 & !1, 0);
        fnx_sampler_free(out);
        // -1 for penalty_last_n is accepted (whole history).
        let mut p = fnx_sampler_params_default();
        p.penalty_last_n = -1;
        fnx_sampler_free(c_sampler(&p));
    }
}

#[test]
fn c_sample_accept_reset_and_misuse() {
    let mut p = fnx_sampler_params_default();
    p.seed = 5;
    p.top_k = 20;
    let s = c_sampler(&p);
    let logits: Vec<f32> = (0..100).map(|i| ((i * 7919) % 100) as f32 / 20.0).collect();
    let mut t = -7;
    unsafe {
        assert_eq!(
            fnx_sampler_sample(null_mut(), logits.as_ptr(), 100, &mut t),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_sampler_sample(s, null(), 100, &mut t),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_sampler_sample(s, logits.as_ptr(), 100, null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_sampler_sample(s, logits.as_ptr(), 0, &mut t),
            FNX_ERR_INVALID_ARGUMENT
        );
        let nan = [0.0, f32::NAN];
        assert_eq!(
            fnx_sampler_sample(s, nan.as_ptr(), 2, &mut t),
            FNX_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("NaN"), "{}", last_error());
        assert_eq!(t, -7, "out_token written on failure");
        assert_eq!(fnx_sampler_accept(null_mut(), 1), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_sampler_accept(s, -1), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert_eq!(fnx_sampler_reset(null_mut()), FNX_ERR_NULL_ARGUMENT);
        fnx_sampler_free(null_mut());
    }
    // Deterministic: the same seed gives the same sequence, reset replays it.
    let a: Vec<i32> = (0..50).map(|_| c_sample(s, &logits)).collect();
    let s2 = c_sampler(&p);
    let b: Vec<i32> = (0..50).map(|_| c_sample(s2, &logits)).collect();
    assert_eq!(a, b);
    assert_eq!(unsafe { fnx_sampler_reset(s) }, FNX_OK);
    let c: Vec<i32> = (0..50).map(|_| c_sample(s, &logits)).collect();
    assert_eq!(a, c);
    assert!(a.iter().all(|&t| (0..100).contains(&t)));
    // The C sampler is the Rust one.
    assert_eq!(a, draws_with(5, 20, 50, &logits));
    // Accepted tokens feed the penalties: a huge presence penalty bans repeats.
    p.presence_penalty = 1e9;
    let g = c_sampler(&p);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..20 {
        let t = c_sample(g, &logits);
        assert!(
            seen.insert(t),
            "token {t} repeated despite the presence penalty"
        );
        assert_eq!(unsafe { fnx_sampler_accept(g, t) }, FNX_OK);
    }
    unsafe {
        fnx_sampler_free(g);
        fnx_sampler_free(s);
        fnx_sampler_free(s2);
    }
}

fn draws_with(seed: u64, top_k: usize, n: usize, logits: &[f32]) -> Vec<i32> {
    let mut s = Sampler::new(SamplerParams {
        seed,
        top_k,
        ..Default::default()
    })
    .unwrap();
    (0..n).map(|_| s.sample(logits).unwrap() as i32).collect()
}

#[test]
fn c_sampler_refuses_other_handles() {
    let m = load(fixture_gguf(), None).unwrap();
    let st = new_state(m);
    let logits = [0.0f32, 1.0];
    let mut t = -7;
    unsafe {
        for wrong in [m.cast::<fnx_sampler>(), st.cast::<fnx_sampler>()] {
            assert_eq!(
                fnx_sampler_sample(wrong, logits.as_ptr(), 2, &mut t),
                FNX_ERR_INVALID_HANDLE
            );
            assert!(last_error().contains("fnx_sampler"), "{}", last_error());
            assert_eq!(fnx_sampler_accept(wrong, 1), FNX_ERR_INVALID_HANDLE);
            assert_eq!(fnx_sampler_reset(wrong), FNX_ERR_INVALID_HANDLE);
            fnx_sampler_free(wrong); // refused by its tag, nothing freed
        }
        // Both handles are still alive and usable.
        assert_eq!(fnx_decode_token(st, 1), FNX_OK);
        fnx_free_state(st);
        fnx_free_model(m);
    }
}

#[test]
fn c_greedy_on_model_logits_is_the_argmax() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let st = new_state(m);
    let mut p = fnx_sampler_params_default();
    let name = CString::new("greedy").unwrap();
    assert_eq!(
        unsafe { fnx_sampler_params_preset(name.as_ptr(), &mut p) },
        FNX_OK
    );
    let g = c_sampler(&p);
    let mut tok = 3;
    for _ in 0..10 {
        assert_eq!(unsafe { fnx_decode_token(st, tok) }, FNX_OK);
        let l = logits(st, vocab);
        tok = c_sample(g, &l);
        assert_eq!(tok as u32, argmax(&l).unwrap());
    }
    unsafe {
        fnx_sampler_free(g);
        fnx_free_state(st);
        fnx_free_model(m);
    }
}
