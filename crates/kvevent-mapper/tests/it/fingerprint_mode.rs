//! Fingerprint key mode: chains across events, removals resolved, clears, restarts, adapters.

use std::borrow::Cow;

use kvevent_fingerprint as fingerprint;
use kvevent_mapper::{KeyMode, Options};
use kvevent_proto as pb;
use kvevent_wire as wire;

use crate::{entries, events, mapper, removed, run, stored, tokens};

fn fp_options() -> Options {
    Options {
        key_mode: KeyMode::Fingerprint,
        ..Options::default()
    }
}

fn keys(chain: &[fingerprint::Block]) -> Vec<Vec<u8>> {
    chain
        .iter()
        .map(|b| fingerprint::wire_key(b.prefix).to_vec())
        .collect()
}

#[test]
fn a_chain_continues_across_events_like_one_prompt() {
    let prompt = tokens(100..164); // 4 blocks of 16
    let whole = fingerprint::chain(&prompt, 16, None);
    let mut m = mapper(fp_options());
    let a = run(
        &mut m,
        vec![stored(&[11, 12], None, prompt[..32].to_vec(), 16)],
    );
    let b = run(
        &mut m,
        vec![stored(&[13, 14], Some(12), prompt[32..].to_vec(), 16)],
    );
    let got: Vec<_> = entries(&a).into_iter().chain(entries(&b)).collect();
    assert_eq!(
        got.iter().map(|e| e.0.clone()).collect::<Vec<_>>(),
        keys(&whole)
    );
    assert_eq!(
        got.iter().map(|e| e.1).collect::<Vec<_>>(),
        vec![16, 32, 48, 64]
    );
}

#[test]
fn mappers_sharing_a_thread_key_each_store_as_if_alone() {
    // A store's scratch buffers are shared by every mapper on a thread: interleaved stores,
    // one long enough to outgrow what the buffers keep, must not see each other's tokens.
    let long = tokens(0..8192); // 512 blocks of 16
    let a1 = tokens(100..132);
    let a2 = tokens(132..164);
    let b1 = tokens(900..916);
    let long_hashes: Vec<u64> = (1000..1512).collect();
    let mut a = mapper(fp_options());
    let mut b = mapper(fp_options());
    let got_a1 = entries(&run(&mut a, vec![stored(&[1, 2], None, a1.clone(), 16)]));
    let got_long = entries(&run(
        &mut b,
        vec![stored(&long_hashes, None, long.clone(), 16)],
    ));
    let got_b1 = entries(&run(&mut b, vec![stored(&[3], None, b1.clone(), 16)]));
    let got_a2 = entries(&run(&mut a, vec![stored(&[4, 5], Some(2), a2.clone(), 16)]));

    let key_list =
        |e: &[(Vec<u8>, i32, i32, String)]| e.iter().map(|e| e.0.clone()).collect::<Vec<_>>();
    let whole_a: Vec<u32> = a1.iter().chain(&a2).copied().collect();
    let expect_a = keys(&fingerprint::chain(&whole_a, 16, None));
    assert_eq!(key_list(&got_a1), expect_a[..2]);
    assert_eq!(key_list(&got_a2), expect_a[2..]);
    assert_eq!(
        key_list(&got_long),
        keys(&fingerprint::chain(&long, 16, None))
    );
    assert_eq!(key_list(&got_b1), keys(&fingerprint::chain(&b1, 16, None)));
}

#[test]
fn removals_resolve_to_the_reported_fingerprint_and_unknown_ones_are_skipped() {
    let prompt = tokens(0..32);
    let whole = fingerprint::chain(&prompt, 16, None);
    let mut m = mapper(fp_options());
    run(&mut m, vec![stored(&[1, 2], None, prompt, 16)]);
    let out = run(&mut m, vec![removed(&[2, 99], "GPU")]);
    assert_eq!(
        events(&out),
        vec![(
            pb::cache_event::Type::PrefixEvicted as i32,
            keys(&whole)[1].clone(),
            String::new()
        )]
    );
    assert_eq!(m.stats().unknown_removals, 1);
    // Removed once, forgotten: a second removal is unknown.
    run(&mut m, vec![removed(&[2], "GPU")]);
    assert_eq!(m.stats().unknown_removals, 2);
}

#[test]
fn an_unknown_parent_starts_a_new_chain_and_is_counted() {
    let mut m = mapper(fp_options());
    let out = run(&mut m, vec![stored(&[5], Some(4), tokens(16..32), 16)]);
    assert_eq!(
        entries(&out)[0].0,
        keys(&fingerprint::chain(&tokens(16..32), 16, None))[0]
    );
    assert_eq!(m.stats().unknown_parents, 1);
}

