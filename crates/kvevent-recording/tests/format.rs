//! The format: round trips, what a kill leaves, and damage found at its offset.

use kvevent_recording::{Error, Header, Reader, Record, Writer, read_all};

fn record(rank: u32, seq: u64, at_us: u64, topic: &[u8], payload: &[u8]) -> Record {
    Record {
        rank,
        seq,
        at_us,
        topic: topic.to_vec(),
        replay: seq.is_multiple_of(3),
        reset: None,
        payload: payload.to_vec(),
    }
}

/// Two ranks, seqs that jump back (a restart) and forward (a gap), a topic that changes, an
/// empty payload, a long one.
fn records() -> Vec<Record> {
    vec![
        record(0, 0, 10, b"kv-events", b"\x93\xcb"),
        record(1, 0, 15, b"kv-events", b"\x90"),
        record(0, 1, 20, b"kv-events", b""),
        record(0, 7, 1_000_000, b"kv-events", &[7u8; 20_000]),
        record(1, 1, 1_000_001, b"other", b"\x91\x01"),
        Record {
            reset: Some("restart".into()),
            ..record(0, 0, 5_000_000, b"kv-events", b"\x92")
        },
        record(0, u64::MAX - 1, 5_000_001, b"", b"\x93"),
    ]
}

fn file(records: &[Record]) -> Vec<u8> {
    let mut header = Header::new("sglang", 1_700_000_000_123);
    header.replay_first = true;
    let mut w = Writer::new(Vec::new(), &header).expect("header");
    for r in records {
        w.write(r).expect("record");
    }
    w.finish().expect("finish")
}

#[test]
fn records_come_back_as_written() {
    let want = records();
    let bytes = file(&want);
    let (header, got, cut) = read_all(&bytes).expect("reads");
    assert_eq!(header.engine, "sglang");
    assert_eq!(header.started_unix_ms, 1_700_000_000_123);
    assert!(header.replay_first);
    assert_eq!(got, want);
    assert_eq!(cut, None);
}

#[test]
fn a_batch_costs_at_most_16_bytes_beyond_its_payload() {
    // A live stream: one rank, seqs in order, 10 ms apart, payloads of 2 kB.
    let payload = vec![0x90u8; 2_000];
    let n = 10_000u64;
    let stream: Vec<Record> = (0..n)
        .map(|i| Record {
            rank: 0,
            seq: i,
            at_us: i * 10_000,
            topic: b"kv-events".to_vec(),
            replay: false,
            reset: None,
            payload: payload.clone(),
        })
        .collect();
    let empty = file(&[]).len() as u64;
    let bytes = file(&stream).len() as u64;
    let per_batch = (bytes - empty - n * payload.len() as u64) as f64 / n as f64;
    assert!(per_batch <= 16.0, "{per_batch} bytes a batch");
}

#[test]
fn a_file_cut_anywhere_reads_back_up_to_its_last_whole_record() {
    let all = records();
    let bytes = file(&all);
    // Where each record ends.
    let mut ends = Vec::new();
    let mut r = Reader::new(&bytes[..]).expect("header");
    let header_end = r.offset();
    while r.next_record().expect("record").is_some() {
        ends.push(r.offset());
    }
    for cut in header_end..bytes.len() as u64 {
        let (_, got, at) = read_all(&bytes[..cut as usize]).expect("a cut file reads");
        let whole = ends.iter().filter(|e| **e <= cut).count();
        assert_eq!(got, all[..whole], "cut at {cut}");
        let clean = cut == header_end || ends.contains(&cut);
        assert_eq!(at.is_none(), clean, "cut at {cut}");
    }
}

#[test]
fn a_damaged_byte_is_an_error_naming_an_offset_or_reads_the_same_never_a_panic() {
    let all = records();
    let bytes = file(&all);
    // Every byte around the records' fields; a sample inside the long payload.
    let n = bytes.len();
    for i in (0..n).filter(|i| *i < 2_000 || *i + 2_000 > n || i % 97 == 0) {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut damaged = bytes.clone();
            damaged[i] ^= flip;
            match read_all(&damaged) {
                Ok((_, got, _)) => assert!(got.len() <= all.len(), "byte {i}"),
                Err(e) => {
                    let offset = e
                        .offset()
                        .unwrap_or_else(|| panic!("byte {i}: {e} names no offset"));
                    assert!(offset <= i as u64, "byte {i} damaged, {e} names {offset}");
                }
            }
        }
    }
}

#[test]
fn a_foreign_file_or_another_version_is_named() {
    assert!(matches!(read_all(b"{\"ts\": 0}"), Err(Error::Foreign)));
    assert!(matches!(read_all(b""), Err(Error::Foreign)));
    let mut bytes = file(&records());
    bytes[7] = 9;
    let err = read_all(&bytes).expect_err("version 9");
    assert!(err.to_string().contains("version 9"), "{err}");
    assert_eq!(err.offset(), Some(7));
}

/// Found by the fuzzer: a file that ends within its first 12 bytes names where it ends, never a
/// byte past it.
#[test]
fn a_file_that_ends_inside_its_header_names_where_it_ends() {
    let bytes = file(&[]);
    for n in 7..bytes.len() {
        let err = read_all(&bytes[..n]).expect_err("a cut header");
        let offset = err.offset().expect("an offset");
        assert!(offset <= n as u64, "{n} bytes: {err}");
    }
}
