//! Checking a worker's signature on a `kv` record, natively (`schemas/signing.py` is the
//! specification: `Verifier.check`).
//!
//! A worker event's owner is `worker:<envelope key>`; its key is
//! `HMAC-SHA256(master, "switchyard-event-owner\0" + owner)`, and the signature is the
//! envelope's last field, `"sig": bin(32)` = `HMAC-SHA256(owner key, the envelope without it)`,
//! where "without it" is the map header one lower and the last 38 bytes dropped.
//!
//! [`Verifier::verified`] answers only "yes, this is the owner's signature": it says yes only
//! when every condition of the reference holds (a kv event, its key the payload's worker id,
//! the signature the last field in its canonical encoding, the MAC equal). Every other record
//! (unsigned, forged, or merely encoded differently) gets "not here", and the caller asks the
//! reference, which accepts it or raises the reason it is refused. So the native path can only
//! ever accept what the reference accepts.

use std::collections::HashMap;

use crate::blockhash::{compress, hardware_sha, H0};

const CONTEXT: &[u8] = b"switchyard-event-owner\x00";
/// fixstr "sig", then bin8 of 32 bytes: how msgspec-era signers append the field.
pub const SIG_FIELD: &[u8] = b"\xa3sig\xc4\x20";
pub const SIG_TRAILER: usize = SIG_FIELD.len() + 32;

/// SHA-256 fed in pieces, from a given chaining state (HMAC's inner and outer states).
struct Sha256 {
    state: [u32; 8],
    buf: [u8; 64],
    n: usize,
    total: u64,
    hw: bool,
}

impl Sha256 {
    fn from_state(state: [u32; 8], done: u64, hw: bool) -> Self {
        Sha256 { state, buf: [0; 64], n: 0, total: done, hw }
    }

    fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.n > 0 {
            let k = (64 - self.n).min(data.len());
            self.buf[self.n..self.n + k].copy_from_slice(&data[..k]);
            self.n += k;
            data = &data[k..];
            if self.n < 64 {
                return;
            }
            compress(&mut self.state, &self.buf, self.hw);
            self.n = 0;
        }
        let full = data.len() / 64 * 64;
        compress(&mut self.state, &data[..full], self.hw);
        let rest = &data[full..];
        self.buf[..rest.len()].copy_from_slice(rest);
        self.n = rest.len();
    }

    fn finish(mut self) -> [u8; 32] {
        let bits = self.total * 8;
        let mut tail = [0u8; 128];
        tail[..self.n].copy_from_slice(&self.buf[..self.n]);
        tail[self.n] = 0x80;
        let len = if self.n + 9 <= 64 { 64 } else { 128 };
        tail[len - 8..len].copy_from_slice(&bits.to_be_bytes());
        compress(&mut self.state, &tail[..len], self.hw);
        let mut out = [0u8; 32];
        for (i, s) in self.state.iter().enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&s.to_be_bytes());
        }
        out
    }
}

/// An HMAC-SHA256 key with its padded blocks already compressed.
#[derive(Clone)]
pub struct HmacKey {
    inner: [u32; 8],
    outer: [u32; 8],
    hw: bool,
}

impl HmacKey {
    pub fn new(key: &[u8]) -> Self {
        let hw = hardware_sha();
        let mut k = [0u8; 64];
        if key.len() > 64 {
            let mut h = Sha256::from_state(H0, 0, hw);
            h.update(key);
            k[..32].copy_from_slice(&h.finish());
        } else {
            k[..key.len()].copy_from_slice(key);
        }
        let pad = |x: u8| {
            let mut st = H0;
            let block: Vec<u8> = k.iter().map(|b| b ^ x).collect();
            compress(&mut st, &block, hw);
            st
        };
        HmacKey { inner: pad(0x36), outer: pad(0x5c), hw }
    }

    /// HMAC of the concatenation of `parts`.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut h = Sha256::from_state(self.inner, 64, self.hw);
        for p in parts {
            h.update(p);
        }
        let inner = h.finish();
        let mut o = Sha256::from_state(self.outer, 64, self.hw);
        o.update(&inner);
        o.finish()
    }
}

