//! Layers, precedence and validation of the settings.
#![allow(
    clippy::result_large_err,
    reason = "figment::Jail fixes the closure's error type"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use figment::Jail;
use kvevent_sidecar::Settings;
use kvevent_sidecar::settings::parse_duration;

fn flags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn precedence_is_defaults_then_file_then_env_then_flags() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "sub.toml",
            r#"
                replica_id = "from-file"
                model_id = "from-file"
                window = "250ms"
                topic = "file-topic"
                dp_size = 2
            "#,
        )?;
        jail.set_env("KVEVENT_MODEL_ID", "from-env");
        jail.set_env("KVEVENT_TOPIC", "env-topic");
        jail.set_env("KVEVENT_ENGINE_BIND", "true");
        jail.set_env("KVEVENT_PYTHON", "/not/an/option");
        let path = jail.directory().join("sub.toml");
        let s = Settings::load(Some(&path), flags(&[("topic", "flag-topic")])).expect("valid");
        assert_eq!(s.replica_id, "from-file");
        assert_eq!(s.model_id, "from-env");
        assert_eq!(s.topic, "flag-topic");
        assert_eq!(s.window.0, Duration::from_millis(250));
        assert_eq!(s.dp_size, 2);
        assert!(s.engine_bind);
        assert_eq!(
            s.server().as_deref(),
            Some("http://127.0.0.1:9090"),
            "default kept"
        );
        Ok(())
    });
}

#[test]
fn numeric_looking_env_values_are_still_strings() {
    Jail::expect_with(|jail| {
        jail.set_env("KVEVENT_REPLICA_ID", "123");
        jail.set_env("KVEVENT_MODEL_ID", "7");
        jail.set_env("KVEVENT_STATS_INTERVAL", "1m30s");
        let s = Settings::load(None, flags(&[])).expect("valid");
        assert_eq!((s.replica_id.as_str(), s.model_id.as_str()), ("123", "7"));
        assert_eq!(s.stats_interval.0, Duration::from_secs(90));
        Ok(())
    });
}

