#![doc = include_str!("../README.md")]

use std::borrow::Cow;
use std::fmt;

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;

/// Labels of one sample, in order; none are written without braces. Values are escaped as
/// the text format asks (prometheus-client 0.24 writes them as given).
pub type Labels<'l> = &'l [(&'l str, &'l str)];

/// `labels` with each value escaped (`\`, `"`, a newline); borrowed when none needs it.
fn escaped<'l>(labels: Labels<'l>) -> Vec<(&'l str, Cow<'l, str>)> {
    labels
        .iter()
        .map(|&(k, v)| {
            let v = if v.contains(['\\', '"', '\n']) {
                Cow::Owned(
                    v.replace('\\', "\\\\")
                        .replace('"', "\\\"")
                        .replace('\n', "\\n"),
                )
            } else {
                Cow::Borrowed(v)
            };
            (k, v)
        })
        .collect()
}

/// A counter family; `name` is as exposed, ending in `_total`.
pub fn counter<'e>(
    enc: &'e mut DescriptorEncoder<'_>,
    name: &'static str,
    help: &str,
) -> Result<MetricEncoder<'e>, fmt::Error> {
    enc.encode_descriptor(
        name.trim_end_matches("_total"),
        help,
        None,
        MetricType::Counter,
    )
}

/// A gauge family.
pub fn gauge<'e>(
    enc: &'e mut DescriptorEncoder<'_>,
    name: &'static str,
    help: &str,
) -> Result<MetricEncoder<'e>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)
}

/// A histogram family.
pub fn histogram<'e>(
    enc: &'e mut DescriptorEncoder<'_>,
    name: &'static str,
    help: &str,
) -> Result<MetricEncoder<'e>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Histogram)
}

/// One counter sample.
pub fn count(
    family: &mut MetricEncoder<'_>,
    labels: Labels<'_>,
    value: impl EncodeCounterValue,
) -> fmt::Result {
    if labels.is_empty() {
        family.encode_counter::<NoLabelSet, _, f64>(&value, None)
    } else {
        family
            .encode_family(&escaped(labels).as_slice())?
            .encode_counter::<NoLabelSet, _, f64>(&value, None)
    }
}

/// One gauge sample.
pub fn level(
    family: &mut MetricEncoder<'_>,
    labels: Labels<'_>,
    value: impl EncodeGaugeValue,
) -> fmt::Result {
    if labels.is_empty() {
        family.encode_gauge(&value)
    } else {
        family
            .encode_family(&escaped(labels).as_slice())?
            .encode_gauge(&value)
    }
}

/// One histogram: `cumulative` is (upper bound, observations at or below it) per bucket, the
/// last bound infinite; `sum` and `count` over every observation.
pub fn buckets(
    family: &mut MetricEncoder<'_>,
    labels: Labels<'_>,
    cumulative: &[(f64, u64)],
    sum: f64,
    count: u64,
) -> fmt::Result {
    let mut before = 0;
    let own: Vec<(f64, u64)> = cumulative
        .iter()
        .map(|&(le, n)| {
            let own = n.saturating_sub(before);
            before = n;
            // prometheus-client writes the bound f64::MAX as `+Inf`.
            (if le.is_infinite() { f64::MAX } else { le }, own)
        })
        .collect();
    if labels.is_empty() {
        family.encode_histogram::<NoLabelSet>(sum, count, &own, None)
    } else {
        family
            .encode_family(&escaped(labels).as_slice())?
            .encode_histogram::<NoLabelSet>(sum, count, &own, None)
    }
}

/// A family of one sample without labels: a counter or a gauge.
pub fn single(
    enc: &mut DescriptorEncoder<'_>,
    counter: bool,
    name: &'static str,
    help: &str,
    value: u64,
) -> fmt::Result {
    if counter {
        count(&mut self::counter(enc, name, help)?, &[], value)
    } else {
        level(&mut gauge(enc, name, help)?, &[], value)
    }
}

/// `registry` in the Prometheus text format 0.0.4 (what `promtool check metrics` and every
/// scraper read), for an endpoint served as `text/plain; version=0.0.4`. prometheus-client
/// writes OpenMetrics: here a counter's HELP and TYPE name its samples (`x_total`), and
/// OpenMetrics' `# UNIT` and `# EOF` lines go.
pub fn prometheus_text(registry: &prometheus_client::registry::Registry) -> String {
    let mut open_metrics = String::with_capacity(16 * 1024);
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut open_metrics, registry);
    let counters: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len() + 64 * counters.len());
    for line in open_metrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let (name, tail) = line.strip_prefix(p)?.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use prometheus_client::collector::Collector;
    use prometheus_client::encoding::DescriptorEncoder;

    #[derive(Debug)]
    struct Sample;

    impl Collector for Sample {
        fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
            let mut f = super::gauge(&mut enc, "t_level", "A level.")?;
            super::level(&mut f, &[("replica", "a\"b\\c\nd")], 2u64)?;
            super::level(&mut f, &[("replica", "plain")], 1u64)?;
            let mut h = super::histogram(&mut enc, "t_seconds", "A histogram.")?;
            super::buckets(&mut h, &[], &[(0.5, 1), (f64::INFINITY, 3)], 2.5, 3)
        }
    }

    #[test]
    fn labels_are_escaped_and_histograms_are_cumulative() {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Sample));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert!(
            text.contains("t_level{replica=\"a\\\"b\\\\c\\nd\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("t_level{replica=\"plain\"} 1\n"), "{text}");
        assert!(text.contains("t_seconds_bucket{le=\"0.5\"} 1\n"), "{text}");
        assert!(text.contains("t_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(
            text.contains("t_seconds_sum 2.5\nt_seconds_count 3\n"),
            "{text}"
        );
    }

    #[test]
    fn prometheus_text_names_counters_by_their_samples_and_drops_unit_and_eof() {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Sample));
        let c = prometheus_client::metrics::counter::Counter::<u64>::default();
        c.inc();
        registry.register_with_unit(
            "t_work",
            "Work done",
            prometheus_client::registry::Unit::Seconds,
            c,
        );
        let text = super::prometheus_text(&registry);
        assert!(
            text.contains("# HELP t_work_seconds_total Work done.\n# TYPE t_work_seconds_total counter\nt_work_seconds_total 1\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE t_level gauge\n"), "{text}");
        assert!(
            !text.contains("# UNIT") && !text.contains("# EOF"),
            "{text}"
        );
    }
}
