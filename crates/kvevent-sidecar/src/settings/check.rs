//! What an option's value must be, on its own: the checks that entries in `options.rs` name
//! (`check(...)`), each a function of the value, `Err` saying what is wrong in our words.
//! Constraints between options (a certificate and its key, the ranks' derived endpoints) are in
//! `Settings::validate`.

use std::path::PathBuf;

use super::value::{Endpoint, GoDuration, ListenAddress, Parsed};

/// A required option: not empty.
pub(super) fn required(value: &str) -> Result<(), String> {
    if value.trim().is_empty() {
        return Err("is required".into());
    }
    Ok(())
}

/// A ZeroMQ endpoint (`tcp://host:port`, `ipc://path`…), named the way the sidecar connects.
pub(super) fn endpoint(value: &Endpoint) -> Result<(), String> {
    if value.is_empty() {
        return Err("is required (e.g. tcp://127.0.0.1:5557)".into());
    }
    parsed(value)
}

/// A value read from text that is one (an endpoint, a server, a URL, a map; empty is none).
pub(super) fn parsed(value: &impl Parsed) -> Result<(), String> {
    value.problem().map_or(Ok(()), |why| Err(why.to_owned()))
}

/// `lo` to `hi`, both included.
pub(super) fn within<T>(lo: T, hi: T) -> impl Fn(&T) -> Result<(), String>
where
    T: PartialOrd + std::fmt::Display,
{
    move |value| {
        if *value < lo || *value > hi {
            return Err(format!("must be {lo} to {hi}, not {value}"));
        }
        Ok(())
    }
}

/// A count of at least one.
pub(super) fn at_least_one(value: &usize) -> Result<(), String> {
    if *value == 0 {
        return Err("must be at least 1".into());
    }
    Ok(())
}

/// A number of zero (no limit) or more.
pub(super) fn not_negative(value: &i32) -> Result<(), String> {
    if *value < 0 {
        return Err("must be 0 (no limit) or more".into());
    }
    Ok(())
}

/// A duration longer than zero.
pub(super) fn positive(value: &GoDuration) -> Result<(), String> {
    if value.0.is_zero() {
        return Err("must be more than 0".into());
    }
    Ok(())
}

/// A listen address: host:port in one of Go's forms, or empty (off).
pub(super) fn listen_address(value: &ListenAddress) -> Result<(), String> {
    ListenAddress::parse(value.as_str()).map(|_| ())
}

/// A file that exists, when one is named.
pub(super) fn existing_file(value: &Option<PathBuf>) -> Result<(), String> {
    match value {
        Some(path) if !path.is_file() => Err(format!("no such file {}", path.display())),
        _ => Ok(()),
    }
}

/// A log level (`trace` … `error`, `off`) or filter directives `target=level`, comma-separated.
/// A bare word that is not a level would be read as a target and silence every log line.
pub(super) fn log_filter(filter: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let is_level = |l: &str| LEVELS.iter().any(|v| v.eq_ignore_ascii_case(l.trim()));
    if filter.trim().is_empty() {
        return Err("is empty: give a level (trace, debug, info, warn, error, off)".into());
    }
    for directive in filter.split(',') {
        let ok = match directive.rsplit_once('=') {
            Some((target, level)) => !target.trim().is_empty() && is_level(level),
            None => is_level(directive),
        };
        if !ok {
            return Err(format!(
                "`{directive}` is neither a level (trace, debug, info, warn, error, off) nor target=level"
            ));
        }
    }
    Ok(())
}
