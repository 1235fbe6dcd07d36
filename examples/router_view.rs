//! A router-style consumer: keeps its own view of which replica (source) holds which block,
//! straight from the engines' KV events, with no gRPC in between.
//!
//! ```sh
//! cargo run -p kvevent-examples --example router_view                 # self-contained demo
//! cargo run -p kvevent-examples --example router_view -- tcp://10.0.0.7:5557 tcp://10.0.0.7:5558
//! ```
//!
//! With no arguments it starts two in-process fake engines (two replicas) and a scripted
//! workload; with `ENDPOINT [REPLAY_ENDPOINT]` it follows a real engine until Ctrl-C.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvevent_source::{Config, Subscriber, Update};
use kvevent_wire::{self as wire, Release};
use kvevent_zmq::{Source, publisher};

/// The router's view: per replica, the blocks it holds (engine hash bytes).
#[derive(Default)]
struct View {
    blocks: HashMap<usize, HashSet<Vec<u8>>>,
}

impl View {
    fn apply(&mut self, update: &Update) -> anyhow::Result<()> {
        match update {
            Update::Reset { source, reason } => {
                println!("replica {source}: reset ({})", reason.as_str());
                self.blocks.remove(source);
            }
            Update::Batch(batch) => {
                let held = self.blocks.entry(batch.source).or_default();
                for event in batch.decode()?.events {
                    match event {
                        wire::Event::BlockStored(e) => {
                            held.extend(e.block_hashes.iter().map(|h| h.to_bytes().into_owned()));
                        }
                        wire::Event::BlockRemoved(e) => {
                            for h in &e.block_hashes {
                                held.remove(&*h.to_bytes());
                            }
                        }
                        wire::Event::AllBlocksCleared(_) => held.clear(),
                    }
                }
            }
        }
        Ok(())
    }

    /// Which replicas hold this block.
    fn holders(&self, hash: u64) -> Vec<usize> {
        let key = hash.to_be_bytes().to_vec();
        let mut v: Vec<usize> = self
            .blocks
            .iter()
            .filter(|(_, held)| held.contains(&key))
            .map(|(r, _)| *r)
            .collect();
        v.sort_unstable();
        v
    }
}

fn stored(hashes: &[u64]) -> wire::Event<'static> {
    wire::Event::BlockStored(wire::BlockStored {
        block_hashes: hashes
            .iter()
            .map(|h| wire::BlockHash::Int(wire::Int::U64(*h)))
            .collect(),
        token_ids: (0..16 * hashes.len() as u32).collect::<Vec<_>>().into(),
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    })
}

fn removed(hashes: &[u64]) -> wire::Event<'static> {
    wire::Event::BlockRemoved(wire::BlockRemoved {
        block_hashes: hashes
            .iter()
            .map(|h| wire::BlockHash::Int(wire::Int::U64(*h)))
            .collect(),
        medium: Some("GPU".into()),
        ..Default::default()
    })
}

fn batch(events: Vec<wire::Event<'static>>) -> wire::EventBatch<'static> {
    wire::EventBatch {
        ts: 1.0,
        events,
        data_parallel_rank: Some(0),
        unknown_events: 0,
    }
}

fn demo() -> anyhow::Result<()> {
    let ctx = zmq::Context::new();
    let engines = [
        publisher::Publisher::start(
            &ctx,
            publisher::PublisherConfig::loopback(Release::NEWEST_KNOWN),
        )?,
        publisher::Publisher::start(
            &ctx,
            publisher::PublisherConfig::loopback(Release::new(0, 20, 0)),
        )?,
    ];
    let sources = engines
        .iter()
        .map(|e| Source {
            endpoint: e.endpoint().to_owned(),
            replay_endpoint: e.replay_endpoint().map(str::to_owned),
            topic: b"kv-events".to_vec(),
            bind: false,
            dp_rank: 0,
        })
        .collect();
    let mut subscriber = Subscriber::start(&ctx, Config::new(sources))?;
    for e in &engines {
        anyhow::ensure!(
            e.wait_for_subscribers(1, Duration::from_secs(10)),
            "no subscription"
        );
    }
    // Replica 0 caches prefix 1→2→3; replica 1 caches 1→2 and then evicts 2.
    engines[0].publish(&batch(vec![stored(&[1, 2, 3])]))?;
    engines[1].publish(&batch(vec![stored(&[1, 2])]))?;
    engines[1].publish(&batch(vec![removed(&[2])]))?;
    let mut view = View::default();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut batches = 0;
    while batches < 3 {
        anyhow::ensure!(Instant::now() < deadline, "the workload did not arrive");
        if let Some(update) = subscriber.next(Duration::from_millis(100)) {
            batches += usize::from(matches!(update, Update::Batch(_)));
            view.apply(&update)?;
        }
    }
    for block in [1, 2, 3] {
        println!("block {block}: held by replicas {:?}", view.holders(block));
    }
    anyhow::ensure!(
        view.holders(1) == [0, 1] && view.holders(2) == [0],
        "unexpected view"
    );
    subscriber.shutdown();
    Ok(())
}

fn follow(endpoint: String, replay: Option<String>) -> anyhow::Result<()> {
    let ctx = zmq::Context::new();
    let source = Source {
        endpoint,
        replay_endpoint: replay,
        topic: Vec::new(),
        bind: false,
        dp_rank: 0,
    };
    let mut subscriber = Subscriber::start(&ctx, Config::new(vec![source]))?;
    let mut view = View::default();
    let mut last_print = Instant::now();
    loop {
        if let Some(update) = subscriber.next(Duration::from_millis(500)) {
            view.apply(&update)?;
        }
        if last_print.elapsed() > Duration::from_secs(5) {
            let held = view.blocks.get(&0).map_or(0, HashSet::len);
            println!("replica 0 holds {held} blocks");
            last_print = Instant::now();
        }
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    match args.next() {
        None => demo(),
        Some(endpoint) => follow(endpoint, args.next()),
    }
}
