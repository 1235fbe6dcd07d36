//! The messages encode with the contract's field numbers and types.

use kvevent_proto as pb;
use prost::Message;

#[test]
fn field_numbers_and_types_match_the_contract() {
    // CacheStateUpdate: replica_id=1 (string), timestamp_us=5 (int64), prefixes=6, adapter_id=8.
    let update = pb::CacheStateUpdate {
        replica_id: "r".into(),
        timestamp_us: 1,
        prefixes: vec![pb::PrefixEntry {
            prefix_hash: vec![0xab],
            token_count: 16,
            tier: pb::CacheTier::T2 as i32,
            ..Default::default()
        }],
        adapter_id: "a".into(),
        ..Default::default()
    };
    assert_eq!(
        update.encode_to_vec(),
        [
            0x0a, 1, b'r', // 1: replica_id
            0x28, 1, // 5: timestamp_us varint
            0x32, 7, 0x0a, 1, 0xab, 0x10, 16, 0x28,
            2, // 6: prefixes {1: hash, 2: count, 5: tier}
            0x42, 1, b'a', // 8: adapter_id
        ]
    );
    // CacheEvent: type=1 (enum), prefix_hash=5, timestamp_us=6, adapter_id=7.
    let event = pb::CacheEvent {
        r#type: pb::cache_event::Type::PrefixEvicted as i32,
        prefix_hash: vec![1],
        timestamp_us: 2,
        adapter_id: "x".into(),
        ..Default::default()
    };
    assert_eq!(
        event.encode_to_vec(),
        [0x08, 2, 0x2a, 1, 1, 0x30, 2, 0x3a, 1, b'x']
    );
    // ReplicaStats: hit_rate=3 is a float (fixed32).
    let stats = pb::ReplicaStats {
        hit_rate: 0.5,
        ..Default::default()
    };
    assert_eq!(stats.encode_to_vec(), [0x1d, 0, 0, 0, 0x3f]);
    // LookupRouteRequest.token_ids=9 is packed uint32.
    let lookup = pb::LookupRouteRequest {
        token_ids: vec![1, 300],
        ..Default::default()
    };
    assert_eq!(lookup.encode_to_vec(), [0x4a, 3, 1, 0xac, 0x02]);
    assert_eq!(pb::cache_event::Type::AllCleared as i32, 4);
}
