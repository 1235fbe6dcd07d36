//! An engine's load as a router weighs it: requests running and waiting, and KV-cache usage,
//! per DP rank, read from one exposition ([`read_load`]).
//!
//! Stricter than the stats: a router acts on every figure at once, so a load that is not
//! whole or not sane is refused ([`LoadError`]) rather than read as 0. The caller keeps the
//! last good load, which then ages.

use crate::stats::{Profile, Select, StatsConfig, StatsError};
use crate::text::Exposition;

/// One DP rank's load: the one shape of an engine's load from its reading to the sidecar's
/// feed, a `Fleet`, the routing rule and the wheel (the feed's messages convert at its edge). A
/// new figure is a field here, its reading in [`read_load`], its fold in [`Load`] and its name
/// in [`RankLoad::figures`]; the feed's message carries it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankLoad {
    /// The rank (the series' `engine` or `dp_rank` label; 0 without one).
    pub rank: u32,
    /// Requests in the engine's running batch.
    pub running: u32,
    /// Requests queued for it.
    pub waiting: u32,
    /// KV-cache usage, 0–1 (`None`: the engine exposes no usage gauge).
    pub kv_usage: Option<f32>,
}

impl RankLoad {
    /// A rank with nothing running or waiting and no usage said.
    pub fn idle(rank: u32) -> Self {
        Self {
            rank,
            running: 0,
            waiting: 0,
            kv_usage: None,
        }
    }

    /// Its figures by name, as every display of a load shows them (a router's `/replicas`, the
    /// wheel's `Load.ranks`): listed once, so a new figure shows everywhere.
    pub fn figures(&self) -> [(&'static str, Figure); 4] {
        [
            ("rank", Figure::Count(self.rank)),
            ("running", Figure::Count(self.running)),
            ("waiting", Figure::Count(self.waiting)),
            ("kv_usage", Figure::Fraction(self.kv_usage)),
        ]
    }
}

/// One figure of a rank's load ([`RankLoad::figures`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Figure {
    /// A count (requests).
    Count(u32),
    /// A fraction, 0–1, when the engine says it.
    Fraction(Option<f32>),
}

/// An engine's load, rank by rank (sorted by rank).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Load {
    /// Each rank the exposition names.
    pub ranks: Vec<RankLoad>,
}

impl Load {
    /// Requests in the engine, running or waiting, over every rank: what the routing rule
    /// weighs.
    pub fn queued(&self) -> u32 {
        self.running().saturating_add(self.waiting())
    }

    /// Requests running, over every rank.
    pub fn running(&self) -> u32 {
        self.ranks
            .iter()
            .map(|r| r.running)
            .fold(0, u32::saturating_add)
    }

    /// Requests waiting, over every rank.
    pub fn waiting(&self) -> u32 {
        self.ranks
            .iter()
            .map(|r| r.waiting)
            .fold(0, u32::saturating_add)
    }

    /// The mean KV-cache usage over the ranks that say it.
    pub fn kv_usage(&self) -> Option<f32> {
        let said: Vec<f32> = self.ranks.iter().filter_map(|r| r.kv_usage).collect();
        (!said.is_empty()).then(|| said.iter().sum::<f32>() / said.len() as f32)
    }
}

/// Why an exposition gave no load.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoadError {
    /// Not a known engine's metrics.
    #[error(transparent)]
    Engine(#[from] StatsError),
    /// A series the load needs is not there (after the model filter).
    #[error("`{series}` is not in the engine's metrics{filter}")]
    Missing {
        /// The series.
        series: &'static str,
        /// ` for model_name=…` when filtered.
        filter: String,
    },
    /// A value no engine would say: NaN, infinite, negative, a request count past 2³²,
    /// a usage past 1.
    #[error("`{series}` of rank {rank} is {value}, which is not a load")]
    Nonsense {
        /// The series.
        series: &'static str,
        /// The rank.
        rank: u32,
        /// The value read.
        value: f64,
    },
}

impl LoadError {
    /// A short label for metrics and for telling one failure from another in logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Engine(_) => "unknown_engine",
            Self::Missing { .. } => "missing_series",
            Self::Nonsense { .. } => "nonsense",
        }
    }
}

/// Rank `rank`'s entry, made if it has none.
fn at(ranks: &mut Vec<RankLoad>, rank: u32) -> &mut RankLoad {
    let i = match ranks.iter().position(|r| r.rank == rank) {
        Some(i) => i,
        None => {
            ranks.push(RankLoad::idle(rank));
            ranks.len() - 1
        }
    };
    &mut ranks[i]
}

