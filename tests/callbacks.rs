//! Callbacks and the calls that drive them: load progress with cancel, the
//! log callback, the per-state abort callback, multi-token decoding and the
//! generation loop (`fnx_decode_tokens`, `fnx_generate` and the Rust
//! `flashnext::generate`), with misuse of every entry point. Leak checks run
//! in a child process under a counting allocator, and a C program exercising
//! the same calls runs under AddressSanitizer (and valgrind when installed).

mod leaks;
mod util;

use flashnext::capi::*;
use flashnext::generate::{self, GenerateOptions, NoText, StopMatcher, StopReason};
use flashnext::tokenizer::Tokenizer;
use flashnext::Error;
use flashnext::load::LOAD_CANCELLED;
use flashnext::{LoadOptions, Model, State};
use flashnext::sampling::{argmax, Sampler, SamplerParams};
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use util::*;

const PROMPT: [i32; 6] = [3, 14, 15, 92, 65, 35];

// ---------------------------------------------------------------------------
// Helpers

/// An abort callback that says "go on" `*user_data` times, then "abort".
unsafe extern "C" fn abort_after(user_data: *mut c_void) -> bool {
    // SAFETY: the tests pass a pointer to a live AtomicI64.
    let budget = unsafe { &*(user_data as *const AtomicI64) };
    budget.fetch_sub(1, Ordering::SeqCst) <= 0
}

/// Progress callback recording every value; cancels when the count reaches `cancel_at`.
struct Progress {
    seen: Vec<f32>,
    cancel_at: usize,
}

unsafe extern "C" fn on_progress(progress: f32, user_data: *mut c_void) -> bool {
    // SAFETY: the tests pass a pointer to a live Progress.
    let p = unsafe { &mut *(user_data as *mut Progress) };
    p.seen.push(progress);
    p.seen.len() < p.cancel_at
}

fn load_with_progress(
    path: &Path,
    cancel_at: usize,
) -> (Result<*mut fnx_model, (fnx_status, String)>, Vec<f32>) {
    let mut prog = Progress {
        seen: Vec::new(),
        cancel_at,
    };
    let mut p = fnx_load_params_default();
    p.progress_callback = Some(on_progress);
    p.progress_user_data = (&mut prog as *mut Progress).cast();
    let r = load(path, Some(&p));
    (r, prog.seen)
}

fn c_decode(s: *mut fnx_state, tokens: &[i32]) {
    // SAFETY: live state, valid buffer.
    assert_eq!(
        unsafe { fnx_decode_tokens(s, tokens.as_ptr(), tokens.len()) },
        FNX_OK,
        "{}",
        last_error()
    );
}

/// What a failed call must leave alone: position, logits, snapshot bytes.
fn observe(s: *const fnx_state) -> (usize, Vec<u8>) {
    // SAFETY: live state.
    unsafe {
        let mut size = 0;
        assert_eq!(
            fnx_state_save_size(s, &mut size),
            FNX_OK,
            "{}",
            last_error()
        );
        let mut buf = vec![0u8; size];
        assert_eq!(
            fnx_state_save(s, buf.as_mut_ptr(), size, null_mut()),
            FNX_OK
        );
        (fnx_state_position(s), buf)
    }
}

/// Greedy continuation of `prompt` by hand: `n` tokens and the final logits.
fn manual_greedy(m: *mut fnx_model, prompt: &[i32], n: usize) -> (Vec<i32>, Vec<f32>) {
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let s = new_state(m);
    c_decode(s, prompt);
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits(s, vocab)).unwrap() as i32;
        out.push(t);
        c_decode(s, &[t]);
    }
    let l = logits(s, vocab);
    unsafe { fnx_free_state(s) };
    (out, l)
}

/// Tokens and pieces passed to `on_token`; returns false after `stop_after` calls.
#[derive(Default)]
struct Stream {
    tokens: Vec<i32>,
    pieces: Vec<Vec<u8>>,
    stop_after: usize,
}

unsafe extern "C" fn on_token(
    token: i32,
    piece: *const c_char,
    len: usize,
    user_data: *mut c_void,
) -> bool {
    // SAFETY: the tests pass a live Stream; `piece` holds `len` bytes and a NUL.
    let s = unsafe { &mut *(user_data as *mut Stream) };
    let bytes = unsafe { std::slice::from_raw_parts(piece.cast::<u8>(), len + 1) };
    assert_eq!(bytes[len], 0, "piece is not NUL-terminated");
    s.tokens.push(token);
    s.pieces.push(bytes[..len].to_vec());
    s.stop_after == 0 || s.tokens.len() < s.stop_after
}

fn gen_params() -> fnx_generate_params {
    let mut p = fnx_generate_params_default();
    p.ignore_eos = true;
    p
}

/// Runs fnx_generate; returns the status, the stream and `*out_n_generated` (7777 if unwritten).
fn c_generate(
    s: *mut fnx_state,
    prompt: &[i32],
    p: Option<&fnx_generate_params>,
    stop_after: usize,
) -> (fnx_status, Stream, usize) {
    let mut stream = Stream {
        stop_after,
        ..Default::default()
    };
    let mut n = 7777usize;
    // SAFETY: live state and valid pointers.
    let st = unsafe {
        fnx_generate(
            s,
            if prompt.is_empty() {
                null()
            } else {
                prompt.as_ptr()
            },
            prompt.len(),
            p.map_or(null(), |p| p as *const _),
            Some(on_token),
            (&mut stream as *mut Stream).cast(),
            &mut n,
        )
    };
    (st, stream, n)
}

// ---------------------------------------------------------------------------
// Load progress and cancel

