//! A minimal msgpack reader and writer over byte slices.
//!
//! The reader borrows from the input and checks every length against the bytes that remain
//! before it allocates or slices, so hostile input can neither panic nor make it allocate more
//! than the input's size. The writer picks the same encodings msgspec does (the smallest
//! integer, string, binary and array forms; `float64` for every float), which is what makes
//! byte-exact re-encoding possible.

use crate::error::{Error, ErrorKind, Result};
use crate::model::Int;

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Nesting allowed below a value being skipped or read as a tree.
    pub(crate) max_depth: usize,
}

/// The msgpack type name of a marker byte, for error messages.
pub(crate) fn type_name(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => "int",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "nil",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bin",
        0xca | 0xcb => "float",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        0xc1 => "reserved",
    }
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            max_depth: crate::Limits::DEFAULT.max_depth,
        }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn set_pos(&mut self, pos: usize) {
        self.pos = pos;
    }

    /// The bytes from `start` up to the current position.
    pub(crate) fn slice_from(&self, start: usize) -> &'a [u8] {
        &self.buf[start..self.pos]
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn err(&self, kind: ErrorKind) -> Error {
        Error::new(kind, self.pos)
    }

    pub(crate) fn err_at(&self, kind: ErrorKind, pos: usize) -> Error {
        Error::new(kind, pos)
    }

    pub(crate) fn peek(&self) -> Result<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.err(ErrorKind::Truncated))
    }

    fn byte(&mut self) -> Result<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(ErrorKind::Truncated));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn len16(&mut self) -> Result<usize> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }

    fn len32(&mut self) -> Result<usize> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    fn unexpected(&self, expected: &'static str, marker: u8) -> Error {
        let kind = if marker == 0xc1 {
            ErrorKind::ReservedMarker
        } else {
            ErrorKind::UnexpectedType {
                expected,
                found: type_name(marker),
            }
        };
        self.err(kind)
    }

    /// Consumes a nil and returns true, or returns false and consumes nothing.
    pub(crate) fn try_nil(&mut self) -> Result<bool> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Reads an array header and returns the element count. The count is checked against the
    /// bytes left (every element takes at least one), so callers may reserve that much.
    pub(crate) fn array_len(&mut self) -> Result<usize> {
        let m = self.peek()?;
        let n = match m {
            0x90..=0x9f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xdc => {
                self.pos += 1;
                self.len16()?
            }
            0xdd => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Err(self.unexpected("array", m)),
        };
        if n > self.remaining() {
            return Err(self.err(ErrorKind::Truncated));
        }
        Ok(n)
    }

    /// Reads a map header and returns the entry count (checked like [`Self::array_len`]).
    pub(crate) fn map_len(&mut self) -> Result<usize> {
        let m = self.peek()?;
        let n = match m {
            0x80..=0x8f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xde => {
                self.pos += 1;
                self.len16()?
            }
            0xdf => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Err(self.unexpected("map", m)),
        };
        if n.saturating_mul(2) > self.remaining() {
            return Err(self.err(ErrorKind::Truncated));
        }
        Ok(n)
    }

    /// Reads a string and returns its raw bytes (not yet checked as UTF-8).
    pub(crate) fn str_bytes(&mut self) -> Result<&'a [u8]> {
        let m = self.peek()?;
        let n = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                (m & 0x1f) as usize
            }
            0xd9 => {
                self.pos += 1;
                self.byte()? as usize
            }
            0xda => {
                self.pos += 1;
                self.len16()?
            }
            0xdb => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Err(self.unexpected("str", m)),
        };
        self.take(n)
    }

    pub(crate) fn str(&mut self) -> Result<&'a str> {
        let start = self.pos;
        let bytes = self.str_bytes()?;
        std::str::from_utf8(bytes).map_err(|_| self.err_at(ErrorKind::InvalidUtf8, start))
    }

    pub(crate) fn opt_str(&mut self) -> Result<Option<&'a str>> {
        if self.try_nil()? {
            Ok(None)
        } else {
            self.str().map(Some)
        }
    }

    /// Reads a `bin` value.
    pub(crate) fn bin(&mut self) -> Result<&'a [u8]> {
        let m = self.peek()?;
        let n = match m {
            0xc4 => {
                self.pos += 1;
                self.byte()? as usize
            }
            0xc5 => {
                self.pos += 1;
                self.len16()?
            }
            0xc6 => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Err(self.unexpected("bin", m)),
        };
        self.take(n)
    }

    /// True when the next value is an integer of any width.
    pub(crate) fn at_int(&self) -> Result<bool> {
        Ok(matches!(self.peek()?, 0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3))
    }

    /// Reads an integer of any msgpack width.
    pub(crate) fn int(&mut self) -> Result<Int> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::U64(u64::from(m))
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::I64(i64::from(m as i8))
            }
            0xcc => {
                self.pos += 1;
                Int::U64(u64::from(self.byte()?))
            }
            0xcd => {
                self.pos += 1;
                Int::U64(u64::from(u16::from_be_bytes(self.be()?)))
            }
            0xce => {
                self.pos += 1;
                Int::U64(u64::from(u32::from_be_bytes(self.be()?)))
            }
            0xcf => {
                self.pos += 1;
                Int::U64(u64::from_be_bytes(self.be()?))
            }
            0xd0 => {
                self.pos += 1;
                Int::from_i64(i64::from(self.byte()? as i8))
            }
            0xd1 => {
                self.pos += 1;
                Int::from_i64(i64::from(i16::from_be_bytes(self.be()?)))
            }
            0xd2 => {
                self.pos += 1;
                Int::from_i64(i64::from(i32::from_be_bytes(self.be()?)))
            }
            0xd3 => {
                self.pos += 1;
                Int::from_i64(i64::from_be_bytes(self.be()?))
            }
            _ => return Err(self.unexpected("int", m)),
        };
        Ok(v)
    }

    /// Reads an integer that must fit an `i64`.
    pub(crate) fn i64(&mut self, field: &'static str) -> Result<i64> {
        let start = self.pos;
        self.int()?
            .as_i64()
            .ok_or_else(|| self.err_at(ErrorKind::IntOutOfRange { field }, start))
    }

    pub(crate) fn opt_i64(&mut self, field: &'static str) -> Result<Option<i64>> {
        if self.try_nil()? {
            Ok(None)
        } else {
            self.i64(field).map(Some)
        }
    }

    /// Skips up to `n` integers in the forms that always fit a `u32` (positive fixint, uint 8,
    /// 16 and 32) and returns how many. Stops before any other form, or one cut short, which
    /// the caller then reads with [`Reader::u32`] (and its errors): token ids are almost all
    /// in these forms, and this is the decoder's hottest loop.
    pub(crate) fn skip_u32s(&mut self, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let size = match self.buf.get(self.pos) {
                Some(0x00..=0x7f) => 1,
                Some(0xcc) => 2,
                Some(0xcd) => 3,
                Some(0xce) => 5,
                _ => break,
            };
            if size > self.remaining() {
                break;
            }
            self.pos += size;
            done += 1;
        }
        done
    }

    /// Reads an integer that must fit a `u32`.
    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32> {
        let start = self.pos;
        match self.int()? {
            Int::U64(v) => u32::try_from(v).ok(),
            Int::I64(_) => None,
        }
        .ok_or_else(|| self.err_at(ErrorKind::IntOutOfRange { field }, start))
    }

    /// Reads a float (either width) or an integer, as `f64`.
    pub(crate) fn f64(&mut self) -> Result<f64> {
        let m = self.peek()?;
        match m {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            _ if self.at_int()? => Ok(self.int()?.as_f64()),
            _ => Err(self.unexpected("float", m)),
        }
    }

    /// Skips one value of any type, nested at most `depth` levels.
    pub(crate) fn skip(&mut self, depth: usize) -> Result<()> {
        if depth == 0 {
            return Err(self.err(ErrorKind::LimitExceeded {
                what: "nesting depth",
                limit: self.max_depth,
            }));
        }
        let m = self.peek()?;
        match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => self.pos += 1,
            0xcc..=0xd3 => {
                self.int()?;
            }
            0xca => {
                self.take(5)?;
            }
            0xcb => {
                self.take(9)?;
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                self.str_bytes()?;
            }
            0xc4..=0xc6 => {
                self.bin()?;
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                for _ in 0..self.array_len()? {
                    self.skip(depth - 1)?;
                }
            }
            0x80..=0x8f | 0xde | 0xdf => {
                for _ in 0..self.map_len()? {
                    self.skip(depth - 1)?;
                    self.skip(depth - 1)?;
                }
            }
            0xd4..=0xd8 => {
                self.pos += 1;
                let n = 1usize << (m - 0xd4);
                self.take(1 + n)?;
            }
            0xc7..=0xc9 => {
                self.pos += 1;
                let n = match m {
                    0xc7 => self.byte()? as usize,
                    0xc8 => self.len16()?,
                    _ => self.len32()?,
                };
                self.take(1 + n)?;
            }
            0xc1 => return Err(self.err(ErrorKind::ReservedMarker)),
        }
        Ok(())
    }
}

