//! Generation jobs (`fnx_job_*`): a job gives what `fnx_generate` gives, polling
//! never blocks, cancelling takes effect before the next token (prompt tokens
//! included), freeing a running job cancels and joins it, many jobs run at
//! once on one model, misuse is refused with the state left alone, and jobs
//! and reply parsers leak nothing (counted in a child process). On the
//! repository's default model (`models/default.gguf`).

mod leaks;
mod util;

use flashnext::capi::*;
use std::ffi::{c_char, c_void, CString};
use std::path::Path;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use util::{last_error, new_state};

const PROMPT: [i32; 8] = [3, 14, 15, 92, 65, 35, 89, 79];

fn model() -> *mut fnx_model {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/default.gguf");
    util::load(&path, None).unwrap()
}

fn params(max_tokens: u32) -> fnx_generate_params {
    let mut p = fnx_generate_params_default();
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    p
}

fn start(s: *mut fnx_state, prompt: &[i32], p: &fnx_generate_params) -> *mut fnx_job {
    let mut job = null_mut();
    // SAFETY: live state, valid prompt and params.
    assert_eq!(unsafe { fnx_job_start(s, prompt.as_ptr(), prompt.len(), p, &mut job) }, FNX_OK, "{}", last_error());
    assert!(!job.is_null());
    job
}

struct Poll {
    text: Vec<u8>,
    n_tokens: usize,
    finished: bool,
}

fn poll(job: *mut fnx_job, capacity: usize) -> Poll {
    let mut buf = vec![0u8; capacity];
    let (mut n, mut n_tokens, mut finished) = (usize::MAX, usize::MAX, false);
    let out = if capacity == 0 { null_mut() } else { buf.as_mut_ptr().cast() };
    // SAFETY: live job; a buffer of `capacity` bytes.
    let st = unsafe { fnx_job_poll(job, out, capacity, &mut n, &mut n_tokens, &mut finished) };
    assert_eq!(st, FNX_OK, "{}", last_error());
    buf.truncate(n);
    Poll { text: buf, n_tokens, finished }
}

/// Polls until the job has finished; all its text.
fn drain(job: *mut fnx_job) -> Vec<u8> {
    let mut text = Vec::new();
    loop {
        let p = poll(job, 64);
        text.extend_from_slice(&p.text);
        if p.finished {
            return text;
        }
        std::thread::yield_now();
    }
}

fn wait(job: *mut fnx_job) -> Result<usize, (fnx_status, String)> {
    let mut n = usize::MAX;
    // SAFETY: live job.
    match unsafe { fnx_job_wait(job, &mut n) } {
        FNX_OK => Ok(n),
        st => {
            assert_eq!(n, usize::MAX, "out_n_generated written on failure");
            Err((st, last_error()))
        }
    }
}

/// `fnx_generate` on `s`: the streamed text and the number of tokens.
fn generate(s: *mut fnx_state, prompt: &[i32], p: &fnx_generate_params) -> (Vec<u8>, usize) {
    unsafe extern "C" fn collect(_t: i32, piece: *const c_char, len: usize, user: *mut c_void) -> bool {
        // SAFETY: `user` is the Vec below; `piece` holds `len` bytes.
        unsafe { (*(user as *mut Vec<u8>)).extend_from_slice(std::slice::from_raw_parts(piece.cast(), len)) };
        true
    }
    let mut text = Vec::new();
    let mut n = 0;
    // SAFETY: live state; the callback's user data outlives the call.
    let st = unsafe {
        fnx_generate(s, prompt.as_ptr(), prompt.len(), p, Some(collect), (&mut text as *mut Vec<u8>).cast(), &mut n)
    };
    assert_eq!(st, FNX_OK, "{}", last_error());
    (text, n)
}

fn logits(m: *mut fnx_model, s: *const fnx_state) -> Vec<f32> {
    // SAFETY: live model.
    util::logits(s, unsafe { fnx_model_vocab_size(m) })
}

#[test]
fn a_job_gives_what_fnx_generate_gives() {
    let m = model();
    let (a, b) = (new_state(m), new_state(m));
    let p = params(40);
    let (want, n_want) = generate(a, &PROMPT, &p);
    let job = start(b, &PROMPT, &p);
    let text = drain(job);
    assert_eq!(wait(job), Ok(n_want));
    assert_eq!(text, want);
    assert!(n_want == 40 && !want.is_empty(), "{n_want} tokens, {} bytes", want.len());
    // The job let go of the state, which holds the same sequence.
    unsafe {
        assert_eq!(fnx_state_position(b), PROMPT.len() + 40);
        assert_eq!(logits(m, b), logits(m, a));
        fnx_job_free(job);
        fnx_free_state(a);
        fnx_free_state(b);
        fnx_free_model(m);
    }
}

