//! The public API of every library crate, compared with its snapshot (`api/public.txt`),
//! so that a change to what users can name is seen in review and never by accident.
//!
//! Every `pub` item declaration (functions and methods, types, traits, modules,
//! constants, re-exports, fields) outside test modules is listed with its crate and file,
//! its signature on one line. A removed or changed line is a possible break for users
//! (mark it in the changelog, or undo it); an added line is new API (document it). After
//! a deliberate change, regenerate the snapshot:
//!
//! ```sh
//! OVERLAP_UPDATE_API=1 cargo test --test public_api
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The library crates and their source folders, relative to the repository root.
const CRATES: [(&str, &str); 7] = [
    ("overlap", "src"),
    ("overlap-graph", "graph/src"),
    ("overlap-ops", "ops/src"),
    ("overlap-executor", "executor/src"),
    ("overlap-dist", "dist/src"),
    ("overlap-sim", "sim/src"),
    ("overlap-candle", "candle/src"),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") && p.file_name().unwrap() != "tests.rs" {
            out.push(p);
        }
    }
}

/// The `pub` declarations of one file: each one's text up to its body, on one line.
fn declarations(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        // A test module ends the file's API (they come last, by the code's convention).
        if line == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|l| l.trim().starts_with("mod "))
        {
            break;
        }
        if line.starts_with("pub ") {
            let mut decl = line.to_string();
            // Signatures spread over several lines end at their body or terminator (a
            // field's or a variant's at its comma).
            let is_fn = decl.contains("fn ");
            let ended =
                |d: &str| d.contains('{') || d.ends_with(';') || (!is_fn && d.ends_with(','));
            while !ended(&decl) && i + 1 < lines.len() {
                i += 1;
                decl.push(' ');
                decl.push_str(lines[i].trim());
            }
            let decl = decl
                .split(" {")
                .next()
                .unwrap_or(&decl)
                .trim_end_matches('{');
            out.push(decl.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        i += 1;
    }
    out
}

fn current() -> BTreeSet<String> {
    let mut api = BTreeSet::new();
    for (name, dir) in CRATES {
        let mut files = Vec::new();
        rust_files(&root().join(dir), &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            let rel = f.strip_prefix(root()).unwrap().display().to_string();
            for d in declarations(&text) {
                api.insert(format!("{name} {rel}: {d}"));
            }
        }
    }
    api
}

#[test]
fn the_public_api_matches_its_snapshot() {
    let path = root().join("api/public.txt");
    let now = current();
    if std::env::var_os("OVERLAP_UPDATE_API").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let text: String = now.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let snapshot: BTreeSet<String> = std::fs::read_to_string(&path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let removed: Vec<&String> = snapshot.difference(&now).collect();
    let added: Vec<&String> = now.difference(&snapshot).collect();
    assert!(
        removed.is_empty() && added.is_empty(),
        "the public API differs from api/public.txt\n\nremoved or changed (a possible break for users):\n{}\n\nadded:\n{}\n\nif this is deliberate: OVERLAP_UPDATE_API=1 cargo test --test public_api",
        removed.iter().map(|l| format!("  - {l}")).collect::<Vec<_>>().join("\n"),
        added.iter().map(|l| format!("  + {l}")).collect::<Vec<_>>().join("\n"),
    );
}

#[test]
fn declarations_are_read_whole_and_test_modules_are_left_out() {
    let text = "pub fn a(\n    x: u32,\n) -> u32 {\n    x\n}\npub(crate) fn b() {}\npub struct S {\n    pub field: u8,\n}\n#[cfg(test)]\nmod tests {\n    pub fn hidden() {}\n}\n";
    assert_eq!(
        declarations(text),
        vec![
            "pub fn a( x: u32, ) -> u32",
            "pub struct S",
            "pub field: u8,"
        ]
    );
}
