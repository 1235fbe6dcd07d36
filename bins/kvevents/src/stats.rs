//! `kvevents stats`: what the cache of a replica, and of a fleet, did over a recording. Keys are
//! fingerprints of token ids (as `--key-mode fingerprint` makes them), so replicas compare.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use kvevent_mapper::{Identity, KeyMode, Mapper, Options, Sink, Tier};
use kvevent_recording::Reader;
use kvevent_wire as wire;
use serde::Serialize;

#[derive(clap::Args)]
pub(crate) struct StatsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also draw resident blocks (per replica) and the fleet's duplication share over time,
    /// as SVG, here.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Recordings, one per replica (`kvevents record`); together they are the fleet.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

/// Fingerprints are hashes already: a key hashes to itself, mixed once.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
}

type Fast<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// A prefix across the fleet: its fingerprint and its adapter (interned).
type Key = (u64, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Stored,
    Evicted,
    Cleared,
}

/// One change to a replica's resident set, at an absolute time (µs since the Unix epoch).
#[derive(Debug, Clone, Copy)]
struct Event {
    at_us: u64,
    change: Change,
    key: Key,
}

/// The mapper's output, as changes to the resident set.
struct Collect<'a> {
    at_us: u64,
    adapters: &'a mut HashMap<Arc<str>, u32>,
    events: &'a mut Vec<Event>,
    depths: &'a mut Vec<u32>,
    block_size: u32,
}

impl Collect<'_> {
    fn key(&mut self, key: &[u8], adapter: &Arc<str>) -> Key {
        let n = self.adapters.len() as u32;
        let a = *self.adapters.entry(adapter.clone()).or_insert(n);
        let mut b = [0u8; 8];
        let k = &key[..key.len().min(8)];
        b[8 - k.len()..].copy_from_slice(k);
        (u64::from_be_bytes(b), a)
    }
}

impl Sink for Collect<'_> {
    fn prefix(&mut self, key: &[u8], tokens: u32, _: Tier, adapter: &Arc<str>, new: bool) {
        let key = self.key(key, adapter);
        if new && self.block_size > 0 {
            self.depths.push(tokens.div_ceil(self.block_size));
        }
        self.events.push(Event {
            at_us: self.at_us,
            change: Change::Stored,
            key,
        });
    }
    fn end_update(&mut self, _: i64) {}
    fn evicted(&mut self, key: &[u8], adapter: &Arc<str>, _: i64) {
        let key = self.key(key, adapter);
        self.events.push(Event {
            at_us: self.at_us,
            change: Change::Evicted,
            key,
        });
    }
    fn cleared(&mut self, _: i64) {
        self.events.push(Event {
            at_us: self.at_us,
            change: Change::Cleared,
            key: (0, 0),
        });
    }
}

/// p50, p90, p99 of `values` (sorted here), nearest rank: the smallest value with at least
/// that share of the values at or below it.
fn percentiles(values: &mut [u64]) -> Option<[u64; 3]> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let n = values.len();
    let at = |p: f64| values[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    Some([at(0.5), at(0.9), at(0.99)])
}

/// What one replica's cache did.
#[derive(Debug, Serialize)]
pub(crate) struct Replica {
    name: String,
    engine: String,
    duration_s: f64,
    batches: u64,
    stored_per_s: f64,
    removed_per_s: f64,
    cleared_per_s: f64,
    resident_peak: u64,
    resident_mean: f64,
    /// Seconds a block was resident before its eviction (clears not counted): p50, p90, p99.
    residency_s: Option<[f64; 3]>,
    /// Stores of a prefix this replica had evicted before, as a share of its stores.
    restore_share: f64,
    /// Median seconds from an eviction to the prefix's next store.
    restore_gap_p50_s: Option<f64>,
    /// Blocks from the start of the prompt to a stored block: p50, p90, max.
    depth_blocks: Option<[u64; 3]>,
    #[serde(skip)]
    resident_series: Vec<(f64, u64)>,
}

