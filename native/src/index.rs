//! The prefix index, natively: the same projection as `tests/oracles/prefix_index.py` (the
//! executable specification, "the reference" below, kept as the differential oracle), with the same sequencing, fencing, staleness and resync
//! rules, the same slot numbering and a byte-identical snapshot format.
//!
//! Layout (why it is small)
//! ------------------------
//! One hash map from block hash to its holders (see [`crate::holders`]). A holder is a `u32`:
//! `slot << 4 | tiers` (one bit per tier, device first). A hash held by one slot, the common
//! case, stores that holder inline in the map value (16 bytes per bucket with the key); a hash
//! held by several stores a sorted holder list in a chunk of one shared pool. Per-(slot, tier)
//! counters replace the reference's
//! per-slot sets: stats are O(slots), and clearing a slot is one pass over the map (clears
//! happen on restarts and resyncs, not on the per-event path).
//!
//! `find_matches` walks the prompt's hashes once, merging the sorted holder list of each block
//! with the sorted list of candidates still matching; a candidate drops out at its first miss.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::bitset::BitSet;
use crate::holders::{Holders, EMPTY};
use crate::mp::{self, Reader, Writer};

pub const N_TIERS: usize = 4;
pub const TIER_NAMES: [&str; N_TIERS] = ["device", "host", "disk", "object"];
const ALL_TIERS: u8 = 0b1111;
/// Device and host: gone when a worker process restarts.
const VOLATILE_TIERS: u8 = 0b0011;
const MIN_WIDTH: u32 = 8;
const SNAPSHOT_FORMAT: i64 = 2;

pub const COUNTER_NAMES: [&str; 8] = [
    "applied", "duplicate", "fenced", "ignored", "rejected", "gaps", "new_epochs", "resyncs",
];
const C_APPLIED: usize = 0;
const C_DUPLICATE: usize = 1;
const C_FENCED: usize = 2;
const C_IGNORED: usize = 3;
const C_REJECTED: usize = 4;
const C_GAPS: usize = 5;
const C_NEW_EPOCHS: usize = 6;
const C_RESYNCS: usize = 7;

pub fn tier_index(name: &str) -> Option<u8> {
    TIER_NAMES.iter().position(|&t| t == name).map(|i| i as u8)
}

/// Block hashes are already uniformly distributed; one multiply spreads test-sized ones too.
#[derive(Default)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("U64Hasher hashes u64 keys only")
    }
    #[inline]
    fn write_u64(&mut self, k: u64) {
        let x = (k ^ (k >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 29);
    }
}

type HashIndex = HashMap<u64, u64, BuildHasherDefault<U64Hasher>>;

/// FxHash (rustc's) for the string-keyed maps (worker ids, producers): a multiply per word
/// instead of SipHash's rounds. Keys come from signed, sequenced records, not from clients.
#[derive(Default)]
pub struct FxHasher(u64);

const FX_K: u64 = 0xf135_7aea_2e62_a9c5;

impl Hasher for FxHasher {
    #[inline]
    fn finish(&self) -> u64 {
        // The multiply leaves the entropy in the high bits; the table indexes with the low ones.
        self.0.rotate_left(26)
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(FX_K);
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            h = (h ^ u64::from_le_bytes(w)).wrapping_mul(FX_K);
        }
        self.0 = h;
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.0 = (self.0 ^ i as u64).wrapping_mul(FX_K);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.0 = (self.0 ^ i as u64).wrapping_mul(FX_K);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0 ^ i).wrapping_mul(FX_K);
    }
}

type StrMap<V> = HashMap<String, V, BuildHasherDefault<FxHasher>>;

