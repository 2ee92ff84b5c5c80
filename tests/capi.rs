//! The C ABI under misuse: every bad argument gets its own status and a
//! message, out-parameters stay untouched, and the state is unchanged.
//! Also: one model shared by several threads, each decoding its own state.

mod util;

use flashnext::capi::*;
use std::ptr::null_mut;
use util::*;

const SEQ: [i32; 12] = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26];

fn decode_all(s: *mut fnx_state, tokens: &[i32]) {
    for &t in tokens {
        // SAFETY: live state used by this thread only.
        assert_eq!(unsafe { fnx_decode_token(s, t) }, FNX_OK, "{}", last_error());
    }
}

#[test]
fn null_arguments_are_reported() {
    let m = load(fixture_gguf(), None).unwrap();
    let s = new_state(m);
    let mut out_m = std::ptr::dangling_mut::<fnx_model>();
    let mut out_s = std::ptr::dangling_mut::<fnx_state>();
    unsafe {
        assert_eq!(fnx_load(std::ptr::null(), std::ptr::null(), &mut out_m), FNX_ERR_NULL_ARGUMENT);
        assert!(last_error().contains("path is NULL"), "{}", last_error());
        assert_eq!(out_m, std::ptr::dangling_mut::<fnx_model>(), "out_model written on failure");
        let p = std::ffi::CString::new(fixture_gguf().to_str().unwrap()).unwrap();
        assert_eq!(fnx_load(p.as_ptr(), std::ptr::null(), null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_new_state(null_mut(), &mut out_s), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_new_state(m, null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(out_s, std::ptr::dangling_mut::<fnx_state>());
        assert_eq!(fnx_decode_token(null_mut(), 1), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_get_logits(std::ptr::null(), null_mut(), 0), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_get_logits(s, null_mut(), 10), FNX_ERR_NULL_ARGUMENT);
        assert!(last_error().contains("out is NULL"));
        assert_eq!(fnx_state_reset(null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_state_position(std::ptr::null()), 0);
        assert_eq!(fnx_model_vocab_size(std::ptr::null()), 0);
        assert_eq!(fnx_model_eos_token(std::ptr::null()), -1);
        fnx_free_state(null_mut());
        fnx_free_model(null_mut());
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn bad_values_leave_the_state_unchanged() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let s = new_state(m);
    let mut buf = vec![0f32; vocab];
    unsafe {
        assert_eq!(fnx_get_logits(s, buf.as_mut_ptr(), vocab), FNX_ERR_NO_LOGITS);
        decode_all(s, &SEQ[..4]);
        let before = logits(s, vocab);
        assert_eq!(fnx_decode_token(s, vocab as i32), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert!(last_error().contains("out of range"), "{}", last_error());
        assert_eq!(fnx_decode_token(s, -1), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert_eq!(fnx_decode_token(s, i32::MAX), FNX_ERR_TOKEN_OUT_OF_RANGE);
        assert_eq!(fnx_get_logits(s, buf.as_mut_ptr(), vocab - 1), FNX_ERR_BUFFER_TOO_SMALL);
        assert!(last_error().contains("buffer holds"), "{}", last_error());
        assert_eq!(fnx_state_position(s), 4);
        assert_eq!(logits(s, vocab), before, "failed calls changed the logits");

        // The state continues exactly as if the failures never happened.
        decode_all(s, &SEQ[4..]);
        let after = logits(s, vocab);
        let fresh = new_state(m);
        decode_all(fresh, &SEQ);
        assert_eq!(logits(fresh, vocab), after);
        fnx_free_state(fresh);

        // A model handle where a state is expected is refused by its tag.
        assert_eq!(fnx_decode_token(m.cast(), 1), FNX_ERR_INVALID_HANDLE);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn context_limit_is_enforced() {
    let mut p = fnx_load_params_default();
    p.n_ctx = 5;
    let m = load(fixture_gguf(), Some(&p)).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    assert_eq!(unsafe { fnx_model_context_length(m) }, 5);
    let s = new_state(m);
    decode_all(s, &SEQ[..5]);
    let before = logits(s, vocab);
    unsafe {
        assert_eq!(fnx_decode_token(s, 1), FNX_ERR_CONTEXT_FULL);
        assert!(last_error().contains("context limit 5"), "{}", last_error());
        assert_eq!(fnx_state_position(s), 5);
        assert_eq!(logits(s, vocab), before);
        assert_eq!(fnx_state_reset(s), FNX_OK);
        assert_eq!(fnx_state_position(s), 0);
        assert_eq!(fnx_decode_token(s, 1), FNX_OK);
        fnx_free_state(s);
        fnx_free_model(m);
    }
}

#[test]
fn the_backend_taken_is_reported() {
    let mut p = fnx_load_params_default();
    p.backend = FNX_BACKEND_CPU;
    let m = load(fixture_gguf(), Some(&p)).unwrap();
    // SAFETY: live handle, then NULL (which answers 0).
    unsafe {
        assert_eq!(fnx_model_backend(m), FNX_BACKEND_CPU);
        assert_eq!(fnx_model_backend(std::ptr::null()), 0);
        fnx_free_model(m);
    }
}

#[test]
fn load_params_are_checked() {
    let mut p = fnx_load_params_default();
    p.struct_size = 3;
    let (st, msg) = load(fixture_gguf(), Some(&p)).unwrap_err();
    assert_eq!(st, FNX_ERR_INVALID_ARGUMENT);
    assert!(msg.contains("struct_size"), "{msg}");
    let mut p = fnx_load_params_default();
    p.backend = 77;
    assert_eq!(load(fixture_gguf(), Some(&p)).unwrap_err().0, FNX_ERR_INVALID_ARGUMENT);
    let (st, msg) = load(std::path::Path::new("/nonexistent/model.gguf"), None).unwrap_err();
    assert_eq!(st, FNX_ERR_IO);
    assert!(msg.contains("/nonexistent/model.gguf"), "{msg}");
}

#[test]
fn a_state_outliving_its_model_is_refused() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let s = new_state(m);
    decode_all(s, &SEQ[..2]);
    let mut buf = vec![0f32; vocab];
    unsafe {
        fnx_free_model(m);
        assert_eq!(fnx_decode_token(s, 1), FNX_ERR_MODEL_FREED);
        assert!(last_error().contains("freed"), "{}", last_error());
        assert_eq!(fnx_get_logits(s, buf.as_mut_ptr(), vocab), FNX_ERR_MODEL_FREED);
        assert_eq!(fnx_state_reset(s), FNX_ERR_MODEL_FREED);
        fnx_free_state(s);
    }
}

#[test]
fn states_decode_in_parallel_threads() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let sequences: Vec<Vec<i32>> =
        (0..4).map(|k| SEQ.iter().map(|&t| (t * (k + 1) + k) % vocab as i32).collect()).collect();
    let serial: Vec<Vec<f32>> = sequences
        .iter()
        .map(|seq| {
            let s = new_state(m);
            decode_all(s, seq);
            let l = logits(s, vocab);
            unsafe { fnx_free_state(s) };
            l
        })
        .collect();
    struct Shared(*mut fnx_model);
    // SAFETY: a model may be used from many threads at once (documented contract).
    unsafe impl Sync for Shared {}
    let shared = Shared(m);
    let parallel: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = sequences
            .iter()
            .map(|seq| {
                let shared = &shared;
                scope.spawn(move || {
                    let s = new_state(shared.0);
                    decode_all(s, seq);
                    let l = logits(s, vocab);
                    unsafe { fnx_free_state(s) };
                    l
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(serial, parallel, "parallel decoding changed the results");
    unsafe { fnx_free_model(m) };
}

#[test]
fn status_names_and_version() {
    let name = |s| unsafe { std::ffi::CStr::from_ptr(fnx_status_name(s)) }.to_str().unwrap().to_string();
    assert_eq!(name(FNX_OK), "FNX_OK");
    assert_eq!(name(FNX_ERR_CONTEXT_FULL), "FNX_ERR_CONTEXT_FULL");
    assert_eq!(name(-5), "FNX_UNKNOWN_STATUS");
    let v = unsafe { std::ffi::CStr::from_ptr(fnx_version()) }.to_str().unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
}
