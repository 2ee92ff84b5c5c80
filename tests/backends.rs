//! One test body, every backend: each test below runs on the CPU and on
//! Vulkan (lavapipe in CI, under the validation layer), through the same
//! public API, with the same bounds. [`every_backend!`] writes one `#[test]`
//! per backend from each body (`cpu::name`, `vulkan::name`).
//!
//! - `golden_f32`: every reference fixture converted to F32 and decoded
//!   token by token, against transformers' logits at every position before a
//!   flagged QSA tie: ≤ 1e-4 of the reference's largest logit.
//! - batches, rewinds, checkpoints, copies and snapshots: each compared with
//!   plain token-by-token decoding on the same backend, bit for bit (they run
//!   the same kernels on the same inputs).
//!
//! Without a Vulkan device the `vulkan::` tests print why and pass, unless
//! `FNX_REQUIRE_VULKAN=1` (scripts/test.sh sets it).

mod golden;
mod vulkan_util;

use flashnext::convert::OutType;
use flashnext::model::LogitsFor;
use flashnext::{Backend, Error, LoadOptions, Model, State};
use golden::Manifest;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vulkan_util::{converted, fixture_dir};

/// The backends a test body runs on.
#[derive(Clone, Copy, Debug)]
enum On {
    Cpu,
    Vulkan,
}

impl On {
    /// `path` loaded for this backend with `opts`, or `None` (a skip) when
    /// Vulkan is absent and not required.
    fn load(self, path: &Path, opts: LoadOptions) -> Option<Arc<Model>> {
        match self {
            On::Cpu => Some(Model::load(path, &LoadOptions { backend: Backend::Cpu, ..opts }).unwrap()),
            On::Vulkan => vulkan_util::load_gpu_with(path, opts),
        }
    }
}

/// `every_backend! { fn name(on) { body } ... }`: a `cpu::name` and a
/// `vulkan::name` test running `body` with `on` the backend.
macro_rules! every_backend {
    ($(fn $name:ident($on:ident) $body:block)*) => {
        $(fn $name($on: On) $body)*
        mod cpu {
            $(#[test] fn $name() { super::$name(super::On::Cpu) })*
        }
        mod vulkan {
            $(#[test] fn $name() { super::$name(super::On::Vulkan) })*
        }
    };
}

fn fixtures() -> Vec<PathBuf> {
    ["tiny_flat", "tiny_native", "tiny_nested", "trained_kjv"].iter().map(|f| fixture_dir(f)).collect()
}

fn logits(s: &State) -> Vec<u32> {
    s.logits().expect("a token was decoded").iter().map(|v| v.to_bits()).collect()
}

/// Tokens `0..n` of a fixture's vocabulary, varied.
fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 11 + 5) % 300).collect()
}

/// Decodes `toks` one at a time; the logits after each.
fn one_by_one(s: &mut State, toks: &[u32]) -> Vec<Vec<u32>> {
    toks.iter().map(|&t| {
        s.decode(t).unwrap();
        logits(s)
    }).collect()
}

/// The tiny_native fixture in F32, loaded for `on` with a rewind window of 3.
fn native(on: On) -> Option<Arc<Model>> {
    let path = converted("tiny_native", OutType::F32);
    on.load(&path, LoadOptions { rewind_window: 3, ..Default::default() })
}

