//! The figures of `kvevents stats`: a recording's batches mapped to fingerprint keys by the
//! sidecar's mapper (one a rank), then the resident sets replayed in time order.
//!
//! Invariants: a source is one engine rank (each its own cache), as in the router's index: a
//! clear or an eviction on one rank leaves the others' blocks alone, and the fleet's
//! duplication is `1 − distinct prefixes ÷ (prefix, source) pairs`, the index's
//! (`kvevent_index::IndexStats::duplication`). Everything is placed on the recorder's clock:
//! live batches at arrival, replayed ones at the engine's own time (the batch's `ts`) moved by
//! the difference of the two clocks the live batches show, so an engine on another machine
//! with a clock of its own changes nothing; within a rank, seq order wins over any clock. A
//! replayed batch whose `ts` is not a wall clock counts at its arrival, and the figures say how
//! many did. Keys fold to 64 bits as the index folds them ([`kvevent_index::fold_key`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use kvevent_mapper::{Identity, KeyMode, Mapper, Options, Sink, Tier};
use kvevent_recording::Reader;
use kvevent_wire as wire;
use serde::Serialize;

/// The workspace's hasher for maps of keys (the feed's hub uses it too).
type Fast<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A prefix across the fleet: its fingerprint and its adapter (interned).
pub(crate) type Key = (u64, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    Stored,
    Evicted,
    Cleared,
}

/// One change to a source's resident set, at an absolute time (µs since the Unix epoch).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Event {
    pub(crate) at_us: u64,
    /// The engine rank (the source within its replica).
    pub(crate) rank: u32,
    pub(crate) change: Change,
    pub(crate) key: Key,
}

/// The mapper's output, as changes to the resident set.
struct Collect<'a> {
    at_us: u64,
    rank: u32,
    adapters: &'a mut HashMap<Arc<str>, u32>,
    events: &'a mut Vec<Event>,
    depths: &'a mut Vec<u32>,
    block_size: u32,
}

impl Collect<'_> {
    fn key(&mut self, key: &[u8], adapter: &Arc<str>) -> Key {
        let n = self.adapters.len() as u32;
        let a = *self.adapters.entry(adapter.clone()).or_insert(n);
        (kvevent_index::fold_key(key), a)
    }

    fn push(&mut self, change: Change, key: Key) {
        self.events.push(Event {
            at_us: self.at_us,
            rank: self.rank,
            change,
            key,
        });
    }
}

impl Sink for Collect<'_> {
    fn prefix(&mut self, key: &[u8], tokens: u32, _: Tier, adapter: &Arc<str>, new: bool) {
        let key = self.key(key, adapter);
        if new && self.block_size > 0 {
            self.depths.push(tokens.div_ceil(self.block_size));
        }
        self.push(Change::Stored, key);
    }
    fn end_update(&mut self, _: i64) {}
    fn evicted(&mut self, key: &[u8], adapter: &Arc<str>, _: i64) {
        let key = self.key(key, adapter);
        self.push(Change::Evicted, key);
    }
    fn cleared(&mut self, _: i64) {
        self.push(Change::Cleared, (0, 0));
    }
}

/// p50, p90, p99 of `values` (sorted here), nearest rank: the smallest value with at least
/// that share of the values at or below it.
pub(crate) fn percentiles(values: &mut [u64]) -> Option<[u64; 3]> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let n = values.len();
    let at = |p: f64| values[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    Some([at(0.5), at(0.9), at(0.99)])
}

