//! The command line: the Go sidecar's flags (same names, meanings and defaults) and ours.
//!
//! Flags are the top layer over defaults, the `--config` TOML file and `KVEVENT_*` variables:
//! only the flags actually given are passed on, so an absent flag never hides a lower layer.
//! The options' flags are made from `kvevent_sidecar::settings::OPTIONS`, where each option is
//! written once.

use std::path::PathBuf;

use std::collections::BTreeMap;

use clap::{Parser, Subcommand};
use kvevent_sidecar as sidecar;

/// `--version`: the version, the commit it was built from, the vLLM releases it decodes.
const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("KVEVENT_GIT_COMMIT"),
    ")\nvLLM KV-event wire: releases 0.9.0 to 0.33.0 decoded and encoded as each writes it; newer ones decoded (unknown fields and event types skipped and counted)",
);

#[derive(Debug, Parser)]
#[command(
    name = "kvevent-subscriber",
    version,
    long_version = LONG_VERSION,
    about = "Sidecar next to a vLLM replica: reports its KV-cache events and stats to the InferenceCache server.",
    long_about = "Sidecar next to a vLLM replica: subscribes to the engine's KV-cache events (with replay of missed batches), maps them onto the InferenceCache contract and reports them to the server; scrapes the engine's /metrics for replica stats.\n\nEvery option can also be set in the --config TOML file (same name with underscores) or as an environment variable KVEVENT_<NAME>. Precedence, lowest first: defaults, file, environment, flags. Durations are written Go's way (50ms, 10s, 1m30s). Go-style single-dash flags (-replica-id=x) are accepted.",
    args_conflicts_with_subcommands = true,
    // Go's flag package takes a flag given twice, the last one winning; manifests that append
    // override args rely on it.
    args_override_self = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// TOML file with options.
    #[arg(long, env = "KVEVENT_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
}

/// The command line as given.
#[derive(Debug)]
pub(crate) struct Cli {
    pub(crate) command: Option<Command>,
    pub(crate) config: Option<PathBuf>,
    /// The options given as flags, by name, as written: the top layer of the settings (an
    /// absent flag never hides a lower layer).
    pub(crate) options: BTreeMap<&'static str, String>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run a self-contained demo: an in-process engine, the real sidecar over loopback
    /// sockets, a recording InferenceCache server and a served /metrics fixture.
    Demo {
        /// Engine steps to publish.
        #[arg(long, default_value_t = 200)]
        batches: u64,
    },
}

/// The command line: `--config`, `demo`, and a flag for every option of
/// [`sidecar::settings::OPTIONS`] (its help, with the default `Settings::default()` has and
/// its environment variable). Values stay text here: the settings read them, every layer alike.
pub(crate) fn command() -> clap::Command {
    use clap::CommandFactory;
    let defaults: BTreeMap<String, String> = sidecar::settings::defaults().into_iter().collect();
    let mut command = Args::command();
    for option in sidecar::settings::OPTIONS {
        let env = format!(
            "{}{}",
            sidecar::settings::ENV_PREFIX,
            option.name.to_uppercase()
        );
        let default = defaults.get(option.name).map(String::as_str);
        let help = match default {
            _ if matches!(option.name, "replica_id" | "model_id") => {
                format!("{} [env: {env}]", option.help())
            }
            Some("") | None => format!("{} [default: \"\"] [env: {env}]", option.help()),
            Some(d) => format!("{} [default: {d}] [env: {env}]", option.help()),
        };
        let mut arg = clap::Arg::new(option.name)
            .long(option.flag())
            .help(help)
            // `--max-pending -3` is a bad value to report, not an unknown flag.
            .allow_negative_numbers(true)
            .action(clap::ArgAction::Set);
        arg = arg.value_name(match option.value {
            "" => option.name.to_uppercase(),
            value => value.to_owned(),
        });
        if option.is_switch() {
            arg = arg
                .num_args(0..=1)
                .require_equals(true)
                .default_missing_value("true");
        }
        command = command.arg(arg);
    }
    command
}

