//! The payload decoder, as vLLM's and as SGLang's wire: any bytes decode or fail cleanly; what
//! decodes re-encodes to a fixed point (decode → encode → decode → encode gives the same
//! bytes); the decoder allocates at most a bounded multiple of the input (never what a length
//! header merely claims).
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvevent_wire::{Engine, Limits, Release, SglangRelease, decode, decode_engine, encode, encode_sglang};
use libfuzzer_sys::fuzz_target;

/// Counts live and peak heap bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(live, Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size > layout.size() {
                let live =
                    LIVE.fetch_add(new_size - layout.size(), Relaxed) + new_size - layout.size();
                PEAK.fetch_max(live, Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Most heap a decode may hold per input byte (an event or hash is a few dozen bytes decoded
/// and can be written in one or two), plus a constant.
const BYTES_PER_INPUT_BYTE: usize = 256;
const SLACK: usize = 64 << 10;

fuzz_target!(|data: &[u8]| {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let decoded = decode(data);
    let peak = PEAK.load(Relaxed) - base;
    assert!(
        peak <= data.len() * BYTES_PER_INPUT_BYTE + SLACK,
        "decoding {} bytes held {peak} bytes of heap",
        data.len()
    );
    let Ok(batch) = decoded else {
        return;
    };
    for release in [
        Release::OLDEST,
        Release::new(0, 23, 0),
        Release::NEWEST_KNOWN,
    ] {
        // Some batches cannot be written for some releases (a field it lacks): an error, fine.
        let Ok(first) = encode(&batch, release) else {
            continue;
        };
        let again = decode(&first).expect("what we encode decodes");
        let second = encode(&again, release).expect("what decoded from our encoding re-encodes");
        assert_eq!(first, second, "encode is not a fixed point for {release}");
    }
    sglang(data);
});

/// The same bytes as SGLang's wire.
fn sglang(data: &[u8]) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let decoded = decode_engine(data, Engine::Sglang, &Limits::DEFAULT);
    let peak = PEAK.load(Relaxed) - base;
    assert!(
        peak <= data.len() * BYTES_PER_INPUT_BYTE + SLACK,
        "decoding {} bytes as SGLang's held {peak} bytes of heap",
        data.len()
    );
    let Ok(batch) = decoded else {
        return;
    };
    for release in [
        SglangRelease::OLDEST,
        SglangRelease(Release::new(0, 5, 18)),
        SglangRelease::NEWEST_KNOWN,
    ] {
        let Ok(first) = encode_sglang(&batch, release) else {
            continue;
        };
        let again = decode_engine(&first, Engine::Sglang, &Limits::DEFAULT)
            .expect("what we encode decodes");
        let second =
            encode_sglang(&again, release).expect("what decoded from our encoding re-encodes");
        assert_eq!(first, second, "encode is not a fixed point for SGLang {release}");
    }
}
