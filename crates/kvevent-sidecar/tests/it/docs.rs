//! The operator's docs against the code: `docs/operating.md`'s flag table names every option
//! with its default, and its metrics table every metric (checked against a live `/metrics` in
//! `e2e.rs`).

use std::collections::{BTreeMap, BTreeSet};

use kvevent_sidecar::settings;

fn operating() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/operating.md"
    ))
    .expect("docs/operating.md")
}

/// The rows of the table under `heading` as cells.
fn table(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let section = doc
        .split(heading)
        .nth(1)
        .and_then(|s| s.split("\n#").next())
        .unwrap_or_else(|| panic!("no section {heading}"));
    section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect()
}

/// Metric names in the metrics reference (first column, split at commas).
pub(crate) fn listed_metrics() -> BTreeSet<String> {
    table(&operating(), "## Metrics reference")
        .iter()
        .flat_map(|row| {
            row[0]
                .split(',')
                .map(|m| m.trim().trim_matches('`').to_owned())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every option has a row (`--flag`, or `--a` / `--b` rows of two) whose default is the one
/// `Settings::default()` has; an empty default reads as a parenthesis or nothing.
#[test]
fn the_flag_table_has_every_option_with_its_default() {
    let defaults: BTreeMap<String, String> = settings::defaults().into_iter().collect();
    let mut documented = BTreeMap::new();
    for row in table(&operating(), "## Flag reference") {
        let flags: Vec<&str> = row[0].split(" / ").collect();
        let values: Vec<&str> = row[1].split(" / ").collect();
        for (i, flag) in flags.iter().enumerate() {
            let option = flag
                .trim_matches('`')
                .trim_start_matches("--")
                .replace('-', "_");
            let value = values.get(i).or(values.first()).copied().unwrap_or("");
            documented.insert(option, value.to_owned());
        }
    }
    for (option, default) in &defaults {
        let shown = documented
            .get(option)
            .unwrap_or_else(|| panic!("--{option} is not in the flag table"));
        let shown = if shown.starts_with('`') {
            shown.trim_matches('`').to_owned()
        } else {
            // "(none)", "(required)", "(system roots)", or empty: no value of its own.
            String::new()
        };
        assert_eq!(&shown, default, "--{option}: the table's default");
    }
    for option in documented.keys() {
        assert!(
            defaults.contains_key(option) || option == "config",
            "the table lists --{option}, which is not an option"
        );
    }
}