fn rank_of(s: &crate::text::Sample) -> u32 {
    s.label("engine")
        .or_else(|| s.label("dp_rank"))
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// Reads the load from one exposition (the profile and model filter of `config`; its cache
/// tier is not used: the load's usage is the engine's KV cache).
///
/// ```
/// let e = kvevent_scrape::text::parse(
///     "vllm:num_requests_running{engine=\"0\"} 3\n\
///      vllm:num_requests_waiting{engine=\"0\"} 2\n\
///      vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n",
/// )?;
/// let load = kvevent_scrape::read_load(&e, &Default::default())?;
/// assert_eq!((load.running(), load.waiting(), load.kv_usage()), (3, 2, Some(0.5)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn read_load(e: &Exposition, config: &StatsConfig) -> Result<Load, LoadError> {
    let profile = match config.profile {
        Some(p) => p,
        None => Profile::detect(e).ok_or(StatsError::UnknownEngine)?,
    };
    let select = Select::new(e, profile, config.model_name.as_deref());
    let missing = |series| LoadError::Missing {
        series,
        filter: config
            .model_name
            .as_ref()
            .map(|m| format!(" for model_name={m}"))
            .unwrap_or_default(),
    };
    let count = |series: &'static str, value: f64, rank: u32| {
        if value.is_finite() && value >= 0.0 && value <= f64::from(u32::MAX) {
            Ok(value.round() as u32)
        } else {
            Err(LoadError::Nonsense {
                series,
                rank,
                value,
            })
        }
    };
    let mut ranks: Vec<RankLoad> = Vec::new();
    for (series, waiting) in [(profile.running(), false), (profile.waiting(), true)] {
        let samples = select.samples(series);
        if samples.is_empty() {
            return Err(missing(series));
        }
        for s in samples {
            let rank = rank_of(s);
            let n = count(series, s.value, rank)?;
            let r = at(&mut ranks, rank);
            // Several series of one rank (an exposition without rank labels from several
            // writers) add up, as the stats do.
            if waiting {
                r.waiting = r.waiting.saturating_add(n);
            } else {
                r.running = r.running.saturating_add(n);
            }
        }
    }
    let usage_series: &[&'static str] = match profile {
        Profile::Sglang => &["sglang:token_usage"],
        Profile::Vllm => &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        Profile::VllmLegacy => &["vllm:gpu_cache_usage_perc"],
    };
    if let Some((series, samples)) = usage_series
        .iter()
        .map(|n| (*n, select.samples(n)))
        .find(|(_, s)| !s.is_empty())
    {
        for s in samples {
            let rank = rank_of(s);
            // A little past 1 is rounding in the engine's own division.
            if !(s.value.is_finite() && (0.0..=1.001).contains(&s.value)) {
                return Err(LoadError::Nonsense {
                    series,
                    rank,
                    value: s.value,
                });
            }
            at(&mut ranks, rank).kv_usage = Some(s.value.min(1.0) as f32);
        }
    }
    ranks.sort_by_key(|r| r.rank);
    Ok(Load { ranks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::parse;

    fn read(text: &str) -> Result<Load, LoadError> {
        read_load(&parse(text).expect("exposition"), &StatsConfig::default())
    }

    #[test]
    fn ranks_are_read_each_and_added_up() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/fixtures/metrics/vllm-dp2.txt"
        ))
        .expect("fixture");
        let load = read(&text).expect("a load");
        assert_eq!(load.ranks.len(), 2);
        assert_eq!((load.ranks[0].running, load.ranks[0].waiting), (4, 1));
        assert_eq!((load.ranks[1].running, load.ranks[1].waiting), (6, 3));
        assert_eq!((load.running(), load.waiting()), (10, 4));
        assert!(load.kv_usage().is_some());
    }

    #[test]
    fn sglang_totals_not_their_priority_breakdown() {
        let load = read(
            "sglang:num_running_reqs{dp_rank=\"1\"} 5\n\
             sglang:num_running_reqs{dp_rank=\"1\",priority=\"0\"} 3\n\
             sglang:num_queue_reqs{dp_rank=\"1\"} 2\n\
             sglang:token_usage{dp_rank=\"1\"} 0.25\n",
        )
        .expect("a load");
        assert_eq!(
            load.ranks,
            vec![RankLoad {
                running: 5,
                waiting: 2,
                kv_usage: Some(0.25),
                ..RankLoad::idle(1)
            }]
        );
    }

    #[test]
    fn a_load_that_is_not_whole_or_not_sane_is_refused_by_name() {
        let missing = read("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\n");
        assert!(
            matches!(missing, Err(LoadError::Missing { series, .. }) if series == "vllm:num_requests_waiting"),
            "{missing:?}"
        );
        for (text, series) in [
            (
                "vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n",
                "vllm:num_requests_running",
            ),
            (
                "vllm:num_requests_running 1\nvllm:num_requests_waiting -2\n",
                "vllm:num_requests_waiting",
            ),
            (
                "vllm:num_requests_running 1\nvllm:num_requests_waiting +Inf\n",
                "vllm:num_requests_waiting",
            ),
            (
                "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 7\n",
                "vllm:kv_cache_usage_perc",
            ),
        ] {
            let e = read(text).expect_err(text);
            assert!(
                matches!(&e, LoadError::Nonsense { series: s, .. } if *s == series),
                "{text}: {e:?}"
            );
            assert!(e.to_string().contains(series), "{e}");
        }
        assert!(matches!(read("foo 1\n"), Err(LoadError::Engine(_))));
    }

    #[test]
    fn no_usage_gauge_is_a_load_without_usage() {
        let load =
            read("vllm:num_requests_running 2\nvllm:num_requests_waiting 0\n").expect("a load");
        assert_eq!((load.running(), load.kv_usage()), (2, None));
    }
}
