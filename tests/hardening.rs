//! What an outside probe of the C API broke, each case through the C ABI on
//! real GGUF files: extreme sampler settings, non-finite logits, absurd
//! counts, freed and busy handles, panics and their output, chat templates
//! that try to exhaust memory.
//!
//! Tests that change process-wide settings (the panic hook, an address-space
//! limit) do it in a child process: this test binary started again to run
//! only that test, with `FNX_HARDENING_CHILD` naming the child's job.

mod common;
mod util;

use flashnext::capi::*;
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::ptr::{null, null_mut};
use std::sync::OnceLock;
use util::*;

const PROMPT: [i32; 6] = [3, 14, 15, 92, 65, 35];

fn sampler(p: &fnx_sampler_params) -> *mut fnx_sampler {
    let mut s = null_mut();
    // SAFETY: valid params and out pointer.
    assert_eq!(unsafe { fnx_sampler_new(p, &mut s) }, FNX_OK, "{}", last_error());
    s
}

fn sample(s: *mut fnx_sampler, logits: &[f32]) -> (fnx_status, i32) {
    let mut t = -7;
    // SAFETY: live sampler, valid buffer and out pointer.
    let st = unsafe { fnx_sampler_sample(s, logits.as_ptr(), logits.len(), &mut t) };
    (st, t)
}

fn decode(s: *mut fnx_state, tokens: &[i32]) {
    // SAFETY: live state, valid buffer.
    assert_eq!(unsafe { fnx_decode_tokens(s, tokens.as_ptr(), tokens.len()) }, FNX_OK, "{}", last_error());
}

/// Position and snapshot bytes: what a failed call must leave alone.
fn observe(s: *const fnx_state) -> (usize, Vec<u8>) {
    // SAFETY: live state; the buffer holds the size asked for.
    unsafe {
        let mut size = 0;
        assert_eq!(fnx_state_save_size(s, &mut size), FNX_OK, "{}", last_error());
        let mut buf = vec![0u8; size];
        assert_eq!(fnx_state_save(s, buf.as_mut_ptr(), size, null_mut()), FNX_OK, "{}", last_error());
        (fnx_state_position(s), buf)
    }
}

/// Runs fnx_generate without a token callback; returns the status and `*out_n_generated`.
fn generate(s: *mut fnx_state, prompt: &[i32], p: &fnx_generate_params) -> (fnx_status, usize) {
    let mut n = 7777;
    let ptr = if prompt.is_empty() { null() } else { prompt.as_ptr() };
    // SAFETY: live state, valid buffers.
    let st = unsafe { fnx_generate(s, ptr, prompt.len(), p, None, null_mut(), &mut n) };
    (st, n)
}

/// Runs this test binary again, as a child that runs only `test` with
/// `FNX_HARDENING_CHILD` set to `job` (the test then does that job: see
/// `in_child`); returns its exit status, standard output and standard error.
fn run_child(test: &str, job: &str) -> (std::process::ExitStatus, String, String) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("FNX_HARDENING_CHILD", job)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status, text(&out.stdout), text(&out.stderr))
}

/// The child's side of `run_child`: in a child started for `job`, runs it
/// and returns true (the test then does nothing else).
fn in_child(job: &str, run: impl FnOnce()) -> bool {
    match std::env::var("FNX_HARDENING_CHILD") {
        Ok(j) if j == job => {
            run();
            true
        }
        _ => false,
    }
}

fn scratch_dir() -> PathBuf {
    process_dir("flashnext-hardening")
}

/// The generated tiny model with a NaN in the output row of token 0: the
/// logit of token 0 is NaN, the others are finite.
fn nan_logit_gguf() -> &'static std::path::Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let mut m = common::TinyModel::new();
        m.set_value("output.weight", 0, f32::NAN);
        let path = scratch_dir().join("nan-logit.gguf");
        m.write(&path);
        path
    })
}

// ---------------------------------------------------------------------------
// Extreme sampler settings and non-finite logits

