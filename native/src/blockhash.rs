//! vLLM's default prefix-caching block hash (`sha256(pickle.dumps((parent, tokens, None), 5))`),
//! natively, for the simulated engine's hot paths (trace replay hashes ~1.4M blocks).
//!
//! Bit-compatible with `common/hashing.py` for `HashAlgo.SHA256` without extra
//! keys: [`pickle_block`] writes exactly the bytes CPython's pickler writes for that tuple
//! (protocol 5, one frame), and [`sha256`] is FIPS 180-4 (SHA-NI when the CPU has it, portable
//! otherwise). The Python tests compare both against `pickle` + `hashlib` on random blocks.
//!
//! [`mooncake_chain`] also synthesizes the tokens of Mooncake trace blocks
//! (`data_plane/engines/trace.py::trace_token`: `mix64(hash_id * trace_block_size + pos) %
//! vocab`), so a trace's prompts are hashed without a token ever reaching Python.

/// SHA-256 round constants.
const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

pub(crate) const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

fn compress_soft(state: &mut [u32; 8], block: &[u8]) {
    let mut w = [0u32; 64];
    for i in 0..16 {
        w[i] = u32::from_be_bytes([block[4 * i], block[4 * i + 1], block[4 * i + 2], block[4 * i + 3]]);
    }
    for i in 16..64 {
        let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
        let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = *state;
    for i in 0..64 {
        let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
        let ch = (e & f) ^ (!e & g);
        let t1 = h.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[i]).wrapping_add(w[i]);
        let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
        let maj = (a & b) ^ (a & c) ^ (b & c);
        let t2 = s0.wrapping_add(maj);
        h = g;
        g = f;
        f = e;
        e = d.wrapping_add(t1);
        d = c;
        c = b;
        b = a;
        a = t1.wrapping_add(t2);
    }
    for (s, v) in state.iter_mut().zip([a, b, c, d, e, f, g, h]) {
        *s = s.wrapping_add(v);
    }
}

#[cfg(target_arch = "x86_64")]
mod shani {
    //! The SHA extensions' compression function (the well-known Intel arrangement: state as
    //! ABEF/CDGH, four rounds per `sha256rnds2` pair, message schedule by `sha256msg1/2`).
    use core::arch::x86_64::*;

    pub fn available() -> bool {
        is_x86_feature_detected!("sha") && is_x86_feature_detected!("sse4.1") && is_x86_feature_detected!("ssse3")
    }

    #[inline(always)]
    unsafe fn rounds4(abef: &mut __m128i, cdgh: &mut __m128i, w: __m128i, i: usize) {
        let k = _mm_loadu_si128(super::K.as_ptr().add(4 * i) as *const __m128i);
        let t1 = _mm_add_epi32(w, k);
        *cdgh = _mm_sha256rnds2_epu32(*cdgh, *abef, t1);
        let t2 = _mm_shuffle_epi32(t1, 0x0E);
        *abef = _mm_sha256rnds2_epu32(*abef, *cdgh, t2);
    }

    #[inline(always)]
    unsafe fn schedule(v0: __m128i, v1: __m128i, v2: __m128i, v3: __m128i) -> __m128i {
        let t1 = _mm_sha256msg1_epu32(v0, v1);
        let t2 = _mm_alignr_epi8(v3, v2, 4);
        let t3 = _mm_add_epi32(t1, t2);
        _mm_sha256msg2_epu32(t3, v3)
    }