#[test]
fn every_problem_is_reported_at_once_with_flag_and_env_names() {
    Jail::expect_with(|_jail| {
        let err = Settings::load(
            None,
            flags(&[
                ("rpc_timeout", "0"),
                ("server", "not an address"),
                ("key_mode", "magic"),
                ("lora_adapter_names", "x=y"),
                ("engine_endpoint", "http://engine"),
            ]),
        )
        .expect_err("invalid");
        let text = err.to_string();
        for needle in [
            "--replica-id (KVEVENT_REPLICA_ID): is required",
            "--model-id (KVEVENT_MODEL_ID): is required",
            "--rpc-timeout (KVEVENT_RPC_TIMEOUT): must be more than 0",
            "--server (KVEVENT_SERVER)",
            "--key-mode (KVEVENT_KEY_MODE)",
            "--lora-adapter-names (KVEVENT_LORA_ADAPTER_NAMES)",
            "--engine-endpoint (KVEVENT_ENGINE_ENDPOINT)",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        assert_eq!(err.0.len(), 7, "{text}");
        Ok(())
    });
}

/// Each option's own constraint is the `check` in its entry (`options.rs`): every one of them
/// runs, and says what the value must be, with the flag and the variable.
#[test]
fn each_option_is_checked_by_its_entry() {
    Jail::expect_with(|_jail| {
        let err = Settings::load(
            None,
            flags(&[
                ("replica_id", "r"),
                ("model_id", "m"),
                ("dp_size", "0"),
                ("max_in_flight", "2000"),
                ("engine_rcvhwm", "-1"),
                ("feed_ring_bytes", "0"),
                ("log_level", "loud"),
                ("metrics_address", "nowhere"),
                ("replay_endpoint", "127.0.0.1:5558"),
                ("engine_discovery_url", "https://engine/kv_event_sources"),
                ("token_file", "/no/such/token"),
                ("engine_reconnect_max", "0"),
            ]),
        )
        .expect_err("invalid");
        let text = err.to_string();
        for needle in [
            "--dp-size (KVEVENT_DP_SIZE): must be 1 to 256, not 0",
            "--max-in-flight (KVEVENT_MAX_IN_FLIGHT): must be 1 to 1024, not 2000",
            "--engine-rcvhwm (KVEVENT_ENGINE_RCVHWM): must be 0 (no limit) or more",
            "--feed-ring-bytes (KVEVENT_FEED_RING_BYTES): must be at least 1",
            "--log-level (KVEVENT_LOG_LEVEL): `loud` is neither a level",
            "--metrics-address (KVEVENT_METRICS_ADDRESS)",
            "--replay-endpoint (KVEVENT_REPLAY_ENDPOINT)",
            "--engine-discovery-url (KVEVENT_ENGINE_DISCOVERY_URL): `https://engine/kv_event_sources` is not an http:// URL",
            "--token-file (KVEVENT_TOKEN_FILE): no such file /no/such/token",
            "--engine-reconnect-max (KVEVENT_ENGINE_RECONNECT_MAX): must be more than 0",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        assert_eq!(err.0.len(), 10, "{text}");
        Ok(())
    });
}

#[test]
fn type_errors_name_the_option() {
    Jail::expect_with(|jail| {
        jail.set_env("KVEVENT_DP_SIZE", "many");
        let err = Settings::load(None, flags(&[("replica_id", "r"), ("model_id", "m")]))
            .expect_err("bad");
        assert!(
            err.to_string().contains("--dp-size (KVEVENT_DP_SIZE)"),
            "{err}"
        );
        jail.set_env("KVEVENT_DP_SIZE", "2");
        jail.set_env("KVEVENT_WINDOW", "fast");
        let err = Settings::load(None, flags(&[("replica_id", "r"), ("model_id", "m")]))
            .expect_err("bad");
        assert!(
            err.to_string()
                .contains("--window (KVEVENT_WINDOW): `fast` is not a duration"),
            "{err}"
        );
        Ok(())
    });
}

#[test]
fn a_missing_config_file_and_unknown_file_keys_are_errors() {
    Jail::expect_with(|jail| {
        let missing = jail.directory().join("nope.toml");
        assert!(Settings::load(Some(&missing), flags(&[])).is_err());
        jail.create_file(
            "typo.toml",
            "replica_id = \"r\"\nmodel_id = \"m\"\nwindw = \"1s\"\n",
        )?;
        let err = Settings::load(Some(&jail.directory().join("typo.toml")), flags(&[]))
            .expect_err("typo");
        assert!(err.to_string().contains("windw"), "{err}");
        Ok(())
    });
}

#[test]
fn file_problems_name_the_file_and_key_all_at_once_with_the_key_meant() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "sidecar.toml",
            "replica-id = \"r\"\nmodel_id = \"m\"\nwindow = \"5x\"\nkey_mode = \"foo\"\n",
        )?;
        let path = jail.directory().join("sidecar.toml");
        let err = Settings::load(Some(&path), flags(&[])).expect_err("bad file");
        let text = err.to_string();
        let file = path.display().to_string();
        assert!(
            text.contains(&format!(
                "{file}: key `replica-id`: unknown key: did you mean `replica_id`?"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("{file}: key `window`: `5x` is not a duration")),
            "{text}"
        );
        assert!(
            text.contains("key_mode") || text.contains("--key-mode"),
            "{text}"
        );
        // The dashed key was not taken: replica_id is still missing.
        assert!(
            text.contains("--replica-id (KVEVENT_REPLICA_ID): is required"),
            "{text}"
        );
        // Not the list of every option.
        assert!(!text.contains("tls_server_name"), "{text}");
        // An empty quoted key (found by the config fuzz target): named as written.
        jail.create_file("empty-key.toml", "''=''\n")?;
        let err = Settings::load(Some(&jail.directory().join("empty-key.toml")), flags(&[]))
            .expect_err("unknown key");
        assert!(err.0.iter().all(|p| !p.option.is_empty()), "{err}");
        assert!(err.to_string().contains("key `\"\"`: unknown key"), "{err}");
        jail.create_file("broken.toml", "model_id = \n")?;
        let err = Settings::load(Some(&jail.directory().join("broken.toml")), flags(&[]))
            .expect_err("not toml");
        assert!(err.to_string().contains("is not valid TOML"), "{err}");
        Ok(())
    });
}

