//! From an exposition to replica stats: profiles, model filter, DP aggregation, deltas.

use crate::text::Exposition;

/// Which engine's metric names to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// vLLM 0.9.2+: `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_*`.
    Vllm,
    /// vLLM up to 0.10: `vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*`.
    VllmLegacy,
    /// SGLang (`--enable-metrics`).
    Sglang,
}

impl Profile {
    /// The profile's name in configuration and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::VllmLegacy => "vllm-legacy",
            Self::Sglang => "sglang",
        }
    }

    /// Guesses the profile from what the endpoint exposes: its cache, prefix-cache or load
    /// series (an endpoint with only the load gauges is recognised too).
    pub fn detect(e: &Exposition) -> Option<Profile> {
        let has = |name: &str| e.series(name).next().is_some();
        if has("vllm:kv_cache_usage_perc") || has("vllm:prefix_cache_queries_total") {
            Some(Self::Vllm)
        } else if has("vllm:gpu_cache_usage_perc") || has("vllm:gpu_prefix_cache_queries_total") {
            Some(Self::VllmLegacy)
        } else if has("sglang:token_usage")
            || has("sglang:num_running_reqs")
            || has("sglang:num_queue_reqs")
        {
            Some(Self::Sglang)
        } else if has("vllm:num_requests_running") || has("vllm:num_requests_waiting") {
            Some(Self::Vllm)
        } else {
            None
        }
    }

    pub(crate) fn running(self) -> &'static str {
        match self {
            Self::Sglang => "sglang:num_running_reqs",
            _ => "vllm:num_requests_running",
        }
    }

    pub(crate) fn waiting(self) -> &'static str {
        match self {
            Self::Sglang => "sglang:num_queue_reqs",
            _ => "vllm:num_requests_waiting",
        }
    }
}

/// Which usage gauge is the cache's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheTier {
    /// kv → gpu → cpu, preferring a non-zero gauge.
    #[default]
    Auto,
    /// `vllm:kv_cache_usage_perc`.
    Kv,
    /// `vllm:gpu_cache_usage_perc`.
    Gpu,
    /// `vllm:cpu_cache_usage_perc`.
    Cpu,
}

/// How to turn samples into stats.
#[derive(Debug, Clone, Default)]
pub struct StatsConfig {
    /// The profile; `None` detects it on every scrape.
    pub profile: Option<Profile>,
    /// Which usage gauge.
    pub cache_tier: CacheTier,
    /// Keep only series with this `model_name` label.
    pub model_name: Option<String>,
    /// The engine's KV cache capacity in bytes (0: unknown, report 0).
    pub cache_size_bytes: u64,
    /// Running + waiting requests that count as full pressure.
    pub concurrency_ceiling: u32,
}

/// What one scrape read, already filtered by model and aggregated over DP engines. A series
/// the engine does not expose (or exposes with no finite sample) is `None`, and named in
/// [`Reading::absent`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Reading {
    /// The profile the reading followed.
    pub profile: Option<Profile>,
    /// Requests running.
    pub running: Option<f64>,
    /// Requests waiting.
    pub waiting: Option<f64>,
    /// Cache usage, 0–1.
    pub usage: Option<f64>,
    /// Prefix-cache hits (tokens), a counter.
    pub hits: Option<f64>,
    /// Prefix-cache queries (tokens), a counter.
    pub queries: Option<f64>,
    /// Offload tier hits (tokens), a counter.
    pub t2_hits: Option<f64>,
    /// Offload tier queries (tokens), a counter.
    pub t2_queries: Option<f64>,
    /// SGLang's own hit rate, 0–1.
    pub direct_hit_rate: Option<f64>,
    /// The profile's load and usage series that were absent (reported as 0, "unknown").
    pub absent: Vec<&'static str>,
    /// Samples skipped because they were NaN or ±Inf.
    pub non_finite: u64,
}

/// Why a scrape could not be turned into stats.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatsError {
    /// Nothing the endpoint exposes matches a known engine.
    #[error("no vLLM or SGLang series found: set the profile or check the URL")]
    UnknownEngine,
    /// None of the profile's series is there (after the model filter).
    #[error("none of the series of profile {profile} is present{filter}")]
    NoSeries {
        /// The profile.
        profile: &'static str,
        /// ` for model_name=…` when filtered.
        filter: String,
    },
}