every_backend! {
    fn golden_f32(on) {
        for fixture in fixtures() {
            let name = fixture.file_name().unwrap().to_string_lossy().into_owned();
            let manifest = Manifest::read(&fixture);
            let path = converted(&name, OutType::F32);
            let Some(model) = on.load(&path, LoadOptions::default()) else { return };
            let vocab = model.vocab_size();
            assert_eq!(manifest.vocab_size, vocab);
            let (mut worst, mut n) = (0f32, 0);
            for seq in &manifest.sequences {
                let want_all = seq.logits(&fixture);
                let mut s = State::new(model.clone()).unwrap();
                for (pos, &t) in seq.tokens.iter().enumerate().take(seq.first_tie()) {
                    s.decode(t).unwrap();
                    let want = &want_all[pos * vocab..(pos + 1) * vocab];
                    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let got = s.logits().unwrap();
                    let err = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                    assert!(err <= 1e-4, "{on:?} {name} {} position {pos}: rel err {err:.3e}", seq.name);
                    worst = worst.max(err);
                    n += 1;
                }
            }
            println!("{on:?} {name}: worst rel err {worst:.3e} over {n} positions");
            assert!(n > 0);
        }
    }

    fn batches_match_token_by_token(on) {
        let Some(model) = native(on) else { return };
        let toks = tokens(23, 1);
        let mut a = State::new(model.clone()).unwrap();
        let want = one_by_one(&mut a, &toks);
        let mut b = State::new(model.clone()).unwrap();
        let mut got = Vec::new();
        // Batches of 1, 7 and the rest, with every position's logits.
        for chunk in [&toks[..1], &toks[1..8], &toks[8..]] {
            let all = b.decode_batch(chunk, LogitsFor::All).unwrap();
            got.extend(all.chunks_exact(model.vocab_size()).map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
        }
        assert_eq!(got, want);
        assert_eq!(logits(&b), logits(&a));
        // The last position only: nothing returned, the last token's logits kept.
        let mut c = State::new(model.clone()).unwrap();
        assert!(c.decode_batch(&toks, LogitsFor::Last).unwrap().is_empty());
        assert_eq!(logits(&c), want[toks.len() - 1]);
        // Every position of the last batch stays readable (a rewind may return to them).
        let mut d = State::new(model.clone()).unwrap();
        d.decode_batch(&toks, LogitsFor::All).unwrap();
        for (p, w) in want.iter().enumerate() {
            assert_eq!(d.logits_at(p + 1).map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()).as_ref(), Some(w));
        }
    }

    fn rewinds_return_exactly(on) {
        let Some(model) = native(on) else { return };
        let (w, toks, other) = (model.rewind_window, tokens(20, 2), tokens(6, 9));
        let mut reference = State::new(model.clone()).unwrap();
        let want = one_by_one(&mut reference, &toks);
        let mut s = State::new(model.clone()).unwrap();
        one_by_one(&mut s, &toks[..12]);
        for k in 0..=w {
            // Back k positions, then down another path, then back and on the first path again.
            s.rewind(12 - k).unwrap();
            assert_eq!(s.position(), 12 - k);
            if k > 0 {
                assert_eq!(logits(&s), want[11 - k], "{on:?}: logits after rewinding {k}");
            }
            one_by_one(&mut s, &other[..k]);
            s.rewind(12 - k).unwrap();
            assert_eq!(one_by_one(&mut s, &toks[12 - k..12]), want[12 - k..12].to_vec(), "{on:?}: rewound {k}");
        }
        // A batch's positions are all reachable again.
        s.decode_batch(&toks[12..15], LogitsFor::Last).unwrap();
        assert_eq!(s.rewind_floor(), 15 - w);
        s.rewind(13).unwrap();
        assert_eq!(one_by_one(&mut s, &toks[13..20]), want[13..20].to_vec());
        // A batch longer than the window leaves the states of its last positions.
        let mut b = State::new(model.clone()).unwrap();
        b.decode_batch(&toks[..12], LogitsFor::Last).unwrap();
        b.rewind(12 - w).unwrap();
        assert_eq!(one_by_one(&mut b, &toks[12 - w..14]), want[12 - w..14].to_vec(), "{on:?}: rewound into a longer batch");
        // Beyond the window: refused, nothing changed.
        let floor = s.rewind_floor();
        assert_eq!(floor, 20 - w);
        assert!(matches!(s.rewind(floor - 1), Err(Error::InvalidArgument(_))));
        assert!(matches!(s.rewind(21), Err(Error::InvalidArgument(_))));
        assert_eq!((s.position(), logits(&s)), (20, want[19].clone()));
    }

    fn failed_and_aborted_calls_leave_the_state(on) {
        // Micro-batches of 2: the abort callback is polled before each.
        let path = converted("tiny_native", OutType::F32);
        let Some(model) = on.load(&path, LoadOptions { rewind_window: 3, micro_batch: 2, ..Default::default() }) else { return };
        let toks = tokens(30, 3);
        let mut s = State::new(model.clone()).unwrap();
        one_by_one(&mut s, &toks[..5]);
        let snap = s.save().unwrap();
        // An abort after more tokens than the window (three passes, six tokens): undone by a checkpoint.
        let mut n = 0;
        let r = flashnext::generate::decode_tokens(&mut s, &toks[5..20], &mut || { n += 1; n > 3 });
        assert!(matches!(r, Err(Error::Aborted)));
        assert_eq!(n, 4);
        assert_eq!(s.save().unwrap(), snap);
        // Within the window (one pass of two tokens): undone by a rewind.
        let mut n = 0;
        let r = flashnext::generate::decode_tokens(&mut s, &toks[5..8], &mut || { n += 1; n > 1 });
        assert!(matches!(r, Err(Error::Aborted)));
        assert_eq!(s.save().unwrap(), snap);
        // A bad token anywhere: refused before anything runs.
        assert!(matches!(s.decode_batch(&[1, 2, 1_000_000], LogitsFor::Last), Err(Error::TokenOutOfRange(_))));
        assert_eq!(s.save().unwrap(), snap);
        let mut reference = State::new(model.clone()).unwrap();
        let want = one_by_one(&mut reference, &toks);
        assert_eq!(one_by_one(&mut s, &toks[5..]), want[5..].to_vec());
    }

    fn copies_and_snapshots_continue_exactly(on) {
        let Some(model) = native(on) else { return };
        let toks = tokens(18, 4);
        let mut reference = State::new(model.clone()).unwrap();
        let want = one_by_one(&mut reference, &toks);
        let mut s = State::new(model.clone()).unwrap();
        one_by_one(&mut s, &toks[..9]);
        let mut copy = s.try_clone().unwrap();
        let mut restored = State::new(model.clone()).unwrap();
        restored.restore(&s.save().unwrap()).unwrap();
        assert_eq!(one_by_one(&mut s, &toks[9..]), want[9..].to_vec());
        assert_eq!(one_by_one(&mut copy, &toks[9..]), want[9..].to_vec());
        assert_eq!(one_by_one(&mut restored, &toks[9..]), want[9..].to_vec());
        // A restored state starts its rewind window at the snapshot.
        assert_eq!(restored.rewind_floor(), 18 - model.rewind_window);
        // Rewound into a batch that computed only its last logits: a position
        // without logits, which a snapshot carries as such.
        let mut t = State::new(model.clone()).unwrap();
        one_by_one(&mut t, &toks[..9]);
        t.decode_batch(&toks[9..14], LogitsFor::Last).unwrap();
        t.rewind(12).unwrap();
        assert_eq!(t.logits(), None);
        let mut again = State::new(model.clone()).unwrap();
        again.restore(&t.save().unwrap()).unwrap();
        assert_eq!((again.position(), again.logits()), (12, None));
        assert_eq!(one_by_one(&mut again, &toks[12..]), want[12..].to_vec());
    }

    fn reset_forgets_everything(on) {
        let Some(model) = native(on) else { return };
        let toks = tokens(10, 5);
        let mut s = State::new(model.clone()).unwrap();
        let want = one_by_one(&mut s, &toks);
        s.reset().unwrap();
        assert_eq!((s.position(), s.logits(), s.rewind_floor()), (0, None, 0));
        assert_eq!(one_by_one(&mut s, &toks), want);
    }
}