#[test]
fn go_durations() {
    for (s, ms) in [
        ("50ms", 50),
        ("10s", 10_000),
        ("1m30s", 90_000),
        ("1h", 3_600_000),
        ("1.5s", 1500),
        ("0", 0),
    ] {
        assert_eq!(
            parse_duration(s).expect(s),
            Duration::from_millis(ms),
            "{s}"
        );
    }
    for s in ["", "10", "5 s", "1x", "-1s"] {
        assert!(parse_duration(s).is_err(), "{s}");
    }
}

#[test]
fn dp_ranks_whose_offset_ports_collide_are_refused() {
    Jail::expect_with(|jail| {
        jail.set_env("KVEVENT_DP_SIZE", "2");
        let base = [("replica_id", "r"), ("model_id", "m")];
        let mut adjacent = base.to_vec();
        adjacent.extend([
            ("engine_endpoint", "tcp://10.0.0.1:5557"),
            ("replay_endpoint", "tcp://10.0.0.1:5558"),
        ]);
        let err = Settings::load(None, flags(&adjacent)).expect_err("collision");
        assert!(
            err.to_string()
                .contains("--replay-endpoint (KVEVENT_REPLAY_ENDPOINT): rank 0's replay endpoint tcp://10.0.0.1:5558 is also rank 1's endpoint with 2 ranks: space the base ports at least 2 apart"),
            "{err}"
        );
        let mut spaced = base.to_vec();
        spaced.extend([
            ("engine_endpoint", "tcp://10.0.0.1:5557"),
            ("replay_endpoint", "tcp://10.0.0.1:5657"),
        ]);
        Settings::load(None, flags(&spaced)).expect("spaced apart");
        Ok(())
    });
}

/// The endpoint options are read once: `start` takes the sources `validate` checked, rank by
/// rank, from the one function that derives them.
#[test]
fn the_ranks_sources_are_derived_once_from_the_endpoint_options() {
    Jail::expect_with(|_jail| {
        let s = Settings::load(
            None,
            flags(&[
                ("replica_id", "r"),
                ("model_id", "m"),
                ("dp_size", "3"),
                ("engine_endpoint", " tcp://10.0.0.1:5557 "),
                ("replay_endpoint", "tcp://10.0.0.1:5657"),
                ("topic", "t"),
            ]),
        )
        .expect("valid");
        let sources = s.engine_sources().expect("derived");
        let got: Vec<(&str, Option<&str>, u32)> = sources
            .iter()
            .map(|s| (s.endpoint.as_str(), s.replay_endpoint.as_deref(), s.dp_rank))
            .collect();
        assert_eq!(
            got,
            [
                ("tcp://10.0.0.1:5557", Some("tcp://10.0.0.1:5657"), 0),
                ("tcp://10.0.0.1:5558", Some("tcp://10.0.0.1:5658"), 1),
                ("tcp://10.0.0.1:5559", Some("tcp://10.0.0.1:5659"), 2),
            ]
        );
        assert!(sources.iter().all(|s| s.topic == b"t"));
        // Both options' problems at once, each under its own name.
        let err = Settings::load(
            None,
            flags(&[
                ("replica_id", "r"),
                ("model_id", "m"),
                ("dp_size", "2"),
                ("engine_endpoint", "ipc:///tmp/kv"),
                ("replay_endpoint", "tcp://10.0.0.1:65535"),
            ]),
        )
        .expect_err("cannot offset");
        let text = err.to_string();
        assert!(
            text.contains("--engine-endpoint (KVEVENT_ENGINE_ENDPOINT)"),
            "{text}"
        );
        assert!(
            text.contains("--replay-endpoint (KVEVENT_REPLAY_ENDPOINT)"),
            "{text}"
        );
        assert!(text.contains("above 65535"), "{text}");
        // One rank: the replay endpoint is another socket, so another port.
        let err = Settings::load(
            None,
            flags(&[
                ("replica_id", "r"),
                ("model_id", "m"),
                ("engine_endpoint", "tcp://10.0.0.1:5557"),
                ("replay_endpoint", "tcp://10.0.0.1:5557"),
            ]),
        )
        .expect_err("one port for two sockets");
        assert!(
            err.to_string().contains(
                "--replay-endpoint (KVEVENT_REPLAY_ENDPOINT): rank 0's replay endpoint tcp://10.0.0.1:5557 is also its endpoint: they are two sockets, on two ports"
            ),
            "{err}"
        );
        Ok(())
    });
}

