//! The mapper against the shared vectors and hand-built event sequences.

mod checkpoint;
mod engine_mode;
mod fingerprint_mode;
mod two_keys;
mod vectors;

use std::borrow::Cow;

use kvevent_mapper::{Identity, Mapper, Options};
use kvevent_proto as pb;
use kvevent_wire as wire;

pub(crate) fn identity() -> Identity {
    Identity::new("replica-1", "llama", "tenant-a", "vllm").expect("identity")
}

pub(crate) fn mapper(options: Options) -> Mapper {
    Mapper::new(identity(), options)
}

pub(crate) fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: Vec<u32>,
    bs: u32,
) -> wire::Event<'static> {
    wire::Event::BlockStored(wire::BlockStored {
        block_hashes: hashes
            .iter()
            .map(|h| wire::BlockHash::Int(wire::Int::U64(*h)))
            .collect(),
        parent_block_hash: parent.map(|p| wire::BlockHash::Int(wire::Int::U64(p))),
        token_ids: tokens.into(),
        block_size: bs,
        medium: Some(wire::Medium(Cow::Borrowed("GPU"))),
        ..Default::default()
    })
}

pub(crate) fn removed(hashes: &[u64], medium: &'static str) -> wire::Event<'static> {
    wire::Event::BlockRemoved(wire::BlockRemoved {
        block_hashes: hashes
            .iter()
            .map(|h| wire::BlockHash::Int(wire::Int::U64(*h)))
            .collect(),
        medium: Some(wire::Medium(Cow::Borrowed(medium))),
        ..Default::default()
    })
}

pub(crate) fn run(m: &mut Mapper, events: Vec<wire::Event<'static>>) -> Vec<pb::Report> {
    let batch = wire::EventBatch {
        ts: 2.5,
        events,
        data_parallel_rank: Some(0),
        unknown_events: 0,
    };
    let mut out = Vec::new();
    m.map_batch(&batch, &mut out);
    out
}

/// (key, token_count, tier, adapter) of every prefix entry in the reports.
pub(crate) fn entries(reports: &[pb::Report]) -> Vec<(Vec<u8>, i32, i32, String)> {
    reports
        .iter()
        .filter_map(pb::Report::as_update)
        .flat_map(|u| {
            u.prefixes.iter().map(|p| {
                (
                    p.prefix_hash.clone(),
                    p.token_count,
                    p.tier,
                    p.adapter_id.clone(),
                )
            })
        })
        .collect()
}

/// (type, key, adapter) of every event in the reports.
pub(crate) fn events(reports: &[pb::Report]) -> Vec<(i32, Vec<u8>, String)> {
    reports
        .iter()
        .filter_map(|r| match r {
            pb::Report::Event(e) => Some((e.r#type, e.prefix_hash.clone(), e.adapter_id.clone())),
            _ => None,
        })
        .collect()
}

pub(crate) fn be(h: u64) -> Vec<u8> {
    h.to_be_bytes().to_vec()
}

/// Every `*.msgpack` under `testdata/vectors/vllm-<release>/`, as (path, payload).
pub(crate) fn vector_payloads() -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/vectors");
    let mut out = Vec::new();
    for release in std::fs::read_dir(dir).expect("vectors") {
        let release = release.expect("entry").path();
        let vllm = release
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("vllm-"));
        if !release.is_dir() || !vllm {
            continue;
        }
        for file in std::fs::read_dir(&release).expect("release") {
            let path = file.expect("entry").path();
            if path.extension().is_some_and(|e| e == "msgpack") {
                let payload = std::fs::read(&path).expect("read");
                out.push((path, payload));
            }
        }
    }
    out
}

pub(crate) fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}