#[test]
fn extreme_penalties_keep_every_logit_finite() {
    // frequency_penalty -3e38 after three accepted tokens lifts the token
    // past f32::MAX; min_p then used to see NaN weights and drop everything.
    let mut p = fnx_sampler_params_default();
    p.seed = 1;
    p.frequency_penalty = -3e38;
    p.min_p = 0.1;
    let s = sampler(&p);
    for _ in 0..3 {
        assert_eq!(unsafe { fnx_sampler_accept(s, 2) }, FNX_OK);
    }
    let logits = [0.5f32, 1.0, -2.0, 0.25];
    for _ in 0..5 {
        assert_eq!(sample(s, &logits), (FNX_OK, 2), "{}", last_error());
    }

    // repetition_penalty 1e-6 divides a logit of 3e38 past f32::MAX.
    let mut p = fnx_sampler_params_default();
    p.seed = 1;
    p.repetition_penalty = 1e-6;
    p.min_p = 0.5;
    let r = sampler(&p);
    assert_eq!(unsafe { fnx_sampler_accept(r, 0) }, FNX_OK);
    assert_eq!(sample(r, &[3e38, 1.0, 2.0]), (FNX_OK, 0), "{}", last_error());

    // The other way: multiplying -3e38 by 1e6 must not ban the token (-inf);
    // it stays the one candidate left.
    let mut p = fnx_sampler_params_default();
    p.repetition_penalty = 1e6;
    let q = sampler(&p);
    assert_eq!(unsafe { fnx_sampler_accept(q, 1) }, FNX_OK);
    assert_eq!(sample(q, &[f32::NEG_INFINITY, -3e38, f32::NEG_INFINITY]), (FNX_OK, 1), "{}", last_error());

    // The Rust chain: every penalised logit finite, the distribution a real one.
    use flashnext::sampling::{Sampler, SamplerParams};
    let mut rs = Sampler::new(SamplerParams {
        seed: 3,
        frequency_penalty: -3e38,
        presence_penalty: 3e38,
        min_p: 0.1,
        ..Default::default()
    })
    .unwrap();
    for t in [0, 0, 0, 1, 1, 3] {
        rs.accept(t);
    }
    let pen = rs.penalized(&logits);
    assert!(pen.iter().all(|l| l.is_finite()), "{pen:?}");
    let dist = rs.distribution(&logits).unwrap();
    assert!(!dist.is_empty());
    let total: f64 = dist.iter().map(|(_, p)| p).sum();
    assert!((total - 1.0).abs() < 1e-9 && dist.iter().all(|(_, p)| p.is_finite()), "{dist:?}");
    assert!(rs.sample(&logits).is_ok());
    unsafe {
        fnx_sampler_free(s);
        fnx_sampler_free(r);
        fnx_sampler_free(q);
    }
}