pub(crate) struct Select<'a> {
    e: &'a Exposition,
    model: Option<&'a str>,
    /// SGLang: a series without `priority` (or with `priority=""`) is the total, the others
    /// its breakdown.
    totals_only: bool,
    non_finite: std::cell::Cell<u64>,
}

impl<'a> Select<'a> {
    /// The series of `e` that `profile` reads, kept by `model`'s filter.
    pub(crate) fn new(e: &'a Exposition, profile: Profile, model: Option<&'a str>) -> Self {
        Select {
            e,
            model,
            totals_only: profile == Profile::Sglang,
            non_finite: std::cell::Cell::new(0),
        }
    }

    /// The samples of `name` kept by the model filter (SGLang's totals only), one per series
    /// (DP engine), whatever their value.
    pub(crate) fn samples(&self, name: &str) -> Vec<&'a crate::text::Sample> {
        let kept: Vec<&crate::text::Sample> = self
            .e
            .series(name)
            .filter(|s| self.model.is_none_or(|m| s.label("model_name") == Some(m)))
            .collect();
        let total = |s: &&crate::text::Sample| s.label("priority").is_none_or(str::is_empty);
        if self.totals_only && kept.iter().any(total) {
            kept.into_iter().filter(total).collect()
        } else {
            kept
        }
    }

    /// Finite values of `name` kept by the model filter, one per series (DP engine).
    fn values(&self, name: &str) -> Vec<f64> {
        let kept = self.samples(name);
        let mut out = Vec::with_capacity(kept.len());
        for s in kept {
            if s.value.is_finite() {
                out.push(s.value);
            } else {
                self.non_finite.set(self.non_finite.get() + 1);
            }
        }
        out
    }

    /// The sum over DP engines (load gauges, counters).
    fn sum(&self, name: &str) -> Option<f64> {
        let v = self.values(name);
        (!v.is_empty()).then(|| v.iter().sum())
    }

    /// The mean over DP engines (usage, SGLang's hit rate).
    fn mean(&self, name: &str) -> Option<f64> {
        let v = self.values(name);
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }
}

