//! State snapshots and copies: a restored or copied state continues
//! bit-identically; damaged, truncated and foreign snapshots are refused
//! with the state unchanged. Rust API (`State::save`/`restore`) and C API
//! (`fnx_state_save_size`/`save`/`load`/`copy`), including misuse.

mod util;

use flashnext::capi::*;
use flashnext::convert::{convert, ConvertOptions, OutType};
use flashnext::model::snapshot::{xxh64, FORMAT_VERSION, MAGIC};
use flashnext::model::SnapshotError;
use flashnext::{Error, LoadOptions, Model, State};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};
use std::sync::{Arc, OnceLock};
use util::*;

const SEQ: [u32; 20] = [
    3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19,
];

/// `fixture` (a directory under tests/fixtures) converted to `ty`, once per test binary.
fn converted(fixture: &str, ty: OutType) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| process_dir("flashnext-snapshot"));
    let out = dir.join(format!("{fixture}-{ty:?}.gguf"));
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap();
    if !out.exists() {
        convert(
            &fixtures_dir().join(fixture).join("hf"),
            &out,
            &ConvertOptions {
                out_type: ty,
                ..Default::default()
            },
        )
        .expect("fixture converts");
    }
    out
}

fn model(path: &Path) -> Arc<Model> {
    Model::load(path, &LoadOptions::default()).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Decodes `tokens` and returns every step's logits (as bits).
fn run(s: &mut State, tokens: &[u32]) -> Vec<Vec<u32>> {
    tokens
        .iter()
        .map(|&t| {
            s.decode(t).unwrap();
            bits(s.logits().unwrap())
        })
        .collect()
}

/// Everything observable about a state: position, logits, and its snapshot bytes.
fn fingerprint_of(s: &State) -> (usize, Option<Vec<u32>>, Vec<u8>) {
    (s.position(), s.logits().map(bits), s.save().unwrap())
}

#[test]
fn xxh64_matches_reference_vectors() {
    assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
    assert_eq!(xxh64(b"abc", 0), 0x44BC_2CF5_AD77_0999);
    assert_eq!(
        xxh64(b"Nobody inspects the spammish repetition", 0),
        0xFBCE_A83C_8A37_8BF1
    );
}

#[test]
fn restored_states_continue_bit_identically() {
    let m = model(fixture_gguf());
    // k = 0 (empty state), inside the first QSA block, and past several blocks.
    for k in [0, 3, 9, 13] {
        let mut a = State::new(m.clone()).unwrap();
        run(&mut a, &SEQ[..k]);
        let snap = a.save().unwrap();
        assert_eq!(snap.len(), a.save_size());
        assert_eq!(&snap[..8], &MAGIC);
        let expected = run(&mut a, &SEQ[k..]);

        let mut fresh = State::new(m.clone()).unwrap();
        fresh.restore(&snap).unwrap();
        assert_eq!(fresh.position(), k);
        assert_eq!(
            fresh.save().unwrap(),
            snap,
            "k = {k}: a restored state saves to the same bytes"
        );
        assert_eq!(
            run(&mut fresh, &SEQ[k..]),
            expected,
            "k = {k}: restored state diverged"
        );

        // Restoring into the state that moved on rewinds it.
        a.restore(&snap).unwrap();
        assert_eq!(
            run(&mut a, &SEQ[k..]),
            expected,
            "k = {k}: rewound state diverged"
        );
    }
}

#[test]
fn a_snapshot_loads_into_another_load_of_the_same_file() {
    let m1 = model(fixture_gguf());
    let m2 = model(fixture_gguf());
    assert_eq!(m1.fingerprint(), m2.fingerprint());
    let mut a = State::new(m1).unwrap();
    run(&mut a, &SEQ[..6]);
    let snap = a.save().unwrap();
    let expected = run(&mut a, &SEQ[6..]);
    let mut b = State::new(m2).unwrap();
    b.restore(&snap).unwrap();
    assert_eq!(run(&mut b, &SEQ[6..]), expected);
}

/// Restoring `bytes` into a state holding `SEQ[..5]` fails with `check`, and the
/// state then continues exactly as an untouched one.
fn refused(m: &Arc<Model>, bytes: &[u8], check: impl Fn(&SnapshotError) -> bool) -> String {
    let mut s = State::new(m.clone()).unwrap();
    run(&mut s, &SEQ[..5]);
    let before = fingerprint_of(&s);
    let err = s.restore(bytes).expect_err("snapshot accepted");
    let Error::Snapshot(detail) = &err else { panic!("not a snapshot refusal: {err:?}") };
    assert!(check(detail), "unexpected error: {err:?}");
    assert!(
        fingerprint_of(&s) == before,
        "a refused snapshot changed the state ({err})"
    );
    let mut twin = State::new(m.clone()).unwrap();
    run(&mut twin, &SEQ[..5]);
    assert_eq!(run(&mut s, &SEQ[5..9]), run(&mut twin, &SEQ[5..9]));
    err.to_string()
}

/// Overwrites the checksum so a deliberate edit passes the integrity check.
fn reseal(b: &mut [u8]) {
    let n = b.len() - 8;
    let sum = xxh64(&b[..n], 0);
    b[n..].copy_from_slice(&sum.to_le_bytes());
}

#[test]
fn damaged_and_truncated_snapshots_are_refused() {
    let m = model(fixture_gguf());
    let mut s = State::new(m.clone()).unwrap();
    run(&mut s, &SEQ[..7]);
    let snap = s.save().unwrap();
    let n = snap.len();
    let corrupt = |e: &SnapshotError| matches!(e, SnapshotError::Corrupt(_)) && !e.is_mismatch();
    let truncated = |e: &SnapshotError| matches!(e, SnapshotError::Truncated { .. });

    for cut in [0, 1, 7, 8, 20, 47, 48, n / 2, n - 8, n - 1] {
        let msg = refused(&m, &snap[..cut], truncated);
        assert!(msg.contains("truncated"), "{msg}");
    }
    let mut longer = snap.clone();
    longer.push(0);
    assert!(refused(&m, &longer, corrupt).contains("1 bytes follow"));

    // A flipped bit anywhere in the header's checked fields or the payload.
    for at in [40, 44, 100, n / 3, n / 2, n - 9, n - 1] {
        let mut b = snap.clone();
        b[at] ^= 0x10;
        assert!(refused(&m, &b, corrupt).contains("checksum"), "byte {at}");
    }
    let mut b = snap.clone();
    b[0] = b'X';
    refused(&m, &b, |e| matches!(e, SnapshotError::NotASnapshot));
    refused(
        &m,
        b"definitely not a snapshot at all, just some text bytes",
        |e| matches!(e, SnapshotError::NotASnapshot),
    );

    // Sealed edits: the structure itself is checked, not only the checksum.
    let mut b = snap.clone();
    b[24..32].copy_from_slice(&6u64.to_le_bytes()); // position 6 with 7 positions of data
    reseal(&mut b);
    assert!(refused(&m, &b, corrupt).contains("does not fit position"));
    let mut b = snap.clone();
    b[40..44].copy_from_slice(&1u32.to_le_bytes()); // layer 0 is GDN: claim attention
    reseal(&mut b);
    assert!(refused(&m, &b, corrupt).contains("layer 0 has kind 1"));
    let mut b = snap.clone();
    b[44..52].copy_from_slice(&0u64.to_le_bytes()); // layer 0's conv state holds nothing
    reseal(&mut b);
    assert!(refused(&m, &b, corrupt).contains("elements"));
    let mut b = snap.clone();
    b[12..16].copy_from_slice(&99u32.to_le_bytes()); // layer count
    reseal(&mut b);
    refused(&m, &b, corrupt);
    let mut b = snap.clone();
    b[32..40].copy_from_slice(&u64::MAX.to_le_bytes()); // absurd payload length
    reseal(&mut b);
    refused(&m, &b, |e| {
        matches!(
            e,
            SnapshotError::Corrupt(_) | SnapshotError::Truncated { .. }
        )
    });
}

#[test]
fn snapshots_of_other_models_versions_and_contexts_are_mismatches() {
    let m = model(fixture_gguf());
    let mut s = State::new(m.clone()).unwrap();
    run(&mut s, &SEQ[..7]);
    let snap = s.save().unwrap();

    // Another architecture-compatible fixture.
    let native = model(&converted("tiny_native", OutType::F32));
    assert_ne!(native.fingerprint(), m.fingerprint());
    let mut other = State::new(native.clone()).unwrap();
    run(&mut other, &SEQ[..7]);
    let foreign = other.save().unwrap();
    let msg = refused(&m, &foreign, |e| {
        matches!(e, SnapshotError::WrongModel { .. }) && e.is_mismatch()
    });
    assert!(msg.contains("different model"), "{msg}");
    let mut n2 = State::new(native).unwrap();
    assert!(matches!(
        n2.restore(&snap),
        Err(Error::Snapshot(SnapshotError::WrongModel { .. }))
    ));

    // The same checkpoint stored as F16: same shapes, different tensors.
    let f16 = model(&converted("tiny_flat", OutType::F16));
    assert_ne!(f16.fingerprint(), m.fingerprint());
    let mut h = State::new(f16).unwrap();
    assert!(matches!(
        h.restore(&snap),
        Err(Error::Snapshot(SnapshotError::WrongModel { .. }))
    ));

    // Another format version (the version is checked before the checksum).
    let mut b = snap.clone();
    b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let msg = refused(&m, &b, |e| {
        matches!(e, SnapshotError::Version { .. }) && e.is_mismatch()
    });
    assert!(msg.contains("version 2"), "{msg}");

    // The same file loaded with a context too short for the snapshot.
    let short = Model::load(
        fixture_gguf(),
        &LoadOptions {
            n_ctx: 5,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(short.fingerprint(), m.fingerprint());
    let mut t = State::new(short.clone()).unwrap();
    let err = t.restore(&snap).unwrap_err();
    assert!(
        matches!(err, Error::Snapshot(SnapshotError::ContextTooSmall { pos: 7, n_ctx: 5 })),
        "{err:?}"
    );
    assert_eq!(t.position(), 0);
    // ... but a shorter snapshot fits.
    let mut a = State::new(m.clone()).unwrap();
    run(&mut a, &SEQ[..5]);
    t.restore(&a.save().unwrap()).unwrap();
    assert_eq!(t.position(), 5);
    assert!(
        t.decode(1).is_err(),
        "the restored state respects the short context"
    );
}

#[test]
fn snapshot_errors_are_crate_errors() {
    let e: Error = SnapshotError::NotASnapshot.into();
    assert!(matches!(e, Error::Snapshot(SnapshotError::NotASnapshot)));
    assert_eq!(e.to_string(), SnapshotError::NotASnapshot.to_string());
}

// ---------------------------------------------------------------------------
// C API

fn c_decode(s: *mut fnx_state, tokens: &[u32]) {
    for &t in tokens {
        // SAFETY: live state used by this thread only.
        assert_eq!(
            unsafe { fnx_decode_token(s, t as i32) },
            FNX_OK,
            "{}",
            last_error()
        );
    }
}

fn c_save(s: *const fnx_state) -> Vec<u8> {
    let mut size = 0;
    // SAFETY: live state, valid out pointers and buffer.
    unsafe {
        assert_eq!(
            fnx_state_save_size(s, &mut size),
            FNX_OK,
            "{}",
            last_error()
        );
        let mut buf = vec![0u8; size];
        let mut written = 0;
        assert_eq!(
            fnx_state_save(s, buf.as_mut_ptr(), size, &mut written),
            FNX_OK,
            "{}",
            last_error()
        );
        assert_eq!(written, size);
        buf
    }
}

#[test]
fn c_save_load_round_trip() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let a = new_state(m);
    c_decode(a, &SEQ[..8]);
    let snap = c_save(a);
    let mut expected = Vec::new();
    for &t in &SEQ[8..] {
        c_decode(a, &[t]);
        expected.push(bits(&logits(a, vocab)));
    }
    let b = new_state(m);
    unsafe {
        assert_eq!(
            fnx_state_load(b, snap.as_ptr(), snap.len()),
            FNX_OK,
            "{}",
            last_error()
        );
        assert_eq!(fnx_state_position(b), 8);
    }
    for (i, &t) in SEQ[8..].iter().enumerate() {
        c_decode(b, &[t]);
        assert_eq!(bits(&logits(b, vocab)), expected[i], "step {i}");
    }
    // Oversized buffers are fine; out_written may be NULL.
    let now = c_save(b);
    let mut big = vec![0xAAu8; now.len() + 100];
    unsafe {
        assert_eq!(
            fnx_state_save(b, big.as_mut_ptr(), big.len(), null_mut()),
            FNX_OK
        );
        fnx_free_state(a);
        fnx_free_state(b);
        fnx_free_model(m);
    }
    assert_eq!(big[..now.len()], now[..]);
    assert!(
        big[now.len()..].iter().all(|&x| x == 0xAA),
        "wrote past the snapshot"
    );
}

#[test]
fn c_copies_continue_independently() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let a = new_state(m);
    c_decode(a, &SEQ[..6]);
    let mut b = null_mut();
    unsafe {
        assert_eq!(fnx_state_copy(a, &mut b), FNX_OK, "{}", last_error());
        assert_eq!(fnx_state_position(b), 6);
    }
    assert_eq!(bits(&logits(a, vocab)), bits(&logits(b, vocab)));
    let (way1, way2) = (&SEQ[6..12], &SEQ[12..18]);
    c_decode(a, way1);
    c_decode(b, way2);
    for (s, way) in [(a, way1), (b, way2)] {
        let fresh = new_state(m);
        c_decode(fresh, &SEQ[..6]);
        c_decode(fresh, way);
        assert_eq!(bits(&logits(s, vocab)), bits(&logits(fresh, vocab)));
        unsafe { fnx_free_state(fresh) };
    }
    // Freeing the original leaves the copy working, and vice versa.
    unsafe {
        fnx_free_state(a);
        assert_eq!(fnx_decode_token(b, 1), FNX_OK);
        fnx_free_state(b);
        fnx_free_model(m);
    }
}

#[test]
fn c_refusals_leave_the_state_unchanged() {
    let m = load(fixture_gguf(), None).unwrap();
    let vocab = unsafe { fnx_model_vocab_size(m) };
    let s = new_state(m);
    c_decode(s, &SEQ[..5]);
    let snap = c_save(s);
    let other = new_state(m);
    c_decode(other, &SEQ[..9]);
    let before = (c_save(other), bits(&logits(other, vocab)));
    let foreign = {
        let n = load(&converted("tiny_native", OutType::F32), None).unwrap();
        let ns = new_state(n);
        c_decode(ns, &SEQ[..5]);
        let b = c_save(ns);
        unsafe {
            fnx_free_state(ns);
            fnx_free_model(n);
        }
        b
    };
    let mut versioned = snap.clone();
    versioned[8] ^= 0x7;
    let mut flipped = snap.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 1;
    let cases: [(&[u8], fnx_status, &str); 6] = [
        (&foreign, FNX_ERR_SNAPSHOT_MISMATCH, "different model"),
        (&versioned, FNX_ERR_SNAPSHOT_MISMATCH, "version"),
        (&flipped, FNX_ERR_SNAPSHOT_CORRUPT, "checksum"),
        (
            &snap[..snap.len() - 1],
            FNX_ERR_SNAPSHOT_CORRUPT,
            "truncated",
        ),
        (&snap[..0], FNX_ERR_SNAPSHOT_CORRUPT, "truncated"),
        (
            b"GGUF\x03\x00\x00\x00",
            FNX_ERR_SNAPSHOT_CORRUPT,
            "not a flashnext state snapshot",
        ),
    ];
    for (bytes, status, needle) in cases {
        // SAFETY: live state; valid buffer.
        let st = unsafe { fnx_state_load(other, bytes.as_ptr(), bytes.len()) };
        assert_eq!(st, status, "{needle}: {}", last_error());
        assert!(last_error().contains(needle), "{}", last_error());
        assert!(
            last_error().starts_with("fnx_state_load: "),
            "{}",
            last_error()
        );
        assert_eq!(
            (c_save(other), bits(&logits(other, vocab))),
            before,
            "{needle}: state changed"
        );
    }
    // A context too short for the snapshot: mismatch.
    let mut p = fnx_load_params_default();
    p.n_ctx = 4;
    let short = load(fixture_gguf(), Some(&p)).unwrap();
    let ss = new_state(short);
    unsafe {
        assert_eq!(
            fnx_state_load(ss, snap.as_ptr(), snap.len()),
            FNX_ERR_SNAPSHOT_MISMATCH
        );
        assert!(
            last_error().contains("context limit of 4"),
            "{}",
            last_error()
        );
        assert_eq!(fnx_state_position(ss), 0);
        fnx_free_state(ss);
        fnx_free_model(short);
        fnx_free_state(s);
        fnx_free_state(other);
        fnx_free_model(m);
    }
}

#[test]
fn c_snapshot_misuse() {
    let m = load(fixture_gguf(), None).unwrap();
    let s = new_state(m);
    c_decode(s, &SEQ[..3]);
    let snap = c_save(s);
    let mut size = 7usize;
    let mut written = 7usize;
    let mut copy = std::ptr::dangling_mut::<fnx_state>();
    let mut buf = vec![0x55u8; snap.len()];
    unsafe {
        assert_eq!(
            fnx_state_save_size(null(), &mut size),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(fnx_state_save_size(s, null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(
            fnx_state_save(null(), buf.as_mut_ptr(), buf.len(), &mut written),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_state_save(s, null_mut(), buf.len(), &mut written),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fnx_state_save(s, buf.as_mut_ptr(), snap.len() - 1, &mut written),
            FNX_ERR_BUFFER_TOO_SMALL
        );
        assert!(
            last_error().contains(&format!("needs {}", snap.len())),
            "{}",
            last_error()
        );
        assert_eq!(
            fnx_state_save(s, buf.as_mut_ptr(), 0, &mut written),
            FNX_ERR_BUFFER_TOO_SMALL
        );
        assert!(buf.iter().all(|&b| b == 0x55), "buffer written on failure");
        assert_eq!((size, written), (7, 7), "out-parameters written on failure");
        assert_eq!(
            fnx_state_load(null_mut(), snap.as_ptr(), snap.len()),
            FNX_ERR_NULL_ARGUMENT
        );
        assert_eq!(fnx_state_load(s, null(), 10), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_state_copy(null(), &mut copy), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(fnx_state_copy(s, null_mut()), FNX_ERR_NULL_ARGUMENT);
        assert_eq!(copy, std::ptr::dangling_mut::<fnx_state>());

        // Wrong handles.
        let wrong = m.cast::<fnx_state>();
        assert_eq!(
            fnx_state_save_size(wrong, &mut size),
            FNX_ERR_INVALID_HANDLE
        );
        assert_eq!(
            fnx_state_save(wrong, buf.as_mut_ptr(), buf.len(), &mut written),
            FNX_ERR_INVALID_HANDLE
        );
        assert_eq!(
            fnx_state_load(wrong, snap.as_ptr(), snap.len()),
            FNX_ERR_INVALID_HANDLE
        );
        assert_eq!(fnx_state_copy(wrong, &mut copy), FNX_ERR_INVALID_HANDLE);

        // A state whose model was freed refuses all of them.
        fnx_free_model(m);
        assert_eq!(fnx_state_save_size(s, &mut size), FNX_ERR_MODEL_FREED);
        assert_eq!(
            fnx_state_save(s, buf.as_mut_ptr(), buf.len(), &mut written),
            FNX_ERR_MODEL_FREED
        );
        assert_eq!(
            fnx_state_load(s, snap.as_ptr(), snap.len()),
            FNX_ERR_MODEL_FREED
        );
        assert_eq!(fnx_state_copy(s, &mut copy), FNX_ERR_MODEL_FREED);
        assert_eq!(copy, std::ptr::dangling_mut::<fnx_state>());
        assert_eq!((size, written), (7, 7));
        fnx_free_state(s);
    }
}
