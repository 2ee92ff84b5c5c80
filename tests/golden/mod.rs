//! The golden fixtures' manifests (`tests/fixtures/*/expected/manifest.json`,
//! written by tools/reference/make_fixtures.py from transformers), shared by
//! the tests that compare logits with them.

use serde::Deserialize;
use std::path::Path;

#[derive(Deserialize)]
pub struct Manifest {
    pub vocab_size: usize,
    pub sequences: Vec<Sequence>,
}

#[derive(Deserialize)]
#[allow(dead_code)] // not every test names its sequences
pub struct Sequence {
    pub name: String,
    pub tokens: Vec<u32>,
    pub logits_file: String,
    /// Positions where the reference's QSA top-k met equal scores.
    #[serde(default)]
    pub tie_positions: Vec<usize>,
    /// The logits of one forward pass over the whole sequence (transformers'
    /// prefill), where the fixture stores them.
    #[serde(default)]
    pub full_forward_logits_file: Option<String>,
    #[serde(default)]
    pub full_forward_tie_positions: Vec<usize>,
}

impl Manifest {
    /// The manifest of the fixture directory `fixture`.
    pub fn read(fixture: &Path) -> Manifest {
        serde_json::from_slice(&std::fs::read(fixture.join("expected/manifest.json")).unwrap()).unwrap()
    }
}

impl Sequence {
    /// The first position with a flagged tie (positions from there on are not compared).
    pub fn first_tie(&self) -> usize {
        self.tie_positions.iter().copied().min().unwrap_or(usize::MAX)
    }

    /// The reference logits, [tokens][vocab].
    pub fn logits(&self, fixture: &Path) -> Vec<f32> {
        read_f32(&fixture.join("expected").join(&self.logits_file))
    }

    /// The reference's one-pass logits ([tokens][vocab]) and the first
    /// position of a tie in that pass, where the fixture has them.
    #[allow(dead_code)] // not every test reads them
    pub fn full_forward(&self, fixture: &Path) -> Option<(Vec<f32>, usize)> {
        let file = self.full_forward_logits_file.as_ref()?;
        let first_tie = self.full_forward_tie_positions.iter().copied().min().unwrap_or(usize::MAX);
        Some((read_f32(&fixture.join("expected").join(file)), first_tie))
    }
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}