/// The expert cache: with 0, 1 and 2 slots per layer (most experts then run
/// on the host, some are admitted: filled in the background with 0 and 1
/// slots, uploaded on the critical path with 2), every golden position
/// still matches transformers within the GPU's bound, also across
/// snapshots, copies, rewinds and resets; the cache's contents never change
/// a result.
#[test]
fn vulkan_expert_cache_matches_transformers() {
    for (slots, fill) in [(0, true), (1, true), (2, false)] {
        for fixture in fixtures() {
            let name = fixture.file_name().unwrap().to_string_lossy().into_owned();
            let manifest = Manifest::read(&fixture);
            let path = converted(&name, OutType::F32);
            // Admission at the second miss: the speeds measured at load (noise
            // at these sizes) would decide whether this run uploads at all.
            let opts = LoadOptions { expert_cache_slots: Some(slots), expert_admission: Some(2.0), expert_fill: Some(fill), ..Default::default() };
            let Some(model) = On::Vulkan.load(&path, opts) else { return };
            let cache = model.expert_cache().expect("a cache when fewer slots than experts");
            assert_eq!(cache.slots_per_layer, slots);
            assert!(model.backend_note().contains(&format!("expert cache of {slots} slots")), "{}", model.backend_note());
            let vocab = model.vocab_size();
            let mut worst = 0f32;
            for seq in &manifest.sequences {
                let want_all = seq.logits(&fixture);
                let n = seq.tokens.len().min(seq.first_tie());
                let check = |s: &State, pos: usize, worst: &mut f32| {
                    let want = &want_all[pos * vocab..(pos + 1) * vocab];
                    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let err = s.logits().unwrap().iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
                    assert!(err <= 1e-4, "{name} {} slots {slots} position {pos}: rel err {err:.3e}", seq.name);
                    *worst = worst.max(err);
                };
                let mut s = State::new(model.clone()).unwrap();
                for pos in 0..n {
                    s.decode(seq.tokens[pos]).unwrap();
                    check(&s, pos, &mut worst);
                    // Half way: a copy and a restored snapshot go on the same way.
                    if pos == n / 2 {
                        let mut copy = s.try_clone().unwrap();
                        let mut restored = State::new(model.clone()).unwrap();
                        restored.restore(&s.save().unwrap()).unwrap();
                        for p in pos + 1..n.min(pos + 4) {
                            copy.decode(seq.tokens[p]).unwrap();
                            restored.decode(seq.tokens[p]).unwrap();
                            check(&copy, p, &mut worst);
                            check(&restored, p, &mut worst);
                        }
                    }
                }
                if n > 3 {
                    s.rewind(n - 2).unwrap();
                    s.decode(seq.tokens[n - 2]).unwrap();
                    check(&s, n - 2, &mut worst);
                }
                s.reset().unwrap();
                s.decode(seq.tokens[0]).unwrap();
                check(&s, 0, &mut worst);
            }
            let c = model.expert_cache().unwrap();
            println!(
                "{name} {slots} slots: worst rel err {worst:.3e}; {} hits, {} misses, {} on the host, {} admitted ({} filled in the background)",
                c.hits, c.misses, c.host_experts, c.uploads, c.fills
            );
            assert!(c.misses > 0 && c.host_experts > 0);
            if slots > 0 {
                assert!(c.uploads > 0 && c.hits > 0, "slots were filled and used");
                assert_eq!(c.fills > 0, fill, "admitted experts filled in the background only when asked");
                assert!(fill || c.uploads > 0, "uploads on the critical path");
            }
        }
    }
}

