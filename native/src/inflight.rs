//! The router's in-flight accounts per worker, natively: the `Accounts` of
//! `tests/oracles/ledger.py` (the executable specification, kept as the differential oracle),
//! rule for rule.
//!
//! A worker's account holds the load the router has sent it and not yet seen finish (prefill
//! tokens, blocks beyond the prompt's hashed ones, requests) and a refcount per prompt block
//! hash its in-flight requests hold. The speculative overlap of a query chain is the binary
//! search of the specification (`n - bisect_left(reversed(chain), True, key=refs.__contains__)`
//! when the chain's first block is held), probe for probe, so both give the same depth for any
//! set of hashes, a prefix-closed one or not.
//!
//! Accounts iterate in the order they were opened (a Python dict's order): one is opened by its
//! worker's first entry and closed when its last one leaves.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasherDefault;
use std::sync::Arc;

use crate::index::U64Hasher;

type Refs = HashMap<u64, u64, BuildHasherDefault<U64Hasher>>;

/// One worker's in-flight load and held hashes.
#[derive(Default, Debug)]
pub struct Account {
    refs: Refs,
    pub prefill_tokens: i64,
    pub extra_blocks: i64,
    pub requests: i64,
}

impl Account {
    /// KV blocks held: the distinct hashed blocks once, plus every request's unhashed ones.
    pub fn blocks(&self) -> Option<i64> {
        i64::try_from(self.refs.len()).ok()?.checked_add(self.extra_blocks)
    }

    pub fn holds(&self, h: u64) -> bool {
        self.refs.contains_key(&h)
    }

    /// Held distinct hashes.
    pub fn distinct(&self) -> usize {
        self.refs.len()
    }

    /// `(hash, refcount)` pairs, in no particular order.
    pub fn refs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.refs.iter().map(|(&h, &c)| (h, c))
    }
}

/// Every worker's account, in the order they were opened; indexed by worker id in id order
/// (which is the order a decision visits its candidates).
#[derive(Default, Debug)]
pub struct Accounts {
    /// Worker ids are shared with the views taken of the accounts (a view outlives changes).
    slots: Vec<Option<(Arc<str>, Account)>>,
    index: BTreeMap<Arc<str>, usize>,
}

/// The counters after adding (`sign` 1) or removing (`sign` -1) one entry; None on overflow.
fn moved(a: &Account, prefill: i64, extra: i64, sign: i64) -> Option<(i64, i64, i64)> {
    Some((
        a.prefill_tokens.checked_add(prefill.checked_mul(sign)?)?,
        a.extra_blocks.checked_add(extra.checked_mul(sign)?)?,
        a.requests.checked_add(sign)?,
    ))
}

impl Accounts {
    pub fn get(&self, worker: &str) -> Option<&Account> {
        self.index.get(worker).and_then(|&i| self.slots[i].as_ref()).map(|(_, a)| a)
    }

    /// Open accounts, in the order they were opened.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Account)> {
        self.slots.iter().flatten().map(|(w, a)| (&**w, a))
    }

    /// Open accounts in worker id order (byte order: for UTF-8, the code point order Python
    /// sorts `str` by), each with its rank in opening order's slots (ascending = opening order).
    pub fn iter_by_id(&self) -> impl Iterator<Item = (&Arc<str>, usize, &Account)> {
        self.index.iter().map(|(w, &i)| (w, i, &self.slots[i].as_ref().expect("indexed slots are open").1))
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// One entry routed to `worker`: its prompt `hashes`, the tokens it must prefill and the
    /// blocks it holds beyond them. False, with nothing changed, when a counter would overflow.
    pub fn add(&mut self, worker: &str, hashes: &[u64], prefill: i64, extra: i64) -> bool {
        let slot = match self.index.get(worker) {
            Some(&i) => i,
            None => {
                if moved(&Account::default(), prefill, extra, 1).is_none() {
                    return false;
                }
                let name: Arc<str> = Arc::from(worker);
                self.slots.push(Some((name.clone(), Account::default())));
                self.index.insert(name, self.slots.len() - 1);
                self.slots.len() - 1
            }
        };
        let a = &mut self.slots[slot].as_mut().expect("indexed slots are open").1;
        let Some((p, e, r)) = moved(a, prefill, extra, 1) else { return false };
        (a.prefill_tokens, a.extra_blocks, a.requests) = (p, e, r);
        a.refs.reserve(hashes.len());
        for &h in hashes {
            *a.refs.entry(h).or_insert(0) += 1;
        }
        true
    }

    /// The entry `add` recorded leaves `worker` (the same `hashes`, prefill and extra blocks);
    /// the account closes with its last request. False, with nothing changed, when the worker
    /// has no account or a counter would overflow.
    pub fn remove(&mut self, worker: &str, hashes: &[u64], prefill: i64, extra: i64) -> bool {
        let Some(&slot) = self.index.get(worker) else { return false };
        let a = &mut self.slots[slot].as_mut().expect("indexed slots are open").1;
        let Some((p, e, r)) = moved(a, prefill, extra, -1) else { return false };
        (a.prefill_tokens, a.extra_blocks, a.requests) = (p, e, r);
        for h in hashes {
            if let Some(c) = a.refs.get_mut(h) {
                *c -= 1;
                if *c == 0 {
                    a.refs.remove(h);
                }
            }
        }
        if a.requests == 0 {
            self.close(worker, slot);
        }
        true
    }

    /// An entry's prompt on `worker` is computed: its `tokens` stop counting.
    pub fn prefill_done(&mut self, worker: &str, tokens: i64) -> bool {
        let Some(&slot) = self.index.get(worker) else { return false };
        let a = &mut self.slots[slot].as_mut().expect("indexed slots are open").1;
        match a.prefill_tokens.checked_sub(tokens) {
            Some(p) => {
                a.prefill_tokens = p;
                true
            }
            None => false,
        }
    }

    fn close(&mut self, worker: &str, slot: usize) {
        self.index.remove(worker);
        self.slots[slot] = None;
        // Closed slots keep their place so the open ones keep their order; compact once they
        // are the majority (amortised O(1) per close).
        if self.slots.len() > 2 * self.index.len() + 16 {
            self.slots.retain(Option::is_some);
            for (i, (w, _)) in self.slots.iter().flatten().enumerate() {
                *self.index.get_mut(&**w).expect("open slots are indexed") = i;
            }
        }
    }
}

