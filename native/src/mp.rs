//! A minimal MessagePack reader and writer: exactly what the envelope decode and the snapshot
//! format need, no more.
//!
//! The writer picks the same (smallest) encodings msgspec does, so a snapshot written here is
//! byte-identical to the one the Python reference writes for the same state. The reader is
//! strict in the ways msgspec is (type of every field, UTF-8 strings, no trailing bytes); a
//! caller that meets anything it does not accept hands the record to the Python codec, which
//! then either decodes it or raises the proper schema error.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

pub type Result<T> = std::result::Result<T, DecodeError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(DecodeError(msg.into()))
}

/// A signed or unsigned MessagePack integer, widened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    Neg(i64),
    Pos(u64),
}

impl Int {
    pub fn as_i64(self) -> Result<i64> {
        match self {
            Int::Neg(v) => Ok(v),
            Int::Pos(v) if v <= i64::MAX as u64 => Ok(v as i64),
            Int::Pos(v) => err(format!("integer {v} does not fit in i64")),
        }
    }

    pub fn as_u64(self) -> Result<u64> {
        match self {
            Int::Pos(v) => Ok(v),
            Int::Neg(v) => err(format!("negative integer {v} where u64 expected")),
        }
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    /// Bytes read so far: where the next value starts (for [`Reader::rewind`] and
    /// [`Reader::since`]).
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Go back to `pos` (a value taken from [`Reader::pos`]).
    pub fn rewind(&mut self, pos: usize) {
        self.pos = pos;
    }

    /// The bytes read since `start` (a value taken from [`Reader::pos`]).
    pub fn since(&self, start: usize) -> &'a [u8] {
        &self.buf[start..self.pos]
    }