/// What one replica's cache did (its ranks' caches together).
#[derive(Debug, Serialize)]
pub(crate) struct Replica {
    pub(crate) name: String,
    pub(crate) engine: String,
    /// Its engine ranks.
    pub(crate) ranks: Vec<u32>,
    pub(crate) duration_s: f64,
    pub(crate) batches: u64,
    /// Replayed batches counted at their arrival: their `ts` is not a wall clock.
    pub(crate) replayed_at_arrival: u64,
    pub(crate) stored_per_s: f64,
    pub(crate) removed_per_s: f64,
    pub(crate) cleared_per_s: f64,
    /// Resident blocks, every rank's together.
    pub(crate) resident_peak: u64,
    pub(crate) resident_mean: f64,
    /// Seconds a block was resident before its eviction (clears not counted): p50, p90, p99.
    pub(crate) residency_s: Option<[f64; 3]>,
    /// Stores of a prefix this rank had evicted before, as a share of its stores.
    pub(crate) restore_share: f64,
    /// Median seconds from an eviction to the prefix's next store on the rank.
    pub(crate) restore_gap_p50_s: Option<f64>,
    /// Blocks from the start of the prompt to a stored block: p50, p90, max.
    pub(crate) depth_blocks: Option<[u64; 3]>,
    #[serde(skip)]
    pub(crate) resident_series: Vec<(f64, u64)>,
}

/// The fleet's figures.
#[derive(Debug, Serialize)]
pub(crate) struct Fleet {
    pub(crate) replicas: usize,
    /// Sources: engine ranks across the replicas.
    pub(crate) sources: usize,
    pub(crate) distinct_prefixes: u64,
    /// (prefix, source) pairs resident at the end.
    pub(crate) pairs_end: u64,
    /// The share of resident (prefix, source) pairs whose prefix another source also holds,
    /// at the end, at its mean over time and at its peak: 1 − distinct resident prefixes ÷
    /// pairs (the index's duplication).
    pub(crate) duplication_end: f64,
    pub(crate) duplication_mean: f64,
    pub(crate) duplication_peak: f64,
    /// The pairs of sources that most often stored a prefix the other held, with how often.
    pub(crate) shared_pairs: Vec<(String, String, u64)>,
    #[serde(skip)]
    pub(crate) duplication_series: Vec<(f64, f64)>,
}

/// The engine's time of a batch, in µs since the Unix epoch, when its `ts` is one (vLLM and
/// SGLang stamp `time.time()`); `None` when it is not (a test's or a stand-in's counter).
fn wall_clock_us(ts: f64) -> Option<u64> {
    // 2001-09-09 to 2286: any engine running today.
    (1e9..1e10).contains(&ts).then_some((ts * 1e6) as u64)
}

/// Where a recorded batch's changes begin in the replica's list, and what says when it
/// happened.
struct Placed {
    rank: u32,
    replay: bool,
    /// Its `ts`, when it is a wall clock (the engine's).
    engine_us: Option<u64>,
    /// When it reached the recorder (the recorder's clock).
    arrival: u64,
    first_event: usize,
}

/// Puts each batch's changes on the recorder's clock: a live batch at its arrival; a replayed
/// one at its `ts` moved onto the recorder's clock by the rank's offset (the least of arrival
/// less `ts` over its live batches: the clocks' difference plus the shortest delivery; none
/// live: the clocks taken as one), at its arrival when its `ts` is not a wall clock. Within a
/// rank, seq order (the file's) wins over any clock: no batch is placed before the one before.
fn place(placed: &[Placed], events: &mut [Event]) {
    let mut offsets: HashMap<u32, i64> = HashMap::new();
    for p in placed.iter().filter(|p| !p.replay) {
        if let Some(ts) = p.engine_us {
            let d = p.arrival as i64 - ts as i64;
            offsets
                .entry(p.rank)
                .and_modify(|o| *o = (*o).min(d))
                .or_insert(d);
        }
    }
    let mut last: HashMap<u32, u64> = HashMap::new();
    for (i, p) in placed.iter().enumerate() {
        let at = match (p.replay, p.engine_us) {
            (true, Some(ts)) => {
                (ts as i64 + offsets.get(&p.rank).copied().unwrap_or(0)).max(0) as u64
            }
            _ => p.arrival,
        };
        let at = last.get(&p.rank).map_or(at, |&l| at.max(l));
        last.insert(p.rank, at);
        let end = placed.get(i + 1).map_or(events.len(), |n| n.first_event);
        for e in &mut events[p.first_event..end] {
            e.at_us = at;
        }
    }
}

