//! Who holds a block: the value the index's hash map keeps per block hash.
//!
//! A holder is a `u32`, `slot << 4 | tiers` (one bit per tier, device first). A value is one of
//!
//! * `INLINE | holder`: the only holder (the common case: no allocation at all);
//! * `class << 56 | offset`: a holder list, sorted by slot, of at least two holders, in a chunk
//!   of `2^class` words of one shared pool (`[len, holder, holder, ...]`);
//! * [`EMPTY`] (0, never stored: the map drops the entry): no holder.
//!
//! Why a pool and not a `Vec` per list: a list costs its words and nothing else (no 24-byte
//! header, no allocator call and no allocator overhead), and freed chunks are reused per size
//! class, so the per-event path allocates nothing once the pool has grown.

/// Map value tag: the low 32 bits are the only holder.
pub const INLINE: u64 = 1 << 63;
/// No holder (the entry is removed).
pub const EMPTY: u64 = 0;
const CLASS_SHIFT: u32 = 56;
const OFFSET_MASK: u64 = (1 << CLASS_SHIFT) - 1;
/// The smallest chunk: 4 words, room for 3 holders.
const MIN_CLASS: u32 = 2;

#[inline]
pub fn holder(slot: u32, tiers: u8) -> u32 {
    slot << 4 | tiers as u32
}

#[derive(Default)]
pub struct Holders {
    pool: Vec<u32>,
    /// Per class, the offsets of free chunks.
    free: Vec<Vec<u64>>,
}

impl Holders {
    pub fn new() -> Self {
        Holders::default()
    }

    /// The holders `v` stands for (an inline one is copied into `tmp`).
    #[inline]
    pub fn get<'a>(&'a self, v: u64, tmp: &'a mut [u32; 1]) -> &'a [u32] {
        if v & INLINE != 0 {
            tmp[0] = v as u32;
            &tmp[..]
        } else {
            let off = (v & OFFSET_MASK) as usize;
            let len = self.pool[off] as usize;
            &self.pool[off + 1..off + 1 + len]
        }
    }

    /// Whether `v` is a holder list (for invariant checks).
    pub fn is_list(v: u64) -> bool {
        v & INLINE == 0
    }

    /// Heap bytes: the pool and the free-chunk stacks.
    pub fn bytes(&self) -> usize {
        self.pool.capacity() * 4 + self.free.iter().map(|f| f.capacity() * 8).sum::<usize>()
    }

    /// Set the tiers `slot` holds in `v` to `f(old)` (old = 0 when it holds none). Returns the
    /// new value ([`EMPTY`]: drop the entry), the old tiers and the new ones.
    #[inline]
    pub fn update(&mut self, v: u64, slot: u32, f: impl FnOnce(u8) -> u8) -> (u64, u8, u8) {
        if v == EMPTY {
            let new = f(0);
            let nv = if new == 0 { EMPTY } else { INLINE | holder(slot, new) as u64 };
            return (nv, 0, new);
        }
        if v & INLINE != 0 {
            let hd = v as u32;
            if hd >> 4 == slot {
                let old = (hd & 15) as u8;
                let new = f(old);
                let nv = if new == 0 { EMPTY } else { INLINE | holder(slot, new) as u64 };
                return (nv, old, new);
            }
            let new = f(0);
            if new == 0 {
                return (v, 0, 0);
            }
            let mine = holder(slot, new);
            let (a, b) = if hd < mine { (hd, mine) } else { (mine, hd) };
            let off = self.alloc(MIN_CLASS);
            self.pool[off..off + 3].copy_from_slice(&[2, a, b]);
            return (list_value(off, MIN_CLASS), 0, new);
        }
        let (off, class) = ((v & OFFSET_MASK) as usize, (v >> CLASS_SHIFT) as u32);
        let len = self.pool[off] as usize;
        let list = &mut self.pool[off + 1..off + 1 + len];
        match list.binary_search_by_key(&slot, |x| x >> 4) {
            Ok(i) => {
                let old = (list[i] & 15) as u8;
                let new = f(old);
                if new != 0 {
                    list[i] = holder(slot, new);
                    return (v, old, new);
                }
                list.copy_within(i + 1.., i);
                let len = len - 1;
                if len == 1 {
                    let single = self.pool[off + 1];
                    self.release(off, class);
                    return (INLINE | single as u64, old, 0);
                }
                self.pool[off] = len as u32;
                // Halve a chunk a quarter full, so a list that shrank does not keep its peak.
                if class > MIN_CLASS && len < (1 << class) / 4 {
                    let to = self.alloc(class - 1);
                    self.pool.copy_within(off..off + 1 + len, to);
                    self.release(off, class);
                    return (list_value(to, class - 1), old, 0);
                }
                (v, old, 0)
            }
            Err(i) => {
                let new = f(0);
                if new == 0 {
                    return (v, 0, 0);
                }
                let (mut off, mut class) = (off, class);
                if len + 1 == 1 << class {
                    let to = self.alloc(class + 1);
                    self.pool.copy_within(off..off + 1 + len, to);
                    self.release(off, class);
                    (off, class) = (to, class + 1);
                }
                let list = &mut self.pool[off + 1..off + 2 + len];
                list.copy_within(i..len, i + 1);
                list[i] = holder(slot, new);
                self.pool[off] = (len + 1) as u32;
                (list_value(off, class), 0, new)
            }
        }
    }