#[test]
fn generate_with_extreme_penalties_succeeds_and_keeps_the_state_sound() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let mut sp = fnx_sampler_params_default();
    sp.seed = 9;
    sp.frequency_penalty = -3e38;
    sp.min_p = 0.1;
    let smp = sampler(&sp);
    for t in [5, 5, 5] {
        assert_eq!(unsafe { fnx_sampler_accept(smp, t) }, FNX_OK);
    }
    let s = new_state(m);
    let mut p = fnx_generate_params_default();
    p.ignore_eos = true;
    p.sampler = smp;
    p.max_tokens = 4;
    assert_eq!(generate(s, &PROMPT, &p), (FNX_OK, 4), "{}", last_error());
    assert_eq!(unsafe { fnx_state_position(s) }, PROMPT.len() + 4);
    // The state is usable, not poisoned: it keeps decoding.
    decode(s, &[1]);
    assert_eq!(logits(s, vocab).len(), vocab);
    unsafe {
        fnx_sampler_free(smp);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn greedy_generation_refuses_nan_logits_like_a_temperature_zero_sampler() {
    let m = load(nan_logit_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let s = new_state(m);
    let prompt = [3, 14, 15, 9, 26, 5]; // the generated model has 64 tokens
    decode(s, &prompt[..3]);
    let l = logits(s, vocab);
    assert!(l[0].is_nan() && l[1..].iter().all(|x| x.is_finite()), "the model gives one NaN logit");
    let before = observe(s);

    let mut greedy = fnx_sampler_params_default();
    greedy.temperature = 0.0;
    let g = sampler(&greedy);
    let (st_sampler, _) = sample(g, &l);
    assert_eq!(st_sampler, FNX_ERR_INVALID_ARGUMENT);

    // fnx_generate without a sampler (greedy), with and without a prompt,
    // and with the temperature-0 sampler: one rule, the same refusal.
    let mut p = fnx_generate_params_default();
    p.ignore_eos = true;
    p.max_tokens = 3;
    for (prompt, smp) in [(&[][..], null_mut()), (&prompt[3..], null_mut()), (&[][..], g)] {
        p.sampler = smp;
        let (st, n) = generate(s, prompt, &p);
        assert_eq!((st, n), (st_sampler, 7777), "sampler {smp:?}, prompt {prompt:?}");
        assert!(last_error().contains("NaN"), "{}", last_error());
        assert!(observe(s) == before, "a refused generation changed the state");
    }
    unsafe {
        fnx_sampler_free(g);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn a_panic_inside_generation_rolls_everything_back() {
    use flashnext::generate::{self as gen, GenerateOptions};
    use flashnext::{Error, LoadOptions, Model, State};
    use flashnext::sampling::{Sampler, SamplerParams};
    let model = Model::load(fixture_gguf(), &LoadOptions::default()).unwrap();
    let mut state = State::new(model).unwrap();
    state.decode_tokens(&[3, 14, 15]).unwrap();
    let before = (state.position(), state.logits().unwrap().to_vec());
    let mut smp = Sampler::new(SamplerParams { seed: 4, ..Default::default() }).unwrap();
    smp.accept(7);
    let smp_before = format!("{smp:?}");
    // The detokenizer panics on the third generated token, after two were decoded.
    let mut calls = 0;
    let mut detok = |_t: u32| -> Vec<u8> {
        calls += 1;
        assert!(calls < 3, "a bug in a detokenizer");
        Vec::new()
    };
    let opts = GenerateOptions { max_tokens: 8, ..Default::default() };
    let r = gen::generate(&mut state, &[92, 65], Some(&mut smp), &opts, &mut detok, &mut || false, &mut |_, _| true);
    match r {
        Err(Error::Internal(msg)) => assert!(msg.contains("a bug in a detokenizer"), "{msg}"),
        other => panic!("expected an internal error, got {other:?}"),
    }
    assert_eq!((state.position(), state.logits().unwrap().to_vec()), before, "the state was not rolled back");
    assert_eq!(format!("{smp:?}"), smp_before, "the sampler was not rolled back");
    // And it goes on as if nothing happened.
    state.decode(1).unwrap();
}

// ---------------------------------------------------------------------------
// Counts that cannot be real

/// An address nothing is mapped at: reading through it crashes the test, so
/// a call that must refuse a count before reading proves it did.
fn unreadable<T>() -> *const T {
    std::ptr::dangling::<T>()
}

#[test]
fn thread_counts_beyond_four_per_cpu_are_refused_before_any_start() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max = (4 * cpus).max(256);
    for n in [max as u32 + 1, 100_000, u32::MAX] {
        let mut p = fnx_load_params_default();
        p.n_threads = n;
        let (st, msg) = load(fixture_gguf(), Some(&p)).unwrap_err();
        assert_eq!(st, FNX_ERR_INVALID_ARGUMENT, "{n}: {msg}");
        assert!(msg.contains("n_threads") && msg.contains(&max.to_string()), "{msg}");
    }
    let mut p = fnx_load_params_default();
    p.n_threads = 3;
    let m = load(fixture_gguf(), Some(&p)).unwrap();
    unsafe { fnx_free_model(m) };
}

#[test]
fn token_counts_are_checked_before_the_tokens_are_read() {
    let mut lp = fnx_load_params_default();
    lp.n_ctx = 16;
    let m = load(fixture_gguf(), Some(&lp)).unwrap();
    let s = new_state(m);
    decode(s, &PROMPT[..2]);
    let before = observe(s);
    let huge = 1usize << 62;
    unsafe {
        // More ids than any array can hold: refused, nothing decoded.
        let buf = [1i32; 4];
        assert_eq!(fnx_decode_tokens(s, buf.as_ptr(), huge), FNX_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("more than any array"), "{}", last_error());
        assert_eq!(fnx_decode_tokens(s, buf.as_ptr(), usize::MAX), FNX_ERR_INVALID_ARGUMENT);
        // Real-looking counts beyond the context room are refused before reading.
        assert_eq!(fnx_decode_tokens(s, unreadable(), 15), FNX_ERR_CONTEXT_FULL);
        assert!(last_error().contains("15 tokens do not fit"), "{}", last_error());
        let p = fnx_generate_params_default();
        for n in [huge, 15] {
            let mut out = 7777;
            let st = fnx_generate(s, unreadable(), n, &p, None, null_mut(), &mut out);
            assert_eq!((st, out), (if n == huge { FNX_ERR_INVALID_ARGUMENT } else { FNX_ERR_CONTEXT_FULL }, 7777));
        }
        // Arrays in the generation params.
        let mut p = fnx_generate_params_default();
        p.stop_tokens = unreadable();
        p.n_stop_tokens = huge;
        assert_eq!(generate(s, &[1], &p).0, FNX_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("stop_tokens"), "{}", last_error());
        let mut p = fnx_generate_params_default();
        p.stop_strings = unreadable();
        p.n_stop_strings = huge;
        assert_eq!(generate(s, &[1], &p).0, FNX_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("stop_strings"), "{}", last_error());
        assert!(observe(s) == before, "a refused call changed the state");

        // Snapshot bytes.
        assert_eq!(fnx_state_load(s, unreadable(), usize::MAX), FNX_ERR_INVALID_ARGUMENT);
        assert!(observe(s) == before);
        fnx_free_state(s);
    }

    // Text calls: token ids, text bytes and chat messages.
    let mut out = [0 as std::ffi::c_char; 16];
    let mut len = 4242usize;
    unsafe {
        let st = fnx_detokenize(m, unreadable(), huge, false, out.as_mut_ptr(), out.len(), &mut len);
        assert_eq!((st, len), (FNX_ERR_INVALID_ARGUMENT, 4242), "{}", last_error());
        let mut ids = [0i32; 4];
        let st = fnx_tokenize(m, unreadable(), usize::MAX, false, false, ids.as_mut_ptr(), 4, &mut len);
        assert_eq!((st, len), (FNX_ERR_INVALID_ARGUMENT, 4242), "{}", last_error());
        for n in [huge, usize::MAX / 2] {
            let st = fnx_apply_chat_template(
                m,
                null(),
                unreadable(),
                n,
                null(),
                true,
                true,
                out.as_mut_ptr(),
                out.len(),
                &mut len,
            );
            assert_eq!((st, len), (FNX_ERR_INVALID_ARGUMENT, 4242), "{n}: {}", last_error());
            assert!(last_error().contains("n_messages"), "{}", last_error());
        }
        fnx_free_model(m);
    }
}

// ---------------------------------------------------------------------------
// Freed handles

#[test]
fn a_freed_handle_is_refused_even_when_a_new_object_takes_its_memory() {
    let m = load(fixture_gguf(), None).unwrap();
    unsafe {
        for _ in 0..8 {
            let a = new_state(m);
            fnx_free_state(a);
            // The allocator hands a's memory to the next state of the same size.
            let b = new_state(m);
            decode(b, &[3]);
            assert_eq!(fnx_decode_token(a, 1), FNX_ERR_INVALID_HANDLE);
            assert!(last_error().contains("not a live fnx_state handle"), "{}", last_error());
            assert_eq!(fnx_state_reset(a), FNX_ERR_INVALID_HANDLE);
            assert_eq!(fnx_state_position(a), 0);
            fnx_free_state(a); // refused: b is not freed through a
            assert_eq!(fnx_state_position(b), 1, "a call on the freed handle reached the new state");
            decode(b, &[14]);
            assert_eq!(fnx_state_position(b), 2);
            fnx_free_state(b);
        }

        // The same for the other kinds of handle.
        let mut smp = null_mut();
        assert_eq!(fnx_sampler_new(null(), &mut smp), FNX_OK);
        fnx_sampler_free(smp);
        let mut fresh = null_mut();
        assert_eq!(fnx_sampler_new(null(), &mut fresh), FNX_OK);
        assert_eq!(fnx_sampler_accept(smp, 1), FNX_ERR_INVALID_HANDLE);
        let (st, _) = sample(smp, &[0.0, 1.0]);
        assert_eq!(st, FNX_ERR_INVALID_HANDLE);
        fnx_sampler_free(smp);
        assert_eq!(sample(fresh, &[f32::NEG_INFINITY, 1.0]), (FNX_OK, 1));
        fnx_sampler_free(fresh);

        let mut d = null_mut();
        assert_eq!(fnx_detokenizer_new(m, &mut d), FNX_OK);
        fnx_detokenizer_free(d);
        let mut len = 0;
        let mut out = [0 as std::ffi::c_char; 8];
        assert_eq!(fnx_detokenizer_push(d, 1, out.as_mut_ptr(), 8, &mut len), FNX_ERR_INVALID_HANDLE);
        fnx_detokenizer_free(d);

        let vocab = fnx_model_vocab_size(m);
        fnx_free_model(m);
        let m2 = load(fixture_gguf(), None).unwrap();
        assert_eq!(fnx_model_vocab_size(m), 0, "a freed model handle answered");
        assert_eq!(fnx_model_vocab_size(m2), vocab);
        let mut s = null_mut();
        assert_eq!(fnx_new_state(m, &mut s), FNX_ERR_INVALID_HANDLE);
        assert!(last_error().contains("fnx_model"), "{}", last_error());
        fnx_free_model(m); // refused: m2 stays loaded
        let s2 = new_state(m2);
        decode(s2, &[3]);
        fnx_free_state(s2);
        fnx_free_model(m2);
    }
}

// ---------------------------------------------------------------------------
// Re-entrancy and busy handles

/// What the token callback tries on the state and sampler that are generating.
struct Nested {
    state: *mut fnx_state,
    sampler: *mut fnx_sampler,
    tokens: Vec<i32>,
    statuses: Vec<(&'static str, fnx_status)>,
}

unsafe extern "C" fn meddle(token: i32, _piece: *const c_char, _len: usize, user_data: *mut c_void) -> bool {
    // SAFETY: the test passes a live Nested.
    let n = unsafe { &mut *(user_data as *mut Nested) };
    n.tokens.push(token);
    // SAFETY: the handles are live; the calls must refuse to touch them.
    unsafe {
        let mut out = null_mut();
        let mut size = 0;
        n.statuses.push(("decode_token", fnx_decode_token(n.state, 1)));
        n.statuses.push(("decode_tokens", fnx_decode_tokens(n.state, [1, 2].as_ptr(), 2)));
        n.statuses.push(("reset", fnx_state_reset(n.state)));
        n.statuses.push(("copy", fnx_state_copy(n.state, &mut out)));
        n.statuses.push(("save_size", fnx_state_save_size(n.state, &mut size)));
        let mut g = 0;
        n.statuses.push(("generate", fnx_generate(n.state, null(), 0, null(), None, null_mut(), &mut g)));
        n.statuses.push(("sampler_accept", fnx_sampler_accept(n.sampler, 1)));
        n.statuses.push(("sampler_reset", fnx_sampler_reset(n.sampler)));
        fnx_free_state(n.state);
        fnx_sampler_free(n.sampler);
    }
    true
}

unsafe extern "C" fn abort_meddling(user_data: *mut c_void) -> bool {
    // SAFETY: the test passes a live Nested.
    let n = unsafe { &mut *(user_data as *mut Nested) };
    // SAFETY: the state is live and must refuse.
    unsafe {
        n.statuses.push(("decode_token in abort", fnx_decode_token(n.state, 1)));
        n.statuses.push(("reset in abort", fnx_state_reset(n.state)));
    }
    false
}

#[test]
fn callbacks_cannot_use_the_state_or_sampler_that_is_generating() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let mut sp = fnx_sampler_params_default();
    sp.seed = 11;
    let run = |on_token: fnx_token_callback| {
        let s = new_state(m);
        let smp = sampler(&sp);
        let mut nested = Nested { state: s, sampler: smp, tokens: Vec::new(), statuses: Vec::new() };
        let mut p = fnx_generate_params_default();
        p.ignore_eos = true;
        p.max_tokens = 5;
        p.sampler = smp;
        let mut n = 0;
        // SAFETY: live handles, valid buffers; `nested` outlives the call.
        let st = unsafe {
            fnx_generate(s, PROMPT.as_ptr(), PROMPT.len(), &p, on_token, (&mut nested as *mut Nested).cast(), &mut n)
        };
        assert_eq!((st, n), (FNX_OK, 5), "{}", last_error());
        (s, smp, nested)
    };
    let (clean_s, clean_smp, clean) = run(Some(record_only));
    let (s, smp, nested) = run(Some(meddle));
    assert_eq!(nested.tokens, clean.tokens, "nested calls changed the generated sequence");
    assert_eq!(nested.statuses.len(), 5 * 8);
    for (what, st) in &nested.statuses {
        assert_eq!(*st, FNX_ERR_BUSY, "{what} inside the token callback");
    }
    unsafe {
        assert_eq!(fnx_state_position(s), PROMPT.len() + 5);
        assert_eq!(logits(s, vocab), logits(clean_s, vocab), "the state's sequence was corrupted");
        // Neither was freed from inside the callback; both go on.
        assert_eq!(fnx_sampler_accept(smp, 1), FNX_OK);
        decode(s, &[1]);
        let name = std::ffi::CStr::from_ptr(fnx_status_name(FNX_ERR_BUSY));
        assert_eq!(name.to_str().unwrap(), "FNX_ERR_BUSY");
        for h in [s, clean_s] {
            fnx_free_state(h);
        }
        fnx_sampler_free(smp);
        fnx_sampler_free(clean_smp);
    }

    // An abort callback that uses its own state during a decode.
    let s = new_state(m);
    let mut nested = Nested { state: s, sampler: null_mut(), tokens: Vec::new(), statuses: Vec::new() };
    unsafe {
        let ud = (&mut nested as *mut Nested).cast();
        assert_eq!(fnx_state_set_abort_callback(s, Some(abort_meddling), ud), FNX_OK);
        decode(s, &PROMPT[..3]);
        assert_eq!(fnx_decode_token(s, 3), FNX_OK);
        assert_eq!(fnx_state_position(s), 4);
        assert!(nested.statuses.len() >= 4);
        for (what, st) in &nested.statuses {
            assert_eq!(*st, FNX_ERR_BUSY, "{what}");
        }
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

unsafe extern "C" fn record_only(token: i32, _piece: *const c_char, _len: usize, user_data: *mut c_void) -> bool {
    // SAFETY: the test passes a live Nested.
    unsafe { &mut *(user_data as *mut Nested) }.tokens.push(token);
    true
}

#[test]
fn stop_strings_that_are_not_utf8_are_refused() {
    let m = load(fixture_gguf(), None).unwrap();
    let s = new_state(m);
    decode(s, &PROMPT[..2]);
    let before = observe(s);
    let bad = CString::new(vec![b'a', 0xff, b'b']).unwrap();
    let good = CString::new("x").unwrap();
    let strs = [good.as_ptr(), bad.as_ptr()];
    let mut p = fnx_generate_params_default();
    p.stop_strings = strs.as_ptr();
    p.n_stop_strings = 2;
    p.max_tokens = 2;
    assert_eq!(generate(s, &[1], &p), (FNX_ERR_INVALID_ARGUMENT, 7777));
    assert!(last_error().contains("stop_strings[1] is not valid UTF-8"), "{}", last_error());
    assert!(observe(s) == before);
    p.n_stop_strings = 1;
    assert_eq!(generate(s, &[1], &p).0, FNX_OK, "{}", last_error());
    unsafe {
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

// ---------------------------------------------------------------------------
// Panics: the message goes to the log callback and fnx_last_error, not to stderr

static LOGGED: std::sync::Mutex<Vec<(i32, String)>> = std::sync::Mutex::new(Vec::new());

unsafe extern "C" fn keep_log(level: i32, message: *const c_char, _user_data: *mut c_void) {
    // SAFETY: the library passes a NUL-terminated line.
    let text = unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned();
    LOGGED.lock().unwrap().push((level, text));
}

fn panics_in_a_process_with_the_default_hook() {
    // No log callback: a caught panic says nothing on stderr.
    assert_eq!(panic_behind_boundary("probe-1 (silent)"), FNX_ERR_INTERNAL);
    println!("LAST1 {}", last_error());
    // With a log callback, the message and its place go there.
    unsafe { fnx_set_log_callback(Some(keep_log), null_mut()) };
    assert_eq!(panic_behind_boundary("probe-2 (logged)"), FNX_ERR_INTERNAL);
    println!("LAST2 {}", last_error());
    for (level, text) in LOGGED.lock().unwrap().iter() {
        println!("LOG {level} {text}");
    }
    unsafe { fnx_set_log_callback(None, null_mut()) };
    // A panic outside any fnx_ call still reaches the default hook.
    let _ = std::panic::catch_unwind(|| panic!("host-panic-outside"));
    println!("DONE");
}

fn panics_in_a_process_with_its_own_hook() {
    host_hook();
    assert_eq!(panic_behind_boundary("probe-3 (inside)"), FNX_ERR_INTERNAL);
    let _ = std::panic::catch_unwind(|| panic!("host-4 (outside)"));
    let _ = std::thread::spawn(|| panic!("host-5 (another thread)")).join();
    assert_eq!(panic_behind_boundary("probe-6 (inside again)"), FNX_ERR_INTERNAL);
    println!("DONE");
}

fn host_hook() {
    std::panic::set_hook(Box::new(|info| {
        let p = info.payload();
        let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
        eprintln!("HOST HOOK: {}", msg.unwrap_or_default());
    }));
}

unsafe extern "C" fn panicking_abort_callback(_user_data: *mut c_void) -> bool {
    panic!("host-7 (in the host's abort callback)")
}

fn a_callback_of_the_host_panics() {
    host_hook();
    let m = load(fixture_gguf(), None).unwrap();
    let s = new_state(m);
    unsafe {
        assert_eq!(fnx_state_set_abort_callback(s, Some(panicking_abort_callback), null_mut()), FNX_OK);
        // The panic cannot unwind out of an extern "C" function: the process
        // aborts, but the host's hook has seen the host's panic first.
        fnx_decode_token(s, 1);
    }
    println!("NOT REACHED");
}

#[test]
fn caught_panics_go_to_the_log_callback_not_to_stderr() {
    if in_child("panic-default-hook", panics_in_a_process_with_the_default_hook) {
        return;
    }
    let (status, out, err) = run_child("caught_panics_go_to_the_log_callback_not_to_stderr", "panic-default-hook");
    assert!(status.success() && out.contains("DONE"), "{status}\n{out}\n{err}");
    assert!(!err.contains("probe-"), "a caught panic reached stderr:\n{err}");
    assert!(!err.contains("stack backtrace"), "{err}");
    // (libtest prints "test child ... " before the child's first line)
    let line = |tag: &str| out.lines().find_map(|l| l.find(tag).map(|i| l[i..].to_string())).unwrap_or_default();
    let last1 = line("LAST1 ");
    assert!(
        last1.contains("internal error (please report): probe-1 (silent) at src/capi/mod.rs:"),
        "the message and its place are in fnx_last_error: {last1}"
    );
    assert!(line("LAST2 ").contains("probe-2 (logged)"), "{out}");
    let logged: Vec<&str> = out.lines().filter(|l| l.starts_with("LOG ")).collect();
    assert_eq!(logged.len(), 1, "{out}");
    assert!(logged[0].starts_with(&format!("LOG {FNX_LOG_ERROR} internal error (please report) at src/capi/mod.rs:")), "{out}");
    assert!(logged[0].ends_with("probe-2 (logged)"), "{out}");
    // The default hook still reports the host's own panic.
    assert!(err.contains("host-panic-outside"), "the host's panic went missing:\n{err}");
}

#[test]
fn a_hosts_own_panic_hook_keeps_working() {
    if in_child("panic-host-hook", panics_in_a_process_with_its_own_hook)
        || in_child("panic-in-callback", a_callback_of_the_host_panics)
    {
        return;
    }
    let (status, out, err) = run_child("a_hosts_own_panic_hook_keeps_working", "panic-host-hook");
    assert!(status.success() && out.contains("DONE"), "{status}\n{out}\n{err}");
    assert!(err.contains("HOST HOOK: host-4 (outside)"), "{err}");
    assert!(err.contains("HOST HOOK: host-5 (another thread)"), "{err}");
    assert!(!err.contains("probe-"), "the library's panics reached the host's hook:\n{err}");

    // A host callback runs outside the boundary: its panic is the host's.
    let (status, out, err) = run_child("a_hosts_own_panic_hook_keeps_working", "panic-in-callback");
    assert!(!status.success() && !out.contains("NOT REACHED"), "{status}\n{out}\n{err}");
    assert!(err.contains("HOST HOOK: host-7 (in the host's abort callback)"), "{err}");
}

// ---------------------------------------------------------------------------
// Chat templates that try to exhaust memory

/// Templates a model file (or a caller) could carry to make rendering take
/// gigabytes (the message they are given is 16 KiB): each must be refused,
/// quickly and with little memory.
const ATTACKS: &[(&str, &str)] = &[
    ("format width", "{{ '%0999999999d'|format(1) }}"),
    ("format precision", "{{ '%.999999999f'|format(1.5) }}"),
    ("str.format width", "{{ '{:>999999999}'.format(1) }}"),
    ("a message printed 100000 times", "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"),
    (
        "the same into a captured block",
        "{% set x %}{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}{% endset %}{{ x|length }}",
    ),
    (
        "a string doubled 40 times",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    ),
    (
        "doubling by macro recursion",
        "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}{% endmacro %}{{ d('x', 40) }}",
    ),
    ("a repeated string", "{{ ('x' * 100000000)|length }}"),
    ("str.replace", "{{ messages[0].content.replace('x', messages[0].content)|length }}"),
    ("strftime_now", "{{ strftime_now('%B' * 2000000)|length }}"),
    ("debug()", "{{ debug() }}"),
];

/// A list holding the 16 KiB message 8^6 times (6 levels of 8 references):
/// a few hundred bytes to build, 4 GiB as text.
const SHARED: &str = "{% set s = messages[0].content %}{% set a = [s,s,s,s,s,s,s,s] %}{% set b = [a,a,a,a,a,a,a,a] %}\
{% set c = [b,b,b,b,b,b,b,b] %}{% set d = [c,c,c,c,c,c,c,c] %}{% set e = [d,d,d,d,d,d,d,d] %}\
{% set f = [e,e,e,e,e,e,e,e] %}";

/// Ways of turning that list into text that flashnext's own hooks bound.
const SHARED_TO_TEXT: &[(&str, &str)] = &[
    ("printed", "{{ f }}"),
    ("|string", "{{ f|string|length }}"),
    ("|tojson", "{{ f|tojson|length }}"),
    ("|tojson(indent=64)", "{{ f|tojson(indent=64)|length }}"),
    ("|trim", "{{ f|trim|length }}"),
    ("raise_exception", "{{ raise_exception(f) }}"),
];

/// Ways of turning such lists into text inside minijinja itself (operators,
/// built-in filters, their string arguments): bounded by the vendored
/// minijinja's fuel charge for each item written (vendor/README.md).
const SHARED_TO_TEXT_IN_MINIJINJA: &[(&str, &str)] = &[
    ("~", "{{ ('' ~ f)|length }}"),
    ("|join", "{{ f|join|length }}"),
    ("|pprint", "{{ f|pprint|length }}"),
    ("|format('%s')", "{{ '%s'|format(f)|length }}"),
    (".format()", "{{ '{}'.format(f)|length }}"),
    ("|lower", "{{ f|lower|length }}"),
    (
        "|pprint of a list 400 levels deep",
        "{% set ns = namespace(l='x') %}{% for i in range(400) %}{% set ns.l = [ns.l] %}{% endfor %}\
         {{ ([ns.l] * 1000000)|pprint|length }}",
    ),
    (
        "~ of a list holding itself 40 times over",
        "{% set ns = namespace(l=[messages[0].content]) %}{% for i in range(40) %}{% set ns.l = ns.l + [ns.l] %}\
         {% endfor %}{{ ('' ~ ns.l)|length }}",
    ),
];

/// A value of /proc/self/status, in bytes.
fn proc_status(key: &str) -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no {key}"));
    line.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 1024
}

/// Renders `template` (as the override) through the C API for one user
/// message of `content_len` bytes, into a buffer of `capacity` bytes.
fn render_override(m: *mut fnx_model, template: &str, content_len: usize, capacity: usize) -> (fnx_status, usize) {
    let content = CString::new("x".repeat(content_len)).unwrap();
    let role = CString::new("user").unwrap();
    let msg = fnx_chat_message {
        role: role.as_ptr(),
        content: content.as_ptr(),
        reasoning_content: null(),
        tool_calls_json: null(),
    };
    let t = CString::new(template).unwrap();
    let mut out = vec![0 as c_char; capacity];
    let mut len = 0;
    // SAFETY: valid strings, one message, a buffer of `capacity` bytes.
    let st = unsafe {
        fnx_apply_chat_template(m, t.as_ptr(), &msg, 1, null(), true, true, out.as_mut_ptr(), capacity, &mut len)
    };
    (st, len)
}

/// Caps this process's address space `headroom` bytes above what it uses now.
fn limit_address_space(headroom: usize) {
    #[repr(C)]
    struct RLimit {
        cur: u64,
        max: u64,
    }
    extern "C" {
        fn setrlimit(resource: i32, rlim: *const RLimit) -> i32;
    }
    const RLIMIT_AS: i32 = 9;
    let cap = (proc_status("VmSize:") + headroom) as u64;
    // SAFETY: a valid struct; lowering one's own limit is always allowed.
    assert_eq!(unsafe { setrlimit(RLIMIT_AS, &RLimit { cur: cap, max: cap }) }, 0);
}

/// The child's side of the template tests: renders each template of the
/// job's list under a 256 MiB address-space limit (an allocation beyond it
/// aborts the child) and prints status, time and peak memory of each.
fn templates_within_an_address_space_limit(templates: Vec<(String, String)>) {
    let m = load(fixture_gguf(), None).unwrap();
    // Warm up (the tokenizer is built on first use), then cap the address space.
    assert_eq!(render_override(m, "{{ messages[0].role }}", 16, 64).0, FNX_OK, "{}", last_error());
    limit_address_space(256 << 20);
    for (name, template) in &templates {
        std::fs::write("/proc/self/clear_refs", "5").unwrap(); // resets VmHWM
        let before = proc_status("VmRSS:");
        let start = std::time::Instant::now();
        let (st, _) = render_override(m, template, 16 << 10, 0);
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let peak = proc_status("VmHWM:").saturating_sub(before);
        println!("TEMPLATE {st} {peak} {ms:.1} {name}: {}", last_error());
    }
    println!("DONE");
}

fn parse_template_runs(out: &str) -> Vec<(fnx_status, usize, f64, String)> {
    out.lines()
        .filter_map(|l| l.find("TEMPLATE ").map(|i| &l[i + 9..]))
        .map(|l| {
            let mut f = l.splitn(4, ' ');
            let st = f.next().unwrap().parse().unwrap();
            let peak = f.next().unwrap().parse().unwrap();
            let ms = f.next().unwrap().parse().unwrap();
            (st, peak, ms, f.next().unwrap().to_string())
        })
        .collect()
}

fn check_refused_small(test: &str, job: &str, expected: usize) {
    let (status, out, err) = run_child(test, job);
    assert!(status.success() && out.contains("DONE"), "the child died ({status}): the memory was not bounded\n{out}\n{err}");
    let runs = parse_template_runs(&out);
    assert_eq!(runs.len(), expected, "{out}");
    for (st, peak, ms, what) in &runs {
        eprintln!("refused in {ms:.1} ms, peak +{:.1} MiB: {what}", *peak as f64 / 1048576.0);
        assert_eq!(*st, FNX_ERR_INVALID_ARGUMENT, "{what}");
        assert!(*peak < 32 << 20, "{what}: peak memory +{peak} bytes");
        assert!(*ms < 5000.0, "{what}: {ms} ms");
    }
}

#[test]
#[cfg(target_os = "linux")]
fn chat_templates_cannot_exhaust_memory() {
    let all = || -> Vec<(String, String)> {
        ATTACKS
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .chain(
                SHARED_TO_TEXT
                    .iter()
                    .chain(SHARED_TO_TEXT_IN_MINIJINJA)
                    .map(|(n, t)| (format!("a shared list {n}"), format!("{SHARED}{t}"))),
            )
            .collect()
    };
    if in_child("template-attacks", || templates_within_an_address_space_limit(all())) {
        return;
    }
    check_refused_small("chat_templates_cannot_exhaust_memory", "template-attacks", all().len());
}

#[test]
fn the_files_own_template_is_refused_as_an_invalid_model() {
    let mut tiny = common::TinyModel::new();
    tiny.set("tokenizer.chat_template", flashnext::gguf::Value::String(ATTACKS[0].1.into()));
    let path = scratch_dir().join("greedy-template.gguf");
    tiny.write(&path);
    let m = load(&path, None).unwrap();
    let role = CString::new("user").unwrap();
    let content = CString::new("hi").unwrap();
    let msg = fnx_chat_message { role: role.as_ptr(), content: content.as_ptr(), reasoning_content: null(), tool_calls_json: null() };
    let mut out = [0 as c_char; 64];
    let mut len = 4242;
    unsafe {
        let st = fnx_apply_chat_template(m, null(), &msg, 1, null(), true, true, out.as_mut_ptr(), 64, &mut len);
        assert_eq!((st, len), (FNX_ERR_INVALID_MODEL, 4242), "{}", last_error());
        assert!(last_error().contains("the file's chat template") && last_error().contains("limit"), "{}", last_error());
        fnx_free_model(m);
    }
}

#[test]
fn the_limit_is_the_larger_of_4_mib_and_the_output_buffer() {
    let m = load(fixture_gguf(), None).unwrap();
    assert_eq!(FNX_CHAT_TEMPLATE_MAX_BYTES, 4 << 20);
    let print = "{{ messages[0].content }}";
    // Up to the limit: the size query works as before.
    let (st, len) = render_override(m, print, 4 << 20, 0);
    assert_eq!((st, len), (FNX_ERR_BUFFER_TOO_SMALL, 4 << 20), "{}", last_error());
    // Beyond it: refused, unless the buffer holds the text.
    let big = (4 << 20) + 1;
    let (st, _) = render_override(m, print, big, 0);
    assert_eq!(st, FNX_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("limit of 4194304 bytes"), "{}", last_error());
    assert_eq!(render_override(m, print, big, big), (FNX_OK, big), "{}", last_error());
    // The same in Rust, where the limit is a parameter of the template.
    use flashnext::chat::{ChatMessage, ChatOptions, ChatTemplate};
    let msg = [ChatMessage::new("user", "y".repeat(1000))];
    let t = ChatTemplate::new(print).unwrap().with_max_bytes(999);
    assert!(matches!(t.apply(&msg, None, &ChatOptions::default()), Err(flashnext::Error::InvalidArgument(_))));
    assert_eq!(t.with_max_bytes(1000).apply(&msg, None, &ChatOptions::default()).unwrap().len(), 1000);
    unsafe { fnx_free_model(m) };
}
