//! The payload decoder, as vLLM's and as SGLang's wire: any bytes decode or fail cleanly; what
//! decodes re-encodes to a fixed point (decode → encode → decode → encode gives the same
//! bytes); the decoder allocates at most a bounded multiple of the input (never what a length
//! header merely claims).
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvevent_wire::{
    Engine, EventBatch, Limits, Release, SglangRelease, decode_engine, encode, encode_sglang,
};
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
    let vllm = [
        Release::OLDEST,
        Release::new(0, 23, 0),
        Release::NEWEST_KNOWN,
    ];
    check(data, Engine::Vllm, &vllm, encode);
    let sglang = [
        SglangRelease::OLDEST,
        SglangRelease(Release::new(0, 5, 18)),
        SglangRelease::NEWEST_KNOWN,
    ];
    check(data, Engine::Sglang, &sglang, encode_sglang);
});

/// `data` as `engine`'s wire: the heap bound, then the encode fixed point for each release.
fn check<R: Copy + std::fmt::Display>(
    data: &[u8],
    engine: Engine,
    releases: &[R],
    encode: fn(&EventBatch<'_>, R) -> kvevent_wire::Result<Vec<u8>>,
) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let decoded = decode_engine(data, engine, &Limits::DEFAULT);
    let peak = PEAK.load(Relaxed) - base;
    assert!(
        peak <= data.len() * BYTES_PER_INPUT_BYTE + SLACK,
        "decoding {} bytes as {engine}'s held {peak} bytes of heap",
        data.len()
    );
    let Ok(batch) = decoded else {
        return;
    };
    for &release in releases {
        // Some batches cannot be written for some releases (a field it lacks): an error, fine.
        let Ok(first) = encode(&batch, release) else {
            continue;
        };
        let again =
            decode_engine(&first, engine, &Limits::DEFAULT).expect("what we encode decodes");
        let second = encode(&again, release).expect("what decoded from our encoding re-encodes");
        assert_eq!(
            first, second,
            "encode is not a fixed point for {engine} {release}"
        );
    }
}