/// Two states of one cached model decoding on two threads at once give
/// what each gives alone.
#[test]
fn vulkan_expert_cache_two_states_on_two_threads() {
    let path = converted("tiny_native", OutType::F32);
    let Some(model) = On::Vulkan.load(&path, LoadOptions { expert_cache_slots: Some(1), ..Default::default() }) else { return };
    let (a, b) = (tokens(40, 6), tokens(40, 7));
    let alone = |toks: &[u32]| {
        let mut s = State::new(model.clone()).unwrap();
        one_by_one(&mut s, toks)
    };
    let (want_a, want_b) = (alone(&a), alone(&b));
    let (got_a, got_b) = std::thread::scope(|sc| {
        let ta = sc.spawn(|| alone(&a));
        let tb = sc.spawn(|| alone(&b));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    // The cache's contents differ between the runs: results agree to the GPU's rounding.
    let close = |x: &[Vec<u32>], y: &[Vec<u32>]| {
        x.iter().zip(y).all(|(p, q)| {
            let (p, q): (Vec<f32>, Vec<f32>) = (p.iter().map(|b| f32::from_bits(*b)).collect(), q.iter().map(|b| f32::from_bits(*b)).collect());
            let scale = q.iter().fold(0f32, |m, v| m.max(v.abs()));
            p.iter().zip(&q).all(|(a, b)| (a - b).abs() <= 1e-5 * scale)
        })
    };
    assert!(close(&got_a, &want_a) && close(&got_b, &want_b));
}

/// The model's threads spinning through the waits for the GPU (rather than
/// sleeping) change nothing in the results. (Each load measures the host's
/// and the bus's speeds, which by default set when a miss is uploaded: the
/// admission is fixed here so that both loads place experts alike.)
#[test]
fn vulkan_expert_cache_spinning_threads_change_nothing() {
    let path = converted("tiny_native", OutType::F32);
    let toks = tokens(24, 8);
    let run = |spin, prefetch| {
        let opts = LoadOptions {
            expert_cache_slots: Some(1),
            expert_admission: Some(2.0),
            spin_wait: Some(spin),
            expert_prefetch: Some(prefetch),
            n_threads: 2,
            ..Default::default()
        };
        let model = On::Vulkan.load(&path, opts)?;
        let mut s = State::new(model.clone()).unwrap();
        let logits = one_by_one(&mut s, &toks);
        let c = model.expert_cache().unwrap();
        assert!(c.host_experts > 0, "misses ran on the host while the threads waited");
        // Reading ahead predicts each layer after the first (and reads what it misses).
        if prefetch {
            assert!(c.predicted_of > 0 && c.prefetch_bytes > 0, "read ahead: {c:?}");
        }
        Some(logits)
    };
    let Some(sleeping) = run(false, false) else { return };
    for spinning in [run(true, false).unwrap(), run(true, true).unwrap()] {
    for (pos, (p, q)) in spinning.iter().zip(&sleeping).enumerate() {
        let (p, q): (Vec<f32>, Vec<f32>) = (p.iter().map(|b| f32::from_bits(*b)).collect(), q.iter().map(|b| f32::from_bits(*b)).collect());
        let scale = q.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = p.iter().zip(&q).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(err <= 1e-5, "position {pos}: rel err {err:.3e}");
    }
    }
}

/// A routing profile saved from one session fills the next load's cache:
/// its first token already hits, and the logits are those of a cold cache.
#[test]
fn vulkan_routing_profile_warms_the_cache() {
    let path = converted("tiny_native", OutType::F32);
    // Admission fixed: by default it comes from the host and upload speeds
    // measured at each load, so two loads on a busy machine could place the
    // same misses differently (host or GPU) and differ by more than the bound.
    let opts = LoadOptions { expert_cache_slots: Some(2), expert_admission: Some(2.0), ..Default::default() };
    let Some(cold) = On::Vulkan.load(&path, opts.clone()) else { return };
    let toks = tokens(30, 8);
    let want = one_by_one(&mut State::new(cold.clone()).unwrap(), &toks);
    let profile = cold.routing_profile().expect("a cached model keeps a profile");
    assert_eq!(profile.layers.iter().map(|l| l.iter().map(|&c| c as usize).sum::<usize>()).collect::<Vec<_>>(), vec![30 * cold.config.n_experts_used; cold.config.n_layers]);
    let file = std::env::temp_dir().join(format!("flashnext-profile-{}.json", std::process::id()));
    profile.save(&file).unwrap();
    let Some(warm) = On::Vulkan.load(&path, LoadOptions { routing_profile: Some(file.clone()), ..opts }) else { return };
    let mut s = State::new(warm.clone()).unwrap();
    s.decode(toks[0]).unwrap();
    assert!(warm.expert_cache().unwrap().hits > 0, "the first token hits the warmed cache");
    let got = [vec![logits(&s)], one_by_one(&mut s, &toks[1..])].concat();
    let close = got.iter().zip(&want).all(|(p, q)| {
        let scale = q.iter().fold(0f32, |m, b| m.max(f32::from_bits(*b).abs()));
        p.iter().zip(q).all(|(a, b)| (f32::from_bits(*a) - f32::from_bits(*b)).abs() <= 1e-5 * scale)
    });
    assert!(close, "a warm cache gives the cold cache's logits");
    std::fs::remove_file(&file).ok();
}

/// The C API: load parameters for the rewind window (and an older caller's
/// struct without the new fields), `fnx_state_rewind`, its floor, and the
/// routing profile of a model without an expert cache.
#[test]
fn c_rewind_and_load_parameters() {
    use flashnext::capi::*;
    use std::ffi::CString;
    let path = CString::new(converted("tiny_native", OutType::F32).to_str().unwrap()).unwrap();
    let logits = |s: *mut fnx_state, v: usize| {
        let mut out = vec![0f32; v];
        assert_eq!(unsafe { fnx_get_logits(s, out.as_mut_ptr(), v) }, FNX_OK);
        out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    unsafe {
        let mut p = fnx_load_params_default();
        p.backend = FNX_BACKEND_CPU;
        p.rewind_window = 2;
        let mut m = std::ptr::null_mut();
        assert_eq!(fnx_load(path.as_ptr(), &p, &mut m), FNX_OK);
        let v = fnx_model_vocab_size(m);
        let mut s = std::ptr::null_mut();
        assert_eq!(fnx_new_state(m, &mut s), FNX_OK);
        assert_eq!(fnx_decode_tokens(s, [5, 6, 7].as_ptr(), 3), FNX_OK);
        let at3 = logits(s, v);
        assert_eq!(fnx_decode_tokens(s, [9, 9].as_ptr(), 2), FNX_OK);
        let mut floor = 99;
        assert_eq!(fnx_state_rewind_floor(s, &mut floor), FNX_OK);
        assert_eq!(floor, 3);
        assert_eq!(fnx_state_rewind(s, 3), FNX_OK);
        assert_eq!((fnx_state_position(s), logits(s, v)), (3, at3.clone()));
        assert_eq!(fnx_state_rewind(s, 2), FNX_ERR_INVALID_ARGUMENT);
        assert_eq!(fnx_state_rewind(s, 4), FNX_ERR_INVALID_ARGUMENT);
        assert_eq!(fnx_state_position(s), 3);
        assert_eq!(fnx_state_rewind_floor(s, std::ptr::null_mut()), FNX_ERR_NULL_ARGUMENT);
        // No expert cache on the CPU: no routing profile.
        let file = CString::new(std::env::temp_dir().join("flashnext-no-profile.json").to_str().unwrap()).unwrap();
        assert_eq!(fnx_model_save_routing_profile(m, file.as_ptr()), FNX_ERR_INVALID_ARGUMENT);
        fnx_free_state(s);
        fnx_free_model(m);
        // A caller built before the expert-cache fields: accepted, defaults.
        p.struct_size = std::mem::offset_of!(fnx_load_params, expert_cache_slots) as u32;
        assert_eq!(fnx_load(path.as_ptr(), &p, &mut m), FNX_OK);
        fnx_free_model(m);
        // A caller built before spin_wait: accepted.
        p.struct_size = std::mem::offset_of!(fnx_load_params, spin_wait) as u32;
        assert_eq!(fnx_load(path.as_ptr(), &p, &mut m), FNX_OK);
        fnx_free_model(m);
        // A negative slot count other than -1 is refused, and so is a spin_wait that is not -1, 0 or 1.
        let mut q = fnx_load_params_default();
        q.expert_cache_slots = -2;
        assert_eq!(fnx_load(path.as_ptr(), &q, &mut m), FNX_ERR_INVALID_ARGUMENT);
        let mut q = fnx_load_params_default();
        q.spin_wait = 2;
        assert_eq!(fnx_load(path.as_ptr(), &q, &mut m), FNX_ERR_INVALID_ARGUMENT);
        let message = std::ffi::CStr::from_ptr(fnx_last_error()).to_string_lossy().into_owned();
        assert!(message.contains("spin_wait 2"), "{message}");
    }
}
