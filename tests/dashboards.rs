//! The Grafana dashboards in `dashboards/` are well formed: a stable uid, a Prometheus
//! datasource variable that every panel uses (no hard-coded datasource), a unit on
//! every panel, `$__rate_interval` in every rate, a panel for every metric, and
//! provisioning that points at the dashboards folder. Their PromQL is checked against a
//! real Prometheus in `cli/tests/prometheus.rs`.

use std::path::{Path, PathBuf};

use overlap::observe::metrics::METRICS;
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn dashboards() -> Vec<(PathBuf, Value)> {
    let dir = root().join("dashboards");
    let mut out: Vec<(PathBuf, Value)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let v = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: not JSON: {e}", p.display()));
            (p, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!out.is_empty(), "no dashboard JSON in {}", dir.display());
    out
}

/// Every panel that shows data (rows are containers), nested rows included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            if p["type"] == "row" {
                walk(&p["panels"], out);
            } else {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

fn exprs(dashboard: &Value) -> Vec<String> {
    panels(dashboard)
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn every_dashboard_has_a_stable_uid_and_a_prometheus_datasource_variable() {
    for (path, d) in dashboards() {
        let uid = d["uid"].as_str().unwrap_or_default();
        assert!(
            !uid.is_empty()
                && uid.len() <= 40
                && uid
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "{}: uid {uid:?}",
            path.display()
        );
        assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
        let vars = d["templating"]["list"].as_array().expect("templating.list");
        let ds = vars
            .iter()
            .find(|v| v["name"] == "datasource")
            .unwrap_or_else(|| panic!("{}: no `datasource` variable", path.display()));
        assert_eq!(ds["type"], "datasource", "{}", path.display());
        assert_eq!(ds["query"], "prometheus", "{}", path.display());
    }
}

#[test]
fn no_datasource_is_hard_coded() {
    fn walk(v: &Value, at: &str, file: &Path) {
        match v {
            Value::Object(m) => {
                if let Some(ds) = m.get("datasource") {
                    let uid = match ds {
                        Value::String(s) => s.as_str(),
                        other => other["uid"].as_str().unwrap_or_default(),
                    };
                    assert_eq!(
                        uid,
                        "${datasource}",
                        "{}: {at}.datasource must be the variable",
                        file.display()
                    );
                    if let Some(t) = ds.get("type") {
                        assert_eq!(t, "prometheus", "{}: {at}", file.display());
                    }
                }
                for (k, x) in m {
                    walk(x, &format!("{at}.{k}"), file);
                }
            }
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, x)| walk(x, &format!("{at}[{i}]"), file)),
            _ => {}
        }
    }
    for (path, d) in dashboards() {
        walk(&d, "", &path);
    }
}

#[test]
fn every_panel_uses_the_datasource_variable_has_a_unit_and_queries() {
    for (path, d) in dashboards() {
        let mut ids = Vec::new();
        for p in panels(&d) {
            let title = p["title"].as_str().unwrap_or("?");
            let at = format!("{}: panel {title:?}", path.display());
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{at}");
            let unit = p["fieldConfig"]["defaults"]["unit"].as_str();
            assert!(unit.is_some_and(|u| !u.is_empty()), "{at}: no unit");
            let targets = p["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{at}: no query");
            for t in targets {
                assert!(
                    t["expr"].as_str().is_some_and(|e| !e.trim().is_empty()),
                    "{at}: a target without expr"
                );
            }
            assert!(p["gridPos"]["w"].as_u64().is_some(), "{at}: no gridPos");
            assert!(
                p["description"].as_str().is_some_and(|s| !s.is_empty()),
                "{at}: say what the panel answers"
            );
            ids.push(p["id"].as_u64().expect("panel id"));
        }
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), n, "{}: duplicate panel ids", path.display());
    }
}

#[test]
fn every_rate_uses_rate_interval() {
    for (path, d) in dashboards() {
        for e in exprs(&d) {
            if e.contains("rate(") || e.contains("increase(") {
                assert!(e.contains("[$__rate_interval]"), "{}: {e}", path.display());
            }
            // Every range selector is the rate interval.
            for (i, _) in e.match_indices('[') {
                assert!(
                    e[i..].starts_with("[$__rate_interval]"),
                    "{}: range selector other than $__rate_interval in {e}",
                    path.display()
                );
            }
        }
    }
}

#[test]
fn every_metric_has_a_panel() {
    let all: Vec<String> = dashboards().iter().flat_map(|(_, d)| exprs(d)).collect();
    for (name, _, _) in METRICS {
        assert!(
            all.iter().any(|e| e.contains(name)),
            "no dashboard panel queries {name}"
        );
    }
}

/// The value of the first `key: value` line of a YAML file (enough for these files).
fn yaml_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().trim_matches('"'))
}

#[test]
fn provisioning_points_at_the_dashboards_folder() {
    let dir = root().join("dashboards/provisioning");
    let dash = std::fs::read_to_string(dir.join("dashboards.yaml")).unwrap();
    assert_eq!(yaml_value(&dash, "apiVersion"), Some("1"));
    assert!(dash.contains("providers:"));
    assert_eq!(yaml_value(&dash, "type"), Some("file"));
    let path = yaml_value(&dash, "path").expect("options.path");
    assert!(path.ends_with("/dashboards"), "{path}");
    // docs/observe.md mounts the repository's dashboards/ folder at that path.
    let readme = std::fs::read_to_string(root().join("docs/observe.md")).unwrap();
    assert!(
        readme.contains(&format!("dashboards:{path}")),
        "docs/observe.md does not mount dashboards/ at {path}"
    );
    let ds = std::fs::read_to_string(dir.join("datasources.yaml")).unwrap();
    assert_eq!(yaml_value(&ds, "type"), Some("prometheus"));
    assert!(yaml_value(&ds, "url").is_some_and(|u| u.starts_with("http")));
}
