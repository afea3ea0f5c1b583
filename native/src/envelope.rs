//! Decoding KV events straight from envelope bytes (the `sy.kv` record values).
//!
//! Only the four KV payload types at version 1 are decoded here. The decoder is at least as
//! strict as the Python codec (`schemas.envelope.EventCodec`): every envelope field and every
//! payload field is type-checked, enums are checked against their values, strings must be
//! UTF-8, and nothing may follow the envelope. Anything else (other types or versions, a field
//! of the wrong type, a negative hash) is `None`: the caller hands the record to the Python
//! codec, which decodes it or raises the schema error that dead-letters it. So this path can
//! only ever accept records the reference accepts, and folds them the same way.

use crate::index::{tier_index, Event, Payload};
use crate::mp::{utf8, Reader, Result};

pub const CACHE_GROUPS: [&str; 4] = ["full_attention", "sliding_window", "mamba", "other"];

/// A decoded KV record: envelope sequencing fields and the payload the index folds.
pub struct KvRecord<'a> {
    /// The envelope's key (a worker's events are keyed by its id).
    pub key: &'a str,
    /// The envelope's one `sig` field is its last, as signers write it: `"sig": bin8(32)`
    /// (see `signing.rs`).
    pub sig_last: bool,
    pub producer: &'a str,
    pub epoch: i64,
    pub seq: i64,
    pub worker_id: &'a str,
    pub dp_rank: i64,
    pub kind: Kind<'a>,
}

pub enum Kind<'a> {
    Stored { tier: u8, block_size: i64, hash_algo: &'a str, cache_group: &'a str },
    Removed { tier: u8, cache_group: &'a str },
    Moved { from: u8, to: u8, cache_group: &'a str },
    Cleared { tier: Option<u8> },
}

impl<'a> KvRecord<'a> {
    /// The event as the index folds it; `hashes` is the buffer `decode` filled.
    pub fn event(&self, hashes: &'a [u64]) -> Event<'a> {
        let full = |g: &str| g == "full_attention";
        let payload = match self.kind {
            Kind::Stored { tier, block_size, hash_algo, cache_group } => Payload::Stored {
                tier,
                hashes,
                block_size,
                hash_algo,
                full_attention: full(cache_group),
            },
            Kind::Removed { tier, cache_group } => {
                Payload::Removed { tier, hashes, full_attention: full(cache_group) }
            }
            Kind::Moved { from, to, cache_group } => {
                Payload::Moved { from, to, hashes, full_attention: full(cache_group) }
            }
            Kind::Cleared { tier } => Payload::Cleared { tier },
        };
        Event { worker_id: self.worker_id, stream: "kv", dp_rank: Some(self.dp_rank), payload }
    }
}

fn tier(r: &mut Reader) -> Result<Option<u8>> {
    Ok(tier_index(r.str()?))
}

fn opt_int(r: &mut Reader) -> Result<()> {
    if !r.nil()? {
        r.int()?;
    }
    Ok(())
}

/// The longest worker id a reader accepts (`schemas.types.MAX_WORKER_ID_LEN`, in characters).
pub const MAX_WORKER_ID_LEN: usize = 256;

/// The payload types this path takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Stored,
    Removed,
    Moved,
    Cleared,
}

fn which_of(ty: &str) -> Option<Which> {
    Some(match ty {
        "BlockStored" => Which::Stored,
        "BlockRemoved" => Which::Removed,
        "BlockMoved" => Which::Moved,
        "AllBlocksCleared" => Which::Cleared,
        _ => return None,
    })
}

/// A payload's fields: (worker id, dp rank, what it says).
type Fields<'a> = (&'a str, i64, Kind<'a>);

/// Decode one envelope carrying a v1 KV event; `None` when this path does not take it.
pub fn decode<'a>(buf: &'a [u8], hashes: &mut Vec<u64>) -> Option<KvRecord<'a>> {
    decode_inner(buf, hashes).ok().flatten()
}