/// Checks worker signatures from the stack's master secret; owner keys are derived once each.
pub struct Verifier {
    master: HmacKey,
    keys: HashMap<String, HmacKey>,
    owner: String,
}

impl Verifier {
    pub fn new(master: &[u8]) -> Self {
        Verifier { master: HmacKey::new(master), keys: HashMap::new(), owner: String::new() }
    }

    fn key(&mut self, worker: &str) -> &HmacKey {
        if !self.keys.contains_key(worker) {
            if self.keys.len() > 100_000 {
                self.keys.clear(); // as the reference bounds its cache
            }
            self.owner.clear();
            self.owner.push_str("worker:");
            self.owner.push_str(worker);
            let k = self.master.mac(&[CONTEXT, self.owner.as_bytes()]);
            self.keys.insert(worker.to_owned(), HmacKey::new(&k));
        }
        &self.keys[worker]
    }

    /// True when `buf` (a decoded kv envelope whose key is `key`, about worker `worker_id`,
    /// with `sig_last`: its one `sig` field is the last one, in the canonical encoding) carries
    /// its owner's signature. False: not decided here (the reference decides).
    pub fn verified(&mut self, buf: &[u8], key: &str, worker_id: &str, sig_last: bool) -> bool {
        let n = buf.len();
        if !sig_last || key != worker_id || n < SIG_TRAILER + 1 || !(0x81..=0x8f).contains(&buf[0]) {
            return false;
        }
        if &buf[n - SIG_TRAILER..n - 32] != SIG_FIELD {
            return false;
        }
        let head = [buf[0] - 1];
        let mac = self.key(key).mac(&[&head, &buf[1..n - SIG_TRAILER]]);
        // Not secret-dependent timing that matters here (the record is public), but cheap to keep constant.
        mac.iter().zip(&buf[n - 32..]).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockhash::tests::hex;

    #[test]
    fn hmac_sha256_rfc4231() {
        // RFC 4231 test cases 1, 2 and 6 (a key longer than the block).
        let k1 = HmacKey::new(&[0x0b; 20]);
        assert_eq!(hex(&k1.mac(&[b"Hi There"])),
                   "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
        let k2 = HmacKey::new(b"Jefe");
        assert_eq!(hex(&k2.mac(&[b"what do ya want ", b"for nothing?"])),
                   "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        let k6 = HmacKey::new(&[0xaa; 131]);
        assert_eq!(hex(&k6.mac(&[b"Test Using Larger Than Block-Size Key - Hash Key First"])),
                   "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }

    #[test]
    fn pieces_hash_as_one() {
        let k = HmacKey::new(b"k");
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
        let whole = k.mac(&[&data]);
        for cut in [0, 1, 63, 64, 65, 127, 128, 299, 300] {
            assert_eq!(k.mac(&[&data[..cut], &data[cut..]]), whole, "cut at {cut}");
        }
    }

    #[test]
    fn only_the_owners_signature_verifies() {
        let master = b"master secret";
        let owner_key = HmacKey::new(master).mac(&[CONTEXT, b"worker:w0"]);
        let unsigned: Vec<u8> = [&[0x82u8][..], b"\xa1a\x01\xa1b\x02"].concat();
        let tag = HmacKey::new(&owner_key).mac(&[&unsigned]);
        let mut signed = unsigned.clone();
        signed[0] += 1;
        signed.extend_from_slice(SIG_FIELD);
        signed.extend_from_slice(&tag);
        let mut v = Verifier::new(master);
        assert!(v.verified(&signed, "w0", "w0", true));
        assert!(!v.verified(&signed, "w1", "w1", true), "another worker's key");
        assert!(!v.verified(&signed, "w0", "w1", true), "key is not the worker");
        assert!(!v.verified(&signed, "w0", "w0", false), "sig not the last field");
        let mut bad = signed.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(!v.verified(&bad, "w0", "w0", true));
        assert!(!Verifier::new(b"other").verified(&signed, "w0", "w0", true));
    }
}
