//! Hardware profiles: the TOML files `overlap simulate --hardware` reads
//! (`hardware/*.toml`, `docs/simulate.md`), parsed into the simulator's typed
//! [`Profile`].
//!
//! Every key of [`crate::simulate::KEYS`] is a number (the `network.*` keys are
//! required together, and only in a `[network]` table), `name` a string. An unknown key,
//! a value of the wrong type or out of its range, a missing key or a TOML syntax error is
//! refused as a [`HardwareError`] naming the file, the dotted key, its line and column
//! where the text has them, and the reason.
//!
//! Invariant: a profile this module returns passes [`Profile::check`].

use std::fmt;
use std::ops::Range;
use std::path::Path;

use crate::simulate::{Profile, KEYS};
use toml::de::{DeTable, DeValue};

/// Why a hardware profile was refused. Displays as `{file}:{line}:{column}: `{key}`:
/// {reason}`, the position left out where unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct HardwareError {
    /// The file as given.
    pub file: String,
    /// The dotted key at fault (empty when the file cannot be read).
    pub key: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column in characters, when known.
    pub column: Option<usize>,
    /// What is wrong and what is allowed.
    pub reason: String,
}

impl fmt::Display for HardwareError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
            if let Some(c) = self.column {
                write!(f, ":{c}")?;
            }
        }
        if !self.key.is_empty() {
            write!(f, ": `{}`", self.key)?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// Reads and checks a profile file.
pub fn from_file(path: &Path) -> Result<Profile, HardwareError> {
    let file = path.display().to_string();
    // Profiles are a few KiB; a config's limit is ample.
    let limit = overlap::resources::MAX_CONFIG_BYTES;
    let text = overlap::resources::read_text_bounded(path, limit).map_err(|e| HardwareError {
        file: file.clone(),
        key: String::new(),
        line: None,
        column: None,
        reason: format!("cannot read the hardware profile: {e}"),
    })?;
    from_toml(&text, &file)
}

/// Parses and checks profile text; `file` names it in errors.
pub fn from_toml(text: &str, file: &str) -> Result<Profile, HardwareError> {
    let doc = Doc { text, file };
    let table = DeTable::parse(text).map_err(|e| {
        let span = e.span();
        doc.err("", span, e.message().trim().to_string())
    })?;
    let mut profile = Profile::neutral("");
    profile.network = None;
    let mut seen: Vec<&str> = Vec::new();
    let mut name = None;
    doc.walk(table.get_ref(), "", &mut |path, value, span| {
        if path == "name" {
            return match value.as_str() {
                Some(s) if !s.trim().is_empty() => {
                    name = Some(s.to_string());
                    Ok(())
                }
                Some(_) => Err(doc.err(path, Some(span), "must not be empty")),
                None => Err(doc.err(
                    path,
                    Some(span),
                    format!("must be a string, got {}", value.type_str()),
                )),
            };
        }
        let Some(key) = KEYS.iter().find(|k| k.path == path) else {
            return Err(doc.err(
                path,
                Some(span),
                format!(
                    "unknown key; a profile has `name` and {}",
                    KEYS.iter()
                        .map(|k| format!("`{}`", k.path))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        let v = match value {
            DeValue::Integer(i) => i64::from_str_radix(i.as_str(), i.radix())
                .map(|x| x as f64)
                .map_err(|_| doc.err(path, Some(span.clone()), "integer out of range"))?,
            DeValue::Float(f) => f
                .as_str()
                .parse::<f64>()
                .map_err(|_| doc.err(path, Some(span.clone()), "not a number"))?,
            other => {
                return Err(doc.err(
                    path,
                    Some(span),
                    format!("must be {}, got {}", key.rule.describe(), other.type_str()),
                ))
            }
        };
        if let Some(reason) = key.rule.violation(v) {
            return Err(doc.err(path, Some(span), reason));
        }
        profile.set(key.path, v);
        seen.push(key.path);
        Ok(())
    })?;
    let has_network = seen.iter().any(|p| p.starts_with("network."));
    for k in KEYS {
        let needed = k.required || (has_network && k.path.starts_with("network."));
        if needed && !seen.contains(&k.path) {
            return Err(doc.err(
                k.path,
                None,
                format!("missing; {}: {}", k.rule.describe(), k.doc),
            ));
        }
    }
    profile.name = name.ok_or_else(|| doc.err("name", None, "missing; a name for reports"))?;
    profile
        .check()
        .map_err(|e| doc.err(&e.key, None, e.reason))?;
    Ok(profile)
}

struct Doc<'a> {
    text: &'a str,
    file: &'a str,
}

/// What [`Doc::walk`] calls with each leaf: its dotted path, value and the value's span.
type Leaf<'f, 't> =
    dyn FnMut(&str, &'t DeValue<'t>, Range<usize>) -> Result<(), HardwareError> + 'f;

impl Doc<'_> {
    fn err(
        &self,
        key: &str,
        span: Option<Range<usize>>,
        reason: impl Into<String>,
    ) -> HardwareError {
        let (line, column) = match span {
            Some(s) => {
                let mut at = s.start.min(self.text.len());
                while !self.text.is_char_boundary(at) {
                    at -= 1;
                }
                let before = &self.text[..at];
                let line = before.matches('\n').count() + 1;
                let start = before.rfind('\n').map_or(0, |i| i + 1);
                (Some(line), Some(before[start..].chars().count() + 1))
            }
            None => (None, None),
        };
        HardwareError {
            file: self.file.to_string(),
            key: key.to_string(),
            line,
            column,
            reason: reason.into(),
        }
    }

    /// Calls `f` with every leaf of the table (dotted path, value, span of the value),
    /// in the file's order.
    fn walk<'t>(
        &self,
        table: &'t DeTable<'t>,
        prefix: &str,
        f: &mut Leaf<'_, 't>,
    ) -> Result<(), HardwareError> {
        for (k, v) in table.iter() {
            let path = if prefix.is_empty() {
                k.get_ref().to_string()
            } else {
                format!("{prefix}.{}", k.get_ref())
            };
            match v.get_ref() {
                DeValue::Table(t) => {
                    let known = KEYS
                        .iter()
                        .any(|key| key.path.starts_with(&format!("{path}.")));
                    if !known {
                        return Err(self.err(
                            &path,
                            Some(k.span()),
                            "unknown table; a profile has [compute], [memory], [sync], [combine], [copy_engine], [nvlink], [nvlink.busbw_gbs], [network], [interference.nccl], [interference.combine], [interference.copy_engine] and [host]",
                        ));
                    }
                    self.walk(t, &path, f)?;
                }
                value => f(&path, value, v.span())?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped(name: &str) -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../hardware")
            .join(name);
        std::fs::read_to_string(path).unwrap()
    }

    #[test]
    fn the_shipped_profiles_parse_and_check() {
        for name in ["h200-nvlink.toml", "h200-8x-400g.toml"] {
            let p = from_toml(&shipped(name), name).unwrap();
            p.check().unwrap();
            assert!(!p.name.is_empty());
        }
        let multi = from_toml(&shipped("h200-8x-400g.toml"), "m").unwrap();
        assert_eq!(multi.gpus_per_node, 8);
        assert!(multi.network.is_some());
        assert!(from_toml(&shipped("h200-nvlink.toml"), "n")
            .unwrap()
            .network
            .is_none());
    }

    #[test]
    fn docs_simulate_md_describes_every_key() {
        let doc = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/simulate.md"),
        )
        .unwrap();
        for k in KEYS {
            assert!(
                doc.contains(&format!("`{}`", k.path)),
                "docs/simulate.md lacks `{}`",
                k.path
            );
        }
    }

    /// The shipped one-node profile with `line` replaced by `with`.
    fn edited(line: &str, with: &str) -> String {
        let text = shipped("h200-nvlink.toml");
        let at = text
            .lines()
            .position(|l| l.trim_start().starts_with(line))
            .unwrap_or_else(|| panic!("no line starting with {line}"));
        text.lines()
            .enumerate()
            .map(|(i, l)| {
                if i == at {
                    with.to_string()
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn line_of(text: &str, needle: &str) -> usize {
        text.lines().position(|l| l.contains(needle)).unwrap() + 1
    }

    #[test]
    fn bad_profiles_are_refused_with_key_line_and_reason() {
        // A value out of its range.
        let text = edited("peer_gbs", "peer_gbs = -3");
        let e = from_toml(&text, "bad.toml").unwrap_err();
        assert_eq!(e.key, "copy_engine.peer_gbs");
        assert_eq!(e.line, Some(line_of(&text, "peer_gbs = -3")));
        assert!(e.reason.contains("above 0"), "{e}");
        assert!(e.to_string().starts_with("bad.toml:"), "{e}");
        // A stretch below 1, a fractional count.
        let e = from_toml(&edited("stretch", "stretch = 0.5"), "b").unwrap_err();
        assert!(
            e.key.ends_with(".stretch") && e.reason.contains("at least 1"),
            "{e}"
        );
        let e = from_toml(&edited("concurrency", "concurrency = 1.5"), "b").unwrap_err();
        assert_eq!(e.key, "copy_engine.concurrency");
        assert!(e.reason.contains("whole number"), "{e}");
        // The wrong type.
        let text = edited("gemm_tflops", "gemm_tflops = \"fast\"");
        let e = from_toml(&text, "b").unwrap_err();
        assert_eq!(e.key, "compute.gemm_tflops");
        assert_eq!(e.line, Some(line_of(&text, "\"fast\"")));
        assert!(e.reason.contains("string"), "{e}");
        // An unknown key and an unknown table.
        let text = edited("hbm_gbs", "hbm_gb = 2000");
        let e = from_toml(&text, "b").unwrap_err();
        assert_eq!(e.key, "memory.hbm_gb");
        assert!(e.reason.contains("unknown key"), "{e}");
        let e = from_toml("name = \"x\"\n[gpu]\nsms = 132\n", "b").unwrap_err();
        assert_eq!((e.key.as_str(), e.line), ("gpu", Some(2)));
        // A missing key: named, no line.
        let text = edited("hbm_gbs", "");
        let e = from_toml(&text, "b").unwrap_err();
        assert_eq!((e.key.as_str(), e.line), ("memory.hbm_gbs", None));
        assert!(e.reason.starts_with("missing"), "{e}");
        // Half a network.
        let text = format!("{}\n[network]\nhop_us = 5\n", shipped("h200-nvlink.toml"));
        let e = from_toml(&text, "b").unwrap_err();
        assert_eq!(e.key, "network.nic_gbs");
        // TOML syntax: the parser's line.
        let text = edited("hbm_gbs", "hbm_gbs = = 3");
        let e = from_toml(&text, "b").unwrap_err();
        assert_eq!(e.line, Some(line_of(&text, "= = 3")), "{e}");
        // Not a number at all.
        let e = from_toml(&edited("hbm_gbs", "hbm_gbs = nan"), "b").unwrap_err();
        assert!(e.reason.contains("finite"), "{e}");
        // An empty name.
        let e = from_toml(&edited("name", "name = \"\""), "b").unwrap_err();
        assert_eq!(e.key, "name");
    }
}
