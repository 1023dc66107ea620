//! Gates: what one micro-batch does with its gradients, as in FSDP2.
//!
//! `reduce` off is `no_sync` (no collectives, local accumulation); `replicate` off runs
//! Stage 1 and folds into the partial; both on run both stages. A micro-batch's state is
//! one [`Gate`]; a step is a sequence of them.

use serde::{Deserialize, Serialize};

/// The state of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    /// Reduce gate off: no collectives; the full gradient accumulates locally.
    NoSync,
    /// Replicate gate off: Stage 1, then fold into the partial on the reduce stream.
    #[serde(rename = "off")]
    ReplicateOff,
    /// Both gates on: fold the partial into Stage 1's output, run Stage 2, unpack.
    On,
}

impl Gate {
    /// The gate from FSDP2-style flags: `reduce` off wins over `replicate`.
    pub fn from_flags(reduce: bool, replicate: bool) -> Gate {
        match (reduce, replicate) {
            (false, _) => Gate::NoSync,
            (true, false) => Gate::ReplicateOff,
            (true, true) => Gate::On,
        }
    }

    /// The short name used in CLI output and metrics labels: `no_sync`, `off`, `on`.
    pub fn label(self) -> &'static str {
        match self {
            Gate::NoSync => "no_sync",
            Gate::ReplicateOff => "off",
            Gate::On => "on",
        }
    }

    /// Parses `no_sync`, `off` or `on`.
    pub fn parse(s: &str) -> Result<Gate, String> {
        match s {
            "no_sync" => Ok(Gate::NoSync),
            "off" => Ok(Gate::ReplicateOff),
            "on" => Ok(Gate::On),
            _ => Err(format!("unknown gate `{s}`; expected no_sync, off or on")),
        }
    }

    /// The default pattern for `m` micro-batches: replicate gate off for all but the last.
    pub fn default_pattern(m: usize) -> Vec<Gate> {
        (0..m)
            .map(|i| {
                if i + 1 == m {
                    Gate::On
                } else {
                    Gate::ReplicateOff
                }
            })
            .collect()
    }

    /// Formats a pattern run-length compressed: `off×255,on` for 255 `off` micro-batches
    /// then one `on` (a run of one stays bare: `off,on`). Its length grows with the number
    /// of gate changes, not of micro-batches, so step lines and labels stay short.
    /// [`Gate::parse_pattern`] reads it back.
    pub fn pattern_label(gates: &[Gate]) -> String {
        let mut out = String::new();
        let mut i = 0;
        while let Some(&g) = gates.get(i) {
            let run = gates[i..].iter().take_while(|&&x| x == g).count();
            if !out.is_empty() {
                out.push(',');
            }
            out.push_str(g.label());
            if run > 1 {
                out.push('×');
                out.push_str(&run.to_string());
            }
            i += run;
        }
        out
    }

    /// Parses a comma-separated pattern whose entries are a gate, optionally repeated
    /// `×n` (or `*n`, easier to type): `no_sync,off*3,on`, as [`Gate::pattern_label`]
    /// writes it. An empty pattern, a count of 0 or more micro-batches than
    /// [`crate::MAX_MICRO_BATCHES`] in all is an error.
    pub fn parse_pattern(s: &str) -> Result<Vec<Gate>, String> {
        let mut gates = Vec::new();
        for entry in s.split(',') {
            let entry = entry.trim();
            let (name, count) = match entry.split_once(['×', '*']) {
                Some((name, n)) => {
                    let n: usize = n.trim().parse().map_err(|_| {
                        format!("`{entry}`: the count after the gate must be a whole number")
                    })?;
                    (name.trim(), n)
                }
                None => (entry, 1),
            };
            if count == 0 {
                return Err(format!("`{entry}`: a gate repeated 0 times"));
            }
            let gate = Gate::parse(name)?;
            let max = crate::MAX_MICRO_BATCHES;
            if count > max - gates.len() {
                return Err(format!(
                    "`{entry}`: the pattern has more than {max} micro-batches, the limit of a step"
                ));
            }
            gates.extend(std::iter::repeat(gate).take(count));
        }
        Ok(gates)
    }
}

impl std::fmt::Display for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_labels_are_run_length_compressed_and_parse_back() {
        let mut many = vec![Gate::ReplicateOff; 255];
        many.push(Gate::On);
        assert_eq!(Gate::pattern_label(&many), "off×255,on");
        assert_eq!(
            Gate::pattern_label(&[Gate::ReplicateOff, Gate::On]),
            "off,on"
        );
        assert_eq!(
            Gate::pattern_label(&[Gate::NoSync, Gate::NoSync, Gate::On, Gate::NoSync]),
            "no_sync×2,on,no_sync"
        );
        assert_eq!(Gate::pattern_label(&[]), "");
        for gates in [many, vec![Gate::On], Gate::default_pattern(5)] {
            assert_eq!(Gate::parse_pattern(&Gate::pattern_label(&gates)), Ok(gates));
        }
        assert_eq!(
            Gate::parse_pattern("no_sync, off*2 ,on"),
            Ok(vec![
                Gate::NoSync,
                Gate::ReplicateOff,
                Gate::ReplicateOff,
                Gate::On
            ])
        );
        assert!(Gate::parse_pattern("off×0,on").is_err());
        assert!(Gate::parse_pattern("off×x").is_err());
        assert!(Gate::parse_pattern("").is_err());
        assert!(Gate::parse_pattern("up").is_err());
        // A step's limit, not the memory of the machine, bounds a pattern.
        let max = crate::MAX_MICRO_BATCHES;
        assert_eq!(
            Gate::parse_pattern(&format!("off×{max}")).map(|g| g.len()),
            Ok(max)
        );
        for big in [
            format!("off×{max},on"),
            "on*10000000000000".to_string(),
            format!("on*{}", usize::MAX),
        ] {
            let e = Gate::parse_pattern(&big).unwrap_err();
            assert!(e.contains("more than 65536 micro-batches"), "{e}");
        }
    }
}