/// What the index did with one event (the reference's `ApplyOutcome`, plus `Rejected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    Duplicate,
    Fenced,
    Ignored,
    /// The caller dead-letters the event: "hash_algo", "block_size" or "cache_group".
    Rejected(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyResult {
    pub outcome: Outcome,
    /// The event started a new epoch of its worker (volatile tiers dropped).
    pub new_epoch: bool,
    /// The event followed a gap in its producer's sequence (slots marked stale and lost).
    pub gap: bool,
}

/// The payload fields the index folds. `Other` is any other event about a worker: it is
/// sequenced (so it is not taken for a gap) and ignored.
#[derive(Debug, Clone, Copy)]
pub enum Payload<'a> {
    Stored { tier: u8, hashes: &'a [u64], block_size: i64, hash_algo: &'a str, full_attention: bool },
    Removed { tier: u8, hashes: &'a [u64], full_attention: bool },
    Moved { from: u8, to: u8, hashes: &'a [u64], full_attention: bool },
    Cleared { tier: Option<u8> },
    Registered { block_size: i64, hash_algo: &'a str },
    Deregistered,
    Other,
}

#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    pub worker_id: &'a str,
    /// The payload type's stream ("kv", "workers", ...): sequences are per (producer, stream).
    pub stream: &'a str,
    /// KV events carry a DP rank; worker lifecycle events do not.
    pub dp_rank: Option<i64>,
    pub payload: Payload<'a>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchOut {
    pub slot: u32,
    pub depth: u32,
    pub by_tier: [u32; N_TIERS],
    pub stale: bool,
}

/// `find_matches`'s answer (`out`) and its working space, reused across queries so that a
/// lookup allocates nothing.
#[derive(Default)]
pub struct Matches {
    pub out: Vec<MatchOut>,
    cur: Vec<(u32, [u32; N_TIERS])>,
}

struct Worker {
    name: String,
    /// Newest epoch seen on the `kv` stream (-1: none yet).
    epoch: i64,
    /// Newest epoch seen on the `workers` stream (-1: none yet).
    life_epoch: i64,
    /// Newest epoch a `WorkerRegistered` was folded for (-1: none).
    registered_epoch: i64,
    deregistered: bool,
    slots: BitSet,
    /// (dp rank, slot) of every slot this worker has.
    ranks: Vec<(i64, u32)>,
}

#[derive(Clone)]
struct SlotKey {
    worker: u32,
    dp_rank: i64,
}

struct SeqPos {
    stream: String,
    epoch: i64,
    last: i64,
}

/// One sequencing producer: its position per stream and the slots its events touched (`None`
/// until one did: the reference's producer mask, absent rather than empty).
struct Producer {
    name: String,
    streams: Vec<SeqPos>,
    slots: Option<BitSet>,
}

pub struct NativeIndex {
    pub hash_algo: String,
    pub block_size: i64,
    width: u32,
    map: HashIndex,
    holders: Holders,
    slots: Vec<Option<SlotKey>>,
    free: Vec<u32>,
    counts: Vec<[u64; N_TIERS]>,
    active: BitSet,
    /// `lost | unsynced`, kept up to date.
    stale: BitSet,
    lost: BitSet,
    unsynced: BitSet,
    nondev: BitSet,
    workers: Vec<Worker>,
    worker_of: StrMap<u32>,
    producers: Vec<Producer>,
    producer_of: StrMap<u32>,
    pub counters: [u64; 8],
    /// Bumped whenever a slot is taken or freed (callers cache slot -> worker).
    pub slot_gen: u64,
}

/// Apply `f` to the tier bits `slot` holds for hash `h` (0 = not held); returns (old, new).
#[inline]
fn update_holder(
    map: &mut HashIndex,
    holders: &mut Holders,
    h: u64,
    slot: u32,
    f: impl FnOnce(u8) -> u8,
) -> (u8, u8) {
    match map.entry(h) {
        Entry::Vacant(e) => {
            let (nv, old, new) = holders.update(EMPTY, slot, f);
            if nv != EMPTY {
                e.insert(nv);
            }
            (old, new)
        }
        Entry::Occupied(mut e) => {
            let v = *e.get();
            let (nv, old, new) = holders.update(v, slot, f);
            if nv == EMPTY {
                e.remove();
            } else if nv != v {
                *e.get_mut() = nv;
            }
            (old, new)
        }
    }
}

#[inline]
fn count_diff(counts: &mut [u64; N_TIERS], old: u8, new: u8) {
    let mut changed = old ^ new;
    while changed != 0 {
        let t = changed.trailing_zeros() as usize;
        changed &= changed - 1;
        if new >> t & 1 == 1 {
            counts[t] += 1;
        } else {
            counts[t] -= 1;
        }
    }
}

impl NativeIndex {
    pub fn new(hash_algo: &str, block_size: i64) -> Self {
        NativeIndex {
            hash_algo: hash_algo.to_string(),
            block_size,
            width: MIN_WIDTH,
            map: HashIndex::default(),
            holders: Holders::new(),
            slots: Vec::new(),
            free: Vec::new(),
            counts: Vec::new(),
            active: BitSet::new(),
            stale: BitSet::new(),
            lost: BitSet::new(),
            unsynced: BitSet::new(),
            nondev: BitSet::new(),
            workers: Vec::new(),
            worker_of: StrMap::default(),
            producers: Vec::new(),
            producer_of: StrMap::default(),
            counters: [0; 8],
            slot_gen: 0,
        }
    }

    // -- queries -----------------------------------------------------------------------------

    /// Distinct block hashes held by anyone.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Total (block, slot) entries.
    pub fn entries(&self) -> u64 {
        let mut n = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.is_some() {
                // A block held in several tiers of one slot is one entry.
                n += self.counts[i].iter().sum::<u64>();
            }
        }
        n
    }

    /// Heap bytes the hash structures occupy (map buckets, control bytes, holder pool).
    pub fn structure_bytes(&self) -> usize {
        // hashbrown: capacity = buckets * 7/8 (buckets - 1 below 8 buckets); 16 bytes per bucket
        // and a control byte, plus one group (16) of trailing control bytes.
        let cap = self.map.capacity();
        let buckets = match cap {
            0 => 0,
            1..=7 => (cap + 1).next_power_of_two(),
            _ => (cap * 8 / 7).next_power_of_two(),
        };
        buckets * (16 + 1) + if buckets > 0 { 16 } else { 0 } + self.holders.bytes()
    }

    #[inline]
    fn holders<'a>(&'a self, h: u64, tmp: &'a mut [u32; 1]) -> &'a [u32] {
        match self.map.get(&h) {
            None => &[],
            Some(&v) => self.holders.get(v, tmp),
        }
    }

    /// Matched prefix per slot, ordered by (depth, slot); slots with no matched block and
    /// inactive (deregistered) slots are absent.
    pub fn find_matches(&self, hashes: &[u64], m: &mut Matches) {
        let Matches { out, cur } = m;
        out.clear();
        cur.clear();
        let Some(&h0) = hashes.first() else { return };
        let mut tmp = [0u32; 1];
        for &hd in self.holders(h0, &mut tmp) {
            let s = hd >> 4;
            if self.active.contains(s) {
                let mut by = [0u32; N_TIERS];
                by[(hd & 15).trailing_zeros() as usize] = 1;
                cur.push((s, by));
            }
        }
        let mut depth = 1u32;
        for (i, &h) in hashes.iter().enumerate().skip(1) {
            if cur.len() <= 1 {
                // One candidate left (deep prompts end this way): follow it alone.
                if let Some(&(s, by)) = cur.first() {
                    cur.clear();
                    let (depth, by) = self.follow(s, by, depth, &hashes[i..]);
                    out.push(MatchOut { slot: s, depth, by_tier: by, stale: self.stale.contains(s) });
                }
                return;
            }
            let mut tmp = [0u32; 1];
            let hs = self.holders(h, &mut tmp);
            let mut j = 0;
            let mut w = 0;
            for r in 0..cur.len() {
                let (s, mut by) = cur[r];
                while j < hs.len() && hs[j] >> 4 < s {
                    j += 1;
                }
                if j < hs.len() && hs[j] >> 4 == s {
                    by[(hs[j] & 15).trailing_zeros() as usize] += 1;
                    cur[w] = (s, by);
                    w += 1;
                } else {
                    out.push(MatchOut { slot: s, depth, by_tier: by, stale: self.stale.contains(s) });
                }
            }
            cur.truncate(w);
            depth += 1;
        }
        for &(s, by) in cur.iter() {
            out.push(MatchOut { slot: s, depth, by_tier: by, stale: self.stale.contains(s) });
        }
    }

    /// Slot numbers in use so far (free ones included).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// (worker number, dp rank) of a live slot: a worker's number never changes.
    pub fn slot_owner(&self, slot: u32) -> Option<(u32, i64)> {
        self.slots.get(slot as usize).and_then(|k| k.as_ref()).map(|k| (k.worker, k.dp_rank))
    }

    /// `find_matches` for one candidate: extend its match (`depth` blocks so far, counted by
    /// tier in `by`) along `rest`; returns the final depth and counts.
    #[inline]
    fn follow(&self, s: u32, mut by: [u32; N_TIERS], mut depth: u32, rest: &[u64]) -> (u32, [u32; N_TIERS]) {
        let mut tmp = [0u32; 1];
        for &h in rest {
            let hs = self.holders(h, &mut tmp);
            match hs.binary_search_by_key(&s, |x| x >> 4) {
                Ok(j) => by[(hs[j] & 15).trailing_zeros() as usize] += 1,
                Err(_) => break,
            }
            depth += 1;
        }
        (depth, by)
    }

    pub fn slot_key(&self, slot: u32) -> Option<(&str, i64)> {
        self.slots
            .get(slot as usize)
            .and_then(|k| k.as_ref())
            .map(|k| (self.workers[k.worker as usize].name.as_str(), k.dp_rank))
    }

    pub fn is_stale(&self, worker_id: &str, dp_rank: i64) -> bool {
        self.slot_of(worker_id, dp_rank).map_or(false, |s| self.stale.contains(s))
    }

    pub fn stale_slots(&self) -> Vec<u32> {
        self.stale.to_vec()
    }

    /// Every slot in use, in slot order.
    pub fn live_slots(&self) -> Vec<u32> {
        (0..self.slots.len() as u32).filter(|&s| self.slots[s as usize].is_some()).collect()
    }

    pub fn slot_counts(&self, slot: u32) -> [u64; N_TIERS] {
        self.counts[slot as usize]
    }

    /// The newest incarnation of the worker seen on either stream.
    pub fn epoch_of(&self, worker_id: &str) -> Option<i64> {
        self.worker_of.get(worker_id).map(|&w| {
            let wk = &self.workers[w as usize];
            wk.epoch.max(wk.life_epoch)
        })
    }

    /// (worker id, KV epoch, deregistered, lifecycle epoch, registered epoch) of every worker
    /// ever seen, in first-seen order.
    pub fn worker_states(&self) -> Vec<(&str, i64, bool, i64, i64)> {
        self.workers
            .iter()
            .map(|w| (w.name.as_str(), w.epoch, w.deregistered, w.life_epoch, w.registered_epoch))
            .collect()
    }

    pub fn position(&self, producer: &str, stream: &str) -> Option<(i64, i64)> {
        let &p = self.producer_of.get(producer)?;
        self.producers[p as usize].streams.iter().find(|p| p.stream == stream).map(|p| (p.epoch, p.last))
    }

    /// (producer, stream, epoch, last) sorted by (producer, stream).
    pub fn positions(&self) -> Vec<(&str, &str, i64, i64)> {
        let mut out: Vec<_> = self
            .producers
            .iter()
            .flat_map(|p| p.streams.iter().map(move |s| (p.name.as_str(), s.stream.as_str(), s.epoch, s.last)))
            .collect();
        out.sort();
        out
    }

    /// Per live slot, per tier, the sorted hashes held.
    pub fn residency(&self) -> Vec<[Vec<u64>; N_TIERS]> {
        let mut out: Vec<[Vec<u64>; N_TIERS]> =
            (0..self.slots.len()).map(|_| Default::default()).collect();
        for (&h, &v) in &self.map {
            let mut tmp = [0u32; 1];
            let hs = self.holders.get(v, &mut tmp);
            for &hd in hs {
                let s = (hd >> 4) as usize;
                for t in 0..N_TIERS {
                    if hd >> t & 1 == 1 {
                        out[s][t].push(h);
                    }
                }
            }
        }
        for per in &mut out {
            for v in per.iter_mut() {
                v.sort_unstable();
            }
        }
        out
    }

    /// Recompute every derived structure from the map; Err on the first disagreement.
    pub fn verify_invariants(&self) -> Result<(), String> {
        let mut counts = vec![[0u64; N_TIERS]; self.slots.len()];
        for (&h, &v) in &self.map {
            if Holders::is_list(v) && self.holders.get(v, &mut [0]).len() < 2 {
                return Err(format!("hash {h} has a holder list of length < 2"));
            }
            let mut tmp = [0u32; 1];
            let hs = self.holders.get(v, &mut tmp);
            let mut prev: Option<u32> = None;
            for &hd in hs {
                let s = hd >> 4;
                if prev.map_or(false, |p| p >= s) {
                    return Err(format!("holders of {h} not sorted by slot"));
                }
                prev = Some(s);
                if hd & 15 == 0 {
                    return Err(format!("hash {h} has an empty holder"));
                }
                if self.slots.get(s as usize).map_or(true, |k| k.is_none()) {
                    return Err(format!("free slot {s} holds blocks"));
                }
                for t in 0..N_TIERS {
                    if hd >> t & 1 == 1 {
                        counts[s as usize][t] += 1;
                    }
                }
            }
        }
        if counts != self.counts {
            return Err("per-slot counts disagree with the map".into());
        }
        let mut active = BitSet::new();
        for w in &self.workers {
            for &(_, s) in &w.ranks {
                if !w.slots.contains(s) {
                    return Err(format!("worker {} slot {s} missing from its mask", w.name));
                }
            }
            if w.slots.to_vec().len() != w.ranks.len() {
                return Err(format!("worker {} slot mask disagrees with its ranks", w.name));
            }
            if !w.deregistered {
                active.union_with(&w.slots);
            }
        }
        if active.to_vec() != self.active.to_vec() {
            return Err("active mask disagrees with worker registrations".into());
        }
        for s in 0..self.slots.len() {
            let nd = self.counts[s][1..].iter().any(|&c| c > 0);
            if nd != self.nondev.contains(s as u32) {
                return Err(format!("non-device flag of slot {s} disagrees with its counts"));
            }
            let s = s as u32;
            if self.stale.contains(s) != (self.lost.contains(s) || self.unsynced.contains(s)) {
                return Err(format!("stale flag of slot {s} is not lost | unsynced"));
            }
        }
        Ok(())
    }

    // -- applying events ---------------------------------------------------------------------

    fn slot_of(&self, worker_id: &str, dp_rank: i64) -> Option<u32> {
        let &w = self.worker_of.get(worker_id)?;
        self.rank_slot(w, dp_rank)
    }

    #[inline]
    fn rank_slot(&self, w: u32, dp_rank: i64) -> Option<u32> {
        self.workers[w as usize].ranks.iter().find(|r| r.0 == dp_rank).map(|r| r.1)
    }

    /// The producer's number, registered on first sight.
    #[inline]
    fn producer(&mut self, name: &str) -> u32 {
        if let Some(&p) = self.producer_of.get(name) {
            return p;
        }
        let p = self.producers.len() as u32;
        self.producers.push(Producer { name: name.to_string(), streams: Vec::new(), slots: None });
        self.producer_of.insert(name.to_string(), p);
        p
    }

    /// Fold one event given its envelope's producer, epoch and seq (see the reference's
    /// `PrefixIndex.apply` for the rules, which this follows line by line).
    pub fn apply(&mut self, producer: &str, epoch: i64, seq: i64, ev: &Event) -> ApplyResult {
        let mut res = ApplyResult { outcome: Outcome::Applied, new_epoch: false, gap: false };
        let w = match self.worker_of.get(ev.worker_id) {
            Some(&w) => w,
            None => {
                let w = self.workers.len() as u32;
                self.workers.push(Worker {
                    name: ev.worker_id.to_string(),
                    epoch: -1,
                    life_epoch: -1,
                    registered_epoch: -1,
                    deregistered: false,
                    slots: BitSet::new(),
                    ranks: Vec::new(),
                });
                self.worker_of.insert(ev.worker_id.to_string(), w);
                w
            }
        };
        // Epochs per stream: neither stream fences the other (see the reference).
        let kv = ev.stream == "kv";
        let cur = {
            let wk = &self.workers[w as usize];
            if kv { wk.epoch } else { wk.life_epoch }
        };
        if epoch < cur {
            self.counters[C_FENCED] += 1;
            res.outcome = Outcome::Fenced;
            return res;
        }
        res.new_epoch = kv && cur >= 0 && cur < epoch;
        // Sequencing.
        let p = self.producer(producer);
        let streams = &mut self.producers[p as usize].streams;
        match streams.iter_mut().find(|p| p.stream == ev.stream) {
            None => {
                res.gap = seq != 0;
                streams.push(SeqPos { stream: ev.stream.to_string(), epoch, last: seq });
            }
            Some(st) if st.epoch < epoch => {
                res.gap = seq != 0;
                st.epoch = epoch;
                st.last = seq;
            }
            Some(st) if st.epoch == epoch => {
                if seq <= st.last {
                    self.counters[C_DUPLICATE] += 1;
                    res.outcome = Outcome::Duplicate;
                    return res;
                }
                res.gap = seq != st.last + 1;
                st.last = seq;
            }
            Some(_) => {
                self.counters[C_FENCED] += 1;
                res.outcome = Outcome::Fenced;
                return res;
            }
        }

        // Accepted. Sequencing side effects first: they stand even if the event is rejected.
        let mut slot: Option<u32> = ev.dp_rank.and_then(|d| self.rank_slot(w, d));
        if !kv {
            self.workers[w as usize].life_epoch = epoch;
        } else if res.new_epoch {
            self.workers[w as usize].epoch = epoch;
            // A new incarnation has empty memory: its volatile entries are gone for certain;
            // persistent ones stay, unsynced until this epoch is registered.
            for s in self.workers[w as usize].slots.to_vec() {
                let tiers = if self.lost.contains(s) { ALL_TIERS } else { VOLATILE_TIERS };
                self.clear(s, tiers);
            }
            let ws = self.workers[w as usize].slots.clone();
            self.lost.difference_with(&ws);
            if self.workers[w as usize].registered_epoch < epoch {
                self.unsynced.union_with(&ws);
            } else {
                self.unsynced.difference_with(&ws);
            }
            self.refresh_stale(&ws);
            self.counters[C_NEW_EPOCHS] += 1;
        } else {
            self.workers[w as usize].epoch = epoch;
        }
        if res.gap && !kv {
            // A lost lifecycle event says nothing about residency: counted, not flagged.
            self.counters[C_GAPS] += 1;
        } else if res.gap {
            if slot.is_none() {
                if let Some(d) = ev.dp_rank {
                    slot = Some(self.slot_for(w, d));
                }
            }
            let mut lost = self.producers[p as usize].slots.clone().unwrap_or_default();
            if let Some(s) = slot {
                lost.insert(s);
            }
            if lost.is_empty() {
                lost = self.workers[w as usize].slots.clone();
            }
            self.lost.union_with(&lost);
            self.stale.union_with(&lost);
            self.counters[C_GAPS] += 1;
        }
        match ev.payload {
            Payload::Stored { block_size, hash_algo, full_attention, .. } => {
                if !full_attention {
                    return self.reject(res, "cache_group");
                }
                if let Some(r) = self.check_config(hash_algo, block_size) {
                    return self.reject(res, r);
                }
            }
            Payload::Registered { block_size, hash_algo } => {
                if let Some(r) = self.check_config(hash_algo, block_size) {
                    return self.reject(res, r);
                }
            }
            _ => {}
        }
        if slot.is_none() {
            if let Some(d) = ev.dp_rank {
                slot = Some(self.slot_for(w, d));
            }
        }
        if let Some(s) = slot {
            match &mut self.producers[p as usize].slots {
                Some(m) => m.insert(s),
                none => *none = Some(BitSet::single(s)),
            }
        }
        match ev.payload {
            Payload::Stored { tier, hashes, .. } => self.store(slot.unwrap(), tier, hashes),
            Payload::Removed { tier, hashes, full_attention } => {
                if !full_attention {
                    return self.ignored(res);
                }
                self.remove(slot.unwrap(), tier, hashes)
            }
            Payload::Moved { from, to, hashes, full_attention } => {
                if !full_attention {
                    return self.ignored(res);
                }
                self.move_blocks(slot.unwrap(), from, to, hashes)
            }
            Payload::Cleared { tier: None } => {
                let s = slot.unwrap();
                self.clear(s, ALL_TIERS);
                self.resync(&BitSet::single(s));
            }
            Payload::Cleared { tier: Some(t) } => self.clear(slot.unwrap(), 1 << t),
            Payload::Registered { .. } => self.registered(w, epoch),
            Payload::Deregistered => self.deregistered(w),
            Payload::Other => return self.ignored(res),
        }
        if self.workers[w as usize].deregistered {
            self.free_settled(w);
        }
        self.counters[C_APPLIED] += 1;
        res
    }

    fn ignored(&mut self, mut res: ApplyResult) -> ApplyResult {
        self.counters[C_IGNORED] += 1;
        res.outcome = Outcome::Ignored;
        res
    }

    fn reject(&mut self, mut res: ApplyResult, reason: &'static str) -> ApplyResult {
        self.counters[C_REJECTED] += 1;
        res.outcome = Outcome::Rejected(reason);
        res
    }

    fn check_config(&self, hash_algo: &str, block_size: i64) -> Option<&'static str> {
        if hash_algo != self.hash_algo {
            Some("hash_algo")
        } else if block_size != self.block_size {
            Some("block_size")
        } else {
            None
        }
    }

    fn slot_for(&mut self, w: u32, dp_rank: i64) -> u32 {
        let wk = &self.workers[w as usize];
        if let Some(r) = wk.ranks.iter().find(|r| r.0 == dp_rank) {
            return r.1;
        }
        let key = SlotKey { worker: w, dp_rank };
        self.slot_gen += 1;
        let s = if let Some(s) = self.free.pop() {
            self.slots[s as usize] = Some(key);
            s
        } else {
            let s = self.slots.len() as u32;
            if s >= self.width {
                self.width *= 2; // the reference re-lays its packed planes out here
            }
            self.slots.push(Some(key));
            self.counts.push([0; N_TIERS]);
            s
        };
        let wk = &mut self.workers[w as usize];
        wk.ranks.push((dp_rank, s));
        wk.slots.insert(s);
        if !wk.deregistered {
            self.active.insert(s);
        }
        s
    }

    fn free_slot(&mut self, s: u32, w: u32) {
        self.slot_gen += 1;
        self.slots[s as usize] = None;
        let wk = &mut self.workers[w as usize];
        wk.slots.remove(s);
        wk.ranks.retain(|r| r.1 != s);
        self.active.remove(s);
        self.stale.remove(s);
        self.lost.remove(s);
        self.unsynced.remove(s);
        self.nondev.remove(s);
        for m in self.producers.iter_mut().filter_map(|p| p.slots.as_mut()) {
            m.remove(s);
        }
        self.free.push(s);
    }

    fn store(&mut self, s: u32, t: u8, hashes: &[u64]) {
        let bit = 1u8 << t;
        let (map, holders) = (&mut self.map, &mut self.holders);
        let counts = &mut self.counts[s as usize];
        let mut added = false;
        for &h in hashes {
            let (old, new) = update_holder(map, holders, h, s, |o| o | bit);
            if old != new {
                counts[t as usize] += 1;
                added = true;
            }
        }
        if added && t > 0 {
            self.nondev.insert(s);
        }
    }

    fn remove(&mut self, s: u32, t: u8, hashes: &[u64]) {
        let keep = !(1u8 << t);
        let (map, holders) = (&mut self.map, &mut self.holders);
        let counts = &mut self.counts[s as usize];
        for &h in hashes {
            let (old, new) = update_holder(map, holders, h, s, |o| o & keep);
            if old != new {
                counts[t as usize] -= 1;
            }
        }
        if t > 0 {
            self.refresh_nondev(s);
        }
    }

    fn move_blocks(&mut self, s: u32, f: u8, t: u8, hashes: &[u64]) {
        if f == t {
            self.store(s, t, hashes);
            return;
        }
        let (keep, bit) = (!(1u8 << f), 1u8 << t);
        let (map, holders) = (&mut self.map, &mut self.holders);
        let counts = &mut self.counts[s as usize];
        for &h in hashes {
            let (old, new) = update_holder(map, holders, h, s, |o| (o & keep) | bit);
            count_diff(counts, old, new);
        }
        self.refresh_nondev(s);
    }

    fn refresh_nondev(&mut self, s: u32) {
        let nd = self.counts[s as usize][1..].iter().any(|&c| c > 0);
        self.nondev.set(s, nd);
    }

    /// Drop the given tiers of slot `s` (one pass over the map, skipped when there is nothing).
    fn clear(&mut self, s: u32, tiers: u8) {
        let counts = &mut self.counts[s as usize];
        let mut mask = 0u8;
        for t in 0..N_TIERS {
            if tiers >> t & 1 == 1 && counts[t] > 0 {
                mask |= 1 << t;
            }
        }
        if mask != 0 {
            let keep = !mask;
            let holders = &mut self.holders;
            self.map.retain(|_, v| {
                let (nv, old, new) = holders.update(*v, s, |o| o & keep);
                count_diff(counts, old, new);
                *v = nv;
                nv != EMPTY
            });
        }
        self.refresh_nondev(s);
    }

    /// stale = lost | unsynced on the slots of `mask`.
    fn refresh_stale(&mut self, mask: &BitSet) {
        for s in mask.iter() {
            let on = self.lost.contains(s) || self.unsynced.contains(s);
            self.stale.set(s, on);
        }
    }

    fn resync(&mut self, mask: &BitSet) {
        if self.stale.intersects(mask) {
            self.counters[C_RESYNCS] += 1;
        }
        self.stale.difference_with(mask);
        self.lost.difference_with(mask);
        self.unsynced.difference_with(mask);
    }

    fn registered(&mut self, w: u32, epoch: i64) {
        // Touches no residency: it must commute with every KV event (see the reference).
        let wk = &mut self.workers[w as usize];
        if epoch > wk.registered_epoch {
            wk.registered_epoch = epoch;
        }
        let confirmed = wk.registered_epoch >= wk.epoch;
        wk.deregistered = false;
        let ws = wk.slots.clone();
        if confirmed {
            self.unsynced.difference_with(&ws);
            self.refresh_stale(&ws);
        }
        self.active.union_with(&ws);
    }

    fn deregistered(&mut self, w: u32) {
        self.workers[w as usize].deregistered = true;
        let ws = self.workers[w as usize].slots.clone();
        self.active.difference_with(&ws);
    }

    /// Free the empty, unflagged slots of a deregistered worker (the same state as no slot).
    fn free_settled(&mut self, w: u32) {
        for s in self.workers[w as usize].slots.to_vec() {
            if !self.lost.contains(s)
                && !self.unsynced.contains(s)
                && self.counts[s as usize].iter().all(|&c| c == 0)
            {
                self.free_slot(s, w);
            }
        }
    }

    // -- checkpoints (the reference's snapshot format, byte for byte) -----------------------

    pub fn snapshot(&self) -> Vec<u8> {
        let res = self.residency();
        let mut w = Writer::new();
        w.map(11);
        w.str("format");
        w.int(SNAPSHOT_FORMAT);
        w.str("hash_algo");
        w.str(&self.hash_algo);
        w.str("block_size");
        w.int(self.block_size);
        w.str("width");
        w.uint(self.width as u64);
        w.str("n_slots");
        w.uint(self.slots.len() as u64);
        w.str("free");
        w.array(self.free.len());
        for &s in &self.free {
            w.uint(s as u64);
        }
        w.str("slots");
        let live = self.live_slots();
        w.array(live.len());
        for &s in &live {
            let k = self.slots[s as usize].as_ref().unwrap();
            w.array(6);
            w.uint(s as u64);
            w.str(&self.workers[k.worker as usize].name);
            w.int(k.dp_rank);
            w.bool(self.stale.contains(s));
            w.bool(self.lost.contains(s));
            w.array(N_TIERS);
            for hashes in &res[s as usize] {
                w.bin_header(hashes.len() * 8);
                for h in hashes {
                    w.buf.extend_from_slice(&h.to_le_bytes());
                }
            }
        }
        w.str("workers");
        let mut ws: Vec<&Worker> = self.workers.iter().collect();
        ws.sort_by(|a, b| a.name.cmp(&b.name));
        w.array(ws.len());
        for wk in ws {
            w.array(5);
            w.str(&wk.name);
            w.int(wk.epoch);
            w.bool(wk.deregistered);
            w.int(wk.life_epoch);
            w.int(wk.registered_epoch);
        }
        w.str("seq");
        let pos = self.positions();
        w.array(pos.len());
        for (p, stream, epoch, last) in pos {
            w.array(4);
            w.str(p);
            w.str(stream);
            w.int(epoch);
            w.int(last);
        }
        w.str("producers");
        let mut ps: Vec<(&String, &BitSet)> =
            self.producers.iter().filter_map(|p| p.slots.as_ref().map(|m| (&p.name, m))).collect();
        ps.sort_by(|a, b| a.0.cmp(b.0));
        w.array(ps.len());
        for (p, m) in ps {
            w.array(2);
            w.str(p);
            let v = m.to_vec();
            w.array(v.len());
            for s in v {
                w.uint(s as u64);
            }
        }
        w.str("counters");
        w.map(COUNTER_NAMES.len());
        for (i, name) in COUNTER_NAMES.iter().enumerate() {
            w.str(name);
            w.uint(self.counters[i]);
        }
        w.buf
    }

    pub fn restore(data: &[u8]) -> mp::Result<NativeIndex> {
        let bad = |m: &str| mp::DecodeError(format!("prefix index snapshot: {m}"));
        let mut r = Reader::new(data);
        let n = r.map_len()?;
        let mut format = None;
        let (mut hash_algo, mut block_size, mut width, mut n_slots) = (None, None, None, None);
        let mut free = Vec::new();
        let mut slots: Vec<(u32, String, i64, bool, bool, Vec<Vec<u64>>)> = Vec::new();
        let mut workers: Vec<(String, i64, bool, i64, i64)> = Vec::new();
        let mut seqs: Vec<(String, String, i64, i64)> = Vec::new();
        let mut producers: Vec<(String, Vec<u32>)> = Vec::new();
        let mut counters: Vec<(String, u64)> = Vec::new();
        for _ in 0..n {
            match r.str()? {
                "format" => format = Some(r.i64()?),
                "hash_algo" => hash_algo = Some(r.str()?.to_string()),
                "block_size" => block_size = Some(r.i64()?),
                "width" => width = Some(r.u64()? as u32),
                "n_slots" => n_slots = Some(r.u64()? as usize),
                "free" => {
                    for _ in 0..r.array_len()? {
                        free.push(r.u64()? as u32);
                    }
                }
                "slots" => {
                    for _ in 0..r.array_len()? {
                        if r.array_len()? != 6 {
                            return Err(bad("slot entry is not 6 long"));
                        }
                        let s = r.u64()? as u32;
                        let wid = r.str()?.to_string();
                        let dp = r.i64()?;
                        let st = r.bool()?;
                        let lo = r.bool()?;
                        let nt = r.array_len()?;
                        let mut tiers = Vec::with_capacity(nt);
                        for _ in 0..nt {
                            let raw = r.bin()?;
                            if raw.len() % 8 != 0 {
                                return Err(bad("tier bytes not a multiple of 8"));
                            }
                            tiers.push(
                                raw.chunks_exact(8)
                                    .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                                    .collect(),
                            );
                        }
                        slots.push((s, wid, dp, st, lo, tiers));
                    }
                }
                "workers" => {
                    for _ in 0..r.array_len()? {
                        if r.array_len()? != 5 {
                            return Err(bad("worker entry is not 5 long"));
                        }
                        workers.push((r.str()?.to_string(), r.i64()?, r.bool()?, r.i64()?, r.i64()?));
                    }
                }
                "seq" => {
                    for _ in 0..r.array_len()? {
                        r.array_len()?;
                        seqs.push((r.str()?.to_string(), r.str()?.to_string(), r.i64()?, r.i64()?));
                    }
                }
                "producers" => {
                    for _ in 0..r.array_len()? {
                        r.array_len()?;
                        let p = r.str()?.to_string();
                        let mut v = Vec::new();
                        for _ in 0..r.array_len()? {
                            v.push(r.u64()? as u32);
                        }
                        producers.push((p, v));
                    }
                }
                "counters" => {
                    for _ in 0..r.map_len()? {
                        counters.push((r.str()?.to_string(), r.u64()?));
                    }
                }
                _ => r.skip()?,
            }
        }
        if format != Some(SNAPSHOT_FORMAT) {
            return Err(bad(&format!("unknown prefix index snapshot format {format:?}")));
        }
        let mut idx = NativeIndex::new(
            &hash_algo.ok_or_else(|| bad("no hash_algo"))?,
            block_size.ok_or_else(|| bad("no block_size"))?,
        );
        idx.width = width.ok_or_else(|| bad("no width"))?;
        let n_slots = n_slots.ok_or_else(|| bad("no n_slots"))?;
        idx.slots = vec![None; n_slots];
        idx.counts = vec![[0; N_TIERS]; n_slots];
        for (name, epoch, dereg, life_epoch, registered_epoch) in workers {
            let w = idx.workers.len() as u32;
            idx.worker_of.insert(name.clone(), w);
            idx.workers.push(Worker {
                name,
                epoch,
                life_epoch,
                registered_epoch,
                deregistered: dereg,
                slots: BitSet::new(),
                ranks: Vec::new(),
            });
        }
        for (s, wid, dp, st, lo, tiers) in slots {
            let &w = idx.worker_of.get(&wid).ok_or_else(|| bad("slot of an unknown worker"))?;
            if s as usize >= n_slots {
                return Err(bad("slot number beyond n_slots"));
            }
            idx.slots[s as usize] = Some(SlotKey { worker: w, dp_rank: dp });
            let wk = &mut idx.workers[w as usize];
            wk.slots.insert(s);
            wk.ranks.push((dp, s));
            if !wk.deregistered {
                idx.active.insert(s);
            }
            // stale = lost | unsynced; unsynced cannot show while lost (see the reference).
            idx.stale.set(s, st || lo);
            idx.lost.set(s, lo);
            idx.unsynced.set(s, st && !lo);
            for (t, hashes) in tiers.iter().enumerate().take(N_TIERS) {
                if !hashes.is_empty() {
                    idx.store(s, t as u8, hashes);
                }
            }
        }
        idx.free = free;
        for (p, stream, epoch, last) in seqs {
            let p = idx.producer(&p);
            idx.producers[p as usize].streams.push(SeqPos { stream, epoch, last });
        }
        for (p, v) in producers {
            let mut m = BitSet::new();
            for s in v {
                m.insert(s);
            }
            let p = idx.producer(&p);
            idx.producers[p as usize].slots = Some(m);
        }
        for (name, v) in counters {
            if let Some(i) = COUNTER_NAMES.iter().position(|&c| c == name) {
                idx.counters[i] = v;
            }
        }
        Ok(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALGO: &str = "xxh3_64:1337";

    fn stored<'a>(w: &'a str, tier: u8, hashes: &'a [u64]) -> Event<'a> {
        Event {
            worker_id: w,
            stream: "kv",
            dp_rank: Some(0),
            payload: Payload::Stored { tier, hashes, block_size: 16, hash_algo: ALGO, full_attention: true },
        }
    }

    fn removed<'a>(w: &'a str, tier: u8, hashes: &'a [u64]) -> Event<'a> {
        Event {
            worker_id: w,
            stream: "kv",
            dp_rank: Some(0),
            payload: Payload::Removed { tier, hashes, full_attention: true },
        }
    }

    fn matches(idx: &NativeIndex, q: &[u64]) -> Vec<(String, u32, [u32; 4], bool)> {
        let mut m = Matches::default();
        idx.find_matches(q, &mut m);
        m.out
            .iter()
            .map(|m| (idx.slot_key(m.slot).unwrap().0.to_string(), m.depth, m.by_tier, m.stale))
            .collect()
    }

    #[test]
    fn store_match_remove() {
        let mut idx = NativeIndex::new(ALGO, 16);
        assert_eq!(idx.apply("a", 0, 0, &stored("a", 0, &[1, 2, 3])).outcome, Outcome::Applied);
        assert_eq!(idx.apply("b", 0, 0, &stored("b", 1, &[1, 2])).outcome, Outcome::Applied);
        assert_eq!(
            matches(&idx, &[1, 2, 3, 4]),
            vec![("b".into(), 2, [0, 2, 0, 0], false), ("a".into(), 3, [3, 0, 0, 0], false)]
        );
        idx.apply("a", 0, 1, &removed("a", 0, &[2]));
        assert_eq!(matches(&idx, &[1, 2, 3]), vec![("a".into(), 1, [1, 0, 0, 0], false), ("b".into(), 2, [0, 2, 0, 0], false)]);
        idx.verify_invariants().unwrap();
        assert_eq!(idx.entries(), 4);
    }

    #[test]
    fn duplicates_gaps_epochs() {
        let mut idx = NativeIndex::new(ALGO, 16);
        idx.apply("a", 0, 0, &stored("a", 0, &[1]));
        assert_eq!(idx.apply("a", 0, 0, &stored("a", 0, &[9])).outcome, Outcome::Duplicate);
        let r = idx.apply("a", 0, 5, &stored("a", 2, &[1, 2]));
        assert!(r.gap);
        assert_eq!(matches(&idx, &[1, 2]), vec![("a".into(), 2, [1, 0, 1, 0], true)]);
        // A new epoch drops volatile tiers; lost slots lose persistent ones too.
        let r = idx.apply("a", 1, 0, &stored("a", 0, &[7]));
        assert!(r.new_epoch && !r.gap);
        assert_eq!(matches(&idx, &[1]), vec![]);
        assert_eq!(idx.apply("a", 0, 1, &stored("a", 0, &[1])).outcome, Outcome::Fenced);
        idx.verify_invariants().unwrap();
    }

    #[test]
    fn rejections_consume_the_sequence() {
        let mut idx = NativeIndex::new(ALGO, 16);
        let mut ev = stored("a", 0, &[1]);
        ev.payload = Payload::Stored { tier: 0, hashes: &[1], block_size: 32, hash_algo: ALGO, full_attention: true };
        assert_eq!(idx.apply("a", 0, 0, &ev).outcome, Outcome::Rejected("block_size"));
        assert!(!idx.apply("a", 0, 1, &stored("a", 0, &[1])).gap);
        assert_eq!(idx.counters[C_REJECTED], 1);
    }

    #[test]
    fn snapshot_round_trip_and_clears() {
        let mut idx = NativeIndex::new(ALGO, 16);
        let hs: Vec<u64> = (0..100).map(|i| i * 0x1234_5678_9abc).collect();
        for (i, w) in ["a", "b", "c"].iter().enumerate() {
            idx.apply(w, 0, 0, &stored(w, i as u8, &hs[i * 10..]));
        }
        let snap = idx.snapshot();
        let back = NativeIndex::restore(&snap).unwrap();
        assert_eq!(back.snapshot(), snap);
        back.verify_invariants().unwrap();
        let clear = Event { worker_id: "b", stream: "kv", dp_rank: Some(0), payload: Payload::Cleared { tier: None } };
        idx.apply("b", 0, 1, &clear);
        idx.verify_invariants().unwrap();
        assert_eq!(idx.slot_counts(1), [0; 4]);
        let dereg = Event { worker_id: "c", stream: "workers", dp_rank: None, payload: Payload::Deregistered };
        idx.apply("c", 0, 0, &dereg);
        idx.verify_invariants().unwrap();
        // c is gone; a still holds the whole chain.
        assert_eq!(matches(&idx, &hs[20..]), vec![("a".into(), 80, [80, 0, 0, 0], false)]);
    }
}
