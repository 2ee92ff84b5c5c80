//! Routing profiles: how often each layer chose each expert over a session,
//! saved so that a later load can fill an expert cache with each layer's
//! most used experts before the first token (a warm start).
//!
//! The file is JSON: `{"format": "flashnext-routing-profile", "version": 1,
//! "experts": E, "layers": [[count of expert 0, ..., count of expert E-1], ...]}`.

use super::Config;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

const FORMAT: &str = "flashnext-routing-profile";

/// Per layer, how often each expert was chosen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingProfile {
    format: String,
    version: u32,
    experts: usize,
    /// `[layer][expert]` choice counts.
    pub layers: Vec<Vec<u32>>,
}

impl RoutingProfile {
    pub fn new(layers: Vec<Vec<u32>>) -> RoutingProfile {
        let experts = layers.first().map_or(0, Vec::len);
        RoutingProfile { format: FORMAT.into(), version: 1, experts, layers }
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string(self).expect("a profile serializes");
        std::fs::write(path, text).map_err(|e| Error::io(format!("writing the routing profile {}", path.display()), e))
    }

    /// Reads a profile and checks that it fits `cfg` (layers and experts).
    pub fn load(path: &Path, cfg: &Config) -> Result<RoutingProfile> {
        let text = std::fs::read(path).map_err(|e| Error::io(format!("reading the routing profile {}", path.display()), e))?;
        let p: RoutingProfile = serde_json::from_slice(&text)
            .map_err(|e| Error::arg(format!("{} is not a routing profile: {e}", path.display())))?;
        if p.format != FORMAT || p.version != 1 {
            return Err(Error::arg(format!("{} is not a version 1 flashnext routing profile", path.display())));
        }
        if p.layers.len() != cfg.n_layers || p.layers.iter().any(|l| l.len() != cfg.n_experts) || p.experts != cfg.n_experts {
            return Err(Error::arg(format!(
                "the routing profile {} is for {} layers of {} experts; this model has {} of {}",
                path.display(),
                p.layers.len(),
                p.experts,
                cfg.n_layers,
                cfg.n_experts
            )));
        }
        Ok(p)
    }

    /// Layer `layer`'s `n` most chosen experts that were chosen at all, most
    /// chosen first (ties to the lower id).
    pub fn top(&self, layer: usize, n: usize) -> Vec<u32> {
        let counts = &self.layers[layer];
        let mut ids: Vec<u32> = (0..counts.len() as u32).filter(|&e| counts[e as usize] > 0).collect();
        ids.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        ids.truncate(n);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_experts_and_round_trip() {
        let p = RoutingProfile::new(vec![vec![3, 0, 5, 3], vec![0, 0, 0, 1]]);
        assert_eq!(p.top(0, 3), [2, 0, 3]);
        assert_eq!(p.top(1, 3), [3]);
        let path = std::env::temp_dir().join(format!("flashnext-profile-{}.json", std::process::id()));
        p.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let back: RoutingProfile = serde_json::from_str(&text).unwrap();
        assert_eq!(back, p);
        std::fs::remove_file(&path).ok();
    }
}