/// The specification's speculative overlap of a chain of `n` hashes (`hash_at(i)` is its i-th)
/// on an account: 0 unless its first block is held, else `n - bisect_left(reversed, True,
/// key=holds)`, probing the same positions in the same order.
pub fn matched_depth(a: &Account, n: usize, mut hash_at: impl FnMut(usize) -> u64) -> usize {
    if n == 0 || !a.holds(hash_at(0)) {
        return 0;
    }
    let (mut lo, mut hi) = (0usize, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if a.holds(hash_at(n - 1 - mid)) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    n - lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth(acc: &Accounts, w: &str, chain: &[u64]) -> usize {
        acc.get(w).map_or(0, |a| matched_depth(a, chain.len(), |i| chain[i]))
    }

    #[test]
    fn shared_prefix_counted_once_and_released_with_its_last_holder() {
        let mut acc = Accounts::default();
        assert!(acc.add("w", &[1, 2, 3, 4], 64, 2));
        assert!(acc.add("w", &[1, 2, 7], 48, 1));
        let a = acc.get("w").unwrap();
        assert_eq!((a.prefill_tokens, a.blocks(), a.requests), (112, Some(5 + 3), 2));
        assert_eq!(depth(&acc, "w", &[1, 2, 3, 9]), 3);
        assert_eq!(depth(&acc, "w", &[1, 2, 7, 8, 9]), 3);
        assert_eq!(depth(&acc, "w", &[5, 1, 2]), 0);
        assert!(acc.remove("w", &[1, 2, 3, 4], 64, 2));
        assert_eq!(depth(&acc, "w", &[1, 2, 3, 9]), 2);
        assert!(acc.remove("w", &[1, 2, 7], 48, 1));
        assert!(acc.get("w").is_none() && acc.is_empty());
    }

    /// The probe order is the specification's even when membership is not monotone along the
    /// chain (hashes that are not chained): held {1, 3} and chain [1, 2, 3] gives
    /// bisect over reversed [3, 2, 1] -> mid 1 (2: not held) -> lo 2 -> mid 2 (1: held) -> 3 - 2.
    #[test]
    fn bisect_probes_like_the_specification() {
        let mut acc = Accounts::default();
        acc.add("w", &[1, 3], 0, 0);
        assert_eq!(depth(&acc, "w", &[1, 2, 3]), 1);
        assert_eq!(depth(&acc, "w", &[]), 0);
    }

    #[test]
    fn by_id_is_sorted_and_slots_give_the_opening_order() {
        let mut acc = Accounts::default();
        for w in ["b", "c", "a"] {
            acc.add(w, &[1], 0, 0);
        }
        let by_id: Vec<(&str, usize)> = acc.iter_by_id().map(|(w, i, _)| (&**w, i)).collect();
        assert_eq!(by_id, vec![("a", 2), ("b", 0), ("c", 1)]);
    }

    #[test]
    fn accounts_keep_their_opening_order_across_closes() {
        let mut acc = Accounts::default();
        let names: Vec<String> = (0..40).map(|i| format!("w{i:02}")).collect();
        for w in &names {
            acc.add(w, &[1], 0, 0);
        }
        for w in names.iter().step_by(2) {
            assert!(acc.remove(w, &[1], 0, 0));
        }
        acc.add("w00", &[1], 0, 0);
        let order: Vec<&str> = acc.iter().map(|(w, _)| w).collect();
        let mut expect: Vec<&str> = names.iter().skip(1).step_by(2).map(String::as_str).collect();
        expect.push("w00");
        assert_eq!(order, expect);
        assert_eq!(acc.len(), 21);
    }

    #[test]
    fn refuses_overflow_without_changing_anything() {
        let mut acc = Accounts::default();
        assert!(acc.add("w", &[1], i64::MAX, 0));
        assert!(!acc.add("w", &[2], 1, 0));
        let a = acc.get("w").unwrap();
        assert_eq!((a.prefill_tokens, a.requests, a.distinct()), (i64::MAX, 1, 1));
        assert!(!acc.remove("x", &[1], 0, 0));
        assert!(!acc.remove("w", &[1], i64::MIN, 0));
        assert!(!acc.prefill_done("w", i64::MIN));
        assert_eq!(acc.get("w").unwrap().distinct(), 1);
    }
}