/// Appends msgpack values to a buffer the way msgspec writes them.
pub(crate) struct Writer<'b> {
    pub(crate) out: &'b mut Vec<u8>,
}

impl Writer<'_> {
    pub(crate) fn nil(&mut self) {
        self.out.push(0xc0);
    }

    pub(crate) fn bool(&mut self, v: bool) {
        self.out.push(if v { 0xc3 } else { 0xc2 });
    }

    pub(crate) fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.out.push(v as u8);
        } else if v <= 0xff {
            self.out.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= 0xffff {
            self.out.push(0xcd);
            self.out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= 0xffff_ffff {
            self.out.push(0xce);
            self.out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.out.push(0xcf);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn sint(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.out.push(v as i8 as u8);
        } else if v >= i64::from(i8::MIN) {
            self.out.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.out.push(0xd1);
            self.out.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.out.push(0xd2);
            self.out.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.out.push(0xd3);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn int(&mut self, v: Int) {
        match v {
            Int::U64(u) => self.uint(u),
            Int::I64(i) => self.sint(i),
        }
    }

    pub(crate) fn f64(&mut self, v: f64) {
        self.out.push(0xcb);
        self.out.extend_from_slice(&v.to_be_bytes());
    }

    fn header(&mut self, n: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        if n <= fix_max {
            self.out.push(fix | n as u8);
        } else {
            self.header_wide(n, m16, m32);
        }
    }

    fn header_wide(&mut self, n: usize, m16: u8, m32: u8) {
        if n <= 0xffff {
            self.out.push(m16);
            self.out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.out.push(m32);
            self.out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    pub(crate) fn array_len(&mut self, n: usize) {
        self.header(n, 0x90, 15, 0xdc, 0xdd);
    }

    /// A map header for `n` entries, as msgspec writes it for a struct that could hold
    /// `possible` entries: the header form follows `possible`, the count follows `n`.
    pub(crate) fn map_len(&mut self, n: usize, possible: usize) {
        if possible <= 15 {
            self.out.push(0x80 | n as u8);
        } else {
            self.header_wide(n, 0xde, 0xdf);
        }
    }

    pub(crate) fn str(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.out.push(0xa0 | n as u8);
        } else if n <= 0xff {
            self.out.extend_from_slice(&[0xd9, n as u8]);
        } else {
            self.header_wide(n, 0xda, 0xdb);
        }
        self.out.extend_from_slice(s.as_bytes());
    }

    pub(crate) fn bin(&mut self, b: &[u8]) {
        let n = b.len();
        if n <= 0xff {
            self.out.extend_from_slice(&[0xc4, n as u8]);
        } else {
            self.header_wide(n, 0xc5, 0xc6);
        }
        self.out.extend_from_slice(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_round_trip_in_smallest_form() {
        let cases: &[(i128, usize)] = &[
            (0, 1),
            (127, 1),
            (128, 2),
            (65_535, 3),
            (65_536, 5),
            (u64::MAX as i128, 9),
            (-1, 1),
            (-32, 1),
            (-33, 2),
            (-129, 3),
            (-32_769, 5),
            (i64::MIN as i128, 9),
        ];
        for &(v, len) in cases {
            let int = if v >= 0 {
                Int::U64(v as u64)
            } else {
                Int::I64(v as i64)
            };
            let mut out = Vec::new();
            Writer { out: &mut out }.int(int);
            assert_eq!(out.len(), len, "{v}");
            let mut r = Reader::new(&out);
            assert_eq!(r.int().expect("int"), int);
            assert_eq!(r.remaining(), 0);
        }
    }

    #[test]
    fn skipping_u32s_stops_where_the_one_by_one_reader_must_take_over() {
        // fixint, uint 8, 16, 32, then a signed form: four skipped, the fifth left.
        let buf = [
            0x05, 0xcc, 0x80, 0xcd, 1, 0, 0xce, 0, 1, 0, 0, 0xd0, 0x07, 0x01,
        ];
        let mut r = Reader::new(&buf);
        assert_eq!(r.skip_u32s(10), 4);
        assert_eq!(r.pos(), 11);
        assert_eq!(r.u32("t").expect("signed 7"), 7);
        assert_eq!(r.skip_u32s(1), 1);
        assert_eq!(r.remaining(), 0);
        // At most `n`, and never past a value cut short.
        let mut r = Reader::new(&buf);
        assert_eq!(r.skip_u32s(2), 2);
        assert_eq!(r.pos(), 3);
        let mut r = Reader::new(&[0x01, 0xce, 0, 0]);
        assert_eq!(r.skip_u32s(2), 1);
        assert_eq!(r.u32("t").unwrap_err().kind(), &ErrorKind::Truncated);
    }

    #[test]
    fn huge_lengths_are_truncation_not_allocation() {
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x00]);
        assert_eq!(r.array_len().unwrap_err().kind(), &ErrorKind::Truncated);
        let mut r = Reader::new(&[0xc6, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.bin().unwrap_err().kind(), &ErrorKind::Truncated);
    }
}