fn decode_inner<'a>(buf: &'a [u8], hashes: &mut Vec<u64>) -> Result<Option<KvRecord<'a>>> {
    let mut r = Reader::new(buf);
    let n = r.map_len()?;
    let (mut id, mut ty, mut v, mut key) = (false, None, None, None);
    let (mut sigs, mut sig_last) = (0, false);
    let (mut producer, mut epoch, mut seq, mut at) = (None, None, None, false);
    // The payload's bytes and, when its type came before it (as every writer puts it), its
    // fields decoded in the same pass under that type (`None` inside: not taken). A later
    // duplicate key (the last one wins, as in msgspec) is handled by decoding again below.
    let mut data: Option<&'a [u8]> = None;
    let mut parsed: Option<(Which, Option<Fields<'a>>)> = None;
    for _ in 0..n {
        let field_at = r.pos();
        // Keys are compared as bytes: one equal to an ASCII name is UTF-8; others are checked.
        match r.str_bytes()? {
            b"id" => {
                r.str()?;
                id = true;
            }
            b"type" => ty = Some(r.str()?),
            b"v" => v = Some(r.i64()?),
            b"key" => key = Some(r.str()?),
            b"producer" => producer = Some(r.str()?),
            b"epoch" => epoch = Some(r.i64()?),
            b"seq" => seq = Some(r.i64()?),
            b"at" => {
                r.int()?;
                at = true;
            }
            b"corr" | b"cause" => {
                if !r.nil()? {
                    r.str()?;
                }
            }
            b"data" => {
                let start = r.pos();
                parsed = None;
                match ty.and_then(which_of) {
                    Some(w) => match payload(&mut r, w, hashes) {
                        Ok(Some(f)) => parsed = Some((w, Some(f))),
                        // Not taken under this type (or malformed): the same bytes decode the
                        // same way again, so remember that, and step over the value.
                        _ => {
                            r.rewind(start);
                            r.skip()?;
                            parsed = Some((w, None));
                        }
                    },
                    None => r.skip()?,
                }
                data = Some(r.since(start));
            }
            b"sig" => {
                let raw = r.raw()?;
                sigs += 1;
                sig_last = field_at + crate::signing::SIG_TRAILER == buf.len() && raw.len() == 34 && raw[..2] == [0xc4, 0x20];
            }
            k => {
                utf8(k)?;
                r.skip()?;
            }
        }
    }
    if !r.at_end() || !id || !at || v != Some(1) {
        return Ok(None);
    }
    let (Some(ty), Some(key), Some(producer), Some(epoch), Some(seq), Some(data)) = (ty, key, producer, epoch, seq, data)
    else {
        return Ok(None);
    };
    let Some(which) = which_of(ty) else { return Ok(None) };
    let fields = match parsed {
        Some((w, f)) if w == which => f,
        _ => {
            let mut p = Reader::new(data);
            payload(&mut p, which, hashes)?
        }
    };
    let Some((worker_id, dp_rank, kind)) = fields else { return Ok(None) };
    if which == Which::Cleared {
        hashes.clear();
    }
    let sig_last = sig_last && sigs == 1;
    Ok(Some(KvRecord { key, sig_last, producer, epoch, seq, worker_id, dp_rank, kind }))
}

