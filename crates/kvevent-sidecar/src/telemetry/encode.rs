//! Writing families: the workspace's helpers ([`kvevent_metrics`]), and the forwarder's
//! histograms through them.

use std::fmt;

use kvevent_forwarder as fwd;
use prometheus_client::encoding::MetricEncoder;

pub(crate) use kvevent_metrics::{Labels, count, counter, gauge, histogram, level};

/// One forwarder histogram's buckets, sum and count.
pub(crate) fn buckets(
    family: &mut MetricEncoder<'_>,
    labels: Labels<'_>,
    h: &fwd::Histogram,
) -> fmt::Result {
    let (cumulative, sum, count) = h.snapshot();
    kvevent_metrics::buckets(family, labels, &cumulative, sum, count)
}
