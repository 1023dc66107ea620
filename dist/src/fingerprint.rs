//! What a rank will run, as named fields, so that the ranks of a job can check that
//! they agree before the first step ([`crate::rendezvous::Rendezvous::agree`]).
//!
//! Ranks that run different configs or builds issue mismatched collectives: a hang, or
//! silently wrong training. Every multi-process job therefore compares, at start, a
//! fingerprint of each rank: the overlap version and rendezvous protocol, the command,
//! the backend, the mesh, every parameter, the reduction, the bucket cap, the stream
//! bindings, the schedule and transport, the `[overlap]` knobs, the steps and seed, the
//! optimizers' hyper-parameters, parameter groups, learning-rate schedule and clipping,
//! and a SHA-256 of the canonical (JSON) step plan of
//! each gate pattern in use (which also catches two builds whose planners differ).
//! Fields are compared in order, so a difference is reported as the first field that
//! differs, with both values.
//!
//! Invariant: the fingerprint is a pure function of what the rank will run; two ranks
//! that would issue different plans have different fingerprints.

use serde_json::Value;
use sha2::{Digest, Sha256};

use overlap::config::Config;
use overlap::Error;

/// Longest value shown in a disagreement message.
const SHOWN: usize = 160;

/// Named fields describing what a rank will run, in a fixed order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fingerprint {
    fields: Vec<(String, String)>,
}

impl Fingerprint {
    /// A fingerprint with the build's fields: `overlap.version` and
    /// `rendezvous.protocol`.
    pub fn build() -> Fingerprint {
        let mut f = Fingerprint::default();
        f.push("overlap.version", env!("CARGO_PKG_VERSION"));
        f.push(
            "rendezvous.protocol",
            crate::rendezvous::PROTOCOL_VERSION.to_string(),
        );
        f
    }

    /// Adds a field (the order of calls is the order of comparison).
    pub fn push(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.fields.push((name.into(), value.into()));
    }

    /// The fields, in order.
    pub fn fields(&self) -> &[(String, String)] {
        &self.fields
    }

    /// The fingerprint of `command` (`run`, `verify`, ...) of `config` on `backend`,
    /// for `steps` steps from `seed`. Plans every gate pattern in use.
    pub fn of_config(
        config: &Config,
        command: &str,
        backend: &str,
        steps: u64,
        seed: u64,
    ) -> Result<Fingerprint, Error> {
        let mut f = Fingerprint::build();
        f.push("command", command);
        f.push("run.backend", backend);
        let spec = &config.plan;
        f.push("mesh", spec.mesh.to_string());
        f.push("params.count", spec.params.len().to_string());
        for (i, p) in spec.params.iter().enumerate() {
            f.push(format!("param[{i}]"), json(p));
        }
        f.flatten(
            "reduce",
            &serde_json::to_value(spec.reduce).unwrap_or(Value::Null),
        );
        f.push("buckets.cap_bytes", spec.bucket_cap_bytes.to_string());
        f.flatten(
            "streams",
            &serde_json::to_value(spec.bindings).unwrap_or(Value::Null),
        );
        f.push("overlap.transport", spec.schedule.transport.name());
        f.push("overlap.schedule", format!("{:?}", spec.schedule));
        let o = &config.overlap;
        f.push("overlap.stage1_window", o.stage1_window.to_string());
        f.push("overlap.copy_slot_mib", o.copy_slot_mib.to_string());
        f.push("overlap.copy_ring_depth", o.copy_ring_depth.to_string());
        f.push("overlap.nccl_max_ctas", format!("{:?}", o.nccl_max_ctas));
        f.push(
            "accumulation.gates",
            overlap_graph::Gate::pattern_label(&config.gates),
        );
        f.push("run.steps", steps.to_string());
        f.push("run.seed", seed.to_string());
        f.push(
            "run.backward_us_per_layer",
            config.run.backward_us_per_layer.to_string(),
        );
        f.push("run.grads", config.run.grads.name().to_string());
        f.push("optimizer.adamw", format!("{:?}", config.adamw));
        f.push("optimizer.muon", format!("{:?}", config.muon));
        f.push("optimizer.groups", config.groups.len().to_string());
        for (i, g) in config.groups.iter().enumerate() {
            f.push(format!("optimizer.group[{i}]"), format!("{g:?}"));
        }
        f.push("schedule", format!("{:?}", config.schedule));
        f.push("clip", format!("{:?}", config.clip));
        let planner = overlap_graph::Planner::new(spec.clone())?;
        let plan = planner.plan(&config.gates)?;
        f.push(
            format!(
                "plan[{}].sha256",
                overlap_graph::Gate::pattern_label(&config.gates)
            ),
            hex(&Sha256::digest(
                serde_json::to_vec(&plan).unwrap_or_default(),
            )),
        );
        Ok(f)
    }

