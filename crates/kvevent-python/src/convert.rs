//! Arguments from Python: token ids and prefix keys (a list, bytes of native-endian words, or
//! any object with the buffer protocol of integers: `array.array`, `memoryview`, NumPy; a
//! buffer of unsigned bytes is bytes), and durations in seconds. Every refusal is a `ValueError` naming the argument.
//!
//! Invariants: a buffer is read at bytes speed (one copy, then words), whatever its integer
//! width, each value checked against the target's range; `True` and `False` are not ids.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyList};

/// `seconds` as a duration, or a ValueError naming `what`.
pub(crate) fn duration(what: &str, seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds ≥ 0, not {seconds}"
        ))
    })
}

/// Token ids: a list of ints (the fast path), bytes / bytearray of native-endian u32, a buffer
/// of integers (`array.array("I")`, a `memoryview`, a NumPy array of any integer dtype), or
/// any sequence of ints.
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    ids(obj, "token_ids")
}

/// Prefix keys: as [`token_ids`], of u64.
pub(crate) fn keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    ids(obj, "keys")
}

/// What a word of the target type is made from.
pub(crate) trait Word: Sized + Copy + TryFrom<u64> + TryFrom<i64> + Into<u64> {
    const BYTES: usize;
    const RANGE: &'static str;
    fn from_ne(b: &[u8]) -> Self;
    fn extract(item: &Bound<'_, PyAny>) -> PyResult<Self>;
}

impl Word for u32 {
    const BYTES: usize = 4;
    const RANGE: &'static str = "0..2**32";
    fn from_ne(b: &[u8]) -> Self {
        u32::from_ne_bytes(b.try_into().unwrap_or([0; 4]))
    }
    #[inline(always)]
    fn extract(item: &Bound<'_, PyAny>) -> PyResult<Self> {
        item.extract()
    }
}

impl Word for u64 {
    const BYTES: usize = 8;
    const RANGE: &'static str = "0..2**64";
    fn from_ne(b: &[u8]) -> Self {
        u64::from_ne_bytes(b.try_into().unwrap_or([0; 8]))
    }
    #[inline(always)]
    fn extract(item: &Bound<'_, PyAny>) -> PyResult<Self> {
        item.extract()
    }
}

fn ids<T: Word>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return words(b.as_bytes(), what);
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return words(&b.to_vec(), what);
    }
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(one(&item, what, i)?);
        }
        return Ok(out);
    }
    if let Some(v) = buffer(obj, what)? {
        return Ok(v);
    }
    let Ok(seq) = obj.try_iter() else {
        return Err(PyValueError::new_err(format!(
            "{what}: a list of ints, bytes of native-endian {}-byte words, or a buffer of \
             integers; not {}",
            T::BYTES,
            obj.get_type().name()?
        )));
    };
    seq.enumerate()
        .map(|(i, item)| one(&item?, what, i))
        .collect()
}

#[inline(always)]
fn one<T: Word>(item: &Bound<'_, PyAny>, what: &str, i: usize) -> PyResult<T> {
    let id = T::extract(item).map_err(|e| {
        PyValueError::new_err(format!("{what}[{i}]: not an id ({}): {e}", T::RANGE))
    })?;
    // `True` and `False` extract as 1 and 0: only those are looked at again (a check of every
    // id cost a list 15 % of its speed).
    if id.into() <= 1 && item.is_instance_of::<PyBool>() {
        return Err(PyValueError::new_err(format!(
            "{what}[{i}]: {item} is a bool, not an id"
        )));
    }
    Ok(id)
}

/// `raw` as words of the target's width.
fn words<T: Word>(raw: &[u8], what: &str) -> PyResult<Vec<T>> {
    if !raw.len().is_multiple_of(T::BYTES) {
        return Err(PyValueError::new_err(format!(
            "{what}: {} bytes is not a whole number of {}-byte words",
            raw.len(),
            T::BYTES
        )));
    }
    Ok(raw.chunks_exact(T::BYTES).map(T::from_ne).collect())
}

/// An object with the buffer protocol, through a `memoryview` (the stable ABI has no buffer
/// API before 3.11): its bytes in one copy, read as integers of its own width and sign, each
/// checked against the target's range. `None` when it has no buffer.
fn buffer<T: Word>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<Vec<T>>> {
    let py = obj.py();
    let Ok(view) = py.import("builtins")?.getattr("memoryview")?.call1((obj,)) else {
        return Ok(None);
    };
    let format: String = view.getattr("format")?.extract()?;
    let itemsize: usize = view.getattr("itemsize")?.extract()?;
    // Native or little-endian (this wheel is built for x86_64), standard or native size.
    let code = format.trim_start_matches(['@', '=', '<']);
    // Raw bytes (a memoryview of bytes, a bytearray's buffer): as bytes, native-endian words.
    if matches!(code, "B" | "c") {
        let bytes: Vec<u8> = view.call_method0("tobytes")?.extract()?;
        return words(&bytes, what).map(Some);
    }
    let signed = match code {
        "b" | "h" | "i" | "l" | "q" | "n" => true,
        "B" | "H" | "I" | "L" | "Q" | "N" => false,
        _ => {
            return Err(PyValueError::new_err(format!(
                "{what}: a buffer of integers, not of format {format:?} (NumPy: .astype('u4'))"
            )));
        }
    };
    let bytes: Vec<u8> = view.call_method0("tobytes")?.extract()?;
    let bad = |i: usize, v: String| {
        PyValueError::new_err(format!("{what}[{i}]: {v} is not an id ({})", T::RANGE))
    };
    let mut out = Vec::with_capacity(bytes.len() / itemsize.max(1));
    macro_rules! read {
        ($t:ty, $wide:ty) => {
            for (i, c) in bytes.chunks_exact(itemsize).enumerate() {
                let v = <$t>::from_ne_bytes(c.try_into().unwrap_or_default());
                out.push(T::try_from(<$wide>::from(v)).map_err(|_| bad(i, v.to_string()))?);
            }
        };
    }
    match (signed, itemsize) {
        (false, 4) if T::BYTES == 4 => return words(&bytes, what).map(Some),
        (false, 8) if T::BYTES == 8 => return words(&bytes, what).map(Some),
        (false, 2) => read!(u16, u64),
        (false, 4) => read!(u32, u64),
        (false, 8) => read!(u64, u64),
        (true, 1) => read!(i8, i64),
        (true, 2) => read!(i16, i64),
        (true, 4) => read!(i32, i64),
        (true, 8) => read!(i64, i64),
        _ => {
            return Err(PyValueError::new_err(format!(
                "{what}: a buffer of {itemsize}-byte integers is not read"
            )));
        }
    }
    Ok(Some(out))
}