#[test]
fn load_progress_runs_from_zero_to_one_per_layer() {
    let (m, seen) = load_with_progress(fixture_gguf(), usize::MAX);
    let m = m.unwrap();
    let n_layers = unsafe { fnx_model_n_layers(m) };
    assert_eq!(seen.first(), Some(&0.0));
    assert_eq!(seen.last(), Some(&1.0));
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]),
        "not monotonic: {seen:?}"
    );
    assert!(
        seen.len() >= n_layers + 2,
        "{} calls for {n_layers} layers: {seen:?}",
        seen.len()
    );
    unsafe { fnx_free_model(m) };

    // The Rust API reports the same sequence.
    let rust_seen = Arc::new(Mutex::new(Vec::new()));
    let r = rust_seen.clone();
    let opts = LoadOptions {
        progress: Some(Arc::new(move |f| {
            r.lock().unwrap().push(f);
            true
        })),
        ..Default::default()
    };
    assert!(format!("{opts:?}").contains("progress"));
    Model::load(fixture_gguf(), &opts).unwrap();
    assert_eq!(*rust_seen.lock().unwrap(), seen);
}

#[test]
fn cancelling_at_any_point_returns_cancelled() {
    let (_, all) = load_with_progress(fixture_gguf(), usize::MAX);
    for k in 1..=all.len() {
        let (r, seen) = load_with_progress(fixture_gguf(), k);
        let (st, msg) = r.expect_err("cancelled load succeeded");
        assert_eq!(st, FNX_ERR_CANCELLED, "cancel at call {k}: {msg}");
        assert!(msg.contains("cancelled by the progress callback"), "{msg}");
        assert_eq!(
            seen.len(),
            k,
            "the callback was called again after cancelling"
        );
    }
    // Rust: an InvalidArgument error with a fixed message.
    let opts = LoadOptions {
        progress: Some(Arc::new(|f| f < 0.5)),
        ..Default::default()
    };
    let e = Model::load(fixture_gguf(), &opts).err().expect("cancelled");
    assert!(
        matches!(e, flashnext::Error::InvalidArgument(ref m) if m == LOAD_CANCELLED),
        "{e:?}"
    );
    let bytes: flashnext::gguf::Storage = Arc::new(std::fs::read(fixture_gguf()).unwrap());
    assert!(Model::from_bytes(bytes, &opts).is_err());
}

#[test]
fn load_params_from_before_the_progress_fields_are_accepted() {
    unsafe extern "C" fn never(_: f32, _: *mut c_void) -> bool {
        false
    }
    let mut p = fnx_load_params_default();
    p.progress_callback = Some(never); // beyond the old struct: must not be read
    p.struct_size = std::mem::offset_of!(fnx_load_params, progress_callback) as u32;
    let m = load(fixture_gguf(), Some(&p)).expect("old-layout params accepted");
    unsafe { fnx_free_model(m) };
    p.struct_size += 8; // half of the new fields: neither layout
    let (st, msg) = load(fixture_gguf(), Some(&p)).unwrap_err();
    assert_eq!(st, FNX_ERR_INVALID_ARGUMENT);
    assert!(msg.contains("struct_size"), "{msg}");
}

// ---------------------------------------------------------------------------
// Log callback

static LOGS: Mutex<Vec<(i32, String)>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_log(level: i32, msg: *const c_char, user_data: *mut c_void) {
    assert_eq!(user_data as usize, 0xF00D);
    // SAFETY: flashnext passes a NUL-terminated message.
    let m = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    LOGS.lock().unwrap().push((level, m));
}

fn logs_about(needle: &str) -> Vec<(i32, String)> {
    LOGS.lock()
        .unwrap()
        .iter()
        .filter(|(_, m)| m.contains(needle))
        .cloned()
        .collect()
}

