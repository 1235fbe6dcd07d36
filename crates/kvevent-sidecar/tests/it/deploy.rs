//! `deploy/`: the example configuration loads, the dashboard and alert rules name only metrics
//! the sidecar exports, the Kubernetes example passes only flags the sidecar has. (`.ci/run`
//! also runs `promtool check rules` and `promtool test rules` on the alerts.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kvevent_sidecar::Settings;
use kvevent_sidecar::settings::known_options;

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(file)
}

/// Every `kvevent_…` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kvevent_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// The example TOML loads as written, every value it sets taken (its TLS CA and token files
/// exist only in a pod: they are pointed at files that exist here, nothing else changes).
#[test]
#[allow(
    clippy::result_large_err,
    reason = "figment::Jail fixes the closure's error type"
)]
fn the_example_configuration_loads() {
    figment::Jail::expect_with(|jail| {
        let text = std::fs::read_to_string(deploy("kvevent-subscriber.toml")).expect("read");
        let ca = rcgen::CertificateParams::new(vec!["ca.test".to_owned()])
            .and_then(|p| p.self_signed(&rcgen::KeyPair::generate()?))
            .expect("a certificate");
        jail.create_file("ca.crt", &ca.pem())?;
        jail.create_file("token", "secret\n")?;
        let dir = jail.directory().display().to_string();
        let text = text
            .replace("/etc/kvevent/tls/ca.crt", &format!("{dir}/ca.crt"))
            .replace("/var/run/secrets/kvevent/token", &format!("{dir}/token"))
            .replace("/var/lib/kvevent/state", &format!("{dir}/state"));
        jail.create_file("example.toml", &text)?;
        let path = jail.directory().join("example.toml");
        let s = Settings::load(
            Some(&path),
            std::collections::BTreeMap::<String, String>::new(),
        )
        .map_err(|e| e.to_string())?;
        assert_eq!(s.replay_endpoint.get(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(
            s.server.to_string(),
            "https://inference-cache.cache.svc:9090"
        );
        assert_eq!(s.replica_id, "vllm-llama-0");
        assert_eq!(s.model_id, "meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!(s.key_mode, kvevent_mapper::KeyMode::Fingerprint);
        assert_eq!(s.refresh_interval.0, std::time::Duration::from_secs(600));
        assert_eq!(s.max_pending, 100_000);
        assert_eq!(s.engine_cache_size_bytes, 68_719_476_736);
        assert_eq!(s.metrics_address.as_str(), ":9095");
        assert_eq!(s.log_format, kvevent_sidecar::settings::LogFormat::Json);
        assert_eq!(s.token_file, Some(jail.directory().join("token")));
        assert_eq!(s.state_file, Some(jail.directory().join("state")));
        assert!(s.uses_tls());
        Ok(())
    });
}

#[test]
fn dashboards_and_alerts_name_only_exported_metrics() {
    let exported = crate::docs::listed_metrics();
    let dashboard =
        std::fs::read_to_string(deploy("grafana/kvevent-dashboard.json")).expect("read");
    let json: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let panels = json["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10);
    for panel in panels {
        assert!(
            panel["targets"].as_array().is_some_and(|t| !t.is_empty()),
            "{panel}"
        );
    }
    let alerts = std::fs::read_to_string(deploy("prometheus/kvevent-alerts.yaml")).expect("read");
    let alert_tests =
        std::fs::read_to_string(deploy("prometheus/kvevent-alerts.test.yaml")).expect("read");
    for (what, text) in [
        ("dashboard", &dashboard),
        ("alerts", &alerts),
        ("alert tests", &alert_tests),
    ] {
        let named = metric_names(text);
        assert!(!named.is_empty(), "{what}");
        // A histogram family's series: `<family>_bucket`, `_sum`, `_count`.
        let unknown: Vec<_> = named
            .iter()
            .filter(|name| {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix))
                    .filter(|family| exported.contains(*family));
                !exported.contains(*name) && family.is_none()
            })
            .collect();
        assert!(
            unknown.is_empty(),
            "{what} names metrics we do not export: {unknown:?}"
        );
    }
    for alert in [
        "KVEventEngineSilent",
        "KVEventServerFailing",
        "KVEventDropping",
        "KVEventSourceDegraded",
    ] {
        assert!(alerts.contains(&format!("alert: {alert}")), "{alert}");
    }
}

#[test]
fn the_kubernetes_example_passes_only_flags_the_sidecar_has() {
    let manifest =
        std::fs::read_to_string(deploy("kubernetes/vllm-with-kvevent.yaml")).expect("read");
    let sidecar = manifest
        .split("- name: kvevent-subscriber")
        .nth(1)
        .expect("the sidecar container");
    let args = sidecar.split("env:").next().expect("args");
    let known: BTreeSet<String> = known_options()
        .into_iter()
        .map(|o| o.replace('_', "-"))
        .collect();
    let mut flags = 0;
    for line in args.lines() {
        let Some(flag) = line.trim().strip_prefix("- --") else {
            continue;
        };
        let name = flag.split('=').next().unwrap_or_default();
        assert!(
            known.contains(name),
            "--{name} is not a flag of the sidecar"
        );
        flags += 1;
    }
    assert!(flags >= 5);
    assert!(sidecar.contains("KVEVENT_REPLICA_ID") && sidecar.contains("KVEVENT_MODEL_ID"));
    assert!(manifest.contains("emptyDir") && sidecar.contains("/var/lib/kvevent"));
}