/// `--engine-metrics-url` is read as the option is, whether or not stats are on: with a feed
/// its host is where the engine's health is asked, so a typo is refused, not ignored.
#[test]
fn the_engine_metrics_url_is_refused_when_not_a_url_even_without_stats() {
    Jail::expect_with(|_jail| {
        for stats in ["10s", "0"] {
            let err = Settings::load(
                None,
                flags(&[
                    ("replica_id", "r"),
                    ("model_id", "m"),
                    ("stats_interval", stats),
                    ("engine_metrics_url", "127.0.0.1:8000/metrics"),
                ]),
            )
            .expect_err("not a URL");
            assert!(
                err.to_string().contains(
                    "--engine-metrics-url (KVEVENT_ENGINE_METRICS_URL): `127.0.0.1:8000/metrics` is not an http:// URL (http://127.0.0.1:8000/metrics?)"
                ),
                "{err}"
            );
        }
        let s = Settings::load(
            None,
            flags(&[
                ("replica_id", "r"),
                ("model_id", "m"),
                ("engine_metrics_url", ""),
            ]),
        )
        .expect("empty: no stats");
        assert!(s.engine_metrics_url.get().is_none());
        Ok(())
    });
}

/// Settings built in code, not loaded, are validated by `start` itself: the same problems, no
/// half-started sidecar.
#[tokio::test]
async fn start_refuses_settings_built_in_code_with_the_problems_load_would_report() {
    let settings = Settings {
        replica_id: "r".into(),
        model_id: "m".into(),
        engine_endpoint: "127.0.0.1:5557".into(),
        server: "nowhere".into(),
        metrics_address: Default::default(),
        ..Settings::default()
    };
    let err = kvevent_sidecar::start(&settings, &zmq::Context::new())
        .await
        .expect_err("invalid");
    let text = err.to_string();
    assert!(
        matches!(err, kvevent_sidecar::StartError::Config(_)),
        "{err:?}"
    );
    for needle in [
        "--engine-endpoint (KVEVENT_ENGINE_ENDPOINT): `127.0.0.1:5557` is not a tcp://",
        "--server (KVEVENT_SERVER): `nowhere` is not host:port",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
}

#[test]
fn a_zero_window_is_the_default_with_a_warning_as_in_the_go_sidecar() {
    Jail::expect_with(|_jail| {
        let s = Settings::load(
            None,
            flags(&[("window", "0"), ("replica_id", "r"), ("model_id", "m")]),
        )
        .expect("valid");
        assert_eq!(s.window.0, Duration::from_millis(100));
        assert_eq!(s.adjustments.len(), 1);
        assert!(
            s.adjustments[0].contains("--window 0"),
            "{:?}",
            s.adjustments
        );
        let s =
            Settings::load(None, flags(&[("replica_id", "r"), ("model_id", "m")])).expect("valid");
        assert!(s.adjustments.is_empty());
        Ok(())
    });
}

#[test]
fn keys_are_fingerprints_by_default_as_the_go_sidecar_sends_them() {
    Jail::expect_with(|_jail| {
        let s =
            Settings::load(None, flags(&[("replica_id", "r"), ("model_id", "m")])).expect("valid");
        assert_eq!(s.key_mode, kvevent_mapper::KeyMode::Fingerprint);
        Ok(())
    });
}

#[test]
fn a_log_level_that_would_silence_everything_is_a_configuration_error() {
    Jail::expect_with(|_jail| {
        for bad in ["verbose", "kvevent=loud", ""] {
            let err = Settings::load(
                None,
                flags(&[("replica_id", "r"), ("model_id", "m"), ("log_level", bad)]),
            )
            .expect_err(bad);
            assert!(
                err.to_string().contains("--log-level (KVEVENT_LOG_LEVEL)"),
                "{err}"
            );
        }
        for good in ["debug", "WARN", "info,kvevent_forwarder=debug", "off"] {
            Settings::load(
                None,
                flags(&[("replica_id", "r"), ("model_id", "m"), ("log_level", good)]),
            )
            .expect(good);
        }
        Ok(())
    });
}

#[test]
fn every_bad_value_is_reported_at_once_not_only_the_first() {
    Jail::expect_with(|_jail| {
        let err = Settings::load(
            None,
            flags(&[
                ("window", "5x"),
                ("drain_timeout", "1y"),
                ("key_mode", "foo"),
            ]),
        )
        .expect_err("invalid");
        let text = err.to_string();
        for needle in [
            "--window (KVEVENT_WINDOW): `5x` is not a duration",
            "--drain-timeout (KVEVENT_DRAIN_TIMEOUT): `1y` is not a duration",
            "--key-mode (KVEVENT_KEY_MODE)",
            "--replica-id (KVEVENT_REPLICA_ID): is required",
            "--model-id (KVEVENT_MODEL_ID): is required",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        assert_eq!(err.0.len(), 5, "{text}");
        Ok(())
    });
}

#[test]
fn the_metrics_address_takes_go_listen_address_forms() {
    let with = |a: &str| Settings {
        metrics_address: a.into(),
        ..Settings::default()
    };
    assert_eq!(
        with(":9095").metrics_address.addr(),
        Some("0.0.0.0:9095".parse().expect("addr"))
    );
    assert_eq!(
        with("localhost:9095").metrics_address.addr(),
        Some("127.0.0.1:9095".parse().expect("addr"))
    );
    assert_eq!(
        with("10.0.0.1:1").metrics_address.addr(),
        Some("10.0.0.1:1".parse().expect("addr"))
    );
    assert_eq!(with("nohost:x").metrics_address.addr(), None);
    assert_eq!(with("").metrics_address.addr(), None);
}

/// `--scrape-max-bytes`, the option added as one entry of `settings/options.rs`: each layer
/// sets it, and 0 or a word is refused in our words.
#[test]
fn scrape_max_bytes_is_read_from_every_layer_and_checked() {
    Jail::expect_with(|jail| {
        let base = [("replica_id", "r"), ("model_id", "m")];
        assert_eq!(
            Settings::load(None, flags(&base))
                .expect("valid")
                .scrape_max_bytes,
            8 << 20
        );
        jail.create_file("sub.toml", "scrape_max_bytes = 1024")?;
        let path = jail.directory().join("sub.toml");
        let s = Settings::load(Some(&path), flags(&base)).expect("valid");
        assert_eq!(s.scrape_max_bytes, 1024);
        jail.set_env("KVEVENT_SCRAPE_MAX_BYTES", "2048");
        let s = Settings::load(Some(&path), flags(&base)).expect("valid");
        assert_eq!(s.scrape_max_bytes, 2048);
        let mut given = flags(&base);
        given.insert("scrape_max_bytes".into(), "4096".into());
        assert_eq!(
            Settings::load(Some(&path), given.clone())
                .expect("valid")
                .scrape_max_bytes,
            4096
        );
        given.insert("scrape_max_bytes".into(), "0".into());
        let err = Settings::load(None, given.clone()).expect_err("0 is refused");
        assert!(
            err.to_string()
                .contains("--scrape-max-bytes (KVEVENT_SCRAPE_MAX_BYTES): must be at least 1"),
            "{err}"
        );
        given.insert("scrape_max_bytes".into(), "lots".into());
        let err = Settings::load(None, given).expect_err("a word is refused");
        assert!(err.to_string().contains("--scrape-max-bytes"), "{err}");
        Ok(())
    });
}