#[test]
fn log_callback_reports_loads_and_can_be_removed() {
    // A uniquely named copy, so other tests' messages can be told apart.
    let dir = std::env::temp_dir().join(format!("flashnext-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("log-test-model.gguf");
    std::fs::copy(fixture_gguf(), &path).unwrap();
    let name = path.to_str().unwrap().to_string();
    unsafe { fnx_set_log_callback(Some(on_log), 0xF00D as *mut c_void) };

    let m = load(&path, None).unwrap();
    let got = logs_about(&name);
    assert_eq!(got.len(), 1, "{got:?}");
    let (level, msg) = &got[0];
    assert_eq!(*level, FNX_LOG_INFO);
    for needle in [
        "4 layers",
        "3 Gated DeltaNet",
        "1 attention",
        "vocab 320",
        "context 1024",
        "tensors: ",
        " F32",
        " ms",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from {msg:?}");
    }
    unsafe { fnx_free_model(m) };

    let mut p = fnx_load_params_default();
    p.n_ctx = 5000;
    let m = load(&path, Some(&p)).unwrap();
    assert!(logs_about("n_ctx 5000")
        .iter()
        .any(|(l, m)| *l == FNX_LOG_WARN && m.contains("using 1024")));
    // Generation and snapshots log at debug level.
    let s = new_state(m);
    let mut gp = gen_params();
    gp.max_tokens = 2;
    assert_eq!(c_generate(s, &PROMPT, Some(&gp), 0).0, FNX_OK);
    assert!(logs_about("generated 2 tokens after a 6-token prompt")
        .iter()
        .any(|(l, _)| *l == FNX_LOG_DEBUG));
    observe(s);
    assert!(logs_about("saved a state at position 8")
        .iter()
        .any(|(l, _)| *l == FNX_LOG_DEBUG));
    unsafe {
        fnx_free_state(s);
        fnx_free_model(m);
    }

    let missing = dir.join("missing-log-test.gguf");
    load(&missing, None).unwrap_err();
    let got = logs_about("missing-log-test.gguf");
    assert!(got.len() == 1 && got[0].0 == FNX_LOG_ERROR, "{got:?}");

    let (r, _) = load_with_progress(&path, 2);
    assert_eq!(r.unwrap_err().0, FNX_ERR_CANCELLED);
    assert!(logs_about("cancelled")
        .iter()
        .any(|(l, m)| *l == FNX_LOG_INFO && m.contains(&name)));

    // Removed: silent again.
    unsafe { fnx_set_log_callback(None, null_mut()) };
    let before = logs_about(&name).len();
    let m = load(&path, None).unwrap();
    unsafe { fnx_free_model(m) };
    assert_eq!(logs_about(&name).len(), before);
    std::fs::remove_dir_all(&dir).ok();
}

// ---------------------------------------------------------------------------
// Abort

#[test]
fn abort_leaves_every_decoding_call_without_effect() {
    // Micro-batches of one token: the abort callback is polled before each.
    let mut lp = fnx_load_params_default();
    lp.micro_batch = 1;
    let m = load(fixture_gguf(), Some(&lp)).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let s = new_state(m);
    c_decode(s, &PROMPT[..2]);
    let budget = AtomicI64::new(0);
    let ud = (&budget as *const AtomicI64).cast_mut().cast::<c_void>();
    unsafe {
        assert_eq!(
            fnx_state_set_abort_callback(s, Some(abort_after), ud),
            FNX_OK
        );
        let before = observe(s);

        // Single token: aborted before anything happens; bad tokens are still reported as such.
        assert_eq!(fnx_decode_token(s, 5), FNX_ERR_ABORTED);
        assert!(last_error().contains("aborted"), "{}", last_error());
        assert_eq!(
            fnx_decode_token(s, vocab as i32),
            FNX_ERR_TOKEN_OUT_OF_RANGE
        );
        assert_eq!(observe(s), before);

        // Several tokens: aborted part way, rolled back.
        for k in [0, 1, 3, 5] {
            budget.store(k, Ordering::SeqCst);
            assert_eq!(
                fnx_decode_tokens(s, PROMPT.as_ptr(), PROMPT.len()),
                FNX_ERR_ABORTED,
                "budget {k}"
            );
            assert_eq!(observe(s), before, "budget {k}: state changed");
        }

        // Generation: aborted during the prompt and after tokens were streamed.
        let mut p = fnx_sampler_params_default();
        p.seed = 11;
        let mut smp = null_mut();
        assert_eq!(fnx_sampler_new(&p, &mut smp), FNX_OK);
        let mut gp = gen_params();
        gp.sampler = smp;
        gp.max_tokens = 6;
        for k in [0, 2, 7, 9] {
            budget.store(k, Ordering::SeqCst);
            let (st, stream, n) = c_generate(s, &PROMPT[2..], Some(&gp), 0);
            assert_eq!(st, FNX_ERR_ABORTED, "budget {k}");
            assert_eq!(n, 7777, "out_n_generated written on failure");
            assert_eq!(observe(s), before, "budget {k}: state changed");
            if k == 9 {
                assert!(
                    !stream.tokens.is_empty(),
                    "tokens were streamed before the abort"
                );
            }
        }
        // The sampler was rolled back too: the same as a fresh one with the same seed.
        assert_eq!(fnx_state_set_abort_callback(s, None, null_mut()), FNX_OK);
        let (st, ours, _) = c_generate(s, &PROMPT[2..], Some(&gp), 0);
        assert_eq!(st, FNX_OK, "{}", last_error());
        let fresh = new_state(m);
        c_decode(fresh, &PROMPT[..2]);
        let mut smp2 = null_mut();
        assert_eq!(fnx_sampler_new(&p, &mut smp2), FNX_OK);
        gp.sampler = smp2;
        let (_, theirs, _) = c_generate(fresh, &PROMPT[2..], Some(&gp), 0);
        assert_eq!(ours.tokens, theirs.tokens);
        assert_eq!(observe(s), observe(fresh));

        // Copies do not inherit the callback.
        assert_eq!(
            fnx_state_set_abort_callback(s, Some(abort_after), ud),
            FNX_OK
        );
        budget.store(0, Ordering::SeqCst);
        let mut copy = null_mut();
        assert_eq!(fnx_state_copy(s, &mut copy), FNX_OK);
        assert_eq!(fnx_decode_token(copy, 1), FNX_OK);
        assert_eq!(fnx_decode_token(s, 1), FNX_ERR_ABORTED);

        // Misuse.
        assert_eq!(
            fnx_state_set_abort_callback(null_mut(), Some(abort_after), ud),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_state_set_abort_callback(m.cast(), Some(abort_after), ud),
            FNX_ERR_INVALID_HANDLE
        );
        fnx_sampler_free(smp);
        fnx_sampler_free(smp2);
        fnx_free_state(copy);
        fnx_free_state(fresh);
        fnx_free_model(m);
        assert_eq!(
            fnx_state_set_abort_callback(s, None, null_mut()),
            FNX_ERR_MODEL_FREED
        );
        fnx_free_state(s);
    }
}

// ---------------------------------------------------------------------------
// fnx_decode_tokens

#[test]
fn decode_tokens_equals_one_at_a_time_and_checks_first() {
    let mut p = fnx_load_params_default();
    p.n_ctx = 10;
    let m = load(fixture_gguf(), Some(&p)).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let a = new_state(m);
    let b = new_state(m);
    c_decode(a, &PROMPT);
    for &t in &PROMPT {
        assert_eq!(unsafe { fnx_decode_token(b, t) }, FNX_OK);
    }
    assert_eq!(observe(a), observe(b));
    assert_eq!(logits(a, vocab), logits(b, vocab));
    unsafe {
        let before = observe(a);
        assert_eq!(fnx_decode_tokens(a, null(), 0), FNX_OK);
        assert_eq!(fnx_decode_tokens(a, PROMPT.as_ptr(), 0), FNX_OK);
        assert_eq!(observe(a), before);
        assert_eq!(
            fnx_decode_tokens(null_mut(), PROMPT.as_ptr(), 1),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(fnx_decode_tokens(a, null(), 3), FNX_ERR_NULL_ARGUMENT);
        assert!(last_error().contains("tokens is NULL"), "{}", last_error());
        let bad = [1, 2, -4, 5];
        assert_eq!(
            fnx_decode_tokens(a, bad.as_ptr(), 4),
            FNX_ERR_TOKEN_OUT_OF_RANGE
        );
        assert!(last_error().contains("tokens[2] is -4"), "{}", last_error());
        let bad = [1, 2, 3, vocab as i32];
        assert_eq!(
            fnx_decode_tokens(a, bad.as_ptr(), 4),
            FNX_ERR_TOKEN_OUT_OF_RANGE
        );
        assert!(last_error().contains("index 3"), "{}", last_error());
        // 6 decoded, limit 10: five more do not fit, and none is decoded.
        assert_eq!(
            fnx_decode_tokens(a, PROMPT.as_ptr(), 5),
            FNX_ERR_CONTEXT_FULL
        );
        assert!(last_error().contains("4 left"), "{}", last_error());
        assert_eq!(observe(a), before, "a refused call changed the state");
        assert_eq!(fnx_decode_tokens(a, PROMPT.as_ptr(), 4), FNX_OK);
        assert_eq!(fnx_state_position(a), 10);
        assert_eq!(
            fnx_decode_tokens(m.cast(), PROMPT.as_ptr(), 1),
            FNX_ERR_INVALID_HANDLE
        );
        fnx_free_model(m);
        assert_eq!(
            fnx_decode_tokens(b, PROMPT.as_ptr(), 1),
            FNX_ERR_MODEL_FREED
        );
        fnx_free_state(a);
        fnx_free_state(b);
    }
}

// ---------------------------------------------------------------------------
// fnx_generate

#[test]
fn greedy_generation_matches_decoding_by_hand() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let (expected, final_logits) = manual_greedy(m, &PROMPT, 12);
    let s = new_state(m);
    let mut p = gen_params();
    p.max_tokens = 12;
    let (st, stream, n) = c_generate(s, &PROMPT, Some(&p), 0);
    assert_eq!(st, FNX_OK, "{}", last_error());
    assert_eq!(n, 12);
    assert_eq!(stream.tokens, expected);
    assert_eq!(unsafe { fnx_state_position(s) }, PROMPT.len() + 12);
    assert_eq!(
        logits(s, vocab),
        final_logits,
        "every generated token is decoded into the state"
    );

    // Continuing with an empty prompt picks up from the state's logits.
    let (more, _) = manual_greedy(m, &[PROMPT.as_slice(), &expected].concat(), 3);
    p.max_tokens = 3;
    let (st, stream, n) = c_generate(s, &[], Some(&p), 0);
    assert_eq!((st, n), (FNX_OK, 3));
    assert_eq!(stream.tokens, more);
    unsafe {
        // on_token and out_n_generated may be NULL.
        assert_eq!(
            fnx_generate(s, null(), 0, &p, None, null_mut(), null_mut()),
            FNX_OK
        );
        assert_eq!(fnx_state_position(s), PROMPT.len() + 18);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn generation_stops_where_asked() {
    let m = load(fixture_gguf(), None).unwrap();
    let (greedy, _) = manual_greedy(m, &PROMPT, 10);
    // A stop token: the first token not seen earlier in the output, at index >= 2.
    let i = (2..10)
        .find(|&i| !greedy[..i].contains(&greedy[i]))
        .expect("a fresh token");
    let stops = [100_000, greedy[i]];
    let mut p = gen_params();
    p.max_tokens = 10;
    p.stop_tokens = stops.as_ptr();
    p.n_stop_tokens = 2;
    let s = new_state(m);
    let (st, stream, n) = c_generate(s, &PROMPT, Some(&p), 0);
    assert_eq!((st, n), (FNX_OK, i + 1), "{}", last_error());
    assert_eq!(stream.tokens, greedy[..=i]);
    assert_eq!(
        unsafe { fnx_state_position(s) },
        PROMPT.len() + i + 1,
        "the stop token is decoded"
    );
    unsafe { fnx_free_state(s) };

    // The callback returning false stops after that token.
    let s = new_state(m);
    let (st, stream, n) = c_generate(s, &PROMPT, Some(&gen_params()), 3);
    assert_eq!((st, n, stream.tokens.as_slice()), (FNX_OK, 3, &greedy[..3]));
    unsafe { fnx_free_state(s) };

    // The model's EOS token stops generation unless ignore_eos. A greedy
    // sampler with a large negative presence penalty makes EOS, once
    // accepted, the only choice.
    let eos = unsafe { fnx_model_eos_token(m) };
    assert!(eos >= 0, "the fixture names an EOS token");
    for ignore_eos in [false, true] {
        let mut sp = fnx_sampler_params_default();
        sp.temperature = 0.0;
        sp.presence_penalty = -1e6;
        let mut smp = null_mut();
        let s = new_state(m);
        unsafe {
            assert_eq!(fnx_sampler_new(&sp, &mut smp), FNX_OK);
            assert_eq!(fnx_sampler_accept(smp, eos as i32), FNX_OK);
        }
        let mut p = fnx_generate_params_default();
        p.sampler = smp;
        p.max_tokens = 3;
        p.ignore_eos = ignore_eos;
        let (st, stream, n) = c_generate(s, &PROMPT, Some(&p), 0);
        assert_eq!(st, FNX_OK);
        assert_eq!(n, if ignore_eos { 3 } else { 1 });
        assert!(stream.tokens.iter().all(|&t| t as i64 == eos));
        unsafe {
            fnx_sampler_free(smp);
            fnx_free_state(s);
        }
    }

    // A full context ends generation without an error.
    let mut lp = fnx_load_params_default();
    lp.n_ctx = 9;
    let short = load(fixture_gguf(), Some(&lp)).unwrap();
    let s = new_state(short);
    let (st, stream, n) = c_generate(s, &PROMPT, Some(&gen_params()), 0);
    assert_eq!((st, n), (FNX_OK, 3), "{}", last_error());
    assert_eq!(stream.tokens, greedy[..3]);
    assert_eq!(unsafe { fnx_state_position(s) }, 9);
    let (st, _, n) = c_generate(s, &[], Some(&gen_params()), 0);
    assert_eq!((st, n), (FNX_OK, 0));
    unsafe {
        fnx_free_state(s);
        fnx_free_model(short);
        fnx_free_model(m);
    }
}

#[test]
fn seeded_generation_is_reproducible() {
    let m = load(fixture_gguf(), None).unwrap();
    let run = |seed: u64| {
        let mut sp = fnx_sampler_params_default();
        let name = CString::new("thinking").unwrap();
        assert_eq!(
            unsafe { fnx_sampler_params_preset(name.as_ptr(), &mut sp) },
            FNX_OK
        );
        sp.seed = seed;
        let mut smp = null_mut();
        assert_eq!(unsafe { fnx_sampler_new(&sp, &mut smp) }, FNX_OK);
        let s = new_state(m);
        let mut p = gen_params();
        p.sampler = smp;
        p.max_tokens = 24;
        let (st, stream, n) = c_generate(s, &PROMPT, Some(&p), 0);
        assert_eq!((st, n), (FNX_OK, 24), "{}", last_error());
        unsafe {
            fnx_sampler_free(smp);
            fnx_free_state(s);
        }
        stream.tokens
    };
    let a = run(1);
    assert_eq!(a, run(1));
    assert_ne!(a, run(2));
    unsafe { fnx_free_model(m) };
}

#[test]
fn generate_refuses_bad_arguments_without_changing_anything() {
    let mut lp = fnx_load_params_default();
    lp.n_ctx = 12;
    let m = load(fixture_gguf(), Some(&lp)).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) } as i32;
    let s = new_state(m);
    // No logits yet and no prompt.
    let (st, _, n) = c_generate(s, &[], Some(&gen_params()), 0);
    assert_eq!((st, n), (FNX_ERR_NO_LOGITS, 7777));
    c_decode(s, &PROMPT[..2]);
    let before = observe(s);
    let empty = CString::new("").unwrap();
    let stop = CString::new("x").unwrap();
    let strs_null: [*const c_char; 2] = [stop.as_ptr(), null()];
    let strs_empty: [*const c_char; 1] = [empty.as_ptr()];
    let neg = [-3];
    type Edit = Box<dyn Fn(&mut fnx_generate_params)>;
    let cases: Vec<(Edit, Vec<i32>, fnx_status, &str)> = vec![
        (
            Box::new(|p| p.struct_size = 4),
            PROMPT.to_vec(),
            FNX_ERR_INVALID_ARGUMENT,
            "struct_size",
        ),
        (
            Box::new(|p| p.n_stop_tokens = 2),
            PROMPT.to_vec(),
            FNX_ERR_NULL_ARGUMENT,
            "stop_tokens is NULL",
        ),
        (
            Box::new(|p| p.n_stop_strings = 1),
            PROMPT.to_vec(),
            FNX_ERR_NULL_ARGUMENT,
            "stop_strings is NULL",
        ),
        (
            Box::new(move |p| {
                p.stop_strings = strs_null.as_ptr();
                p.n_stop_strings = 2
            }),
            PROMPT.to_vec(),
            FNX_ERR_NULL_ARGUMENT,
            "stop_strings[1] is NULL",
        ),
        (
            Box::new(move |p| {
                p.stop_strings = strs_empty.as_ptr();
                p.n_stop_strings = 1
            }),
            PROMPT.to_vec(),
            FNX_ERR_INVALID_ARGUMENT,
            "stop_strings[0] is empty",
        ),
        (
            Box::new(move |p| {
                p.stop_tokens = neg.as_ptr();
                p.n_stop_tokens = 1
            }),
            PROMPT.to_vec(),
            FNX_ERR_TOKEN_OUT_OF_RANGE,
            "stop_tokens[0] is -3",
        ),
        (
            Box::new(|_| {}),
            vec![1, -1],
            FNX_ERR_TOKEN_OUT_OF_RANGE,
            "prompt[1] is -1",
        ),
        (
            Box::new(|_| {}),
            vec![1, vocab],
            FNX_ERR_TOKEN_OUT_OF_RANGE,
            "out of range",
        ),
        (
            Box::new(|_| {}),
            vec![1; 11],
            FNX_ERR_CONTEXT_FULL,
            "do not fit",
        ),
    ];
    for (edit, prompt, status, needle) in cases {
        let mut p = gen_params();
        edit(&mut p);
        let (st, stream, n) = c_generate(s, &prompt, Some(&p), 0);
        assert_eq!(st, status, "{needle}: {}", last_error());
        assert!(last_error().contains(needle), "{needle}: {}", last_error());
        assert!(
            last_error().starts_with("fnx_generate: "),
            "{}",
            last_error()
        );
        assert_eq!(n, 7777);
        assert!(stream.tokens.is_empty());
        assert_eq!(observe(s), before, "{needle}: state changed");
    }
    unsafe {
        // A handle of the wrong kind as the sampler.
        let mut p = gen_params();
        p.sampler = m.cast();
        assert_eq!(
            c_generate(s, &PROMPT, Some(&p), 0).0,
            FNX_ERR_INVALID_HANDLE
        );
        assert!(last_error().contains("fnx_sampler"), "{}", last_error());
        // NULL state, prompt NULL with a count, wrong state handle.
        assert_eq!(
            fnx_generate(
                null_mut(),
                PROMPT.as_ptr(),
                1,
                null(),
                None,
                null_mut(),
                null_mut()
            ),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_generate(s, null(), 2, null(), None, null_mut(), null_mut()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert!(last_error().contains("prompt is NULL"), "{}", last_error());
        assert_eq!(
            fnx_generate(
                m.cast(),
                PROMPT.as_ptr(),
                1,
                null(),
                None,
                null_mut(),
                null_mut()
            ),
            FNX_ERR_INVALID_HANDLE
        );
        assert_eq!(observe(s), before);
        fnx_free_model(m);
        assert_eq!(c_generate(s, &PROMPT, None, 0).0, FNX_ERR_MODEL_FREED);
        fnx_free_state(s);
    }
}

#[test]
fn c_generate_streams_the_model_text_and_stops_on_strings() {
    let rust = Model::load(fixture_gguf(), &LoadOptions::default()).unwrap();
    let tok = Tokenizer::from_metadata(&rust.metadata).expect("the fixture has a tokenizer");
    let tok = &tok;
    let m = load(fixture_gguf(), None).unwrap();
    let s = new_state(m);
    let mut p = gen_params();
    p.max_tokens = 24;
    let (st, stream, _) = c_generate(s, &PROMPT, Some(&p), 0);
    assert_eq!(st, FNX_OK, "{}", last_error());
    unsafe { fnx_free_state(s) };
    // The pieces are the tokenizer's text, split at whole characters.
    let text: Vec<u8> = stream.pieces.concat();
    let ids: Vec<u32> = stream.tokens.iter().map(|&t| t as u32).collect();
    let full = tok.decode(&ids, true).unwrap();
    let text = String::from_utf8(text).expect("pieces are whole UTF-8 characters");
    assert!(
        full.starts_with(&text) && full.len() - text.len() <= 3,
        "{text:?} vs {full:?}"
    );
    assert!(!text.is_empty(), "the fixture's greedy output has text");

    // A stop string taken from the middle of that text, across pieces when possible.
    let start = text.len() / 3;
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap();
    let end = (start + 3..=text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    let stop = &text[start..end];
    let first_end = text.find(stop).unwrap() + stop.len();
    let mut len = 0;
    let expect_n = stream
        .pieces
        .iter()
        .position(|p| {
            len += p.len();
            len >= first_end
        })
        .unwrap()
        + 1;
    let c_stop = CString::new(stop).unwrap();
    let stops = [c_stop.as_ptr()];
    p.stop_strings = stops.as_ptr();
    p.n_stop_strings = 1;
    let s = new_state(m);
    let (st, stopped, n) = c_generate(s, &PROMPT, Some(&p), 0);
    assert_eq!(st, FNX_OK, "{}", last_error());
    assert_eq!(n, expect_n, "stop string {stop:?}");
    assert_eq!(stopped.tokens, stream.tokens[..expect_n]);
    unsafe {
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

// ---------------------------------------------------------------------------
// Rust generation API and stop strings

#[test]
fn stop_matcher_finds_strings_across_pieces_once() {
    let mut m = StopMatcher::new(vec![
        b"world".to_vec(),
        b"lo w".to_vec(),
        b"\xc3\xa9t\xc3\xa9".to_vec(),
    ])
    .unwrap();
    assert_eq!(m.push(b"hel"), None);
    assert_eq!(m.push(b"lo"), None);
    // "lo w" ends before "world": the earliest-ending match wins.
    assert_eq!(m.push(b" world"), Some(1));
    let mut m = StopMatcher::new(vec![b"ab".to_vec(), b"b".to_vec()]).unwrap();
    // Both end at the same byte: the lower index.
    assert_eq!(m.push(b"xab"), Some(0));
    // Old text does not match again.
    assert_eq!(m.push(b"x"), None);
    // Bytes of a multi-byte character may arrive in separate pieces.
    let mut m = StopMatcher::new(vec![b"\xc3\xa9t\xc3\xa9".to_vec()]).unwrap();
    let got: Vec<Option<usize>> = [&b"\xc3"[..], b"\xa9", b"t\xc3", b"", b"\xa9"]
        .into_iter()
        .map(|p| m.push(p))
        .collect();
    assert_eq!(got, [None, None, None, None, Some(0)]);
}

#[test]
fn stop_matcher_refuses_empty_strings() {
    assert!(StopMatcher::new(vec![b"a".to_vec(), Vec::new()]).is_err());
    let mut none = StopMatcher::new(Vec::new()).unwrap();
    assert_eq!(none.push(b"anything"), None);
}

#[test]
fn rust_generate_streams_text_and_stops_on_strings() {
    // Micro-batches of one token: the abort callback is polled before each.
    let m = Model::load(fixture_gguf(), &LoadOptions { micro_batch: 1, ..Default::default() }).unwrap();
    let prompt: Vec<u32> = PROMPT.iter().map(|&t| t as u32).collect();
    let text = |t: u32| format!("<{t}>").into_bytes();
    let opts = GenerateOptions {
        max_tokens: 12,
        ..Default::default()
    };
    let mut s = State::new(m.clone()).unwrap();
    let mut pieces = Vec::new();
    let g = generate::generate(
        &mut s,
        &prompt,
        None,
        &opts,
        &mut text.clone(),
        &mut || false,
        &mut |t, p| {
            pieces.push((t, p.to_vec()));
            true
        },
    )
    .unwrap();
    assert_eq!(g.stop, StopReason::MaxTokens);
    assert_eq!(g.tokens.len(), 12);
    assert!(pieces.iter().all(|(t, p)| *p == text(*t)));
    let full: Vec<u8> = pieces.iter().flat_map(|(_, p)| p.clone()).collect();

    // A stop string spanning two tokens' text: the generation stops at the
    // first token whose text completes it.
    let stop = format!("{}><{}", g.tokens[4], g.tokens[5]).into_bytes();
    let end = full
        .windows(stop.len())
        .position(|w| w == &stop[..])
        .unwrap()
        + stop.len();
    let mut len = 0;
    let expect_n = pieces
        .iter()
        .position(|(_, p)| {
            len += p.len();
            len >= end
        })
        .unwrap()
        + 1;
    let opts2 = GenerateOptions {
        max_tokens: 12,
        stop_strings: vec![b"never".to_vec(), stop],
        ..Default::default()
    };
    let mut s2 = State::new(m.clone()).unwrap();
    let g2 = generate::generate(
        &mut s2,
        &prompt,
        None,
        &opts2,
        &mut text.clone(),
        &mut || false,
        &mut |_, _| true,
    )
    .unwrap();
    assert_eq!(g2.stop, StopReason::StopString(1));
    assert_eq!(g2.tokens, g.tokens[..expect_n]);

    // Without text, stop strings never match.
    let mut s3 = State::new(m.clone()).unwrap();
    let g3 = generate::generate(
        &mut s3,
        &prompt,
        None,
        &opts2,
        &mut NoText,
        &mut || false,
        &mut |_, p| {
            assert!(p.is_empty());
            true
        },
    )
    .unwrap();
    assert_eq!((g3.stop, g3.tokens.len()), (StopReason::MaxTokens, 12));

    // Stop tokens, with a sampler; an abort rolls back state and sampler.
    let mut smp = Sampler::new(SamplerParams {
        seed: 3,
        ..SamplerParams::thinking()
    })
    .unwrap();
    let mut s4 = State::new(m.clone()).unwrap();
    let before = (s4.save().unwrap(), format!("{smp:?}"));
    let mut polls = 0;
    let r = generate::generate(
        &mut s4,
        &prompt,
        Some(&mut smp),
        &opts,
        &mut NoText,
        &mut || {
            polls += 1;
            polls > 9
        },
        &mut |_, _| true,
    );
    assert!(matches!(r, Err(Error::Aborted)));
    assert_eq!((s4.save().unwrap(), format!("{smp:?}")), before);
    let g4 = generate::generate(
        &mut s4,
        &prompt,
        Some(&mut smp),
        &opts,
        &mut NoText,
        &mut || false,
        &mut |_, _| true,
    )
    .unwrap();
    let opts5 = GenerateOptions {
        stop_tokens: vec![g4.tokens[2]],
        ..opts.clone()
    };
    let mut smp5 = Sampler::new(SamplerParams {
        seed: 3,
        ..SamplerParams::thinking()
    })
    .unwrap();
    let mut s5 = State::new(m.clone()).unwrap();
    let g5 = generate::generate(
        &mut s5,
        &prompt,
        Some(&mut smp5),
        &opts5,
        &mut NoText,
        &mut || false,
        &mut |_, _| true,
    )
    .unwrap();
    let first = g4.tokens.iter().position(|&t| t == g4.tokens[2]).unwrap();
    assert_eq!(g5.stop, StopReason::StopToken(g4.tokens[2]));
    assert_eq!(g5.tokens, g4.tokens[..=first]);

    // Rust decode_tokens: atomic and abortable.
    let mut s6 = State::new(m.clone()).unwrap();
    let snap = s6.save().unwrap();
    let mut n = 0;
    let r = generate::decode_tokens(&mut s6, &prompt, &mut || {
        n += 1;
        n > 3
    });
    assert!(matches!(r, Err(Error::Aborted)));
    assert_eq!(s6.save().unwrap(), snap);
    assert!(matches!(
        generate::decode_tokens(&mut s6, &[1, 1_000_000], &mut || false),
        Err(Error::TokenOutOfRange(_))
    ));
    assert_eq!(s6.save().unwrap(), snap);
    generate::decode_tokens(&mut s6, &prompt, &mut || false).unwrap();
    s.reset().unwrap();
    s.decode_tokens(&prompt).unwrap();
    assert_eq!(s6.save().unwrap(), s.save().unwrap());
}

// ---------------------------------------------------------------------------
// Leak checks (child process)

#[test]
fn cancel_and_abort_leak_nothing() {
    if !leaks::in_child("cancel_and_abort_leak_nothing") {
        return;
    }
    let path = fixture_gguf();
    leaks::check_counter();

    let (_, all) = load_with_progress(path, usize::MAX);
    for k in 1..=all.len() {
        let g = leaks::growth(5, || {
            let (r, _) = load_with_progress(path, k);
            assert_eq!(r.unwrap_err().0, FNX_ERR_CANCELLED);
        });
        assert_eq!(g, 0, "a load cancelled at call {k} leaked {g} bytes");
    }
    let g = leaks::growth(5, || unsafe { fnx_free_model(load(path, None).unwrap()) });
    assert_eq!(g, 0, "load + free leaked {g} bytes");

    // Micro-batches of one token: the abort callback is polled before each.
    let mut lp = fnx_load_params_default();
    lp.micro_batch = 1;
    let m = load(path, Some(&lp)).unwrap();
    let budget = AtomicI64::new(0);
    let ud = (&budget as *const AtomicI64).cast_mut().cast::<c_void>();
    let mut sp = fnx_sampler_params_default();
    sp.seed = 4;
    for k in [0, 3, 8] {
        let g = leaks::growth(5, || unsafe {
            let s = new_state(m);
            c_decode(s, &PROMPT[..2]);
            assert_eq!(
                fnx_state_set_abort_callback(s, Some(abort_after), ud),
                FNX_OK
            );
            budget.store(k, Ordering::SeqCst);
            let st = fnx_decode_tokens(s, PROMPT.as_ptr(), PROMPT.len());
            assert_eq!(st, if k < 6 { FNX_ERR_ABORTED } else { FNX_OK });
            let mut smp = null_mut();
            assert_eq!(fnx_sampler_new(&sp, &mut smp), FNX_OK);
            let mut gp = gen_params();
            gp.sampler = smp;
            gp.max_tokens = 6;
            budget.store(k, Ordering::SeqCst);
            let (st, _, _) = c_generate(s, &PROMPT, Some(&gp), 0);
            assert_eq!(st, FNX_ERR_ABORTED);
            let mut copy = null_mut();
            assert_eq!(fnx_state_copy(s, &mut copy), FNX_OK);
            let (_, snap) = observe(copy);
            assert_eq!(
                fnx_state_load(copy, snap.as_ptr(), snap.len() - 1),
                FNX_ERR_SNAPSHOT_CORRUPT
            );
            fnx_sampler_free(smp);
            fnx_free_state(copy);
            fnx_free_state(s);
        });
        assert_eq!(g, 0, "abort after {k} polls leaked {g} bytes");
    }
    unsafe { fnx_free_model(m) };
}

// ---------------------------------------------------------------------------
// C program under AddressSanitizer / valgrind

const C_PROGRAM: &str = r#"
#include "flashnext.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call, want)                                                              \
    do {                                                                               \
        fnx_status st_ = (call);                                                       \
        if (st_ != (want)) {                                                           \
            fprintf(stderr, "line %d: %s gave %s (%s), wanted %s\n", __LINE__, #call, \
                    fnx_status_name(st_), fnx_last_error(), #want);                    \
            return 1;                                                                  \
        }                                                                              \
    } while (0)

static bool cancel_third(float progress, void *user_data) {
    int *calls = user_data;
    (void)progress;
    return ++*calls < 3;
}

static bool abort_after(void *user_data) {
    int *budget = user_data;
    return --*budget < 0;
}

static bool on_token(int32_t token, const char *piece, size_t len, void *user_data) {
    size_t *n = user_data;
    (void)token;
    if (piece[len] != '\0') return false;
    ++*n;
    return true;
}

static void on_log(int32_t level, const char *message, void *user_data) {
    size_t *n = user_data;
    if (level >= FNX_LOG_ERROR && level <= FNX_LOG_DEBUG && strlen(message) > 0) ++*n;
}

int main(int argc, char **argv) {
    static const int32_t prompt[] = {3, 14, 15, 92, 65, 35};
    const char *stops[] = {"never-appears"};
    fnx_load_params lp = fnx_load_params_default();
    fnx_model *model = NULL;
    fnx_state *state = NULL, *copy = NULL;
    fnx_sampler *sampler = NULL;
    fnx_sampler_params sp;
    fnx_generate_params gp = fnx_generate_params_default();
    size_t logs = 0, pieces = 0, generated = 0, size = 0, written = 0;
    int calls = 0, budget = 0;
    uint8_t *snapshot;

    if (argc != 2) return 2;
    fnx_set_log_callback(on_log, &logs);
    lp.progress_callback = cancel_third;
    lp.progress_user_data = &calls;
    CHECK(fnx_load(argv[1], &lp, &model), FNX_ERR_CANCELLED);
    if (model != NULL || calls != 3) return 1;
    lp.progress_callback = NULL;
    lp.micro_batch = 1; /* the abort callback is polled before each micro-batch */
    CHECK(fnx_load(argv[1], &lp, &model), FNX_OK);
    if (logs == 0) return 1;
    CHECK(fnx_new_state(model, &state), FNX_OK);

    budget = 3;
    CHECK(fnx_state_set_abort_callback(state, abort_after, &budget), FNX_OK);
    CHECK(fnx_decode_tokens(state, prompt, 6), FNX_ERR_ABORTED);
    if (fnx_state_position(state) != 0) return 1;
    CHECK(fnx_state_set_abort_callback(state, NULL, NULL), FNX_OK);
    CHECK(fnx_decode_tokens(state, prompt, 6), FNX_OK);

    CHECK(fnx_sampler_params_preset("thinking", &sp), FNX_OK);
    sp.seed = 1;
    CHECK(fnx_sampler_new(&sp, &sampler), FNX_OK);
    gp.max_tokens = 8;
    gp.sampler = sampler;
    gp.stop_strings = stops;
    gp.n_stop_strings = 1;
    gp.ignore_eos = true;
    budget = 4;
    CHECK(fnx_state_set_abort_callback(state, abort_after, &budget), FNX_OK);
    CHECK(fnx_generate(state, prompt, 2, &gp, on_token, &pieces, &generated), FNX_ERR_ABORTED);
    if (fnx_state_position(state) != 6 || generated != 0) return 1;
    CHECK(fnx_state_set_abort_callback(state, NULL, NULL), FNX_OK);
    CHECK(fnx_generate(state, NULL, 0, &gp, on_token, &pieces, &generated), FNX_OK);
    if (generated != 8 || fnx_state_position(state) != 14) return 1;

    CHECK(fnx_state_save_size(state, &size), FNX_OK);
    snapshot = malloc(size);
    if (snapshot == NULL) return 1;
    CHECK(fnx_state_save(state, snapshot, size, &written), FNX_OK);
    CHECK(fnx_state_copy(state, &copy), FNX_OK);
    CHECK(fnx_decode_token(copy, 1), FNX_OK);
    CHECK(fnx_state_load(copy, snapshot, written), FNX_OK);
    if (fnx_state_position(copy) != 14) return 1;
    snapshot[written / 2] ^= 1;
    CHECK(fnx_state_load(copy, snapshot, written), FNX_ERR_SNAPSHOT_CORRUPT);
    free(snapshot);

    printf("ok: %zu generated, %zu pieces streamed, %zu log lines\n", generated, pieces, logs);
    fnx_set_log_callback(NULL, NULL);
    fnx_sampler_free(sampler);
    fnx_free_state(copy);
    fnx_free_state(state);
    fnx_free_model(model);
    return 0;
}
"#;

fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(
        dir.join("libflashnext.so").exists(),
        "{} has no libflashnext.so; run cargo build first",
        dir.display()
    );
    dir
}

fn compile(src: &Path, out: &Path, extra: &[&str]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    let status = Command::new("cc")
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-O1",
            "-g",
        ])
        .args(extra)
        .arg("-I")
        .arg(root.join("include"))
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lflashnext")
        .status()
        .expect("a C compiler (cc) is installed");
    assert!(status.success(), "compiling the callbacks C program failed");
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn c_program_with_callbacks_is_clean_under_sanitizers() {
    let dir = std::env::temp_dir().join(format!("flashnext-callbacks-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("callbacks.c");
    std::fs::write(&src, C_PROGRAM).unwrap();
    let model = fixture_gguf();

    let plain = dir.join("callbacks");
    compile(&src, &plain, &[]);
    let out = run_ok(Command::new(&plain).arg(model));
    assert!(out.contains("ok: 8 generated"), "{out}");

    let asan = dir.join("callbacks-asan");
    compile(
        &src,
        &asan,
        &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    );
    run_ok(
        Command::new(&asan)
            .arg(model)
            .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1"),
    );

    if Command::new("valgrind").arg("--version").output().is_ok() {
        run_ok(
            // Auto would probe Vulkan (dlopen of the driver): valgrind reports
            // glibc's loader there (a known false positive), so take the CPU.
            Command::new("valgrind")
                .env("FNX_BACKEND", "cpu")
                .args([
                    "--error-exitcode=9",
                    "--leak-check=full",
                    "--errors-for-leak-kinds=definite",
                    "-q",
                ])
                .arg(&plain)
                .arg(model),
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