#[test]
fn a_text_prompt_and_a_sampler() {
    let m = model();
    let (a, b) = (new_state(m), new_state(m));
    let text = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n";
    let mut ids = vec![0i32; 256];
    let mut n_ids = 0;
    let mut sp = fnx_sampler_params_default();
    sp.seed = 11;
    let (mut s1, mut s2) = (null_mut(), null_mut());
    unsafe {
        assert_eq!(fnx_tokenize(m, text.as_ptr().cast(), text.len(), false, true, ids.as_mut_ptr(), 256, &mut n_ids), FNX_OK);
        assert_eq!(fnx_sampler_new(&sp, &mut s1), FNX_OK);
        assert_eq!(fnx_sampler_new(&sp, &mut s2), FNX_OK);
    }
    let mut p = params(32);
    p.sampler = s1;
    let (want, n_want) = generate(a, &ids[..n_ids], &p);
    p.sampler = s2;
    let mut job = null_mut();
    // SAFETY: live state; valid text and params.
    let st = unsafe { fnx_job_start_text(b, text.as_ptr().cast(), text.len(), true, &p, &mut job) };
    assert_eq!(st, FNX_OK, "{}", last_error());
    assert_eq!(wait(job), Ok(n_want));
    // Text not polled before the job ended is still there.
    assert_eq!(drain(job), want);
    unsafe {
        assert_eq!(fnx_state_position(b), n_ids + n_want);
        fnx_job_free(job);
        fnx_sampler_free(s1);
        fnx_sampler_free(s2);
        fnx_free_state(a);
        fnx_free_state(b);
        fnx_free_model(m);
    }
}

#[test]
fn many_jobs_on_one_model() {
    let m = model();
    let vocab = unsafe { fnx_model_vocab_size(m) } as i32;
    let prompts: Vec<Vec<i32>> = (0..6).map(|k| PROMPT.iter().map(|&t| (t * (k + 1) + k) % vocab).collect()).collect();
    let p = params(48);
    let want: Vec<(Vec<u8>, usize)> = prompts
        .iter()
        .map(|pr| {
            let s = new_state(m);
            let r = generate(s, pr, &p);
            unsafe { fnx_free_state(s) };
            r
        })
        .collect();
    let states: Vec<*mut fnx_state> = prompts.iter().map(|_| new_state(m)).collect();
    let jobs: Vec<*mut fnx_job> = states.iter().zip(&prompts).map(|(&s, pr)| start(s, pr, &p)).collect();
    // One loop polls them all, as a frame loop would.
    let mut texts = vec![Vec::new(); jobs.len()];
    let mut done = vec![false; jobs.len()];
    while done.iter().any(|d| !d) {
        for (i, &job) in jobs.iter().enumerate() {
            let r = poll(job, 16);
            texts[i].extend_from_slice(&r.text);
            done[i] = r.finished;
        }
        std::thread::yield_now();
    }
    for (i, &job) in jobs.iter().enumerate() {
        assert_eq!(wait(job), Ok(want[i].1), "job {i}");
        assert_eq!(texts[i], want[i].0, "job {i}");
        unsafe {
            fnx_job_free(job);
            fnx_free_state(states[i]);
        }
    }
    unsafe { fnx_free_model(m) };
}