/// The fleet's figures.
#[derive(Debug, Serialize)]
pub(crate) struct Fleet {
    replicas: usize,
    distinct_prefixes: u64,
    /// The share of resident entries whose prefix another replica also holds, now (at the end),
    /// at its mean over time and at its peak: 1 − distinct resident prefixes ÷ resident
    /// entries.
    duplication_end: f64,
    duplication_mean: f64,
    duplication_peak: f64,
    /// The pairs of replicas that most often stored a prefix the other held, with how often.
    shared_pairs: Vec<(String, String, u64)>,
    #[serde(skip)]
    duplication_series: Vec<(f64, f64)>,
}

#[derive(Debug, Serialize)]
struct Report {
    replicas: Vec<Replica>,
    fleet: Fleet,
}

/// One recording, read and mapped: the replica's figures and its changes for the fleet.
fn replica(
    path: &PathBuf,
    adapters: &mut HashMap<Arc<str>, u32>,
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
    let mut mappers: HashMap<u32, Mapper> = HashMap::new();
    let mut events = Vec::new();
    let mut depths = Vec::new();
    let (mut batches, mut stored, mut removed, mut cleared) = (0u64, 0u64, 0u64, 0u64);
    let (mut first, mut last) = (None, 0u64);
    let mut block_size = 0u32;
    while let Some(r) = reader
        .next_record()
        .with_context(|| path.display().to_string())?
    {
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
        first.get_or_insert(r.at_us);
        last = r.at_us;
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
        let mut sink = Collect {
            at_us: base_us + r.at_us,
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
    let duration_s = first.map_or(0.0, |f| (last - f) as f64 / 1e6);
    let per_s = |n: u64| {
        if duration_s > 0.0 {
            n as f64 / duration_s
        } else {
            0.0
        }
    };
    // The resident set over time, residencies and re-stores.
    let mut resident: Fast<Key, u64> = Fast::default();
    let mut evicted_at: Fast<Key, u64> = Fast::default();
    let mut residency = Vec::new();
    let mut gaps = Vec::new();
    let (mut new_stores, mut restores) = (0u64, 0u64);
    let (mut peak, mut area, mut prev_at) = (0u64, 0f64, None::<u64>);
    let mut series = Vec::new();
    for e in &events {
        if let Some(p) = prev_at {
            area += resident.len() as f64 * (e.at_us - p) as f64;
        }
        prev_at = Some(e.at_us);
        match e.change {
            Change::Stored => {
                if let std::collections::hash_map::Entry::Vacant(v) = resident.entry(e.key) {
                    v.insert(e.at_us);
                    new_stores += 1;
                    if let Some(at) = evicted_at.remove(&e.key) {
                        restores += 1;
                        gaps.push(e.at_us - at);
                    }
                }
            }
            Change::Evicted => {
                if let Some(at) = resident.remove(&e.key) {
                    residency.push(e.at_us - at);
                    evicted_at.insert(e.key, e.at_us);
                }
            }
            Change::Cleared => resident.clear(),
        }
        peak = peak.max(resident.len() as u64);
        if series
            .last()
            .is_none_or(|(t, _): &(f64, u64)| (e.at_us - base_us) as f64 / 1e6 - t >= 0.1)
        {
            series.push(((e.at_us - base_us) as f64 / 1e6, resident.len() as u64));
        }
    }
    let span = events
        .first()
        .zip(events.last())
        .map_or(0, |(a, b)| b.at_us - a.at_us);
    let to_s = |v: [u64; 3]| v.map(|x| x as f64 / 1e6);
    let mut depths: Vec<u64> = depths.into_iter().map(u64::from).collect();
    let depth =
        percentiles(&mut depths).map(|[p50, p90, _]| [p50, p90, *depths.last().unwrap_or(&0)]);
    Ok((
        Replica {
            name,
            engine: reader.header().engine.clone(),
            duration_s,
            batches,
            stored_per_s: per_s(stored),
            removed_per_s: per_s(removed),
            cleared_per_s: per_s(cleared),
            resident_peak: peak,
            resident_mean: if span > 0 {
                area / span as f64
            } else {
                resident.len() as f64
            },
            residency_s: percentiles(&mut residency).map(to_s),
            restore_share: if new_stores > 0 {
                restores as f64 / new_stores as f64
            } else {
                0.0
            },
            restore_gap_p50_s: percentiles(&mut gaps).map(|p| p[0] as f64 / 1e6),
            depth_blocks: depth,
            resident_series: series,
        },
        events,
    ))
}

/// The fleet: every replica's changes in time order, holders counted per prefix.
fn fleet(names: &[String], per_replica: Vec<Vec<Event>>) -> Fleet {
    let mut all: Vec<(u64, usize, Event)> = per_replica
        .into_iter()
        .enumerate()
        .flat_map(|(r, events)| events.into_iter().map(move |e| (e.at_us, r, e)))
        .collect();
    all.sort_by_key(|(at, r, _)| (*at, *r));
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
    let remove = |r: usize,
                  key: Key,
                  holders: &mut Fast<Key, Vec<u32>>,
                  entries: &mut u64,
                  distinct: &mut u64| {
        if let Some(h) = holders.get_mut(&key) {
            h.retain(|x| *x as usize != r);
            *entries -= 1;
            if h.is_empty() {
                holders.remove(&key);
                *distinct -= 1;
            }
        }
    };
    for (at, r, e) in all {
        if let Some(p) = prev {
            area += share(entries, distinct) * (at - p) as f64;
        }
        prev = Some(at);
        match e.change {
            Change::Stored => {
                ever.insert(e.key, ());
                if held[r].insert(e.key, ()).is_none() {
                    let h = holders.entry(e.key).or_default();
                    if h.is_empty() {
                        distinct += 1;
                    }
                    for &other in h.iter() {
                        let (a, b) = (r.min(other as usize), r.max(other as usize));
                        pairs[a * n + b] += 1;
                    }
                    h.push(r as u32);
                    entries += 1;
                }
            }
            Change::Evicted => {
                if held[r].remove(&e.key).is_some() {
                    remove(r, e.key, &mut holders, &mut entries, &mut distinct);
                }
            }
            Change::Cleared => {
                for (key, ()) in std::mem::take(&mut held[r]) {
                    remove(r, key, &mut holders, &mut entries, &mut distinct);
                }
            }
        }
        let now = share(entries, distinct);
        peak = peak.max(now);
        let t = (at - start) as f64 / 1e6;
        if series
            .last()
            .is_none_or(|(last, _): &(f64, f64)| t - last >= 0.1)
        {
            series.push((t, now));
        }
    }
    let span = prev.map_or(0, |p| p - start);
    let mut shared_pairs: Vec<(String, String, u64)> = (0..n)
        .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
        .filter(|&(a, b)| pairs[a * n + b] > 0)
        .map(|(a, b)| (names[a].clone(), names[b].clone(), pairs[a * n + b]))
        .collect();
    shared_pairs.sort_by(|x, y| y.2.cmp(&x.2).then_with(|| (&x.0, &x.1).cmp(&(&y.0, &y.1))));
    shared_pairs.truncate(5);
    Fleet {
        replicas: n,
        distinct_prefixes: ever.len() as u64,
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

pub(crate) fn stats(args: StatsArgs) -> anyhow::Result<()> {
    let mut adapters = HashMap::new();
    let mut replicas = Vec::new();
    let mut events = Vec::new();
    let started = std::time::Instant::now();
    let mut blocks = 0u64;
    for path in &args.files {
        let (r, e) = replica(path, &mut adapters)?;
        blocks += e.len() as u64;
        replicas.push(r);
        events.push(e);
    }
    let names: Vec<String> = replicas.iter().map(|r| r.name.clone()).collect();
    let fleet = fleet(&names, events);
    let took = started.elapsed().as_secs_f64();
    if let Some(path) = &args.svg {
        std::fs::write(path, svg(&replicas, &fleet))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let report = Report { replicas, fleet };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
    }
    eprintln!(
        "kvevents: {blocks} block changes in {took:.2} s ({:.1} M a second)",
        blocks as f64 / took.max(1e-9) / 1e6
    );
    Ok(())
}

fn table(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut t = String::new();
    let s3 = |v: Option<[f64; 3]>| {
        v.map_or("-".to_owned(), |[a, b, c]| {
            format!("p50 {a:.2} s  p90 {b:.2} s  p99 {c:.2} s")
        })
    };
    for r in &report.replicas {
        let _ = writeln!(
            t,
            "replica {} ({}): {:.1} s, {} batches",
            r.name, r.engine, r.duration_s, r.batches
        );
        let _ = writeln!(
            t,
            "  blocks a second     stored {:.1}  removed {:.1}  clears {:.3}",
            r.stored_per_s, r.removed_per_s, r.cleared_per_s
        );
        let _ = writeln!(
            t,
            "  resident blocks     peak {}  mean {:.1}",
            r.resident_peak, r.resident_mean
        );
        let _ = writeln!(t, "  residency, evicted  {}", s3(r.residency_s));
        let _ = writeln!(
            t,
            "  re-stores           {:.1} % of stores, median gap {}",
            r.restore_share * 100.0,
            r.restore_gap_p50_s
                .map_or("-".to_owned(), |g| format!("{g:.2} s"))
        );
        let _ = writeln!(
            t,
            "  prefix depth        {}",
            r.depth_blocks.map_or("-".to_owned(), |[a, b, c]| format!(
                "p50 {a}  p90 {b}  max {c} blocks"
            ))
        );
    }
    let f = &report.fleet;
    let _ = writeln!(
        t,
        "fleet ({} replicas): {} distinct prefixes; duplication at the end {:.1} %, mean {:.1} %, peak {:.1} %",
        f.replicas,
        f.distinct_prefixes,
        f.duplication_end * 100.0,
        f.duplication_mean * 100.0,
        f.duplication_peak * 100.0
    );
    for (a, b, n) in &f.shared_pairs {
        let _ = writeln!(t, "  {a} and {b}: {n} stores of a prefix the other held");
    }
    t
}

/// Resident blocks per replica (left axis) and the fleet's duplication share (right axis, in
/// %) over time: plain SVG polylines, nothing to install to look at them.
fn svg(replicas: &[Replica], fleet: &Fleet) -> String {
    use std::fmt::Write as _;
    let (w, h, m) = (900.0, 400.0, 50.0);
    let t_max = replicas
        .iter()
        .flat_map(|r| r.resident_series.last().map(|p| p.0))
        .chain(fleet.duplication_series.last().map(|p| p.0))
        .fold(1e-9f64, f64::max);
    let y_max = replicas
        .iter()
        .map(|r| r.resident_peak)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let x = |t: f64| m + t / t_max * (w - 2.0 * m);
    let y = |v: f64, max: f64| h - m - v / max * (h - 2.0 * m);
    const COLOURS: [&str; 6] = [
        "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f",
    ];
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<line x1="{m}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        h - m,
        w - m,
        h - m
    );
    let _ = writeln!(
        s,
        r#"<line x1="{m}" y1="{m}" x2="{m}" y2="{}" stroke="black"/>"#,
        h - m
    );
    let _ = writeln!(
        s,
        r#"<text x="{m}" y="{}">resident blocks (peak {})</text>"#,
        m - 10.0,
        y_max
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="end" fill="#d62728">duplication % (peak {:.1})</text>"##,
        w - m,
        m - 10.0,
        fleet.duplication_peak * 100.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">{t_max:.1} s</text>"#,
        w - m,
        h - m + 20.0
    );
    for (i, r) in replicas.iter().enumerate() {
        let points: String = r
            .resident_series
            .iter()
            .map(|(t, v)| format!("{:.1},{:.1} ", x(*t), y(*v as f64, y_max)))
            .collect();
        let c = COLOURS[i % COLOURS.len()];
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" points="{points}"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" fill="{c}">{}</text>"#,
            m + 10.0,
            m + 15.0 * (i as f64 + 1.0),
            r.name
        );
    }
    let points: String = fleet
        .duplication_series
        .iter()
        .map(|(t, v)| format!("{:.1},{:.1} ", x(*t), y(*v, 1.0)))
        .collect();
    let _ = writeln!(
        s,
        r##"<polyline fill="none" stroke="#d62728" stroke-dasharray="4 2" points="{points}"/>"##
    );
    s.push_str("</svg>\n");
    s
}
