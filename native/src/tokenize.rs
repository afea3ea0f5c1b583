//! The hash tokenizer of string prompts, natively: `HashTokenizer.encode` of
//! `common/tokenizer.py`, id for id.
//!
//! The Python specification splits text with `re.findall(r"\w+|[^\w\s]", text)` (a run of word
//! characters, or one character that is neither a word character nor a space; spaces separate)
//! and maps each piece to `RESERVED + xxh32(piece as UTF-8, seed 0) % (vocab - RESERVED)`.
//! Which characters are word characters and spaces is CPython's decision (`str.isalnum()` or
//! `_`, and `str.isspace()`), read from its Unicode database into [`table`] by
//! `native/tools/gen_tokenize_table.py`; `tests/unit/test_tokenizer_native.py` holds the two
//! equal on every code point and on random text.
//!
//! [`hash_tokenize_json`] chains the two things the router does with a string prompt: the ids
//! as the JSON array the worker's body carries (no Python int per id) and the prompt's block
//! hashes (`crate::blockhash::chain_digests`), in one pass over one buffer.

mod table {
    include!("tokenize_table.rs");
}

pub use table::UNICODE_VERSION;

/// Ids below this are reserved for role markers and specials (`HashTokenizer.RESERVED`).
pub const RESERVED: u32 = 256;

const P1: u32 = 2_654_435_761;
const P2: u32 = 2_246_822_519;
const P3: u32 = 3_266_489_917;
const P4: u32 = 668_265_263;
const P5: u32 = 374_761_393;

#[inline(always)]
fn round(acc: u32, lane: u32) -> u32 {
    acc.wrapping_add(lane.wrapping_mul(P2)).rotate_left(13).wrapping_mul(P1)
}

#[inline(always)]
fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// XXH32 of `data` (the `xxhash` package's `xxh32_intdigest(data, seed)`).
pub fn xxh32(data: &[u8], seed: u32) -> u32 {
    let len = data.len();
    let mut rest = data;
    let mut h = if len >= 16 {
        let (mut v1, mut v2) = (seed.wrapping_add(P1).wrapping_add(P2), seed.wrapping_add(P2));
        let (mut v3, mut v4) = (seed, seed.wrapping_sub(P1));
        while rest.len() >= 16 {
            v1 = round(v1, le32(&rest[0..]));
            v2 = round(v2, le32(&rest[4..]));
            v3 = round(v3, le32(&rest[8..]));
            v4 = round(v4, le32(&rest[12..]));
            rest = &rest[16..];
        }
        v1.rotate_left(1).wrapping_add(v2.rotate_left(7)).wrapping_add(v3.rotate_left(12)).wrapping_add(v4.rotate_left(18))
    } else {
        seed.wrapping_add(P5)
    };
    h = h.wrapping_add(len as u32);
    while rest.len() >= 4 {
        h = h.wrapping_add(le32(rest).wrapping_mul(P3)).rotate_left(17).wrapping_mul(P4);
        rest = &rest[4..];
    }
    for &b in rest {
        h = h.wrapping_add((b as u32).wrapping_mul(P5)).rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 15;
    h = h.wrapping_mul(P2);
    h ^= h >> 13;
    h = h.wrapping_mul(P3);
    h ^ (h >> 16)
}

const OTHER: u8 = 0;
const WORD: u8 = 1;

/// The class of an ASCII byte: as [`table::RUNS`] says, without the search.
const ASCII: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut c = 0;
    while c < 128 {
        let mut i = 0;
        while i + 1 < table::RUNS.len() && table::RUNS[i + 1].0 <= c as u32 {
            i += 1;
        }
        t[c] = table::RUNS[i].1;
        c += 1;
    }
    t
};

/// 1 a word character (`\w`), 2 a space (`\s`), 0 anything else, as CPython's `re` says.
#[inline]
pub fn class(c: char) -> u8 {
    let c = c as u32;
    if c < 128 {
        return ASCII[c as usize];
    }
    let i = table::RUNS.partition_point(|&(start, _)| start <= c);
    table::RUNS[i - 1].1 // RUNS[0] starts at 0, so i >= 1
}

/// Calls `emit` with each piece of `text` the pattern `\w+|[^\w\s]` finds, in order.
#[inline]
fn pieces(text: &str, mut emit: impl FnMut(&[u8])) {
    let b = text.as_bytes();
    let mut word: Option<usize> = None;
    for (i, c) in text.char_indices() {
        let k = class(c);
        if k == WORD {
            word.get_or_insert(i);
            continue;
        }
        if let Some(s) = word.take() {
            emit(&b[s..i]);
        }
        if k == OTHER {
            emit(&b[i..i + c.len_utf8()]);
        }
    }
    if let Some(s) = word {
        emit(&b[s..]);
    }
}

/// `HashTokenizer(vocab).encode(text)` appended to `out`. `vocab` must exceed [`RESERVED`].
pub fn hash_tokenize(text: &str, vocab: u32, out: &mut Vec<u32>) {
    let span = vocab - RESERVED;
    pieces(text, |p| out.push(RESERVED + xxh32(p, 0) % span));
}