/// One recording, read and mapped: the replica's figures and its changes for the fleet.
pub(crate) fn replica(
    path: &Path,
    adapters: &mut HashMap<Arc<str>, u32>,
    skip_damaged: bool,
) -> anyhow::Result<(Replica, Vec<Event>)> {
    let name = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut reader = Reader::new(std::io::BufReader::with_capacity(1 << 20, file))
        .with_context(|| path.display().to_string())?;
    let engine = crate::record::engine_of(reader.header())?;
    let base_us = reader.header().started_unix_ms * 1000;
    let identity = Identity::new(&name, "stats", "", "vllm")?;
    // One mapper a rank, as the sidecar keeps; fingerprint keys compare across replicas.
    let mut mappers: std::collections::BTreeMap<u32, Mapper> = Default::default();
    let mut events = Vec::new();
    let mut depths = Vec::new();
    let (mut batches, mut stored, mut removed, mut cleared) = (0u64, 0u64, 0u64, 0u64);
    let mut replayed_at_arrival = 0u64;
    let mut placed = Vec::new();
    let mut block_size = 0u32;
    while let Some(r) = crate::record::next_whole(&mut reader, path, skip_damaged)? {
        let batch =
            wire::decode_engine(&r.payload, engine, &wire::Limits::DEFAULT).map_err(|e| {
                anyhow::anyhow!(
                    "{}: rank {} seq {}: payload byte {}: {}",
                    path.display(),
                    r.rank,
                    r.seq,
                    e.offset(),
                    e.kind()
                )
            })?;
        batches += 1;
        let arrival = base_us + r.at_us;
        let engine_us = wall_clock_us(batch.ts);
        if r.replay && engine_us.is_none() {
            replayed_at_arrival += 1;
        }
        placed.push(Placed {
            rank: r.rank,
            replay: r.replay,
            engine_us,
            arrival,
            first_event: events.len(),
        });
        // Set once every batch is read (`place`): the recorder's clock is known then.
        let at_us = arrival;
        for e in &batch.events {
            match e {
                wire::Event::BlockStored(s) => {
                    stored += s.block_hashes.len() as u64;
                    block_size = block_size.max(s.block_size);
                }
                wire::Event::BlockRemoved(s) => removed += s.block_hashes.len() as u64,
                wire::Event::AllBlocksCleared(_) => cleared += 1,
            }
        }
        let mapper = mappers.entry(r.rank).or_insert_with(|| {
            Mapper::new(
                identity.clone(),
                Options {
                    key_mode: KeyMode::Fingerprint,
                    ..Options::default()
                },
            )
        });
        // Where the rank started over (an engine restart, a gap nothing filled), what it held
        // is gone, as a sidecar clears it.
        if r.reset.is_some() {
            mapper.reset(0);
            events.push(Event {
                at_us,
                rank: r.rank,
                change: Change::Cleared,
                key: (0, 0),
            });
        }
        let mut sink = Collect {
            at_us,
            rank: r.rank,
            adapters: &mut *adapters,
            events: &mut events,
            depths: &mut depths,
            block_size,
        };
        mapper.map_batch_into(&batch, &mut sink);
    }
    if let Some(cut) = reader.truncated() {
        eprintln!(
            "kvevents: {}: cut at byte {cut} inside a record: read up to the last whole batch",
            path.display()
        );
    }
    place(&placed, &mut events);
    events.sort_by_key(|e| e.at_us);
    let ranks: Vec<u32> = mappers.keys().copied().collect();
    let figures = Figures::of(&events, base_us);
    let duration_s = figures.span_us as f64 / 1e6;
    let per_s = |n: u64| {
        if duration_s > 0.0 {
            n as f64 / duration_s
        } else {
            0.0
        }
    };
    let to_s = |v: [u64; 3]| v.map(|x| x as f64 / 1e6);
    let mut depths: Vec<u64> = depths.into_iter().map(u64::from).collect();
    let depth =
        percentiles(&mut depths).map(|[p50, p90, _]| [p50, p90, *depths.last().unwrap_or(&0)]);
    let Figures {
        peak,
        mean,
        mut residency,
        mut gaps,
        restore_share,
        series,
        ..
    } = figures;
    Ok((
        Replica {
            name,
            engine: reader.header().engine.clone(),
            ranks,
            duration_s,
            batches,
            replayed_at_arrival,
            stored_per_s: per_s(stored),
            removed_per_s: per_s(removed),
            cleared_per_s: per_s(cleared),
            resident_peak: peak,
            resident_mean: mean,
            residency_s: percentiles(&mut residency).map(to_s),
            restore_share,
            restore_gap_p50_s: percentiles(&mut gaps).map(|p| p[0] as f64 / 1e6),
            depth_blocks: depth,
            resident_series: series,
        },
        events,
    ))
}

