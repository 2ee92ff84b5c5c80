//! Arbitrary bytes through the whole loading path: the GGUF parser, then
//! (when it parses) the hyper-parameter checks, then the weight loader over
//! an in-memory image, and for a model that loads, a few decode steps. Any
//! panic, overflow (debug assertions are on), out-of-bounds access or
//! allocation over libFuzzer's limit is a bug: hostile files must be refused
//! with an error.

#![no_main]

use flashnext::gguf::{parse, GgufFile};
use flashnext::model::Config;
use flashnext::{LoadOptions, Model, State};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

fuzz_target!(|data: &[u8]| {
    // The parser alone, on the borrowed bytes.
    let Ok((metadata, tensors, alignment)) = parse(data) else { return };
    assert!(alignment.is_power_of_two());
    for t in &tensors {
        // Every tensor the parser accepts lies inside the input.
        assert!(t.offset.checked_add(t.nbytes).is_some_and(|end| end <= data.len()));
    }
    if Config::from_metadata(&metadata).is_err() {
        return;
    }
    // The full load from an in-memory image (the same path as `Model::load`
    // after the file is mapped).
    let Ok(file) = GgufFile::from_storage(Arc::new(data.to_vec())) else {
        panic!("parse() accepted the bytes but from_storage() refused them")
    };
    let Ok(model) = Model::from_gguf(file, &LoadOptions::default()) else { return };
    let vocab = model.vocab_size() as u32;
    // Creating the state may fail cleanly (out of memory for hostile sizes).
    let Ok(mut state) = State::new(model) else { return };
    for token in [0, 1, 17] {
        let _ = state.decode(token % vocab);
    }
});