#[test]
fn cancel_takes_effect_before_the_next_token() {
    let m = model();
    let s = new_state(m);
    // No limit: only the cancel (or a full context) ends it.
    let job = start(s, &PROMPT, &params(0));
    let t0 = Instant::now();
    let mut seen = 0;
    while seen < 8 {
        let r = poll(job, 0);
        assert!(!r.finished, "the job ended before it was cancelled");
        seen = r.n_tokens;
        std::thread::yield_now();
    }
    let per_token = t0.elapsed() / seen as u32;
    unsafe { assert_eq!(fnx_job_cancel(job), FNX_OK) };
    let cancelled_at = Instant::now();
    let at_cancel = poll(job, 0).n_tokens;
    let (st, msg) = wait(job).unwrap_err();
    let latency = cancelled_at.elapsed();
    assert_eq!(st, FNX_ERR_CANCELLED, "{msg}");
    assert!(msg.contains("cancelled"), "{msg}");
    drain(job);
    let r = poll(job, 0);
    assert!(r.finished);
    // The token being made when the cancel came may still be finished; no other.
    assert!(r.n_tokens <= at_cancel + 1, "{} tokens after the cancel at {at_cancel}", r.n_tokens);
    eprintln!("cancel latency {latency:?} (about {per_token:?} per token while polling; {at_cancel} tokens at the cancel)");
    assert!(latency < Duration::from_secs(2), "cancel took {latency:?}");
    unsafe {
        // A cancelled job leaves the state as before it: usable, at position 0.
        assert_eq!(fnx_state_position(s), 0);
        assert_eq!(fnx_decode_token(s, 1), FNX_OK);
        // Cancelling a finished job changes nothing.
        assert_eq!(fnx_job_cancel(job), FNX_OK);
        assert_eq!(wait(job).unwrap_err().0, FNX_ERR_CANCELLED);
        fnx_job_free(job);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

/// Counts the polls of the state's abort callback.
unsafe extern "C" fn count_polls(user: *mut c_void) -> bool {
    // SAFETY: `user` is the test's AtomicUsize, alive while the callback is set.
    unsafe { (*(user as *const AtomicUsize)).fetch_add(1, Ordering::SeqCst) };
    false
}

/// A cancel lands within the prompt, between two layers of its pass: the
/// whole prompt is one micro-batch here, so polls between passes alone
/// would let it run to its end first.
#[test]
fn cancel_takes_effect_within_the_prompt() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/default.gguf");
    let mut lp = fnx_load_params_default();
    lp.micro_batch = 4096;
    let m = util::load(&path, Some(&lp)).unwrap();
    let s = new_state(m);
    let (n_ctx, n_layers) = unsafe { (fnx_model_context_length(m), fnx_model_n_layers(m)) };
    assert!(n_layers >= 3, "the test needs layer boundaries to cancel at");
    let n_prompt = n_ctx.min(4096) - 1;
    let prompt: Vec<i32> = (0..n_prompt as i32).map(|i| (i * 7 + 3) % 200).collect();
    let polls = AtomicUsize::new(0);
    unsafe {
        assert_eq!(fnx_state_set_abort_callback(s, Some(count_polls), (&polls as *const AtomicUsize).cast_mut().cast()), FNX_OK);
    }
    let job = start(s, &prompt, &params(4));
    // One poll before the prompt, then one between each two layers of its
    // one pass: the second is the first layer boundary.
    while polls.load(Ordering::SeqCst) < 2 {
        assert!(!poll(job, 0).finished, "the job ended before its prompt's first layer boundary");
        std::thread::yield_now();
    }
    unsafe { assert_eq!(fnx_job_cancel(job), FNX_OK) };
    let at_cancel = polls.load(Ordering::SeqCst);
    assert_eq!(wait(job).unwrap_err().0, FNX_ERR_CANCELLED);
    let after = polls.load(Ordering::SeqCst);
    // The cancel flag is checked before the state's callback: at most the
    // check that was under way when it came sees the callback once more.
    assert!(after <= at_cancel + 1, "{after} polls after the cancel at {at_cancel}");
    // The pass's last boundary is poll 1 + (n_layers - 1): it was not reached.
    assert!(after < n_layers, "the prompt's pass ran to its end ({after} polls, {n_layers} layers)");
    let r = poll(job, 16);
    assert!(r.finished && r.n_tokens == 0 && r.text.is_empty());
    unsafe {
        // The state is as before the job, and decodes the same as a fresh one.
        assert_eq!(fnx_state_position(s), 0);
        assert_eq!(fnx_state_set_abort_callback(s, None, std::ptr::null_mut()), FNX_OK);
        let fresh = new_state(m);
        let v = fnx_model_vocab_size(m);
        let (mut a, mut b) = (vec![0f32; v], vec![0f32; v]);
        for st in [s, fresh] {
            assert_eq!(fnx_decode_tokens(st, prompt.as_ptr(), 64), FNX_OK);
        }
        assert_eq!(fnx_get_logits(s, a.as_mut_ptr(), v), FNX_OK);
        assert_eq!(fnx_get_logits(fresh, b.as_mut_ptr(), v), FNX_OK);
        assert_eq!(a, b, "the cancelled state decodes as a fresh one");
        fnx_free_state(fresh);
        fnx_job_free(job);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn freeing_a_running_job_cancels_and_joins_it() {
    let m = model();
    let s = new_state(m);
    for wait_for in [0, 4] {
        let job = start(s, &PROMPT, &params(0));
        while poll(job, 0).n_tokens < wait_for {
            std::thread::yield_now();
        }
        let t = Instant::now();
        unsafe { fnx_job_free(job) };
        eprintln!("freeing a running job after {wait_for} tokens took {:?}", t.elapsed());
        unsafe {
            // Joined: the state is free again at once, as it was before the job.
            assert_eq!(fnx_state_position(s), 0);
            assert_eq!(fnx_decode_token(s, 5), FNX_OK, "{}", last_error());
            assert_eq!(fnx_state_reset(s), FNX_OK);
            // The handle is gone.
            assert_eq!(fnx_job_cancel(job), FNX_ERR_INVALID_HANDLE);
            fnx_job_free(job);
        }
    }
    unsafe {
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn polling_after_completion_and_in_small_pieces() {
    let m = model();
    let s = new_state(m);
    let p = params(24);
    let reference = new_state(m);
    let (want, n_want) = generate(reference, &PROMPT, &p);
    let job = start(s, &PROMPT, &p);
    assert_eq!(wait(job), Ok(n_want));
    // Text comes in whole characters: with room for 4 bytes, no piece splits one.
    let mut text = Vec::new();
    loop {
        let r = poll(job, 4);
        std::str::from_utf8(&r.text).expect("a poll split a character");
        assert_eq!(r.n_tokens, n_want);
        text.extend_from_slice(&r.text);
        if r.finished {
            break;
        }
        assert!(!r.text.is_empty(), "an unfinished poll of a finished job gave nothing");
    }
    assert_eq!(text, want);
    // With room for one byte, a longer character is refused with its length, and nothing is taken.
    let other = new_state(m);
    let again = start(other, &PROMPT, &p);
    assert_eq!(wait(again), Ok(n_want));
    let mut text = Vec::new();
    let mut refused = 0;
    loop {
        let mut buf = [0u8; 4];
        let (mut n, mut fin) = (0usize, false);
        // SAFETY: live job, room for 1 byte.
        match unsafe { fnx_job_poll(again, buf.as_mut_ptr().cast(), 1, &mut n, null_mut(), &mut fin) } {
            FNX_OK => text.extend_from_slice(&buf[..n]),
            FNX_ERR_BUFFER_TOO_SMALL => {
                assert!((2..=4).contains(&n), "{n}");
                refused += 1;
                // SAFETY: as above, with the room asked for.
                assert_eq!(unsafe { fnx_job_poll(again, buf.as_mut_ptr().cast(), n, &mut n, null_mut(), &mut fin) }, FNX_OK);
                text.extend_from_slice(&buf[..n]);
            }
            st => panic!("{st}: {}", last_error()),
        }
        if fin {
            break;
        }
    }
    assert_eq!(text, want);
    eprintln!("{refused} characters longer than one byte in {} bytes", want.len());
    unsafe {
        fnx_job_free(again);
        fnx_free_state(other);
    }
    for _ in 0..3 {
        let r = poll(job, 64);
        assert!(r.finished && r.text.is_empty() && r.n_tokens == n_want);
        assert_eq!(wait(job), Ok(n_want));
    }
    // Polling costs little: measure it on the finished job.
    let mut buf = [0u8; 64];
    let (mut n, mut nt, mut fin) = (0, 0, false);
    let rounds = 100_000;
    let t = Instant::now();
    for _ in 0..rounds {
        // SAFETY: live job, a 64-byte buffer.
        unsafe { fnx_job_poll(job, buf.as_mut_ptr().cast(), buf.len(), &mut n, &mut nt, &mut fin) };
    }
    eprintln!("fnx_job_poll: {:?} per call", t.elapsed() / rounds);
    unsafe {
        fnx_job_free(job);
        fnx_free_state(s);
        fnx_free_state(reference);
        fnx_free_model(m);
    }
}

#[test]
fn misuse_is_refused_and_the_state_is_busy_while_a_job_runs() {
    let m = model();
    let s = new_state(m);
    let mut sampler = null_mut();
    unsafe { assert_eq!(fnx_sampler_new(&fnx_sampler_params_default(), &mut sampler), FNX_OK) };
    let mut p = params(0);
    p.sampler = sampler;
    let dangling = std::ptr::dangling_mut::<fnx_job>();
    let mut out = dangling;
    unsafe {
        // NULL arguments.
        assert_eq!(fnx_job_start(null_mut(), PROMPT.as_ptr(), 1, &p, &mut out), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_job_start(s, PROMPT.as_ptr(), 1, &p, null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert!(last_error().contains("out_job is NULL"), "{}", last_error());
        assert_eq!(fnx_job_start(s, null(), 3, &p, &mut out), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_job_start_text(s, null(), 3, true, &p, &mut out), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_job_poll(null_mut(), null_mut(), 0, &mut 0, null_mut(), null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_job_cancel(null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_job_wait(null_mut(), null_mut()), FNX_ERR_NULL_ARGUMENT);
        fnx_job_free(null_mut());
        // Bad values: nothing starts, the state and the sampler stay free.
        assert_eq!(fnx_job_start(s, [-1].as_ptr(), 1, &p, &mut out), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert_eq!(fnx_job_start(s, null(), 0, &p, &mut out), FNX_ERR_NO_LOGITS);
        let bad = [b'h', 0xc3];
        assert_eq!(fnx_job_start_text(s, bad.as_ptr().cast(), 2, true, &p, &mut out), FNX_ERR_INVALID_ARGUMENT);
        let mut wrong = p;
        wrong.struct_size = 3;
        assert_eq!(fnx_job_start(s, PROMPT.as_ptr(), 1, &wrong, &mut out), FNX_ERR_INVALID_ARGUMENT);
        let empty = CString::new("").unwrap();
        let stops = [empty.as_ptr()];
        let mut wrong = p;
        wrong.stop_strings = stops.as_ptr();
        wrong.n_stop_strings = 1;
        assert_eq!(fnx_job_start(s, PROMPT.as_ptr(), 1, &wrong, &mut out), FNX_ERR_INVALID_ARGUMENT);
        let n_ctx = fnx_model_context_length(m);
        let long = vec![1i32; n_ctx + 1];
        assert_eq!(fnx_job_start(s, long.as_ptr(), long.len(), &p, &mut out), FNX_ERR_CONTEXT_FULL);
        assert_eq!(out, dangling, "out_job written on failure");
        assert_eq!(fnx_decode_token(s, 1), FNX_OK);
        assert_eq!(fnx_state_reset(s), FNX_OK);
        // A handle of another kind.
        assert_eq!(fnx_job_poll(s.cast(), null_mut(), 0, &mut 0, null_mut(), null_mut()), FNX_ERR_INVALID_HANDLE);

        // While a job runs, its state and sampler are busy, with a message that says why.
        let job = start(s, &PROMPT, &p);
        assert_eq!(fnx_decode_token(s, 1), FNX_ERR_BUSY);
        assert!(last_error().contains("generation job"), "{}", last_error());
        assert_eq!(fnx_job_start(s, PROMPT.as_ptr(), 1, &params(1), &mut out), FNX_ERR_BUSY);
        assert_eq!(out, dangling);
        let logits = [0f32; 8];
        let mut tok = 0;
        assert_eq!(fnx_sampler_sample(sampler, logits.as_ptr(), logits.len(), &mut tok), FNX_ERR_BUSY);
        assert!(last_error().contains("fnx_sampler is in use by a running generation job"), "{}", last_error());
        // Freeing the state is refused (left alone); so is freeing the sampler.
        fnx_free_state(s);
        fnx_sampler_free(sampler);
        assert_eq!(fnx_job_poll(job, null_mut(), 4, &mut 0, null_mut(), null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_job_poll(job, null_mut(), 0, null_mut(), null_mut(), null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_job_cancel(job), FNX_OK);
        assert_eq!(wait(job).unwrap_err().0, FNX_ERR_CANCELLED);
        // Both survived and are free again.
        assert_eq!(fnx_state_position(s), 0);
        assert_eq!(fnx_decode_token(s, 1), FNX_OK, "{}", last_error());
        assert_eq!(fnx_sampler_reset(sampler), FNX_OK, "{}", last_error());
        fnx_job_free(job);
        fnx_sampler_free(sampler);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn wait_lets_other_threads_poll_cancel_and_free() {
    let m = model();
    let s = new_state(m);
    let mut woken_by_free = 0;
    for round in 0..6 {
        let free = round % 2 == 1;
        let job = start(s, &PROMPT, &params(0));
        let handle = job as usize;
        let waiter = std::thread::spawn(move || wait(handle as *mut fnx_job));
        // The waiter does not hold the job: this thread polls it meanwhile.
        let mut seen = 0;
        while seen < 3 {
            seen = poll(job, 64).n_tokens;
            std::thread::yield_now();
        }
        // Give the waiter time to block (it must be waiting before the job is freed).
        std::thread::sleep(Duration::from_millis(5));
        unsafe {
            if free {
                fnx_job_free(job);
            } else {
                assert_eq!(fnx_job_cancel(job), FNX_OK);
            }
        }
        match waiter.join().unwrap() {
            Err((FNX_ERR_CANCELLED, _)) => woken_by_free += free as usize,
            // A waiter that had not started before the free finds the handle gone.
            Err((FNX_ERR_INVALID_HANDLE, _)) if free => {}
            other => panic!("round {round}: {other:?}"),
        }
        unsafe {
            if !free {
                fnx_job_free(job);
            }
            assert_eq!(fnx_state_position(s), 0);
        }
    }
    // Freeing the job woke a waiter blocked in fnx_job_wait, with the cancelled outcome.
    assert!(woken_by_free > 0, "no waiter was blocked when its job was freed");
    unsafe {
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

// ---------------------------------------------------------------------------
// Leak check (child process)

#[test]
fn jobs_and_parsers_leak_nothing() {
    if !leaks::in_child("jobs_and_parsers_leak_nothing") {
        return;
    }
    leaks::check_counter();
    let m = model();
    for how in ["finish", "cancel", "free", "error"] {
        let g = leaks::growth(4, || unsafe {
            let s = new_state(m);
            let job = start(s, &PROMPT, &params(if how == "finish" { 6 } else { 0 }));
            while poll(job, 0).n_tokens < 2 {
                std::thread::yield_now();
            }
            match how {
                "finish" => assert_eq!(wait(job), Ok(6)),
                "cancel" => {
                    assert_eq!(fnx_job_cancel(job), FNX_OK);
                    assert_eq!(wait(job).unwrap_err().0, FNX_ERR_CANCELLED);
                }
                "error" => assert_eq!(fnx_decode_token(s, 1), FNX_ERR_BUSY),
                _ => {}
            }
            fnx_job_free(job);
            fnx_free_state(s);
        });
        assert_eq!(g, 0, "a job ({how}) leaked {g} bytes");
    }
    let reply = "a\n</think>\n\nb<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><tool_call>\nbad";
    let g = leaks::growth(4, || {
        parse(reply, false, None).unwrap();
        let mut p = null_mut();
        unsafe {
            assert_eq!(fnx_chat_parser_new(true, &mut p), FNX_OK);
            assert_eq!(fnx_chat_parser_push(p, reply.as_ptr().cast(), reply.len()), FNX_OK);
            assert_eq!(fnx_chat_parser_finish(p), FNX_OK);
            let (mut kind, mut n) = (0, 0usize);
            let mut buf = [0u8; 64];
            while fnx_chat_parser_next(p, &mut kind, buf.as_mut_ptr().cast(), buf.len(), &mut n) == FNX_OK && kind != 0 {}
            // Pending segments are dropped with the parser.
            assert_eq!(fnx_chat_parser_push(p, null(), 0), FNX_ERR_INVALID_ARGUMENT);
            fnx_chat_parser_free(p);
            let mut q = null_mut();
            assert_eq!(fnx_chat_parser_new(false, &mut q), FNX_OK);
            assert_eq!(fnx_chat_parser_push(q, reply.as_ptr().cast(), reply.len()), FNX_OK);
            fnx_chat_parser_free(q);
        }
    });
    assert_eq!(g, 0, "reply parsing leaked {g} bytes");
    unsafe { fnx_free_model(m) };
}

/// `fnx_chat_parse` with a buffer large enough.
fn parse(text: &str, in_reasoning: bool, tools: Option<&CString>) -> Result<String, fnx_status> {
    let mut buf = vec![0u8; 4096];
    let mut n = 0usize;
    let tools = tools.map_or(null(), |t| t.as_ptr());
    // SAFETY: valid text; a buffer of 4096 bytes.
    let st = unsafe {
        fnx_chat_parse(text.as_ptr().cast(), text.len(), in_reasoning, tools, buf.as_mut_ptr().cast(), buf.len(), &mut n)
    };
    if st != FNX_OK {
        return Err(st);
    }
    buf.truncate(n);
    Ok(String::from_utf8(buf).unwrap())
}

#[test]
fn a_job_on_every_backend() {
    // The job moves the state to its own thread: that must hold on the GPU too.
    std::env::set_var("FNX_VULKAN_VALIDATION", "1");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/default.gguf");
    for backend in [FNX_BACKEND_CPU, FNX_BACKEND_VULKAN] {
        let mut lp = fnx_load_params_default();
        lp.backend = backend;
        let m = match util::load(&path, Some(&lp)) {
            Ok(m) => m,
            Err((FNX_ERR_BACKEND_UNAVAILABLE, why)) if std::env::var("FNX_REQUIRE_VULKAN").as_deref() != Ok("1") => {
                println!("SKIPPED the Vulkan job: {why}; set FNX_REQUIRE_VULKAN=1 to make this a failure");
                continue;
            }
            Err(e) => panic!("loading for backend {backend}: {e:?}"),
        };
        let (a, b) = (new_state(m), new_state(m));
        let p = params(20);
        let (want, n_want) = generate(a, &PROMPT, &p);
        let job = start(b, &PROMPT, &p);
        assert_eq!(drain(job), want, "backend {backend}");
        assert_eq!(wait(job), Ok(n_want));
        unsafe {
            assert_eq!(logits(m, b), logits(m, a), "backend {backend}");
            fnx_job_free(job);
            // Cancelled part way: the state is as it was, and decodes on as the other.
            let job = start(b, &PROMPT, &params(0));
            while poll(job, 0).n_tokens < 2 {
                std::thread::yield_now();
            }
            fnx_job_free(job);
            assert_eq!(fnx_state_position(b), PROMPT.len() + n_want);
            assert_eq!(fnx_decode_token(a, 7), FNX_OK);
            assert_eq!(fnx_decode_token(b, 7), FNX_OK);
            assert_eq!(logits(m, b), logits(m, a), "backend {backend}");
            fnx_free_state(a);
            fnx_free_state(b);
            fnx_free_model(m);
        }
    }
}

/// Frees the job whose address `user` holds, from the job's own thread; aborts nothing.
unsafe extern "C" fn free_own_job(user: *mut c_void) -> bool {
    // SAFETY: `user` is the test's AtomicUsize holding the job handle (0 until it is known).
    let job = unsafe { &*(user as *const AtomicUsize) }.swap(0, Ordering::SeqCst);
    if job != 0 {
        // Waiting for itself is refused, not a deadlock.
        // SAFETY: a live job handle.
        assert_eq!(unsafe { fnx_job_wait(job as *mut fnx_job, null_mut()) }, FNX_ERR_BUSY);
        // SAFETY: a live job handle, freed once.
        unsafe { fnx_job_free(job as *mut fnx_job) };
    }
    false
}

#[test]
fn a_job_freed_from_its_own_abort_callback_ends() {
    let m = model();
    let s = new_state(m);
    let slot = AtomicUsize::new(0);
    unsafe {
        assert_eq!(fnx_state_set_abort_callback(s, Some(free_own_job), (&slot as *const AtomicUsize).cast_mut().cast()), FNX_OK);
    }
    let job = start(s, &PROMPT, &params(0));
    slot.store(job as usize, Ordering::SeqCst);
    // The callback frees the job at its next poll; the job then stops, cancelled, and lets go of the state.
    let t = Instant::now();
    loop {
        // SAFETY: live state.
        let st = unsafe { fnx_state_set_abort_callback(s, None, null_mut()) };
        if st == FNX_OK {
            break;
        }
        assert_eq!(st, FNX_ERR_BUSY);
        assert!(t.elapsed() < Duration::from_secs(10), "the job never ended");
        std::thread::yield_now();
    }
    assert_eq!(slot.load(Ordering::SeqCst), 0);
    unsafe {
        assert_eq!(fnx_job_cancel(job), FNX_ERR_INVALID_HANDLE);
        assert_eq!(fnx_state_position(s), 0);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}