/// One replica's resident sets (one a rank) replayed over its changes, in time order.
#[derive(Debug, Default)]
pub(crate) struct Figures {
    /// Resident (prefix, rank) pairs at the peak.
    pub(crate) peak: u64,
    /// Their mean over the span.
    pub(crate) mean: f64,
    /// At the end.
    pub(crate) end: u64,
    /// µs each evicted block stayed.
    pub(crate) residency: Vec<u64>,
    /// µs from an eviction to the prefix's next store on the same rank.
    pub(crate) gaps: Vec<u64>,
    pub(crate) restore_share: f64,
    /// (seconds from the recording's start, resident pairs), every 100 ms at most.
    pub(crate) series: Vec<(f64, u64)>,
    /// µs from the first change to the last.
    pub(crate) span_us: u64,
}

impl Figures {
    pub(crate) fn of(events: &[Event], base_us: u64) -> Self {
        let mut resident: Fast<(u32, Key), u64> = Fast::default();
        let mut evicted_at: Fast<(u32, Key), u64> = Fast::default();
        let mut f = Self::default();
        let (mut new_stores, mut restores) = (0u64, 0u64);
        let (mut area, mut prev_at) = (0f64, None::<u64>);
        for e in events {
            if let Some(p) = prev_at {
                area += resident.len() as f64 * e.at_us.saturating_sub(p) as f64;
            }
            prev_at = Some(e.at_us);
            let at = (e.rank, e.key);
            match e.change {
                Change::Stored => {
                    if let std::collections::hash_map::Entry::Vacant(v) = resident.entry(at) {
                        v.insert(e.at_us);
                        new_stores += 1;
                        if let Some(t) = evicted_at.remove(&at) {
                            restores += 1;
                            f.gaps.push(e.at_us.saturating_sub(t));
                        }
                    }
                }
                Change::Evicted => {
                    if let Some(t) = resident.remove(&at) {
                        f.residency.push(e.at_us.saturating_sub(t));
                        evicted_at.insert(at, e.at_us);
                    }
                }
                // One rank's cache: the others keep theirs.
                Change::Cleared => resident.retain(|(rank, _), _| *rank != e.rank),
            }
            f.peak = f.peak.max(resident.len() as u64);
            let t = e.at_us.saturating_sub(base_us) as f64 / 1e6;
            if f.series.last().is_none_or(|(last, _)| t - last >= 0.1) {
                f.series.push((t, resident.len() as u64));
            }
        }
        f.end = resident.len() as u64;
        f.span_us = events
            .first()
            .zip(events.last())
            .map_or(0, |(a, b)| b.at_us.saturating_sub(a.at_us));
        f.mean = if f.span_us > 0 {
            area / f.span_us as f64
        } else {
            f.end as f64
        };
        f.restore_share = if new_stores > 0 {
            restores as f64 / new_stores as f64
        } else {
            0.0
        };
        f
    }
}