    fn byte(&mut self) -> Result<u8> {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => err("truncated"),
        }
    }

    fn peek(&self) -> Result<u8> {
        self.buf.get(self.pos).copied().ok_or_else(|| DecodeError("truncated".into()))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return err("truncated");
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64> {
        let s = self.take(n)?;
        let mut v = 0u64;
        for &b in s {
            v = (v << 8) | b as u64;
        }
        Ok(v)
    }

    /// True (and consumed) if the next value is nil.
    pub fn nil(&mut self) -> Result<bool> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    pub fn int(&mut self) -> Result<Int> {
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => Int::Pos(b as u64),
            0xe0..=0xff => Int::Neg(b as i8 as i64),
            0xcc => Int::Pos(self.be(1)?),
            0xcd => Int::Pos(self.be(2)?),
            0xce => Int::Pos(self.be(4)?),
            0xcf => Int::Pos(self.be(8)?),
            0xd0 => signed(self.be(1)? as u8 as i8 as i64),
            0xd1 => signed(self.be(2)? as u16 as i16 as i64),
            0xd2 => signed(self.be(4)? as u32 as i32 as i64),
            0xd3 => signed(self.be(8)? as i64),
            _ => return err(format!("expected int, got 0x{b:02x}")),
        })
    }

    pub fn i64(&mut self) -> Result<i64> {
        self.int()?.as_i64()
    }

    pub fn u64(&mut self) -> Result<u64> {
        self.int()?.as_u64()
    }

    pub fn bool(&mut self) -> Result<bool> {
        match self.byte()? {
            0xc2 => Ok(false),
            0xc3 => Ok(true),
            b => err(format!("expected bool, got 0x{b:02x}")),
        }
    }

    pub fn str(&mut self) -> Result<&'a str> {
        utf8(self.str_bytes()?)
    }

    /// A str's bytes, not yet checked to be UTF-8: for map keys compared with ASCII names (a
    /// key equal to one is valid UTF-8; the caller checks any other with [`utf8`]).
    #[inline(always)]
    pub fn str_bytes(&mut self) -> Result<&'a [u8]> {
        // Fast path: a fixstr (up to 31 bytes: keys, ids, names).
        if let Some(&b) = self.buf.get(self.pos) {
            if b & 0xe0 == 0xa0 {
                let end = self.pos + 1 + (b & 0x1f) as usize;
                if let Some(s) = self.buf.get(self.pos + 1..end) {
                    self.pos = end;
                    return Ok(s);
                }
            }
        }
        self.str_bytes_long()
    }

    #[cold]
    fn str_bytes_long(&mut self) -> Result<&'a [u8]> {
        let b = self.byte()?;
        let n = match b {
            0xa0..=0xbf => (b & 0x1f) as usize,
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            _ => return err(format!("expected str, got 0x{b:02x}")),
        };
        self.take(n)
    }

    pub fn bin(&mut self) -> Result<&'a [u8]> {
        let b = self.byte()?;
        let n = match b {
            0xc4 => self.be(1)? as usize,
            0xc5 => self.be(2)? as usize,
            0xc6 => self.be(4)? as usize,
            _ => return err(format!("expected bin, got 0x{b:02x}")),
        };
        self.take(n)
    }

    pub fn array_len(&mut self) -> Result<usize> {
        let b = self.byte()?;
        Ok(match b {
            0x90..=0x9f => (b & 0x0f) as usize,
            0xdc => self.be(2)? as usize,
            0xdd => self.be(4)? as usize,
            _ => return err(format!("expected array, got 0x{b:02x}")),
        })
    }

    pub fn map_len(&mut self) -> Result<usize> {
        let b = self.byte()?;
        Ok(match b {
            0x80..=0x8f => (b & 0x0f) as usize,
            0xde => self.be(2)? as usize,
            0xdf => self.be(4)? as usize,
            _ => return err(format!("expected map, got 0x{b:02x}")),
        })
    }

    /// An array of non-negative integers (block hashes).
    pub fn u64_array(&mut self, out: &mut Vec<u64>) -> Result<()> {
        let n = self.array_len()?;
        out.clear();
        // Fast path: every element a uint64, what 64-bit hashes almost always encode to.
        if let Some(body) = self.buf[self.pos..].get(..n * 9) {
            if body.chunks_exact(9).all(|c| c[0] == 0xcf) {
                out.extend(body.chunks_exact(9).map(|c| u64::from_be_bytes(c[1..].try_into().unwrap())));
                self.pos += n * 9;
                return Ok(());
            }
        }
        // Each element takes a byte at least: a length beyond the bytes left is refused below,
        // without reserving memory for it first.
        out.reserve(n.min(self.buf.len() - self.pos));
        for _ in 0..n {
            out.push(self.u64()?);
        }
        Ok(())
    }

    /// An array of integers, validated and discarded.
    pub fn skip_int_array(&mut self) -> Result<()> {
        let n = self.array_len()?;
        for _ in 0..n {
            self.int()?;
        }
        Ok(())
    }

    /// Skip any one value (checking it is well formed: what msgspec.Raw accepts).
    pub fn skip(&mut self) -> Result<()> {
        let b = self.byte()?;
        match b {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => {}
            0x80..=0x8f => self.skip_n(2 * (b & 0x0f) as usize)?,
            0x90..=0x9f => self.skip_n((b & 0x0f) as usize)?,
            0xa0..=0xbf => {
                self.take((b & 0x1f) as usize)?;
            }
            0xc4 | 0xd9 => {
                let n = self.be(1)? as usize;
                self.take(n)?;
            }
            0xc5 | 0xda => {
                let n = self.be(2)? as usize;
                self.take(n)?;
            }
            0xc6 | 0xdb => {
                let n = self.be(4)? as usize;
                self.take(n)?;
            }
            0xcc | 0xd0 => {
                self.take(1)?;
            }
            0xcd | 0xd1 => {
                self.take(2)?;
            }
            0xce | 0xd2 | 0xca => {
                self.take(4)?;
            }
            0xcf | 0xd3 | 0xcb => {
                self.take(8)?;
            }
            0xd4 => {
                self.take(2)?;
            }
            0xd5 => {
                self.take(3)?;
            }
            0xd6 => {
                self.take(5)?;
            }
            0xd7 => {
                self.take(9)?;
            }
            0xd8 => {
                self.take(17)?;
            }
            0xc7 => {
                let n = self.be(1)? as usize;
                self.take(n + 1)?;
            }
            0xc8 => {
                let n = self.be(2)? as usize;
                self.take(n + 1)?;
            }
            0xc9 => {
                let n = self.be(4)? as usize;
                self.take(n + 1)?;
            }
            0xdc => {
                let n = self.be(2)? as usize;
                self.skip_n(n)?;
            }
            0xdd => {
                let n = self.be(4)? as usize;
                self.skip_n(n)?;
            }
            0xde => {
                let n = self.be(2)? as usize;
                self.skip_n(2 * n)?;
            }
            0xdf => {
                let n = self.be(4)? as usize;
                self.skip_n(2 * n)?;
            }
            0xc1 => return err("reserved byte 0xc1"),
        }
        Ok(())
    }

    fn skip_n(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            self.skip()?;
        }
        Ok(())
    }

    /// The raw bytes of the next value.
    pub fn raw(&mut self) -> Result<&'a [u8]> {
        let start = self.pos;
        self.skip()?;
        Ok(&self.buf[start..self.pos])
    }
}

/// `bytes` as a str if they are UTF-8 (ASCII, the common case, checked word-wise first).
#[inline]
pub fn utf8(bytes: &[u8]) -> Result<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII is valid UTF-8.
        return Ok(unsafe { std::str::from_utf8_unchecked(bytes) });
    }
    std::str::from_utf8(bytes).map_err(|_| DecodeError("invalid utf-8".into()))
}

fn signed(v: i64) -> Int {
    if v >= 0 {
        Int::Pos(v as u64)
    } else {
        Int::Neg(v)
    }
}