    /// # Safety
    /// The CPU must have SHA, SSE4.1 and SSSE3 ([`available`]); `blocks.len()` a multiple of 64.
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub unsafe fn compress(state: &mut [u32; 8], blocks: &[u8]) {
        let mask = _mm_set_epi64x(0x0C0D_0E0F_0809_0A0Bu64 as i64, 0x0405_0607_0001_0203u64 as i64);
        let sp = state.as_ptr() as *const __m128i;
        let dcba = _mm_loadu_si128(sp);
        let efgh = _mm_loadu_si128(sp.add(1));
        let cdab = _mm_shuffle_epi32(dcba, 0xB1);
        let efgh = _mm_shuffle_epi32(efgh, 0x1B);
        let mut abef = _mm_alignr_epi8(cdab, efgh, 8);
        let mut cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
        for block in blocks.chunks_exact(64) {
            let (abef_save, cdgh_save) = (abef, cdgh);
            let dp = block.as_ptr() as *const __m128i;
            let mut w0 = _mm_shuffle_epi8(_mm_loadu_si128(dp), mask);
            let mut w1 = _mm_shuffle_epi8(_mm_loadu_si128(dp.add(1)), mask);
            let mut w2 = _mm_shuffle_epi8(_mm_loadu_si128(dp.add(2)), mask);
            let mut w3 = _mm_shuffle_epi8(_mm_loadu_si128(dp.add(3)), mask);
            rounds4(&mut abef, &mut cdgh, w0, 0);
            rounds4(&mut abef, &mut cdgh, w1, 1);
            rounds4(&mut abef, &mut cdgh, w2, 2);
            rounds4(&mut abef, &mut cdgh, w3, 3);
            // Rounds 16..64: each new schedule word group needs the previous four.
            for i in 4..16 {
                let w4 = schedule(w0, w1, w2, w3);
                rounds4(&mut abef, &mut cdgh, w4, i);
                w0 = w1;
                w1 = w2;
                w2 = w3;
                w3 = w4;
            }
            abef = _mm_add_epi32(abef, abef_save);
            cdgh = _mm_add_epi32(cdgh, cdgh_save);
        }
        let feba = _mm_shuffle_epi32(abef, 0x1B);
        let dchg = _mm_shuffle_epi32(cdgh, 0xB1);
        let dcba = _mm_blend_epi16(feba, dchg, 0xF0);
        let hgef = _mm_alignr_epi8(dchg, feba, 8);
        let out = state.as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(out, dcba);
        _mm_storeu_si128(out.add(1), hgef);
    }
}

pub(crate) fn compress(state: &mut [u32; 8], blocks: &[u8], hw: bool) {
    #[cfg(target_arch = "x86_64")]
    if hw {
        // SAFETY: `hw` is only true when `shani::available()` said so.
        unsafe { shani::compress(state, blocks) };
        return;
    }
    let _ = hw;
    for b in blocks.chunks_exact(64) {
        compress_soft(state, b);
    }
}

/// Whether [`sha256`] uses the CPU's SHA extensions here.
pub fn hardware_sha() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        shani::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// SHA-256 of `data`, with the hardware path when `hw` (callers pass [`hardware_sha`]).
pub fn sha256_with(data: &[u8], hw: bool) -> [u8; 32] {
    let mut state = H0;
    let full = data.len() / 64 * 64;
    compress(&mut state, &data[..full], hw);
    let rest = &data[full..];
    let mut tail = [0u8; 128];
    tail[..rest.len()].copy_from_slice(rest);
    tail[rest.len()] = 0x80;
    let tail_len = if rest.len() + 9 <= 64 { 64 } else { 128 };
    tail[tail_len - 8..tail_len].copy_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    compress(&mut state, &tail[..tail_len], hw);
    let mut out = [0u8; 32];
    for (i, s) in state.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&s.to_be_bytes());
    }
    out
}

pub fn sha256(data: &[u8]) -> [u8; 32] {
    sha256_with(data, hardware_sha())
}

/// CPython's pickler starts a new frame once one reaches 64 KiB; we only write single-frame
/// pickles, so a block whose pickle would not fit in one is refused (the caller falls back).
const MAX_FRAME: usize = 64 * 1024 - 64;

