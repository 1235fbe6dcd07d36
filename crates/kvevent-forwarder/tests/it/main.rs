//! The forwarder against a real tonic server on loopback.

use std::time::Duration;

use kvevent_forwarder::{self as fwd, DropReason, Submit};
use kvevent_proto as pb;
use kvevent_test_support::{
    Behaviour, Received, RecordingServer, distinct_prefixes, eventually, when,
};

mod flow;
mod outages;
mod windows;

const WAIT: Duration = Duration::from_secs(10);

fn update(keys: &[u8], tier: pb::CacheTier) -> pb::Report {
    pb::Report::Update(pb::CacheStateUpdate {
        replica_id: "r1".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        timestamp_us: 1,
        prefixes: keys
            .iter()
            .map(|k| pb::PrefixEntry {
                prefix_hash: vec![*k],
                token_count: 16,
                tier: tier as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    })
}

fn adds(keys: &[u8]) -> pb::Report {
    update(keys, pb::CacheTier::T1)
}

/// Adds the server cannot hold yet (their first report).
fn new_adds(keys: &[u8]) -> pb::Report {
    match update(keys, pb::CacheTier::T1) {
        pb::Report::Update(u) => pb::Report::New(u),
        other => other,
    }
}

fn event(kind: pb::cache_event::Type, key: &[u8]) -> pb::Report {
    pb::Report::Event(pb::CacheEvent {
        r#type: kind as i32,
        replica_id: "r1".into(),
        model_id: "m".into(),
        prefix_hash: key.to_vec(),
        ..Default::default()
    })
}

fn evict(key: u8) -> pb::Report {
    event(pb::cache_event::Type::PrefixEvicted, &[key])
}

fn clear() -> pb::Report {
    event(pb::cache_event::Type::AllCleared, &[])
}

fn config(window_ms: u64) -> fwd::Config {
    fwd::Config {
        window: Duration::from_millis(window_ms),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..fwd::Config::default()
    }
}

fn client(server: &RecordingServer, rpc_timeout_ms: u64) -> fwd::Client {
    let mut cfg = fwd::ClientConfig::new(server.addr().to_string());
    cfg.rpc_timeout = Duration::from_millis(rpc_timeout_ms);
    cfg.connect_timeout = Duration::from_millis(500);
    fwd::connect(&cfg).expect("client")
}

/// A compact view of what the server received: `U[keys]`, `E<key>`, `C`.
fn trace(server: &RecordingServer) -> Vec<String> {
    server
        .received()
        .into_iter()
        .map(|r| match r {
            Received::Update(u) => format!(
                "U{:?}",
                u.prefixes
                    .iter()
                    .map(|p| p.prefix_hash[0])
                    .collect::<Vec<_>>()
            ),
            Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32 => {
                "C".into()
            }
            Received::Event(e) => format!("E{}", e.prefix_hash[0]),
        })
        .collect()
}

fn submit(h: &fwd::Handle, r: pb::Report) {
    assert_eq!(h.try_submit(r), Submit::Queued);
}

#[test]
fn status_codes_are_classified_in_one_place() {
    use fwd::Retry;
    for code in [
        tonic::Code::Unavailable,
        tonic::Code::DeadlineExceeded,
        tonic::Code::ResourceExhausted,
    ] {
        assert_eq!(
            fwd::classify(&tonic::Status::new(code, "")),
            Retry::Retry,
            "{code:?}"
        );
    }
    for code in [
        tonic::Code::InvalidArgument,
        tonic::Code::Unimplemented,
        tonic::Code::NotFound,
    ] {
        assert_eq!(
            fwd::classify(&tonic::Status::new(code, "")),
            Retry::GiveUp,
            "{code:?}"
        );
    }
}