/// Parses the command line (Go-style single-dash flags accepted).
pub(crate) fn parse(args: impl IntoIterator<Item = String>) -> Result<Cli, clap::Error> {
    use clap::FromArgMatches;
    let matches = command().try_get_matches_from(go_style(args))?;
    let Args { command, config } = Args::from_arg_matches(&matches)?;
    let options = sidecar::settings::OPTIONS
        .iter()
        .filter_map(|o| Some((o.name, matches.get_one::<String>(o.name)?.clone())))
        .collect();
    Ok(Cli {
        command,
        config,
        options,
    })
}

/// Rewrites Go-style single-dash long flags (`-replica-id=x`, `-window 50ms`) to `--`.
pub(crate) fn go_style(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let command = command();
    let longs: Vec<String> = command
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_owned))
        .chain(["help".to_owned(), "version".to_owned()])
        .collect();
    let mut out = Vec::new();
    let mut rest_literal = false;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || rest_literal {
            out.push(arg);
            continue;
        }
        if arg == "--" {
            rest_literal = true;
            out.push(arg);
            continue;
        }
        let single = arg.starts_with('-') && !arg.starts_with("--") && arg.len() > 2;
        // `arg` starts with the one-byte '-' here, so byte 1 is a character boundary.
        let name = if single {
            arg[1..].split('=').next().unwrap_or_default()
        } else {
            ""
        };
        if single && longs.iter().any(|l| l == name) {
            out.push(format!("-{arg}"));
        } else {
            out.push(arg);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::Cli;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let argv = std::iter::once("kvevent-subscriber")
            .chain(args.iter().copied())
            .map(str::to_owned);
        super::parse(argv)
    }

    /// Every option's `--help` names its default as `Settings::default()` has it, and its
    /// environment variable.
    #[test]
    fn every_help_default_is_the_settings_default() {
        let command = super::command();
        for (option, default) in kvevent_sidecar::settings::defaults() {
            let arg = command
                .get_arguments()
                .find(|a| a.get_long() == Some(&option.replace('_', "-")))
                .unwrap_or_else(|| panic!("no flag for the option {option}"));
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            let env = format!("[env: KVEVENT_{}]", option.to_uppercase());
            assert!(help.ends_with(&env), "{option}: {help}");
            if !matches!(option.as_str(), "replica_id" | "model_id") {
                let shown = if default.is_empty() {
                    "\"\"".to_owned()
                } else {
                    default
                };
                assert!(
                    help.contains(&format!(" [default: {shown}] ")),
                    "{option} shows another default: {help}"
                );
            }
        }
        // Every flag but --config is an option of the settings.
        let options = kvevent_sidecar::settings::known_options();
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            assert!(
                options.iter().any(|o| o == id) || matches!(id, "config" | "help" | "version"),
                "--{id} is not an option of the settings"
            );
        }
    }

    #[test]
    fn an_empty_value_is_a_value() {
        let cli = parse(&["--engine-metrics-url", "", "-replica-id", ""]).expect("parses");
        assert_eq!(
            cli.options.get("engine_metrics_url").map(String::as_str),
            Some("")
        );
        assert!(
            parse(&[""]).is_err(),
            "an empty positional is an error, not a panic"
        );
    }

    #[test]
    fn a_flag_given_twice_takes_the_last_value() {
        let cli = parse(&[
            "--window=50ms",
            "-window",
            "2s",
            "--dp-size",
            "2",
            "--dp-size=3",
        ])
        .expect("parses");
        assert_eq!(cli.options.get("window").map(String::as_str), Some("2s"));
        assert_eq!(cli.options.get("dp_size").map(String::as_str), Some("3"));
    }

    /// A negative number is a value to report, not a flag.
    #[test]
    fn a_negative_number_is_a_value() {
        let cli = parse(&["--max-pending", "-3"]).expect("parses");
        assert_eq!(
            cli.options.get("max_pending").map(String::as_str),
            Some("-3")
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// No argument vector makes the command line panic: each is parsed or refused.
        #[test]
        fn no_argv_panics(args in proptest::collection::vec(
            prop_oneof![
                Just(String::new()),
                Just("-".to_owned()),
                Just("--".to_owned()),
                Just("-window".to_owned()),
                Just("--engine-metrics-url".to_owned()),
                Just("-replica-id=".to_owned()),
                "-{1,2}[a-z-]{0,20}(=.{0,8})?",
                ".{0,12}",
            ],
            0..8,
        )) {
            let argv = std::iter::once("kvevent-subscriber".to_owned()).chain(args);
            let _ = super::parse(argv);
        }
    }
}