/// One int as `pickle.Pickler.save_long` writes it at protocol >= 2, at `buf[at..]`; returns
/// the new end. `buf` has room for 10 more bytes.
#[inline(always)]
fn put_int(buf: &mut [u8], at: usize, v: i64) -> usize {
    if (0..=0x7fff_ffff).contains(&v) {
        // Token ids: BININT1 / BININT2 / BININT by size, written without a branch on which
        // (random token ids would mispredict half the time). The 4 value bytes are always
        // written; the next int overwrites the ones this opcode does not use.
        let c = (v > 0xff) as usize + (v > 0xffff) as usize;
        buf[at] = [b'K', b'M', b'J'][c];
        buf[at + 1..at + 5].copy_from_slice(&(v as u32).to_le_bytes());
        return at + [2, 3, 5][c];
    }
    if (0..=0xff).contains(&v) {
        buf[at] = b'K';
        buf[at + 1] = v as u8;
        at + 2
    } else if (0..=0xffff).contains(&v) {
        buf[at] = b'M';
        buf[at + 1..at + 3].copy_from_slice(&(v as u16).to_le_bytes());
        at + 3
    } else if (-0x8000_0000..=0x7fff_ffff).contains(&v) {
        buf[at] = b'J';
        buf[at + 1..at + 5].copy_from_slice(&(v as i32).to_le_bytes());
        at + 5
    } else {
        // LONG1: minimal two's-complement little-endian bytes (pickle.encode_long).
        let bytes = v.to_le_bytes();
        let mut n = 8;
        while n > 1 {
            let top = bytes[n - 1];
            let next_sign = bytes[n - 2] & 0x80;
            if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        buf[at] = 0x8a;
        buf[at + 1] = n as u8;
        buf[at + 2..at + 2 + n].copy_from_slice(&bytes[..n]);
        at + 2 + n
    }
}

/// `pickle.dumps((parent, tuple(tokens), None), protocol=5)` as `out[..len]` (the buffer is
/// reused: it only grows), for a 32-byte `parent`. None if the pickle would need more than one
/// frame.
pub fn pickle_block(out: &mut Vec<u8>, parent: &[u8; 32], tokens: impl ExactSizeIterator<Item = i64>) -> Option<usize> {
    let n = tokens.len();
    // At most 10 bytes a token (LONG1 of 8 bytes) plus the fixed 52.
    if out.len() < n * 10 + 64 {
        out.resize(n * 10 + 64, 0);
    }
    let buf = &mut out[..];
    // PROTO 5, FRAME <len, patched below>, SHORT_BINBYTES 32 <parent>, MEMOIZE.
    buf[..13].copy_from_slice(&[0x80, 5, 0x95, 0, 0, 0, 0, 0, 0, 0, 0, b'C', 32]);
    buf[13..45].copy_from_slice(parent);
    buf[45] = 0x94;
    let mut at = 46;
    match n {
        0 => {
            buf[at] = b')'; // EMPTY_TUPLE is not memoized
            at += 1;
        }
        1..=3 => {
            for t in tokens {
                at = put_int(buf, at, t);
            }
            buf[at] = [0x85, 0x86, 0x87][n - 1]; // TUPLE1/2/3
            buf[at + 1] = 0x94; // MEMOIZE
            at += 2;
        }
        _ => {
            buf[at] = b'(';
            at += 1;
            for t in tokens {
                at = put_int(buf, at, t);
            }
            buf[at] = b't';
            buf[at + 1] = 0x94;
            at += 2;
        }
    }
    // NONE, TUPLE3, MEMOIZE, STOP.
    buf[at..at + 4].copy_from_slice(&[b'N', 0x87, 0x94, b'.']);
    at += 4;
    let frame = at - 11;
    if frame >= MAX_FRAME {
        return None;
    }
    buf[3..11].copy_from_slice(&(frame as u64).to_le_bytes());
    Some(at)
}

/// `x % d` for a fixed nonzero `d` without a division (Lemire, Kaser & Kurz, "Faster remainder
/// by direct computation", 2019: exact for every 64-bit `x` with a 128-bit multiplier).
#[derive(Clone, Copy)]
pub struct FastMod {
    m: u128,
    d: u64,
}

impl FastMod {
    pub fn new(d: u64) -> Self {
        assert!(d > 0);
        FastMod { m: (u128::MAX / d as u128).wrapping_add(1), d }
    }

    #[inline(always)]
    pub fn rem(self, x: u64) -> u64 {
        if self.d == 1 {
            return 0;
        }
        let low = self.m.wrapping_mul(x as u128);
        // The high 64 bits of the 192-bit product low * d.
        let d = self.d as u128;
        let lo = (low as u64 as u128) * d;
        let hi = (low >> 64) * d;
        ((hi + (lo >> 64)) >> 64) as u64
    }
}

/// Chained digests of every full block of `tokens` from `parent`: what `hash_block_digests`
/// returns for sha256 without extra keys. None if a block's pickle needs several frames.
pub fn chain_digests(parent: &[u8; 32], tokens: &[i64], block_size: usize) -> Option<Vec<[u8; 32]>> {
    let hw = hardware_sha();
    let mut buf = Vec::with_capacity(block_size * 5 + 64);
    let mut p = *parent;
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size == 0 {
        return Some(out);
    }
    for block in tokens.chunks_exact(block_size) {
        let len = pickle_block(&mut buf, &p, block.iter().copied())?;
        p = sha256_with(&buf[..len], hw);
        out.push(p);
    }
    Some(out)
}

/// A digest's wire form (`common/hashing.py::to_wire`): its last 8 bytes, big-endian.
#[inline]
pub fn wire(d: &[u8; 32]) -> u64 {
    u64::from_be_bytes(d[24..].try_into().unwrap())
}

/// JSON's insignificant whitespace (RFC 8259).
#[inline(always)]
fn json_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The token ids of `json` when it is one JSON array of plain integers `0 <= id < vocab`, each
/// written as digits only (no sign, fraction, exponent or leading zero), with JSON whitespace
/// anywhere between tokens: appended to `out`, true. False for anything else, with `out` in any
/// state: not an error, only "not this narrow form", and the caller reads the prompt the
/// general way (which words the client's error). Every id of this form is the one a JSON parser
/// reads; no prompt it accepts reads differently there.
pub fn json_token_ids(json: &[u8], vocab: u64, out: &mut Vec<i64>) -> bool {
    let n = json.len();
    let mut i = 0;
    let skip = |mut i: usize| {
        while i < n && json_ws(json[i]) {
            i += 1;
        }
        i
    };
    i = skip(i);
    if i == n || json[i] != b'[' {
        return false;
    }
    i = skip(i + 1);
    if i < n && json[i] == b']' {
        return skip(i + 1) == n;
    }
    // 19 digits always fit in a u64 (10^19 - 1 < 2^64); a longer one is beyond any vocabulary.
    let limit = vocab.min(i64::MAX as u64);
    loop {
        let start = i;
        let mut v: u64 = 0;
        while i < n && json[i].is_ascii_digit() {
            if i - start == 19 {
                return false;
            }
            v = v * 10 + (json[i] - b'0') as u64;
            i += 1;
        }
        let len = i - start;
        if len == 0 || (len > 1 && json[start] == b'0') || v >= limit {
            return false;
        }
        out.push(v as i64);
        i = skip(i);
        if i == n {
            return false;
        }
        match json[i] {
            b',' => i = skip(i + 1),
            b']' => return skip(i + 1) == n,
            _ => return false,
        }
    }
}

/// SplitMix64's finaliser (`data_plane/engines/request.py::mix64`).
#[inline]
pub fn mix64(x: u64) -> u64 {
    let mut x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `pseudo_token(seed, i, vocab)` for `i` in `start..stop` (`data_plane/engines/request.py`:
/// `mix64(seed ^ (i * GOLDEN mod 2**64)) % vocab`), the engine's generated tokens.
pub fn pseudo_tokens(seed: u64, start: u64, stop: u64, vocab: u64) -> Vec<u64> {
    let m = FastMod::new(vocab.max(1));
    (start..stop).map(|i| m.rem(mix64(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))).collect()
}

/// `mix64(base + i) % vocab` for `i` in `start..stop` (64-bit wrapping): token `i` of the trace
/// block whose `base` is `hash_id * trace_block_size` (`trace.py::trace_token`).
pub fn trace_tokens(base: u64, start: u64, stop: u64, vocab: u64) -> Vec<u64> {
    let m = FastMod::new(vocab.max(1));
    (start..stop).map(|i| m.rem(mix64(base.wrapping_add(i)))).collect()
}

/// Chained digests of a run of Mooncake trace blocks: the first `blocks[k]` engine blocks of
/// trace block `hash_ids[k]`, for each k in order, all chained from `parent`. None on mismatched
/// lengths or a block too big for one pickle frame.
pub fn mooncake_chain(
    parent: &[u8; 32],
    hash_ids: &[i64],
    blocks: &[u32],
    block_size: usize,
    trace_block_size: u64,
    vocab: u64,
) -> Option<Vec<[u8; 32]>> {
    if hash_ids.len() != blocks.len() || vocab == 0 {
        return None;
    }
    let hw = hardware_sha();
    let modv = FastMod::new(vocab);
    let total: usize = blocks.iter().map(|&b| b as usize).sum();
    let mut out: Vec<[u8; 32]> = Vec::with_capacity(total);
    let mut buf = Vec::with_capacity(block_size * 5 + 64);
    let mut p = *parent;
    for (&h, &nb) in hash_ids.iter().zip(blocks) {
        // Python's ints wrap the same way: mix64 first reduces its argument modulo 2**64.
        let base = (h as u64).wrapping_mul(trace_block_size);
        for k in 0..nb as usize {
            let start = (k * block_size) as u64;
            let toks = (0..block_size).map(|j| modv.rem(mix64(base.wrapping_add(start + j as u64))) as i64);
            let len = pickle_block(&mut buf, &p, toks)?;
            p = sha256_with(&buf[..len], hw);
            out.push(p);
        }
    }
    Some(out)
}

/// The prompt digests of Mooncake trace records, memoised per trace block: what
/// `data_plane/engines/trace.py::MooncakeTrace.digests` computes, with the memo on this side so
/// a record costs one call. A *segment* is the full engine blocks of the first `n` tokens of
/// trace block `h` after a given parent segment; equal (parent, h, n) is equal tokens after an
/// equal chain, so equal digests.
pub struct MooncakeHasher {
    none_hash: [u8; 32],
    block_size: usize,
    trace_block_size: usize,
    vocab: u64,
    memo: std::collections::HashMap<(u32, i64, u32), u32>,
    /// Segment s's digests are `digests[seg_start[s]..seg_start[s + 1]]`.
    seg_start: Vec<u32>,
    digests: Vec<[u8; 32]>,
    hw: bool,
    buf: Vec<u8>,
}

/// The parent "segment" of a record's first trace block.
const ROOT: u32 = u32::MAX;

impl MooncakeHasher {
    pub fn new(none_hash: [u8; 32], block_size: usize, trace_block_size: usize, vocab: u64) -> Option<Self> {
        if block_size == 0 || trace_block_size % block_size != 0 || vocab == 0 {
            return None;
        }
        Some(MooncakeHasher {
            none_hash,
            block_size,
            trace_block_size,
            vocab,
            memo: std::collections::HashMap::new(),
            seg_start: vec![0],
            digests: Vec::new(),
            hw: hardware_sha(),
            buf: Vec::new(),
        })
    }

    /// Digests of the full engine blocks of a prompt of `length` tokens over `hash_ids`
    /// (`length` already clamped to `hash_ids.len() * trace_block_size`), appended to `out`.
    /// None if a block is too big for one pickle frame.
    pub fn digests(&mut self, hash_ids: &[i64], length: usize, out: &mut Vec<[u8; 32]>) -> Option<()> {
        let (bs, tbs) = (self.block_size, self.trace_block_size);
        let modv = FastMod::new(self.vocab);
        let mut parent = ROOT;
        let mut remaining = length;
        for &h in hash_ids {
            if remaining == 0 {
                break;
            }
            let n = remaining.min(tbs);
            let key = (parent, h, n as u32);
            let seg = match self.memo.get(&key) {
                Some(&s) => s,
                None => {
                    let mut p = if parent == ROOT {
                        self.none_hash
                    } else {
                        let end = self.seg_start[parent as usize + 1] as usize;
                        self.digests[end - 1]
                    };
                    let base = (h as u64).wrapping_mul(tbs as u64);
                    for k in 0..n / bs {
                        let start = (k * bs) as u64;
                        let toks = (0..bs).map(|j| modv.rem(mix64(base.wrapping_add(start + j as u64))) as i64);
                        let len = pickle_block(&mut self.buf, &p, toks)?;
                        p = sha256_with(&self.buf[..len], self.hw);
                        self.digests.push(p);
                    }
                    let s = (self.seg_start.len() - 1) as u32;
                    self.seg_start.push(self.digests.len() as u32);
                    self.memo.insert(key, s);
                    s
                }
            };
            let (a, b) = (self.seg_start[seg as usize] as usize, self.seg_start[seg as usize + 1] as usize);
            out.extend_from_slice(&self.digests[a..b]);
            if n < tbs || a == b {
                break; // the partial last trace block, or one shorter than an engine block
            }
            parent = seg;
            remaining -= n;
        }
        Some(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn sha256_known_vectors_both_paths() {
        let cases: [(&[u8], &str); 3] = [
            (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
            (
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
                "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
            ),
        ];
        for (data, want) in cases {
            assert_eq!(hex(&sha256_with(data, false)), want);
            if hardware_sha() {
                assert_eq!(hex(&sha256_with(data, true)), want);
            }
        }
        // Every length around the padding boundaries: hardware and portable paths agree.
        if hardware_sha() {
            let data: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
            for n in 0..data.len() {
                assert_eq!(sha256_with(&data[..n], true), sha256_with(&data[..n], false), "len {n}");
            }
        }
    }

    #[test]
    fn pickle_ints_use_the_smallest_opcode() {
        let mut out = [0u8; 16];
        for (v, want) in [
            (0i64, vec![b'K', 0]),
            (255, vec![b'K', 255]),
            (256, vec![b'M', 0, 1]),
            (65536, vec![b'J', 0, 0, 1, 0]),
            (-1, vec![b'J', 255, 255, 255, 255]),
            (1 << 31, vec![0x8a, 5, 0, 0, 0, 128, 0]),
            (-(1 << 31) - 1, vec![0x8a, 5, 255, 255, 255, 127, 255]),
        ] {
            let end = put_int(&mut out, 0, v);
            assert_eq!(out[..end], want[..], "{v}");
        }
    }

    #[test]
    fn json_token_ids_reads_only_plain_arrays_of_ids_below_vocab() {
        let read = |s: &str, vocab: u64| {
            let mut out = Vec::new();
            json_token_ids(s.as_bytes(), vocab, &mut out).then_some(out)
        };
        assert_eq!(read("[1,2,3]", 10), Some(vec![1, 2, 3]));
        assert_eq!(read(" [ 0 ,\n9\t,\r10 ] ", 11), Some(vec![0, 9, 10]));
        assert_eq!(read("[]", 10), Some(vec![]));
        assert_eq!(read("[ ]", 10), Some(vec![]));
        assert_eq!(read("[9223372036854775806]", u64::MAX), Some(vec![i64::MAX - 1]));
        for bad in [
            "", "[", "]", "[1", "[1,]", "[,1]", "[1 2]", "[1,,2]", "[01]", "[00]", "[-1]", "[-0]", "[+1]",
            "[1.0]", "[1e2]", "[1E2]", "[\"1\"]", "[true]", "[null]", "[[1]]", "[1]x", "[1] [2]", "1",
            "{}", "[9223372036854775807]", "[12345678901234567890]", "[1\u{a0}]",
        ] {
            assert_eq!(read(bad, u64::MAX), None, "{bad:?}");
        }
        assert_eq!(read("[9,10]", 10), None, "an id at the vocabulary's size");
        // The ids hash as the same list would.
        let none = sha256(b"vllm-none-hash");
        let ids: Vec<i64> = (5000..5000 + 130).collect();
        let text = format!("[{}]", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
        let mut out = Vec::new();
        assert!(json_token_ids(text.as_bytes(), 128_256, &mut out));
        assert_eq!(chain_digests(&none, &out, 64), chain_digests(&none, &ids, 64));
    }

    #[test]
    fn fastmod_is_the_remainder() {
        let mut x = 0x1234_5678_9abc_def0u64;
        for d in [1u64, 2, 3, 7, 64, 1000, 128_256, 151_936, u32::MAX as u64, (1 << 40) + 3, u64::MAX] {
            let f = FastMod::new(d);
            for v in [0, 1, d - 1, d, d.wrapping_add(1), u64::MAX, u64::MAX - 1] {
                assert_eq!(f.rem(v), v % d, "{v} % {d}");
            }
            for _ in 0..10_000 {
                x = mix64(x);
                assert_eq!(f.rem(x), x % d, "{x} % {d}");
            }
        }
    }

    #[test]
    fn mooncake_chain_equals_hashing_its_tokens() {
        let none = sha256(b"vllm-none-hash");
        let all = mooncake_chain(&none, &[7, 8], &[2, 1], 4, 8, 1000).unwrap();
        let toks: Vec<i64> = [7u64, 8]
            .iter()
            .flat_map(|&h| (0..8u64).map(move |p| (mix64(h * 8 + p) % 1000) as i64))
            .collect();
        let direct = chain_digests(&none, &toks[..12], 4).unwrap();
        assert_eq!(all, direct);
        // The memoising hasher: a record over [7, 8] with 13 tokens is 2 + 1 blocks of 4 (the
        // second trace block has 5 tokens), the same digests; again from the memo.
        let mut hs = MooncakeHasher::new(none, 4, 8, 1000).unwrap();
        for _ in 0..2 {
            let mut out = Vec::new();
            hs.digests(&[7, 8], 13, &mut out).unwrap();
            assert_eq!(out, direct);
        }
        let mut out = Vec::new();
        hs.digests(&[7, 9], 16, &mut out).unwrap();
        assert_eq!(out[..2], direct[..2]);
        assert_eq!(out.len(), 4);
        assert!(mooncake_chain(&none, &[1], &[], 4, 8, 1000).is_none());
    }
}

