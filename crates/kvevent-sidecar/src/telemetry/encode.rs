//! Writing a family straight to prometheus-client's encoder: no samples are kept in between.

use std::fmt;

use kvevent_forwarder as fwd;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;

/// Labels of one sample; none are written without braces.
pub(crate) type Labels<'l> = &'l [(&'l str, &'l str)];

/// A counter family; `name` is as exposed, ending in `_total` (which the encoder adds).
pub(crate) fn counter<'e>(
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
pub(crate) fn gauge<'e>(
    enc: &'e mut DescriptorEncoder<'_>,
    name: &'static str,
    help: &str,
) -> Result<MetricEncoder<'e>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)
}

/// A histogram family.
pub(crate) fn histogram<'e>(
    enc: &'e mut DescriptorEncoder<'_>,
    name: &'static str,
    help: &str,
) -> Result<MetricEncoder<'e>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Histogram)
}

/// One counter sample.
pub(crate) fn count(
    family: &mut MetricEncoder<'_>,
    labels: Labels<'_>,
    value: impl EncodeCounterValue,
) -> fmt::Result {
    if labels.is_empty() {
        family.encode_counter::<NoLabelSet, _, f64>(&value, None)
    } else {
        family
            .encode_family(&labels)?
            .encode_counter::<NoLabelSet, _, f64>(&value, None)
    }
}

/// One gauge sample.
pub(crate) fn level(
    family: &mut MetricEncoder<'_>,
    labels: Labels<'_>,
    value: impl EncodeGaugeValue,
) -> fmt::Result {
    if labels.is_empty() {
        family.encode_gauge(&value)
    } else {
        family.encode_family(&labels)?.encode_gauge(&value)
    }
}

/// One histogram's buckets, sum and count.
pub(crate) fn buckets(
    family: &mut MetricEncoder<'_>,
    labels: Labels<'_>,
    h: &fwd::Histogram,
) -> fmt::Result {
    let (cumulative, sum, count) = h.snapshot();
    let mut before = 0;
    let own: Vec<(f64, u64)> = cumulative
        .into_iter()
        .map(|(le, n)| {
            let own = n - before;
            before = n;
            // prometheus-client writes the bound f64::MAX as `+Inf`.
            (if le.is_infinite() { f64::MAX } else { le }, own)
        })
        .collect();
    if labels.is_empty() {
        family.encode_histogram::<NoLabelSet>(sum, count, &own, None)
    } else {
        family
            .encode_family(&labels)?
            .encode_histogram::<NoLabelSet>(sum, count, &own, None)
    }
}

/// A family of one sample without labels: a counter or a gauge.
pub(crate) fn single(
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