#[test]
fn clears_and_restarts_empty_the_chain_map() {
    let mut m = mapper(fp_options());
    run(&mut m, vec![stored(&[1], None, tokens(0..16), 16)]);
    assert_eq!(m.tracked_blocks(), 1);
    let reset = m.reset(0);
    assert!(
        matches!(reset, pb::Report::Event(ref e) if e.r#type == pb::cache_event::Type::AllCleared as i32)
    );
    assert_eq!(m.tracked_blocks(), 0);
    // After a restart the engine's hash 1 is unknown: its child starts a new chain.
    run(&mut m, vec![stored(&[2], Some(1), tokens(16..32), 16)]);
    assert_eq!(m.stats().unknown_parents, 1);
}

#[test]
fn blocks_the_tokens_do_not_cover_are_never_keyed_nor_their_children() {
    let mut m = mapper(fp_options());
    // Sliding window: 3 hashes but tokens for 2 blocks.
    let out = run(&mut m, vec![stored(&[1, 2, 3], None, tokens(0..32), 16)]);
    assert!(entries(&out).is_empty());
    assert_eq!(m.stats().unkeyable_blocks, 3);
    // A child of an unkeyable block cannot be keyed either (its prefix is unknown).
    let out = run(&mut m, vec![stored(&[4], Some(3), tokens(48..64), 16)]);
    assert!(entries(&out).is_empty());
    assert_eq!(m.stats().unkeyable_blocks, 4);
    // Their removal is skipped, not sent under a wrong key.
    let out = run(&mut m, vec![removed(&[3, 4], "GPU")]);
    assert!(events(&out).is_empty());
    assert_eq!(m.tracked_blocks(), 2);
}

#[test]
fn adapters_partition_the_same_tokens() {
    let mut m = mapper(fp_options());
    let mut a = stored(&[1], None, tokens(0..16), 16);
    let mut b = stored(&[2], None, tokens(0..16), 16);
    for (e, name) in [(&mut a, "sql"), (&mut b, "chat")] {
        if let wire::Event::BlockStored(s) = e {
            s.lora_name = Some(Cow::Borrowed(name));
        }
    }
    let out = entries(&run(&mut m, vec![a, b]));
    assert_eq!(out[0].0, out[1].0, "same content, same fingerprint");
    assert_eq!((out[0].3.as_str(), out[1].3.as_str()), ("sql", "chat"));
    let ev = events(&run(&mut m, vec![removed(&[2], "GPU")]));
    assert_eq!(ev[0].2, "chat");
}

#[test]
fn the_chain_map_is_bounded() {
    let options = Options {
        max_tracked_blocks: 1,
        ..fp_options()
    };
    let mut m = mapper(options);
    run(&mut m, vec![stored(&[1, 2], None, tokens(0..32), 16)]);
    assert_eq!((m.tracked_blocks(), m.stats().map_refusals), (1, 1));
}

fn sglang_vector(case: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../testdata/vectors")
            .join(case),
    )
    .expect("vector")
}

#[test]
fn sglang_eagle_pairs_are_keyed_by_the_tokens_they_stand_for() {
    let payload = sglang_vector("sglang-0.5.3/eagle.msgpack");
    let batch = wire::decode_engine(&payload, wire::Engine::Sglang, &wire::Limits::DEFAULT)
        .expect("decode");
    let mut m = mapper(fp_options());
    let mut out = Vec::new();
    m.map_batch(&batch, &mut out);
    // Pairs [500,501] … [503,504] then [504,505] … : blocks of 4 pairs stand for tokens
    // 500..504 and 504..508, the chain a router computes from the prompt's token ids.
    let want = keys(&fingerprint::chain(&tokens(500..508), 4, None));
    let got: Vec<Vec<u8>> = entries(&out).into_iter().map(|e| e.0).collect();
    assert_eq!(got, want);
    let evicted = out
        .iter()
        .filter_map(pb::Report::as_event)
        .filter(|e| e.r#type == pb::cache_event::Type::PrefixEvicted as i32)
        .count();
    assert_eq!(evicted, 2, "the removals resolve to the same keys");
}

#[test]
fn a_salted_sglang_store_is_a_namespace_of_its_own() {
    let payload = sglang_vector("sglang-0.5.18/cache_salt.msgpack");
    let batch = wire::decode_engine(&payload, wire::Engine::Sglang, &wire::Limits::DEFAULT)
        .expect("decode");
    let mut m = mapper(fp_options());
    let mut out = Vec::new();
    m.map_batch(&batch, &mut out);
    let adapters: std::collections::BTreeSet<String> =
        entries(&out).into_iter().map(|e| e.3).collect();
    assert_eq!(
        adapters,
        [
            "".to_owned(),
            kvevent_mapper::salted_adapter("", "tenant-a")
        ]
        .into_iter()
        .collect(),
        "unsalted under the base model, salted under its own name"
    );
}

#[test]
fn an_sglang_short_last_page_is_reported_and_counted() {
    let payload = sglang_vector("sglang-0.5.23/partial_page.msgpack");
    let batch = wire::decode_engine(&payload, wire::Engine::Sglang, &wire::Limits::DEFAULT)
        .expect("decode");
    let sizes: Vec<u32> = batch
        .events
        .iter()
        .filter_map(|e| match e {
            wire::Event::BlockStored(s) => Some(s.block_size),
            _ => None,
        })
        .collect();
    let mut m = mapper(fp_options());
    let mut out = Vec::new();
    m.map_batch(&batch, &mut out);
    let short = sizes
        .iter()
        .enumerate()
        .filter(|(i, s)| sizes[..*i].iter().any(|before| before > s))
        .count() as u64;
    assert!(short > 0, "the vector has a short last page: {sizes:?}");
    assert_eq!(m.stats().short_blocks, short);
    assert_eq!(m.stats().unkeyable_blocks, 0, "keyed over its own tokens");
}
