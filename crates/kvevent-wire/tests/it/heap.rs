//! The heap a payload makes the decoder take: a small multiple of its size, whatever its
//! length headers claim (found by the `decode` fuzz target, which counts the heap: 10,940
//! bytes declaring 10,546 one-byte events took 3.4 MB up front). Checked here by the
//! capacity of what is returned.

use kvevent_wire::{Event, decode};

fn batch_with_events(elements: &[u8], n: usize) -> Vec<u8> {
    let mut b = vec![0x92, 0xcb];
    b.extend_from_slice(&1.0f64.to_be_bytes());
    b.push(0xdd);
    b.extend_from_slice(&(n as u32).to_be_bytes());
    for _ in 0..n {
        b.extend_from_slice(elements);
    }
    b
}

#[test]
fn declared_lengths_reserve_no_more_than_what_decodes() {
    // 60,000 three-byte events of an unknown type (skipped and counted) reserve almost nothing.
    let payload = batch_with_events(&[0x91, 0xa1, b'X'], 60_000);
    let batch = decode(&payload).expect("unknown events are skipped");
    assert_eq!(batch.unknown_events, 60_000);
    let reserved = batch.events.capacity() * std::mem::size_of::<Event<'_>>();
    assert!(
        reserved <= 16 << 10,
        "{} bytes of payload reserved {reserved} bytes of events",
        payload.len()
    );
    // A real event with 60,000 one-byte hashes holds them, with at most twice the room.
    let mut removed = vec![0x92, 0xac];
    removed.extend_from_slice(b"BlockRemoved");
    removed.push(0xdc);
    removed.extend_from_slice(&60_000u16.to_be_bytes());
    removed.extend(std::iter::repeat_n(0x05, 60_000));
    let payload = batch_with_events(&removed, 1);
    let batch = decode(&payload).expect("decodes");
    let Event::BlockRemoved(e) = &batch.events[0] else {
        panic!("a removal");
    };
    assert_eq!(e.block_hashes.len(), 60_000);
    assert!(e.block_hashes.capacity() <= 2 * 60_000);
}
