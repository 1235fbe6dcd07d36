//! What a newer or unusual publisher may send must still decode.

use kvevent_wire::{ErrorKind, Event, MediumKind, decode};

/// msgpack of a str.
fn s(v: &str) -> Vec<u8> {
    let mut out = vec![0xa0 | v.len() as u8];
    out.extend(v.as_bytes());
    out
}

fn batch(events: &[Vec<u8>], extra: &[u8]) -> Vec<u8> {
    let mut out = vec![0x93 + u8::from(!extra.is_empty()), 0xcb];
    out.extend(2.5f64.to_be_bytes());
    out.push(0x90 | events.len() as u8);
    for e in events {
        out.extend(e);
    }
    out.push(0x01); // rank 1
    out.extend(extra);
    out
}

#[test]
fn unknown_tags_are_skipped_and_counted() {
    let mut future = vec![0x83];
    future.extend(s("type"));
    future.extend(s("BlockPinned"));
    future.extend(s("block_hashes"));
    future.extend([0x91, 0x05]);
    future.extend(s("why"));
    future.extend([0x92, 0xc3, 0xcb]);
    future.extend(1.0f64.to_be_bytes());
    let mut positional = vec![0x93];
    positional.extend(s("Compacted"));
    positional.extend([0x01, 0x02]);
    let mut cleared = vec![0x91];
    cleared.extend(s("AllBlocksCleared"));
    let payload = batch(&[future, positional, cleared], &[0xc0]);
    let got = decode(&payload).expect("decode");
    assert_eq!(
        got.events,
        vec![Event::AllBlocksCleared(Default::default())]
    );
    assert_eq!(got.unknown_events, 2);
    assert_eq!(got.data_parallel_rank, Some(1));
}

#[test]
fn unknown_keys_extra_elements_and_tag_not_first_are_fine() {
    let mut stored = vec![0x86];
    stored.extend(s("block_hashes"));
    stored.extend([0x91, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
    stored.extend(s("novel_field"));
    stored.extend([0x81, 0x01, 0x02]);
    stored.extend(s("type"));
    stored.extend(s("BlockStored"));
    stored.extend(s("token_ids"));
    stored.extend([0x92, 0xcd, 0x01, 0x00, 0x07]);
    stored.extend(s("block_size"));
    stored.push(0x02);
    stored.extend(s("medium"));
    stored.extend(s("cpu"));
    let mut removed = vec![0x95];
    removed.extend(s("BlockRemoved"));
    removed.extend([0x91, 0xd0, 0x80]); // hash -128 as int8
    removed.extend(s("GPU"));
    removed.push(0xc0);
    removed.extend(s("future"));
    let payload = batch(&[stored, removed], &[]);
    let got = decode(&payload).expect("decode");
    let Event::BlockStored(e) = &got.events[0] else {
        panic!("not stored: {:?}", got.events[0])
    };
    assert_eq!(e.token_ids.to_vec(), vec![256, 7]);
    assert_eq!(e.medium.as_ref().map(|m| m.kind()), Some(MediumKind::Cpu));
    assert_eq!(
        &*e.block_hashes[0].to_bytes(),
        &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]
    );
    let Event::BlockRemoved(r) = &got.events[1] else {
        panic!("not removed")
    };
    assert_eq!(&*r.block_hashes[0].to_bytes(), &(-128i64).to_be_bytes());
}

#[test]
fn a_map_batch_decodes() {
    let mut payload = vec![0x84];
    payload.extend(s("events"));
    payload.push(0x90);
    payload.extend(s("ts"));
    payload.push(0x07);
    payload.extend(s("data_parallel_rank"));
    payload.push(0x03);
    payload.extend(s("later"));
    payload.push(0xc0);
    let got = decode(&payload).expect("decode");
    assert_eq!(
        (got.ts, got.events.len(), got.data_parallel_rank),
        (7.0, 0, Some(3))
    );
}

#[test]
fn errors_name_the_kind_and_offset() {
    // [ts, [["BlockStored", "not-a-list", ...]]]
    let mut stored = vec![0x96];
    stored.extend(s("BlockStored"));
    stored.extend(s("oops"));
    stored.extend([0xc0, 0x90, 0x10, 0xc0]);
    let payload = batch(&[stored], &[]);
    let err = decode(&payload).expect_err("bad hashes");
    assert_eq!(
        err.kind(),
        &ErrorKind::UnexpectedType {
            expected: "array",
            found: "str"
        }
    );
    // 1 (array) + 9 (ts) + 1 (events) + 1 (event) + 12 (tag)
    assert_eq!(err.offset(), 24);
    assert_eq!(err.to_string(), "expected array, found str at byte 24");

    let mut trailing = batch(&[], &[]);
    trailing.push(0x00);
    assert_eq!(
        decode(&trailing).expect_err("trailing").kind(),
        &ErrorKind::TrailingBytes
    );

    let mut big_token = vec![0x95];
    big_token.extend(s("BlockStored"));
    big_token.extend([0x90, 0xc0, 0x91, 0xcf, 1, 0, 0, 0, 0, 0, 0, 0, 0x10]);
    assert_eq!(
        decode(&batch(&[big_token], &[])).expect_err("token").kind(),
        &ErrorKind::IntOutOfRange { field: "token_ids" }
    );
}

#[test]
fn a_clear_of_one_tier_is_decoded_in_both_encodings() {
    use kvevent_wire::{AllBlocksCleared, Medium, Release, encode};
    // Positional: [ts, [["AllBlocksCleared", "CPU"], ["AllBlocksCleared"]], 0]
    let mut positional = vec![0x93, 0xcb];
    positional.extend(1.5f64.to_be_bytes());
    positional.extend([0x92, 0x92, 0xb0]);
    positional.extend(b"AllBlocksCleared");
    positional.extend([0xa3]);
    positional.extend(b"CPU");
    positional.extend([0x91, 0xb0]);
    positional.extend(b"AllBlocksCleared");
    positional.push(0x00);
    let got = kvevent_wire::decode(&positional).expect("positional");
    let cpu = Event::AllBlocksCleared(AllBlocksCleared {
        medium: Some(Medium::from("CPU")),
    });
    assert_eq!(
        got.events,
        vec![cpu.clone(), Event::AllBlocksCleared(Default::default())]
    );
    // Tagged map: [ts, [{"type": "AllBlocksCleared", "medium": "CPU"}], 0]
    let mut map = vec![0x93, 0xcb];
    map.extend(1.5f64.to_be_bytes());
    map.extend([0x91, 0x82, 0xa4]);
    map.extend(b"type");
    map.push(0xb0);
    map.extend(b"AllBlocksCleared");
    map.push(0xa6);
    map.extend(b"medium");
    map.push(0xa3);
    map.extend(b"CPU");
    map.push(0x00);
    let got = kvevent_wire::decode(&map).expect("map");
    assert_eq!(got.events, vec![cpu.clone()]);
    // JSON both ways, the field only when set.
    let json = kvevent_wire::json::to_json(&got);
    assert_eq!(json["events"][0]["medium"], "CPU");
    assert_eq!(
        kvevent_wire::json::from_json(&json)
            .expect("from json")
            .events,
        got.events
    );
    // No vLLM release writes it: an error, unless the field is dropped on purpose.
    let release = Release::new(0, 33, 0);
    assert!(encode(&got, release).is_err());
    let mut lenient = got.clone();
    assert_eq!(lenient.retain_fields_of(release), 1);
    assert!(encode(&lenient, release).is_ok());
}