/// Appends MessagePack to a byte vector, with msgspec's choice of encodings.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Writer { buf: Vec::new() }
    }

    pub fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else if v >= i8::MIN as i64 {
            self.buf.push(0xd0);
            self.buf.push(v as i8 as u8);
        } else if v >= i16::MIN as i64 {
            self.buf.push(0xd1);
            self.buf.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.buf.push(0xd2);
            self.buf.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn uint(&mut self, v: u64) {
        if v <= 0x7f {
            self.buf.push(v as u8);
        } else if v <= 0xff {
            self.buf.push(0xcc);
            self.buf.push(v as u8);
        } else if v <= 0xffff {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= 0xffff_ffff {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn bool(&mut self, v: bool) {
        self.buf.push(if v { 0xc3 } else { 0xc2 });
    }

    pub fn str(&mut self, s: &str) {
        self.len_header(s.len(), 0xa0, 32, 0xd9, 0xda, 0xdb);
        self.buf.extend_from_slice(s.as_bytes());
    }

    /// A bin header for ``n`` bytes; the caller appends them.
    pub fn bin_header(&mut self, n: usize) {
        self.len_header(n, 0, 0, 0xc4, 0xc5, 0xc6);
    }

    pub fn array(&mut self, n: usize) {
        self.len_header(n, 0x90, 16, 0, 0xdc, 0xdd);
    }

    pub fn map(&mut self, n: usize) {
        self.len_header(n, 0x80, 16, 0, 0xde, 0xdf);
    }

    /// The length prefix of a str, bin, array or map in its smallest form: `fix_tag | n` below
    /// `fix_limit` (0: the type has no fix form), else the 8-bit (`tag8`; 0: none), 16-bit or
    /// 32-bit form.
    fn len_header(&mut self, n: usize, fix_tag: u8, fix_limit: usize, tag8: u8, tag16: u8, tag32: u8) {
        if n < fix_limit {
            self.buf.push(fix_tag | n as u8);
        } else if tag8 != 0 && n <= 0xff {
            self.buf.push(tag8);
            self.buf.push(n as u8);
        } else if n <= 0xffff {
            self.buf.push(tag16);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(tag32);
            self.buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_round_trip_in_smallest_form() {
        for &(v, len) in &[
            (0i64, 1usize),
            (127, 1),
            (128, 2),
            (255, 2),
            (256, 3),
            (65535, 3),
            (65536, 5),
            (1 << 32, 9),
            (-1, 1),
            (-32, 1),
            (-33, 2),
            (-128, 2),
            (-129, 3),
            (-32769, 5),
            (i64::MIN, 9),
        ] {
            let mut w = Writer::new();
            w.int(v);
            assert_eq!(w.buf.len(), len, "{v}");
            let mut r = Reader::new(&w.buf);
            assert_eq!(r.i64().unwrap(), v);
            assert!(r.at_end());
        }
        let mut w = Writer::new();
        w.uint(u64::MAX);
        assert_eq!(Reader::new(&w.buf).u64().unwrap(), u64::MAX);
        assert!(Reader::new(&w.buf).i64().is_err());
    }

    #[test]
    fn strings_arrays_maps_and_skip() {
        let mut w = Writer::new();
        w.map(2);
        w.str("a");
        w.array(17);
        for i in 0..17 {
            w.uint(i * 1000);
        }
        w.str(&"x".repeat(40));
        w.bin_header(3);
        w.buf.extend_from_slice(b"abc");
        let mut r = Reader::new(&w.buf);
        let copy = r.raw().unwrap();
        assert_eq!(copy.len(), w.buf.len());
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.map_len().unwrap(), 2);
        assert_eq!(r.str().unwrap(), "a");
        let mut v = Vec::new();
        r.u64_array(&mut v).unwrap();
        assert_eq!(v[16], 16000);
        assert_eq!(r.str().unwrap().len(), 40);
        assert_eq!(r.bin().unwrap(), b"abc");
        assert!(r.at_end());
    }

    #[test]
    fn an_array_longer_than_its_bytes_is_refused_without_reserving_it() {
        let mut out = Vec::new();
        // array32 of 2^32 - 1 elements, then one.
        assert!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]).u64_array(&mut out).is_err());
        assert!(out.capacity() < 16);
        let mut w = Writer::new();
        w.array(3);
        for v in [1u64, u64::MAX, 300] {
            w.uint(v);
        }
        Reader::new(&w.buf).u64_array(&mut out).unwrap();
        assert_eq!(out, vec![1, u64::MAX, 300]);
    }

    #[test]
    fn truncated_and_wrong_types_are_errors() {
        assert!(Reader::new(&[0xcf, 1, 2]).u64().is_err());
        assert!(Reader::new(&[0xa3, b'a']).str().is_err());
        assert!(Reader::new(&[0xc3]).int().is_err());
        assert!(Reader::new(&[0xa1, 0xff]).str().is_err());
        assert!(Reader::new(&[0xc1]).skip().is_err());
    }
}
