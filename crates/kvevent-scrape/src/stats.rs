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

    /// Guesses the profile from what the endpoint exposes.
    pub fn detect(e: &Exposition) -> Option<Profile> {
        let has = |name: &str| e.series(name).next().is_some();
        if has("vllm:kv_cache_usage_perc") || has("vllm:prefix_cache_queries_total") {
            Some(Self::Vllm)
        } else if has("vllm:gpu_cache_usage_perc") || has("vllm:gpu_prefix_cache_queries_total") {
            Some(Self::VllmLegacy)
        } else if has("sglang:token_usage") || has("sglang:num_running_reqs") {
            Some(Self::Sglang)
        } else {
            None
        }
    }

    fn running(self) -> &'static str {
        match self {
            Self::Sglang => "sglang:num_running_reqs",
            _ => "vllm:num_requests_running",
        }
    }

    fn waiting(self) -> &'static str {
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

/// What one scrape read, already filtered by model and summed (or averaged) over DP engines.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Reading {
    /// The profile the reading followed.
    pub profile: Option<Profile>,
    /// Requests running.
    pub running: f64,
    /// Requests waiting.
    pub waiting: f64,
    /// Cache usage, 0–1.
    pub usage: f64,
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
}

/// Why a scrape could not be turned into stats. No fabricated zeros.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatsError {
    /// Nothing the endpoint exposes matches a known engine.
    #[error("no vLLM or SGLang series found: set the profile or check the URL")]
    UnknownEngine,
    /// The profile's required series are absent (after the model filter).
    #[error("series `{series}` of profile {profile} is absent{filter}")]
    Missing {
        /// The series' name.
        series: &'static str,
        /// The profile.
        profile: &'static str,
        /// ` for model_name=…` when filtered.
        filter: String,
    },
}

struct Select<'a> {
    e: &'a Exposition,
    model: Option<&'a str>,
}

impl Select<'_> {
    /// Values of `name` kept by the model filter, one per series (DP engine).
    fn values(&self, name: &str) -> Vec<f64> {
        self.e
            .series(name)
            .filter(|s| self.model.is_none_or(|m| s.label("model_name") == Some(m)))
            .map(|s| s.value)
            .collect()
    }

    fn sum(&self, name: &str) -> Option<f64> {
        let v = self.values(name);
        (!v.is_empty()).then(|| v.iter().sum())
    }

    fn mean(&self, name: &str) -> Option<f64> {
        let v = self.values(name);
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }
}

/// Reads what the stats need from one exposition.
pub fn read(e: &Exposition, config: &StatsConfig) -> Result<Reading, StatsError> {
    let profile = match config.profile {
        Some(p) => p,
        None => Profile::detect(e).ok_or(StatsError::UnknownEngine)?,
    };
    let select = Select {
        e,
        model: config.model_name.as_deref(),
    };
    let missing = |series: &'static str| StatsError::Missing {
        series,
        profile: profile.as_str(),
        filter: config
            .model_name
            .as_ref()
            .map(|m| format!(" for model_name={m}"))
            .unwrap_or_default(),
    };
    let running = select
        .sum(profile.running())
        .ok_or_else(|| missing(profile.running()))?;
    let waiting = select
        .sum(profile.waiting())
        .ok_or_else(|| missing(profile.waiting()))?;
    let mut reading = Reading {
        profile: Some(profile),
        running,
        waiting,
        ..Reading::default()
    };
    match profile {
        Profile::Sglang => {
            reading.usage = select
                .mean("sglang:token_usage")
                .ok_or_else(|| missing("sglang:token_usage"))?;
            reading.direct_hit_rate = select.mean("sglang:cache_hit_rate");
        }
        Profile::Vllm | Profile::VllmLegacy => {
            let gauges: [(CacheTier, &'static str); 3] = [
                (CacheTier::Kv, "vllm:kv_cache_usage_perc"),
                (CacheTier::Gpu, "vllm:gpu_cache_usage_perc"),
                (CacheTier::Cpu, "vllm:cpu_cache_usage_perc"),
            ];
            reading.usage = match config.cache_tier {
                CacheTier::Auto => {
                    let present: Vec<f64> =
                        gauges.iter().filter_map(|(_, n)| select.mean(n)).collect();
                    let first = present
                        .first()
                        .copied()
                        .ok_or_else(|| missing(gauges[0].1))?;
                    present.into_iter().find(|v| *v > 0.0).unwrap_or(first)
                }
                tier => {
                    let (_, name) = gauges
                        .iter()
                        .find(|(t, _)| *t == tier)
                        .copied()
                        .unwrap_or(gauges[0]);
                    select.mean(name).ok_or_else(|| missing(name))?
                }
            };
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
        }
    }
    Ok(reading)
}

/// Replica stats, as the contract's `ReplicaStats` carries them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    /// Usage × configured capacity; 0 when the capacity is unknown.
    pub cache_memory_bytes: i64,
    /// Δhits / Δqueries since the previous scrape (0 on the first and after a reset).
    pub hit_rate: f32,
    /// clamp01((running + waiting) / ceiling).
    pub pressure: f32,
    /// Offload tier hits since the previous scrape.
    pub t2_hit_tokens: i64,
    /// Offload tier queries since the previous scrape.
    pub t2_query_tokens: i64,
}

/// Turns readings into stats, keeping the previous counters for deltas.
#[derive(Debug, Default)]
pub struct Deltas {
    previous: Option<Reading>,
}

/// `now - before` for a counter; `None` on the first reading or a reset (it went down).
fn delta(now: Option<f64>, before: Option<f64>) -> Option<f64> {
    match (now, before) {
        (Some(n), Some(b)) if n >= b => Some(n - b),
        _ => None,
    }
}

impl Deltas {
    /// The stats of `reading`, relative to the previous one.
    pub fn next(&mut self, reading: Reading, config: &StatsConfig) -> Stats {
        let previous = self.previous.replace(reading);
        let before = |f: fn(&Reading) -> Option<f64>| previous.as_ref().and_then(f);
        let hit_rate = match reading.direct_hit_rate {
            Some(rate) => rate,
            None => match (
                delta(reading.hits, before(|r| r.hits)),
                delta(reading.queries, before(|r| r.queries)),
            ) {
                (Some(h), Some(q)) if q > 0.0 => h / q,
                _ => 0.0,
            },
        };
        let t2 = |now: Option<f64>, f: fn(&Reading) -> Option<f64>| {
            delta(now, before(f)).map_or(0, |d| d as i64)
        };
        let pressure = if config.concurrency_ceiling == 0 {
            0.0
        } else {
            (reading.running + reading.waiting) / f64::from(config.concurrency_ceiling)
        };
        Stats {
            cache_memory_bytes: (reading.usage.clamp(0.0, 1.0) * config.cache_size_bytes as f64)
                as i64,
            hit_rate: hit_rate.clamp(0.0, 1.0) as f32,
            pressure: pressure.clamp(0.0, 1.0) as f32,
            t2_hit_tokens: t2(reading.t2_hits, |r| r.t2_hits),
            t2_query_tokens: t2(reading.t2_queries, |r| r.t2_queries),
        }
    }
}