    fn alloc(&mut self, class: u32) -> usize {
        if let Some(off) = self.free.get_mut(class as usize).and_then(|f| f.pop()) {
            return off as usize;
        }
        let off = self.pool.len();
        self.pool.resize(off + (1 << class), 0);
        off
    }

    fn release(&mut self, off: usize, class: u32) {
        let c = class as usize;
        if self.free.len() <= c {
            self.free.resize_with(c + 1, Vec::new);
        }
        self.free[c].push(off as u64);
    }
}

#[inline]
fn list_value(off: usize, class: u32) -> u64 {
    (class as u64) << CLASS_SHIFT | off as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holders as (slot, tiers) pairs.
    fn pairs(h: &Holders, v: u64) -> Vec<(u32, u8)> {
        let mut tmp = [0];
        if v == EMPTY {
            return vec![];
        }
        h.get(v, &mut tmp).iter().map(|&x| (x >> 4, (x & 15) as u8)).collect()
    }

    #[test]
    fn grows_shrinks_and_goes_back_inline() {
        let mut h = Holders::new();
        let mut v = EMPTY;
        // Insert slots 40, 39, ..., 0 (each at the front), with tier bit 1.
        for s in (0..41).rev() {
            let (nv, old, new) = h.update(v, s, |o| o | 1);
            assert_eq!((old, new), (0, 1));
            v = nv;
        }
        assert_eq!(pairs(&h, v), (0..41).map(|s| (s, 1)).collect::<Vec<_>>());
        // A second tier on slot 7 changes the holder in place.
        let (nv, old, new) = h.update(v, 7, |o| o | 2);
        assert_eq!((nv, old, new), (v, 1, 3));
        // Unknown slot, nothing to add: unchanged.
        assert_eq!(h.update(v, 99, |o| o & !1), (v, 0, 0));
        for s in 0..40 {
            let (nv, old, new) = h.update(v, s, |_| 0);
            assert_eq!(new, 0);
            assert!(old != 0);
            v = nv;
        }
        assert_eq!(v, INLINE | holder(40, 1) as u64);
        let (nv, _, _) = h.update(v, 40, |_| 0);
        assert_eq!(nv, EMPTY);
    }

    #[test]
    fn chunks_are_reused() {
        let mut h = Holders::new();
        let a = INLINE | holder(1, 1) as u64;
        let (v, _, _) = h.update(a, 2, |_| 1);
        let words = h.pool.len();
        let (back, _, _) = h.update(v, 2, |_| 0);
        assert_eq!(back, a);
        let (v2, _, _) = h.update(a, 3, |_| 4);
        assert_eq!(h.pool.len(), words);
        assert_eq!(pairs(&h, v2), vec![(1, 1), (3, 4)]);
    }
}