/// One payload map of type `which`, consumed whole when it is taken (`Some`).
fn payload<'a>(p: &mut Reader<'a>, which: Which, hashes: &mut Vec<u64>) -> Result<Option<Fields<'a>>> {
    use Which::*;
    let n = p.map_len()?;
    let mut worker_id = None;
    let mut dp_rank = 0i64;
    let mut tier_f: Option<Option<u8>> = None; // Some(None) = explicit nil (AllBlocksCleared)
    let (mut from, mut to) = (None, None);
    let mut have_hashes = false;
    let (mut block_size, mut hash_algo) = (None, None);
    let mut cache_group = "full_attention";
    for _ in 0..n {
        let k = p.str_bytes()?;
        match (which, k) {
            (_, b"worker_id") => worker_id = Some(p.str()?),
            (_, b"dp_rank") => dp_rank = p.i64()?,
            (Stored | Removed | Moved, b"block_hashes") => {
                p.u64_array(hashes)?;
                have_hashes = true;
            }
            (Stored | Removed | Moved, b"cache_group") => {
                let g = p.str()?;
                match CACHE_GROUPS.iter().find(|&&c| c == g) {
                    Some(&c) => cache_group = c,
                    None => return Ok(None),
                }
            }
            (Stored | Removed, b"tier") => match tier(p)? {
                Some(t) => tier_f = Some(Some(t)),
                None => return Ok(None),
            },
            (Cleared, b"tier") => {
                if p.nil()? {
                    tier_f = Some(None);
                } else {
                    match tier(p)? {
                        Some(t) => tier_f = Some(Some(t)),
                        None => return Ok(None),
                    }
                }
            }
            (Moved, b"from_tier") => match tier(p)? {
                Some(t) => from = Some(t),
                None => return Ok(None),
            },
            (Moved, b"to_tier") => match tier(p)? {
                Some(t) => to = Some(t),
                None => return Ok(None),
            },
            (Stored, b"block_size") => block_size = Some(p.i64()?),
            (Stored, b"hash_algo") => hash_algo = Some(p.str()?),
            (Stored, b"parent_hash") | (Stored, b"lora_id") => opt_int(p)?,
            (Stored, b"lora_name") => {
                if !p.nil()? {
                    p.str()?;
                }
            }
            (Stored, b"token_counts") | (Stored, b"token_ids") => p.skip_int_array()?,
            (_, k) => {
                utf8(k)?;
                p.skip()?
            }
        }
    }
    let Some(worker_id) = worker_id else { return Ok(None) };
    // Bytes bound characters from above: count only ids that might be too long.
    if worker_id.len() > MAX_WORKER_ID_LEN && worker_id.chars().count() > MAX_WORKER_ID_LEN {
        // Left to the Python codec, which refuses it as malformed: every reader agrees.
        return Ok(None);
    }
    let kind = match which {
        Stored => match (tier_f, have_hashes, block_size, hash_algo) {
            (Some(Some(tier)), true, Some(block_size), Some(hash_algo)) => {
                Kind::Stored { tier, block_size, hash_algo, cache_group }
            }
            _ => return Ok(None),
        },
        Removed => match (tier_f, have_hashes) {
            (Some(Some(tier)), true) => Kind::Removed { tier, cache_group },
            _ => return Ok(None),
        },
        Moved => match (from, to, have_hashes) {
            (Some(from), Some(to), true) => Kind::Moved { from, to, cache_group },
            _ => return Ok(None),
        },
        Cleared => Kind::Cleared { tier: tier_f.flatten() },
    };
    Ok(Some((worker_id, dp_rank, kind)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mp::Writer;

    fn envelope(ty: &str, v: i64, data: impl FnOnce(&mut Writer)) -> Vec<u8> {
        let mut w = Writer::new();
        w.map(9);
        for (k, s) in [("id", "abc"), ("type", ty), ("key", "w0"), ("producer", "w0")] {
            w.str(k);
            w.str(s);
        }
        w.str("v");
        w.int(v);
        w.str("epoch");
        w.int(2);
        w.str("seq");
        w.int(7);
        w.str("at");
        w.int(123456789);
        w.str("data");
        data(&mut w);
        w.buf
    }

    #[test]
    fn decodes_block_stored() {
        let buf = envelope("BlockStored", 1, |w| {
            w.map(5);
            w.str("worker_id");
            w.str("w0");
            w.str("tier");
            w.str("host");
            w.str("block_hashes");
            w.array(2);
            w.uint(u64::MAX);
            w.uint(5);
            w.str("block_size");
            w.int(16);
            w.str("hash_algo");
            w.str("sha256");
        });
        let mut hs = Vec::new();
        let rec = decode(&buf, &mut hs).unwrap();
        assert_eq!((rec.producer, rec.epoch, rec.seq, rec.worker_id), ("w0", 2, 7, "w0"));
        assert_eq!(hs, vec![u64::MAX, 5]);
        assert!(matches!(rec.kind, Kind::Stored { tier: 1, block_size: 16, hash_algo: "sha256", .. }));
    }

    fn removed(w: &mut Writer, tier: &str, hashes: &[u64]) {
        w.map(3);
        w.str("worker_id");
        w.str("w0");
        w.str("tier");
        w.str(tier);
        w.str("block_hashes");
        w.array(hashes.len());
        for &h in hashes {
            w.uint(h);
        }
    }

    /// A payload of only a `worker_id`.
    fn worker_only(w: &mut Writer, worker_id: &str) {
        w.map(1);
        w.str("worker_id");
        w.str(worker_id);
    }

    /// An envelope of `fields` in the given order (each a key and its writer).
    fn fields(fields: &[(&str, &dyn Fn(&mut Writer))]) -> Vec<u8> {
        let mut w = Writer::new();
        w.map(fields.len());
        for (k, f) in fields {
            w.str(k);
            f(&mut w);
        }
        w.buf
    }

    #[test]
    fn field_order_and_duplicate_keys_decode_as_msgspec_does() {
        let s = |v: &'static str| move |w: &mut Writer| w.str(v);
        let i = |v: i64| move |w: &mut Writer| w.int(v);
        let (id, key, prod, v1, ep, sq, at) = (s("abc"), s("w0"), s("w0"), i(1), i(2), i(7), i(1));
        let data = |w: &mut Writer| removed(w, "host", &[1, 2]);
        let other = |w: &mut Writer| removed(w, "disk", &[9]);
        let bad = |w: &mut Writer| removed(w, "gpu", &[9]);
        let stored = s("BlockStored");
        let removed_t = s("BlockRemoved");
        let head: [(&str, &dyn Fn(&mut Writer)); 6] =
            [("id", &id), ("key", &key), ("producer", &prod), ("v", &v1), ("epoch", &ep), ("seq", &sq)];
        let mut hs = Vec::new();
        // The payload before its type: decoded after the envelope.
        let mut f = head.to_vec();
        f.extend([("data", &data as &dyn Fn(&mut Writer)), ("at", &at), ("type", &removed_t)]);
        let buf = fields(&f);
        assert!(matches!(decode(&buf, &mut hs).unwrap().kind, Kind::Removed { tier: 1, .. }));
        assert_eq!(hs, vec![1, 2]);
        // A later type wins: the payload decoded under the first is decoded again.
        let mut f = head.to_vec();
        f.extend([("at", &at as &dyn Fn(&mut Writer)), ("type", &stored), ("data", &data), ("type", &removed_t)]);
        assert!(matches!(decode(&fields(&f), &mut hs).unwrap().kind, Kind::Removed { tier: 1, .. }));
        // A later payload wins, whether the earlier one was taken or not.
        let mut f = head.to_vec();
        f.extend([("at", &at as &dyn Fn(&mut Writer)), ("type", &removed_t), ("data", &other), ("data", &data)]);
        decode(&fields(&f), &mut hs).unwrap();
        assert_eq!(hs, vec![1, 2]);
        let mut f = head.to_vec();
        f.extend([("at", &at as &dyn Fn(&mut Writer)), ("type", &removed_t), ("data", &bad), ("data", &data)]);
        decode(&fields(&f), &mut hs).unwrap();
        assert_eq!(hs, vec![1, 2]);
        let mut f = head.to_vec();
        f.extend([("at", &at as &dyn Fn(&mut Writer)), ("type", &removed_t), ("data", &data), ("data", &bad)]);
        assert!(decode(&fields(&f), &mut hs).is_none());
    }

    #[test]
    fn refuses_what_it_does_not_take() {
        let mut hs = Vec::new();
        // Another version, another type, a bad enum, a missing field, trailing bytes.
        assert!(decode(&envelope("BlockStored", 2, |w| w.map(0)), &mut hs).is_none());
        assert!(decode(&envelope("WorkerRegistered", 1, |w| w.map(0)), &mut hs).is_none());
        let bad_tier = envelope("BlockRemoved", 1, |w| removed(w, "gpu", &[]));
        assert!(decode(&bad_tier, &mut hs).is_none());
        let missing = envelope("BlockRemoved", 1, |w| worker_only(w, "w0"));
        assert!(decode(&missing, &mut hs).is_none());
        let cleared = envelope("AllBlocksCleared", 1, |w| worker_only(w, "w0"));
        assert!(decode(&cleared, &mut hs).is_some());
        let mut trailing = cleared.clone();
        trailing.push(0xc0);
        assert!(decode(&trailing, &mut hs).is_none());
        let negative = envelope("BlockRemoved", 1, |w| {
            w.map(3);
            w.str("worker_id");
            w.str("w0");
            w.str("tier");
            w.str("device");
            w.str("block_hashes");
            w.array(1);
            w.int(-3);
        });
        assert!(decode(&negative, &mut hs).is_none());
        let long_id = "w".repeat(MAX_WORKER_ID_LEN + 1);
        let too_long = envelope("AllBlocksCleared", 1, |w| worker_only(w, &long_id));
        assert!(decode(&too_long, &mut hs).is_none());
    }
}
