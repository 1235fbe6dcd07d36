//! Recordings (`kvevents record`, `decode`, `stats`, `publish --recording`): any bytes read as a
//! recording, up to a cut, or fail with an error naming a byte offset within the input; what
//! reads writes back to a file that reads the same.
#![no_main]

use kvevent_recording::{Reader, Writer, read_all};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match read_all(data) {
        Ok((header, records, cut)) => {
            if let Some(cut) = cut {
                assert!(cut <= data.len() as u64, "cut at {cut} of {}", data.len());
            }
            let mut w = Writer::new(Vec::new(), &header).expect("a header read writes");
            for r in &records {
                w.write(r).expect("a record read writes");
            }
            let bytes = w.finish().expect("finish");
            let (again, back, cut) = read_all(&bytes).expect("what we wrote reads");
            assert_eq!(again, header);
            assert_eq!(back, records);
            assert_eq!(cut, None);
        }
        Err(e) => {
            if let Some(offset) = e.offset() {
                assert!(offset <= data.len() as u64, "{e} names {offset} of {}", data.len());
            }
        }
    }
    // Record by record, the reader stops where read_all does.
    if let Ok(mut r) = Reader::new(data) {
        while let Ok(Some(_)) = r.next_record() {}
    }
});
