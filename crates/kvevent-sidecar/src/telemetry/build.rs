//! The build's metric.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::encode;

/// `kvevent_build_info`.
#[derive(Debug)]
pub(crate) struct Build;

impl Collector for Build {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let mut f = encode::gauge(&mut enc, "kvevent_build_info", "Build information.")?;
        encode::level(&mut f, &[("version", env!("CARGO_PKG_VERSION"))], 1u64)
    }
}