/// The fleet: every source's changes in time order, holders counted per prefix. A source is a
/// replica's rank; `replicas[i]` names replica `i` and its ranks.
pub(crate) fn fleet(replicas: &[(String, Vec<u32>)], per_replica: Vec<Vec<Event>>) -> Fleet {
    // Source numbers and names: `name`, or `name#rank` for a replica of several ranks.
    let mut source_of: HashMap<(usize, u32), usize> = HashMap::new();
    let mut names = Vec::new();
    for (r, (name, ranks)) in replicas.iter().enumerate() {
        for &rank in ranks {
            source_of.insert((r, rank), names.len());
            names.push(if ranks.len() > 1 {
                format!("{name}#{rank}")
            } else {
                name.clone()
            });
        }
    }
    let mut all: Vec<(u64, usize, Event)> = per_replica
        .into_iter()
        .enumerate()
        .flat_map(|(r, events)| events.into_iter().map(move |e| (e.at_us, r, e)))
        .collect();
    all.sort_by_key(|(at, r, e)| (*at, *r, e.rank));
    let n = names.len();
    let mut holders: Fast<Key, Vec<u32>> = Fast::default();
    let mut held: Vec<Fast<Key, ()>> = (0..n).map(|_| Fast::default()).collect();
    let mut ever: Fast<Key, ()> = Fast::default();
    let mut pairs = vec![0u64; n * n];
    let (mut entries, mut distinct) = (0u64, 0u64);
    let share = |entries: u64, distinct: u64| {
        if entries == 0 {
            0.0
        } else {
            1.0 - distinct as f64 / entries as f64
        }
    };
    let (mut area, mut peak, mut prev) = (0f64, 0f64, None::<u64>);
    let start = all.first().map_or(0, |(at, ..)| *at);
    let mut series = Vec::new();
    let remove = |s: usize,
                  key: Key,
                  holders: &mut Fast<Key, Vec<u32>>,
                  entries: &mut u64,
                  distinct: &mut u64| {
        if let Some(h) = holders.get_mut(&key) {
            h.retain(|x| *x as usize != s);
            *entries -= 1;
            if h.is_empty() {
                holders.remove(&key);
                *distinct -= 1;
            }
        }
    };
    for (at, r, e) in all {
        let Some(&s) = source_of.get(&(r, e.rank)) else {
            continue;
        };
        if let Some(p) = prev {
            area += share(entries, distinct) * at.saturating_sub(p) as f64;
        }
        prev = Some(at);
        match e.change {
            Change::Stored => {
                ever.insert(e.key, ());
                if held[s].insert(e.key, ()).is_none() {
                    let h = holders.entry(e.key).or_default();
                    if h.is_empty() {
                        distinct += 1;
                    }
                    for &other in h.iter() {
                        let (a, b) = (s.min(other as usize), s.max(other as usize));
                        pairs[a * n + b] += 1;
                    }
                    h.push(s as u32);
                    entries += 1;
                }
            }
            Change::Evicted => {
                if held[s].remove(&e.key).is_some() {
                    remove(s, e.key, &mut holders, &mut entries, &mut distinct);
                }
            }
            Change::Cleared => {
                for (key, ()) in std::mem::take(&mut held[s]) {
                    remove(s, key, &mut holders, &mut entries, &mut distinct);
                }
            }
        }
        let now = share(entries, distinct);
        peak = peak.max(now);
        let t = at.saturating_sub(start) as f64 / 1e6;
        if series
            .last()
            .is_none_or(|(last, _): &(f64, f64)| t - last >= 0.1)
        {
            series.push((t, now));
        }
    }
    let span = prev.map_or(0, |p| p.saturating_sub(start));
    let mut shared_pairs: Vec<(String, String, u64)> = (0..n)
        .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
        .filter(|&(a, b)| pairs[a * n + b] > 0)
        .map(|(a, b)| (names[a].clone(), names[b].clone(), pairs[a * n + b]))
        .collect();
    shared_pairs.sort_by(|x, y| y.2.cmp(&x.2).then_with(|| (&x.0, &x.1).cmp(&(&y.0, &y.1))));
    shared_pairs.truncate(5);
    Fleet {
        replicas: replicas.len(),
        sources: n,
        distinct_prefixes: ever.len() as u64,
        pairs_end: entries,
        duplication_end: share(entries, distinct),
        duplication_mean: if span > 0 {
            area / span as f64
        } else {
            share(entries, distinct)
        },
        duplication_peak: peak,
        shared_pairs,
        duplication_series: series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(at_ms: u64, rank: u32, change: Change, key: u64) -> Event {
        Event {
            at_us: at_ms * 1000,
            rank,
            change,
            key: (key, 0),
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentiles(&mut v), Some([50, 90, 99]));
        assert_eq!(percentiles(&mut [7]), Some([7, 7, 7]));
        assert_eq!(percentiles(&mut []), None);
    }

    /// Two ranks of one replica: a clear on one leaves the other's blocks, an eviction on one
    /// leaves the other's copy (the index keeps a source a rank; one set a replica did not).
    #[test]
    fn a_replica_counts_its_ranks_apart() {
        use Change::*;
        let events = [
            event(0, 0, Stored, 1),
            event(0, 1, Stored, 1),
            event(0, 1, Stored, 2),
            event(1000, 0, Evicted, 1),
            event(2000, 1, Cleared, 0),
            event(3000, 0, Stored, 3),
        ];
        let f = Figures::of(&events, 0);
        assert_eq!(f.peak, 3);
        assert_eq!(f.end, 1);
        // (0, 1) stayed 1 s; rank 1's entries went in the clear, not evicted.
        assert_eq!(f.residency, vec![1_000_000]);
        // Time-weighted: 3 for 1 s, 2 for 1 s, 0 for 1 s.
        assert!((f.mean - 5.0 / 3.0).abs() < 1e-9, "{}", f.mean);
    }

    /// The fleet counts (prefix, source) pairs as the index does: two ranks of one replica
    /// holding a prefix are duplication; a clear of one rank removes only its pairs.
    #[test]
    fn the_fleet_counts_pairs_per_source_as_the_index_does() {
        use Change::*;
        let a = vec![
            event(0, 0, Stored, 1),
            event(0, 1, Stored, 1),
            event(0, 1, Stored, 2),
        ];
        let b = vec![event(500, 0, Stored, 1), event(1000, 0, Cleared, 0)];
        let replicas = [("a".to_owned(), vec![0, 1]), ("b".to_owned(), vec![0])];
        let f = fleet(&replicas, vec![a, b]);
        assert_eq!(f.sources, 3);
        assert_eq!(f.distinct_prefixes, 2);
        // At the end: a#0 and a#1 hold 1, a#1 holds 2: 3 pairs of 2 prefixes.
        assert_eq!(f.pairs_end, 3);
        assert!((f.duplication_end - (1.0 - 2.0 / 3.0)).abs() < 1e-9);
        // Between 0.5 s and 1 s, 4 pairs of 2 prefixes: the peak.
        assert!((f.duplication_peak - 0.5).abs() < 1e-9);
        assert_eq!(
            f.shared_pairs,
            vec![
                ("a#0".to_owned(), "a#1".to_owned(), 1),
                ("a#0".to_owned(), "b".to_owned(), 1),
                ("a#1".to_owned(), "b".to_owned(), 1),
            ]
        );
    }

    #[test]
    fn a_batch_ts_is_a_wall_clock_only_when_it_looks_like_one() {
        assert_eq!(wall_clock_us(1_764_000_000.5), Some(1_764_000_000_500_000));
        assert_eq!(wall_clock_us(1.0), None);
        assert_eq!(wall_clock_us(f64::NAN), None);
    }
}
