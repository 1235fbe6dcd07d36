//! A parser for the Prometheus text exposition format and OpenMetrics text.
//!
//! Written here rather than taken from a crate: the ones available either do not handle
//! OpenMetrics (`# EOF`, float-second timestamps, exemplars) or label escaping fully, or
//! pull in regex and a date library for what is a line format. This one is pure, allocation-
//! light and never panics on bad input: a bad line is an error naming it.

use std::collections::HashMap;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The sample name as written (`vllm:kv_cache_usage_perc`, or with `_` for `:`).
    pub name: String,
    /// Labels in written order, values unescaped.
    pub labels: Vec<(String, String)>,
    /// The value (NaN and ±Inf included).
    pub value: f64,
    /// The timestamp as written (ms in the classic format, seconds in OpenMetrics), if any.
    pub timestamp: Option<f64>,
}

impl Sample {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A parsed exposition.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    /// Every sample, in order.
    pub samples: Vec<Sample>,
    /// `# TYPE` of each metric family, by family name as written.
    pub types: HashMap<String, String>,
}

/// A line that is not valid exposition text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// The key two names share when they differ only by `:` written as `_`.
pub fn normalize(name: &str) -> String {
    name.replace(':', "_")
}

impl Exposition {
    /// Samples of metric `name`, matching names written with `_` for `:`, and for a counter
    /// `x_total`, both `x_total` and `x` (some writers drop the suffix).
    pub fn series<'e>(&'e self, name: &str) -> impl Iterator<Item = &'e Sample> + 'e {
        let want = normalize(name);
        let bare = want.strip_suffix("_total").map(str::to_owned);
        self.samples.iter().filter(move |s| {
            let n = normalize(&s.name);
            n == want || bare.as_deref().is_some_and(|b| n == b)
        })
    }
}

/// Parses exposition text (classic Prometheus or OpenMetrics).
///
/// ```
/// let text = "# TYPE vllm:num_requests_running gauge\n\
///             vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n";
/// let e = kvevent_scrape::text::parse(text)?;
/// let s = e.series("vllm:num_requests_running").next().unwrap();
/// assert_eq!((s.value, s.label("engine")), (3.0, Some("0")));
/// # Ok::<(), kvevent_scrape::text::ParseError>(())
/// ```
pub fn parse(text: &str) -> Result<Exposition, ParseError> {
    let mut out = Exposition::default();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let err = |message: String| ParseError {
            line: line_no,
            message,
        };
        let line = raw.trim_end_matches('\r');
        let trimmed = line.trim_start();
        if trimmed.is_empty() {
            continue;
        }
        if let Some(comment) = trimmed.strip_prefix('#') {
            let mut parts = comment.trim_start().splitn(3, char::is_whitespace);
            match parts.next() {
                Some("EOF") => break,
                Some("TYPE") => {
                    let name = parts
                        .next()
                        .ok_or_else(|| err("TYPE without a name".into()))?;
                    let kind = parts.next().unwrap_or("untyped").trim();
                    out.types.insert(name.to_owned(), kind.to_owned());
                }
                _ => {}
            }
            continue;
        }
        out.samples.push(sample(trimmed).map_err(err)?);
    }
    Ok(out)
}

fn is_name_char(c: char, first: bool) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':' || (!first && c.is_ascii_digit())
}

fn sample(line: &str) -> Result<Sample, String> {
    let name_end = line
        .char_indices()
        .find(|&(i, c)| !is_name_char(c, i == 0))
        .map_or(line.len(), |(i, _)| i);
    if name_end == 0 {
        return Err(format!("expected a metric name in {line:?}"));
    }
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, after) = label_set(after)?;
        labels = parsed;
        rest = after;
    }
    // OpenMetrics exemplars follow ` # `: not needed here.
    let rest = rest.split(" # ").next().unwrap_or(rest);
    let mut fields = rest.split_whitespace();
    let value = fields
        .next()
        .ok_or_else(|| format!("`{name}` has no value"))
        .and_then(number)?;
    let timestamp = fields.next().map(number).transpose()?;
    if let Some(extra) = fields.next() {
        return Err(format!("unexpected `{extra}` after the value of `{name}`"));
    }
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
        timestamp,
    })
}

fn number(s: &str) -> Result<f64, String> {
    match s {
        "NaN" | "nan" => Ok(f64::NAN),
        "+Inf" | "Inf" | "+inf" | "inf" => Ok(f64::INFINITY),
        "-Inf" | "-inf" => Ok(f64::NEG_INFINITY),
        _ => s.parse().map_err(|_| format!("`{s}` is not a number")),
    }
}

/// Parses `name="value",...}` and returns the labels and what follows the `}`.
/// Label pairs in written order.
type Labels = Vec<(String, String)>;

fn label_set(mut s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((labels, rest));
        }
        let eq = s.find('=').ok_or("a label without `=`")?;
        let key = s[..eq].trim();
        if key.is_empty()
            || !key
                .chars()
                .enumerate()
                .all(|(i, c)| is_name_char(c, i == 0) && c != ':')
        {
            return Err(format!("bad label name `{key}`"));
        }
        s = s[eq + 1..].trim_start();
        let body = s.strip_prefix('"').ok_or("a label value must be quoted")?;
        let mut value = String::new();
        let mut chars = body.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => return Err("unterminated label value".into()),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_owned(), value));
        s = body[end + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err("expected `,` or `}` after a label".into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_special_values_timestamps_and_eof() {
        let text = "# HELP x a \\\"help\\\"\n\
                    # TYPE x gauge\n\
                    x{a=\"q\\\"uote\",b=\"back\\\\slash\",c=\"new\\nline\",} NaN 1700000000000\n\
                    y +Inf\n\
                    z -Inf 1.7e9 # {trace_id=\"abc\"} 1.0\n\
                    # EOF\n\
                    ignored{ 1\n";
        let e = parse(text).expect("parse");
        assert_eq!(e.samples.len(), 3);
        let x = &e.samples[0];
        assert!(x.value.is_nan());
        assert_eq!(x.label("a"), Some("q\"uote"));
        assert_eq!(x.label("b"), Some("back\\slash"));
        assert_eq!(x.label("c"), Some("new\nline"));
        assert_eq!(x.timestamp, Some(1.7e12));
        assert_eq!(e.samples[1].value, f64::INFINITY);
        assert_eq!(e.samples[2].value, f64::NEG_INFINITY);
        assert_eq!(e.types.get("x").map(String::as_str), Some("gauge"));
    }

    #[test]
    fn bad_lines_are_errors_with_their_number() {
        for (text, line) in [
            ("ok 1\nbad{a=\"1\" 2\n", 2),
            ("x{a=1} 2\n", 1),
            ("x abc\n", 1),
            ("x 1 2 3\n", 1),
            ("{a=\"b\"} 1\n", 1),
        ] {
            assert_eq!(parse(text).expect_err(text).line, line, "{text:?}");
        }
    }

    #[test]
    fn names_match_across_colon_and_total_spellings() {
        let e = parse("vllm_prefix_cache_hits 5\nvllm:prefix_cache_hits_total 6\n").expect("parse");
        let values: Vec<f64> = e
            .series("vllm:prefix_cache_hits_total")
            .map(|s| s.value)
            .collect();
        assert_eq!(values, [5.0, 6.0]);
        assert_eq!(e.series("vllm:prefix_cache_hits_created").count(), 0);
    }
}
