//! The envelope of an event this process produces, written from its fields and the payload's
//! MessagePack bytes, and signed (`schemas/envelope.py` `EventCodec.encode` and
//! `schemas/signing.py` `Signer.sign` are the specification; a test holds the bytes equal).
//!
//! The map is written as msgspec writes `Envelope` (`omit_defaults`): `id, type, v, key,
//! producer, epoch, seq, at`, then `corr` and `cause` when set, then `data` (the payload as the
//! caller encoded it: for a request event from v2, without its request id). Signed, the map
//! header is one higher and `"sig": bin8(32)` = HMAC-SHA256(owner key, the unsigned bytes) ends it.

use crate::mp::Writer;
use crate::signing::{HmacKey, SIG_FIELD};

/// The envelope's fields other than the payload.
pub struct Head<'a> {
    pub id: &'a str,
    pub ty: &'a str,
    pub v: i64,
    pub key: &'a str,
    pub producer: &'a str,
    pub epoch: i64,
    pub seq: i64,
    pub at_ns: i64,
    pub corr: Option<&'a str>,
    pub cause: Option<&'a str>,
}

/// The record value: the envelope around `data`, signed with `sign` when given.
pub fn envelope(head: &Head, data: &[u8], sign: Option<&HmacKey>) -> Vec<u8> {
    let mut w = Writer::new();
    w.buf.reserve(160 + head.key.len() * 2 + data.len() + SIG_FIELD.len() + 32);
    let n = 9 + head.corr.is_some() as usize + head.cause.is_some() as usize;
    w.map(n);
    for (k, s) in [("id", head.id), ("type", head.ty)] {
        w.str(k);
        w.str(s);
    }
    w.str("v");
    w.int(head.v);
    for (k, s) in [("key", head.key), ("producer", head.producer)] {
        w.str(k);
        w.str(s);
    }
    for (k, i) in [("epoch", head.epoch), ("seq", head.seq), ("at", head.at_ns)] {
        w.str(k);
        w.int(i);
    }
    for (k, s) in [("corr", head.corr), ("cause", head.cause)] {
        if let Some(s) = s {
            w.str(k);
            w.str(s);
        }
    }
    w.str("data");
    w.buf.extend_from_slice(data);
    let mut buf = w.buf;
    if let Some(k) = sign {
        let tag = k.mac(&[&buf]);
        buf[0] += 1; // a fixmap of at most 11 fields: room for one more
        buf.extend_from_slice(SIG_FIELD);
        buf.extend_from_slice(&tag);
    }
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signing::Verifier;

    fn head<'a>(corr: Option<&'a str>) -> Head<'a> {
        Head { id: "e1", ty: "BlockStored", v: 1, key: "w0", producer: "w0", epoch: 1_700_000_000_000, seq: 300,
               at_ns: 1_700_000_000_000_000_000, corr, cause: None }
    }

    #[test]
    fn writes_the_fields_in_order_and_omits_unset_ones() {
        let data = [0x80u8]; // {}
        let buf = envelope(&head(None), &data, None);
        assert_eq!(buf[0], 0x89);
        let with = envelope(&head(Some("c")), &data, None);
        assert_eq!(with[0], 0x8a);
        let mut r = crate::mp::Reader::new(&buf);
        assert_eq!(r.map_len().unwrap(), 9);
        let mut keys = Vec::new();
        for _ in 0..9 {
            keys.push(r.str().unwrap().to_owned());
            r.skip().unwrap();
        }
        assert_eq!(keys, ["id", "type", "v", "key", "producer", "epoch", "seq", "at", "data"]);
        assert!(r.at_end());
    }

    #[test]
    fn a_signed_worker_event_verifies() {
        // The owner key of worker w0 under a master, as `schemas.signing.owner_key` derives it.
        let master = b"master";
        let owner = HmacKey::new(master).mac(&[b"switchyard-event-owner\x00", b"worker:w0"]);
        let data = [0x81u8, 0xa9, b'w', b'o', b'r', b'k', b'e', b'r', b'_', b'i', b'd', 0xa2, b'w', b'0'];
        let buf = envelope(&head(None), &data, Some(&HmacKey::new(&owner)));
        assert!(Verifier::new(master).verified(&buf, "w0", "w0", true));
        assert!(!Verifier::new(b"other").verified(&buf, "w0", "w0", true));
    }
}
