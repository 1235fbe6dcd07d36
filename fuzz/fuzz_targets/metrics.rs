//! The `/metrics` parser and the stats built on it: any text parses or fails with a line
//! number; what parses reads into stats under every profile without panicking, and every
//! value read is finite (NaN and ±Inf are skipped, never averaged in).
#![no_main]

use kvevent_scrape::stats::{self, Deltas};
use kvevent_scrape::{CacheTier, Profile, StatsConfig, text};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let exposition = match text::parse(text) {
        Ok(e) => e,
        Err(e) => {
            assert!(
                e.line >= 1 && e.line <= text.lines().count().max(1) + 1,
                "{e}"
            );
            return;
        }
    };
    for profile in [
        None,
        Some(Profile::Vllm),
        Some(Profile::VllmLegacy),
        Some(Profile::Sglang),
    ] {
        for model_name in [None, Some("m".to_owned())] {
            let config = StatsConfig {
                profile,
                cache_tier: CacheTier::Auto,
                model_name,
                cache_size_bytes: 1 << 30,
                concurrency_ceiling: 64,
            };
            let Ok(reading) = stats::read(&exposition, &config) else {
                continue;
            };
            for v in [
                reading.running,
                reading.waiting,
                reading.usage,
                reading.hits,
                reading.queries,
                reading.t2_hits,
                reading.t2_queries,
                reading.direct_hit_rate,
            ]
            .into_iter()
            .flatten()
            {
                assert!(v.is_finite(), "a non-finite value was read: {v}");
            }
            let mut deltas = Deltas::default();
            let _ = deltas.next(reading.clone(), &config);
            let _ = deltas.next(reading, &config);
        }
    }
});