/// `n` in decimal, appended to `out`.
#[inline]
fn push_decimal(out: &mut Vec<u8>, mut n: u32) {
    let mut buf = [0u8; 10];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// A string prompt read for the router in one pass: its ids as a JSON array (the bytes
/// `msgspec.json.encode(ids)` writes: `[1,2,3]`), how many, and the full digests of its blocks
/// chained from `parent` (`chain_digests`). None when a block is too big for `chain_digests`.
pub fn hash_tokenize_json(
    text: &str,
    vocab: u32,
    parent: &[u8; 32],
    block_size: usize,
) -> Option<(Vec<u8>, usize, Vec<[u8; 32]>)> {
    let mut ids: Vec<i64> = Vec::with_capacity(text.len() / 4 + 1);
    let span = vocab - RESERVED;
    pieces(text, |p| ids.push((RESERVED + xxh32(p, 0) % span) as i64));
    let digests = crate::blockhash::chain_digests(parent, &ids, block_size)?;
    let mut json = Vec::with_capacity(ids.len() * 6 + 2);
    json.push(b'[');
    for (i, &id) in ids.iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        push_decimal(&mut json, id as u32);
    }
    json.push(b']');
    Some((json, ids.len(), digests))
}

#[cfg(feature = "python")]
pub(crate) mod py {
    //! `hash_tokenize` and `hash_tokenize_json` for `common/tokenizer.py`.

    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;
    use pyo3::types::PyBytes;

    /// Text longer than this (UTF-8 bytes) is tokenized with the GIL released: the router
    /// sends such prompts to a thread (`_TOKENIZE_INLINE_CHARS` in `router/serving.py`), whose
    /// release lets the event loop run meanwhile. Shorter ones keep it: a release would let
    /// another thread take the loop's GIL for a whole switch interval for a few microseconds
    /// of work.
    const DETACH_BYTES: usize = 64 * 1024;

    fn vocab_ok(vocab: u32) -> PyResult<()> {
        if vocab <= super::RESERVED {
            return Err(PyValueError::new_err("vocab_size must exceed the reserved range"));
        }
        Ok(())
    }

    /// `HashTokenizer(vocab).encode(text)`: the ids of `text`'s pieces.
    #[pyfunction]
    fn hash_tokenize(py: Python<'_>, text: &str, vocab: u32) -> PyResult<Vec<u32>> {
        vocab_ok(vocab)?;
        let run = || {
            let mut out = Vec::with_capacity(text.len() / 4 + 1);
            super::hash_tokenize(text, vocab, &mut out);
            out
        };
        Ok(if text.len() > DETACH_BYTES { py.detach(run) } else { run() })
    }

    /// A string prompt tokenized and hashed in one call: (its ids as the JSON array's bytes,
    /// how many, the wire hashes of its full blocks chained from `parent` under sha256), or
    /// None when a block is too big for one pickle frame (the caller then hashes in Python).
    #[pyfunction]
    #[allow(clippy::type_complexity)]
    fn hash_tokenize_json<'py>(
        py: Python<'py>,
        text: &str,
        vocab: u32,
        parent: &[u8],
        block_size: usize,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, usize, Vec<u64>)>> {
        vocab_ok(vocab)?;
        let p: [u8; 32] = parent
            .try_into()
            .map_err(|_| PyValueError::new_err(format!("parent must be 32 bytes, got {}", parent.len())))?;
        let run = || super::hash_tokenize_json(text, vocab, &p, block_size);
        let got = if text.len() > DETACH_BYTES { py.detach(run) } else { run() };
        Ok(got.map(|(json, n, ds)| {
            (PyBytes::new(py, &json), n, ds.iter().map(crate::blockhash::wire).collect())
        }))
    }

    pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(hash_tokenize, m)?)?;
        m.add_function(wrap_pyfunction!(hash_tokenize_json, m)?)?;
        m.add("TOKENIZER_UNICODE_VERSION", super::UNICODE_VERSION)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh32_reference_vectors() {
        // From the xxHash reference implementation's test vectors / the `xxhash` package.
        assert_eq!(xxh32(b"", 0), 0x02CC_5D05);
        assert_eq!(xxh32(b"a", 0), 0x550D_7456);
        assert_eq!(xxh32(b"abc", 0), 0x32D1_53FF);
        assert_eq!(xxh32(b"Nobody inspects the spammish repetition", 0), 0xE229_3B2F);
    }

    #[test]
    fn pieces_are_words_and_single_others() {
        let mut got = Vec::new();
        pieces("héllo, wörld_1!! \t42", |p| got.push(std::str::from_utf8(p).unwrap().to_string()));
        assert_eq!(got, ["héllo", ",", "wörld_1", "!", "!", "42"]);
    }

    #[test]
    fn classes_of_a_few_characters() {
        assert_eq!(class('a'), WORD);
        assert_eq!(class('_'), WORD);
        assert_eq!(class(' '), 2);
        assert_eq!(class('\u{3000}'), 2); // ideographic space
        assert_eq!(class('中'), WORD);
        assert_eq!(class('٣'), WORD); // Arabic-Indic digit
        assert_eq!(class('€'), OTHER);
        assert_eq!(class('\u{10FFFF}'), OTHER);
    }

    #[test]
    fn ids_are_in_range_and_json_matches_them() {
        let mut ids = Vec::new();
        hash_tokenize("w1 w2, w3", 300, &mut ids);
        assert_eq!(ids.len(), 4);
        assert!(ids.iter().all(|&i| (RESERVED..300).contains(&i)));
        let (json, n, ds) = hash_tokenize_json("w1 w2, w3", 300, &[0u8; 32], 2).unwrap();
        let want = format!("[{}]", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        assert_eq!(std::str::from_utf8(&json).unwrap(), want);
        assert_eq!((n, ds.len()), (4, 2));
        let ids64: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        assert_eq!(ds, crate::blockhash::chain_digests(&[0u8; 32], &ids64, 2).unwrap());
        let (json, n, ds) = hash_tokenize_json("", 300, &[0u8; 32], 2).unwrap();
        assert_eq!((json.as_slice(), n, ds.len()), (b"[]".as_slice(), 0, 0));
    }
}