    /// Adds a JSON object's scalar members as `prefix.key` fields (nested objects
    /// recursively; anything else as its JSON text).
    pub fn flatten(&mut self, prefix: &str, v: &Value) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    self.flatten(&format!("{prefix}.{k}"), v);
                }
            }
            Value::String(s) => self.push(prefix, s.clone()),
            other => self.push(prefix, other.to_string()),
        }
    }

    /// SHA-256 (hex) over the canonical serialisation: each name and value, as a
    /// little-endian `u64` length and the bytes.
    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        for (n, v) in &self.fields {
            for s in [n, v] {
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
        hex(&h.finalize())
    }

    /// The wire form (JSON: the fields as `[name, value]` pairs).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(&self.fields).unwrap_or_default()
    }

    /// Reads [`Fingerprint::encode`]'s form.
    pub fn decode(bytes: &[u8]) -> Result<Fingerprint, String> {
        serde_json::from_slice(bytes)
            .map(|fields| Fingerprint { fields })
            .map_err(|e| e.to_string())
    }
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn shown(v: &str) -> String {
    if v.chars().count() <= SHOWN {
        v.to_string()
    } else {
        format!("{}…", v.chars().take(SHOWN).collect::<String>())
    }
}

/// Compares every rank's encoded fingerprint (index = rank) with rank 0's: `None`
/// when all agree, else one message naming rank 0, the first rank that differs and the
/// first field in which it does, e.g. ``ranks 0 and 3 disagree on `buckets.cap_bytes`:
/// 26214400 vs 1048576``.
pub fn compare(all: &[Vec<u8>]) -> Option<String> {
    let first = all.first()?;
    let base = match Fingerprint::decode(first) {
        Ok(f) => f,
        Err(e) => return Some(format!("rank 0 cannot read its own fingerprint: {e}")),
    };
    for (rank, bytes) in all.iter().enumerate().skip(1) {
        let other = match Fingerprint::decode(bytes) {
            Ok(f) => f,
            Err(e) => {
                return Some(format!(
                    "rank {rank} sent a fingerprint rank 0 cannot read ({e}): run the same overlap build on every rank"
                ))
            }
        };
        if let Some(msg) = first_difference(&base, &other, rank) {
            return Some(msg);
        }
    }
    None
}

/// The first field in which rank `rank`'s fingerprint differs from rank 0's.
fn first_difference(a: &Fingerprint, b: &Fingerprint, rank: usize) -> Option<String> {
    let missing = (String::from("(nothing)"), String::new());
    let n = a.fields.len().max(b.fields.len());
    for i in 0..n {
        let (na, va) = a.fields.get(i).unwrap_or(&missing);
        let (nb, vb) = b.fields.get(i).unwrap_or(&missing);
        if na != nb {
            return Some(format!(
                "ranks 0 and {rank} disagree on what they compare: field {i} is `{na}` on rank 0 and `{nb}` on rank {rank}"
            ));
        }
        if va != vb {
            return Some(format!(
                "ranks 0 and {rank} disagree on `{na}`: {} vs {}",
                shown(va),
                shown(vb)
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let base = include_str!("../../examples/hsdp_2x2.toml");
        Config::from_toml(&format!("{base}\n{extra}"), "hsdp_2x2.toml").unwrap()
    }

    fn of(c: &Config) -> Fingerprint {
        Fingerprint::of_config(c, "run", "cpu", 3, 42).unwrap()
    }

    #[test]
    fn the_same_config_gives_the_same_fingerprint_and_digest() {
        let (a, b) = (of(&config("")), of(&config("")));
        assert_eq!(a, b);
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a.digest().len(), 64);
        assert!(
            a.fields().iter().any(|(n, _)| n == "streams.stage1"),
            "{a:?}"
        );
        assert!(
            a.fields().iter().any(|(n, _)| n.starts_with("plan[")),
            "{a:?}"
        );
        assert_eq!(compare(&[a.encode(), b.encode(), a.encode()]), None);
    }

    #[test]
    fn a_different_bucket_cap_is_named_with_both_values() {
        let mut c = config("");
        let a = of(&c);
        c.plan.bucket_cap_bytes = 1_048_576;
        let b = of(&c);
        assert_ne!(a.digest(), b.digest());
        let msg = compare(&[a.encode(), a.encode(), a.encode(), b.encode()]).unwrap();
        let want = format!(
            "ranks 0 and 3 disagree on `buckets.cap_bytes`: {} vs 1048576",
            a.fields()
                .iter()
                .find(|(n, _)| n == "buckets.cap_bytes")
                .unwrap()
                .1
        );
        assert_eq!(msg, want);
    }

    #[test]
    fn a_different_version_steps_or_seed_is_a_disagreement() {
        let a = of(&config(""));
        let mut b = a.clone();
        b.fields[0].1 = "0.0.0-other".into();
        let msg = compare(&[a.encode(), b.encode()]).unwrap();
        assert!(
            msg.starts_with("ranks 0 and 1 disagree on `overlap.version`: "),
            "{msg}"
        );
        let c = Fingerprint::of_config(&config(""), "run", "cpu", 4, 42).unwrap();
        assert!(compare(&[a.encode(), c.encode()])
            .unwrap()
            .contains("`run.steps`: 3 vs 4"));
        let d = Fingerprint::of_config(&config(""), "verify", "cpu", 3, 42).unwrap();
        assert!(compare(&[a.encode(), d.encode()])
            .unwrap()
            .contains("`command`: run vs verify"));
    }

    #[test]
    fn unreadable_or_shorter_fingerprints_are_named() {
        let a = of(&config(""));
        let msg = compare(&[a.encode(), b"\xff garbage".to_vec()]).unwrap();
        assert!(
            msg.starts_with("rank 1 sent a fingerprint rank 0 cannot read"),
            "{msg}"
        );
        let mut short = a.clone();
        short.fields.pop();
        let msg = compare(&[a.encode(), short.encode()]).unwrap();
        assert!(msg.contains("on rank 1"), "{msg}");
    }
}