/// Reads what the stats need from one exposition.
///
/// Across DP engines (series differing in `dp_rank`/`engine`), load gauges and counters add
/// up; usage and SGLang's hit-rate gauge are the mean, for vLLM and SGLang alike (see
/// ARCHITECTURE.md). A series that is absent reads as unknown (`None`, reported as 0) and is
/// named in [`Reading::absent`]; only an exposition with none of the profile's series fails.
pub fn read(e: &Exposition, config: &StatsConfig) -> Result<Reading, StatsError> {
    let profile = match config.profile {
        Some(p) => p,
        None => Profile::detect(e).ok_or(StatsError::UnknownEngine)?,
    };
    let select = Select::new(e, profile, config.model_name.as_deref());
    let mut reading = Reading {
        profile: Some(profile),
        running: select.sum(profile.running()),
        waiting: select.sum(profile.waiting()),
        ..Reading::default()
    };
    let usage_name = match profile {
        Profile::Sglang => {
            reading.usage = select.mean("sglang:token_usage");
            reading.direct_hit_rate = select.mean("sglang:cache_hit_rate");
            "sglang:token_usage"
        }
        Profile::Vllm | Profile::VllmLegacy => {
            let gauges: [(CacheTier, &'static str); 3] = [
                (CacheTier::Kv, "vllm:kv_cache_usage_perc"),
                (CacheTier::Gpu, "vllm:gpu_cache_usage_perc"),
                (CacheTier::Cpu, "vllm:cpu_cache_usage_perc"),
            ];
            let (usage, name) = match config.cache_tier {
                CacheTier::Auto => {
                    let present: Vec<(f64, &'static str)> = gauges
                        .iter()
                        .filter_map(|(_, n)| select.mean(n).map(|v| (v, *n)))
                        .collect();
                    let pick = present
                        .iter()
                        .find(|(v, _)| *v > 0.0)
                        .or(present.first())
                        .copied();
                    (pick.map(|(v, _)| v), pick.map_or(gauges[0].1, |(_, n)| n))
                }
                tier => {
                    let (_, name) = gauges
                        .iter()
                        .find(|(t, _)| *t == tier)
                        .copied()
                        .unwrap_or(gauges[0]);
                    (select.mean(name), name)
                }
            };
            reading.usage = usage;
            let (hits, queries) = if profile == Profile::Vllm {
                (
                    "vllm:prefix_cache_hits_total",
                    "vllm:prefix_cache_queries_total",
                )
            } else {
                (
                    "vllm:gpu_prefix_cache_hits_total",
                    "vllm:gpu_prefix_cache_queries_total",
                )
            };
            reading.hits = select.sum(hits);
            reading.queries = select.sum(queries);
            reading.t2_hits = select.sum("vllm:external_prefix_cache_hits_total");
            reading.t2_queries = select.sum("vllm:external_prefix_cache_queries_total");
            name
        }
    };
    for (value, name) in [
        (reading.running, profile.running()),
        (reading.waiting, profile.waiting()),
        (reading.usage, usage_name),
    ] {
        if value.is_none() {
            reading.absent.push(name);
        }
    }
    reading.non_finite = select.non_finite.get();
    let anything = reading.absent.len() < 3
        || reading.hits.is_some()
        || reading.queries.is_some()
        || reading.direct_hit_rate.is_some();
    if !anything {
        return Err(StatsError::NoSeries {
            profile: profile.as_str(),
            filter: config
                .model_name
                .as_ref()
                .map(|m| format!(" for model_name={m}"))
                .unwrap_or_default(),
        });
    }
    Ok(reading)
}

/// Replica stats, as the contract's `ReplicaStats` carries them. Never NaN: what the engine
/// does not expose is 0 ("unknown").
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stats {
    /// Usage × configured capacity; 0 when the capacity or the usage is unknown.
    pub cache_memory_bytes: i64,
    /// Δhits / Δqueries since the last scrape that had both counters (0 on the first, after a
    /// reset, and for a scrape without them).
    pub hit_rate: f32,
    /// clamp01((running + waiting) / ceiling), an absent gauge counting 0.
    pub pressure: f32,
    /// The engine's offload-tier hits (tokens): its running total, summed over DP engines.
    pub t2_hit_tokens: i64,
    /// The engine's offload-tier queries (tokens): its running total.
    pub t2_query_tokens: i64,
    /// The series that were absent in this scrape (reported as 0).
    pub absent: Vec<&'static str>,
    /// Samples skipped in this scrape because they were NaN or ±Inf.
    pub non_finite: u64,
}

/// Turns readings into stats, keeping the last counters read for the hit rate.
#[derive(Debug, Default)]
pub struct Deltas {
    /// (hits, queries) of the last reading that had both: a scrape that lacks them (a partial
    /// body) leaves it, so the next full one gives the rate since this one.
    baseline: Option<(f64, f64)>,
}

/// A running total as the contract carries it: the engine's counter, never negative. After an
/// engine restart the counter starts again from 0: a new total, which the server sees go down.
fn total(counter: Option<f64>) -> i64 {
    counter.map_or(0, |c| c.max(0.0).min(i64::MAX as f64) as i64)
}

impl Deltas {
    /// The stats of `reading`, relative to the previous one.
    pub fn next(&mut self, reading: Reading, config: &StatsConfig) -> Stats {
        let hit_rate = match (reading.direct_hit_rate, reading.hits, reading.queries) {
            (Some(rate), ..) => rate,
            (None, Some(hits), Some(queries)) => {
                match self.baseline.replace((hits, queries)) {
                    // Counters that went down belong to a restarted engine: a new baseline.
                    Some((h, q)) if hits >= h && queries > q => (hits - h) / (queries - q),
                    _ => 0.0,
                }
            }
            _ => 0.0,
        };
        let load = reading.running.unwrap_or(0.0) + reading.waiting.unwrap_or(0.0);
        let pressure = if config.concurrency_ceiling == 0 {
            0.0
        } else {
            load / f64::from(config.concurrency_ceiling)
        };
        let usage = reading.usage.unwrap_or(0.0).clamp(0.0, 1.0);
        Stats {
            cache_memory_bytes: (usage * config.cache_size_bytes as f64) as i64,
            hit_rate: hit_rate.clamp(0.0, 1.0) as f32,
            pressure: pressure.clamp(0.0, 1.0) as f32,
            t2_hit_tokens: total(reading.t2_hits),
            t2_query_tokens: total(reading.t2_queries),
            absent: reading.absent,
            non_finite: reading.non_finite,
        }
    }
}
