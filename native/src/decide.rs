//! The kv cost of one routing candidate, natively: the hot loop of
//! `tests/oracles/scoring.py::score` (the executable specification, kept as the differential
//! oracle), term for term.
//!
//! Bit-identical by construction: every float is an `f64` computed from the same operands in
//! the same order as the Python loop (Python's `int * float` is `float(int) * float`, exact
//! below 2^53; Rust never contracts `a * b + c` into a fused multiply-add). Integers stay
//! integers. What the Python loop would compute with arbitrary-precision integers the core
//! refuses instead ([`score`] returns `None`: an overflow, or a prompt-plus-queue beyond 2^53
//! tokens whose true division Python rounds once and `f64` would round twice); the router then
//! refuses the input. The Python copy of the loop is the differential oracle in
//! `tests/oracles/scoring.py`.

pub use crate::index::N_TIERS;

/// Weighted slots of an overlap: the four tiers, then a peer reach (blocks another worker holds
/// that this one can pull instead of recomputing; `WorkerOverlap.slots`).
pub const N_SLOTS: usize = N_TIERS + 1;

/// Integers at most this large convert to `f64` exactly.
const EXACT: i64 = 1 << 53;

/// What the whole decision shares: the request and the config's kv terms.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    /// Full prompt blocks hashed (`len(request.block_hashes)`).
    pub n_hash: i64,
    pub block_size: i64,
    pub prompt_tokens: i64,
    /// ceil((prompt + expected output) / block_size).
    pub request_blocks: i64,
    /// False for a decode-phase request: no prefill term.
    pub does_prefill: bool,
    /// Tier weights in TIER_ORDER (device first), then the peer weight (`TierWeights.as_tuple`).
    pub weights: [f64; N_SLOTS],
    pub stale_factor: f64,
    /// `load_combine == "max"` (else "sum").
    pub use_max: bool,
    pub prefill_load_scale: f64,
}

/// A worker's reported load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    pub queued_prefill_tokens: i64,
    pub active_decode_blocks: i64,
    pub inflight_requests: i64,
}

/// The router's in-flight load on the worker (`InflightLoad`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Mine {
    pub prefill_tokens: i64,
    pub decode_blocks: i64,
    pub requests: i64,
    pub shared_blocks: i64,
}

/// The prefix index's match (`WorkerOverlap.slots()`): blocks per tier, fastest first, then the
/// peer reach (at most [`N_SLOTS`]; missing trailing slots count 0), and whether the view is
/// stale.
#[derive(Clone, Copy, Debug)]
pub struct Overlap<'a> {
    pub tiers: &'a [i64],
    pub stale: bool,
}

/// One candidate's terms, as `scoring.Scored` holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Terms {
    pub queued: i64,
    pub active: i64,
    pub in_flight: i64,
    pub shared: i64,
    pub overlap_w: f64,
    pub prefill: f64,
    pub decode: i64,
    pub cost: f64,
}

fn combine(use_max: bool, reported: i64, mine: i64) -> Option<i64> {
    if use_max {
        Some(if mine > reported { mine } else { reported })
    } else {
        reported.checked_add(mine)
    }
}

fn exact(x: i64) -> Option<f64> {
    if (-EXACT..=EXACT).contains(&x) {
        Some(x as f64)
    } else {
        None
    }
}

/// The weighted overlap of the index's blocks at prompt positions `[s, n_hash)`, tiers laid
/// along the prefix fastest first: the two branches of the Python loop, in its order.
fn real_overlap(p: &Params, tiers: &[i64], s: i64) -> Option<f64> {
    let mut total: i64 = 0;
    for &c in tiers {
        total = total.checked_add(c)?;
    }
    let mut real = 0.0f64;
    if s == 0 && total <= p.n_hash {
        // reduce(add, map(mul, counts, weights), 0.0)
        for (&c, &w) in tiers.iter().zip(p.weights.iter()) {
            real += exact(c)? * w;
        }
    } else {
        let mut pos: i64 = 0;
        for (&c, &w) in tiers.iter().zip(p.weights.iter()) {
            if c != 0 {
                let lo = if pos > s { pos } else { s };
                pos = pos.checked_add(c)?;
                let x = (if pos < p.n_hash { pos } else { p.n_hash }) - lo;
                if x > 0 {
                    real += w * exact(x)?;
                }
            }
        }
    }
    Some(real)
}

/// One candidate's kv terms; `None` when the integers leave the range where `f64` reproduces
/// Python's arithmetic exactly (the router then refuses the input).
pub fn score(p: &Params, load: Load, mine: Option<Mine>, overlap: Option<Overlap<'_>>) -> Option<Terms> {
    let mut q = load.queued_prefill_tokens;
    let mut d = load.active_decode_blocks;
    let mut r = load.inflight_requests;
    let mut s = 0;
    if let Some(m) = mine {
        if m.requests != 0 {
            q = combine(p.use_max, q, m.prefill_tokens)?;
            d = combine(p.use_max, d, m.decode_blocks)?;
            r = combine(p.use_max, r, m.requests)?;
            s = m.shared_blocks;
        }
    }
    let wd = p.weights[0];
    let ow = match overlap {
        None => wd * exact(s)?,
        Some(ov) => {
            let real = real_overlap(p, ov.tiers, s)?;
            let f = if ov.stale { p.stale_factor } else { 1.0 };
            wd * exact(s)? + f * real
        }
    };
    let prefill = if p.does_prefill {
        let tokens = exact(q.checked_add(p.prompt_tokens)?)?;
        let x = tokens / exact(p.block_size)? - ow;
        if x < 0.0 {
            0.0
        } else {
            x
        }
    } else {
        0.0
    };
    let dec = d.checked_add(p.request_blocks)?.checked_sub(s)?;
    let cost = p.prefill_load_scale * prefill + exact(dec)?;
    Some(Terms { queued: q, active: d, in_flight: r, shared: s, overlap_w: ow, prefill, decode: dec, cost })
}

/// The candidate-set guards and the kv choice (`RouterConfig`'s `capacity_guard`,
/// `imbalance_guard` and its thresholds; `argmin` = temperature 0).
#[derive(Clone, Copy, Debug)]
pub struct PickParams {
    pub capacity_guard: bool,
    pub imbalance_guard: bool,
    pub imbalance_abs: i64,
    pub imbalance_rel: f64,
    pub argmin: bool,
}

/// What the capacity guard did (`_capacity_guard`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// Off, or no eligible worker over its capacity.
    Unchanged = 0,
    /// The workers in `over` were excluded.
    Excluded = 1,
    /// Every eligible worker is over: the guard is ignored (a note says so).
    Ignored = 2,
}

/// The kv decision's numbers after scoring, as `decide` / `_capacity_guard` / `_choose_kv`
/// compute them (the caller words the reason and draws among `tied` with its seeded RNG).
#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    /// Eligible positions over their KV capacity (`0 < capacity < decode`).
    pub over: Vec<usize>,
    pub capacity: Capacity,
    /// Eligible after the capacity guard.
    pub eligible: Vec<usize>,
    /// The in-flight spread (hi, lo) when the imbalance guard narrowed the competitors.
    pub imbalance: Option<(i64, i64)>,
    /// Who competes (the least busy when the imbalance guard fired, else `eligible`).
    pub competing: Vec<usize>,
    /// argmin only: the competitors within the tie tolerance of the lowest cost, in id order.
    pub tied: Vec<usize>,
    /// argmin with one tied: the cheapest other competitor (the first in id order).
    pub runner_up: Option<usize>,
}

/// `decision._TIE_RTOL`.
const TIE_RTOL: f64 = 1e-9;

/// Python's `min(xs, key=cost)`: the first position whose cost no later one undercuts (a later
/// one replaces it only when strictly less, which is also what Python does with a NaN).
fn first_min(xs: impl Iterator<Item = usize>, cost: impl Fn(usize) -> f64) -> Option<usize> {
    let mut best: Option<usize> = None;
    for i in xs {
        match best {
            Some(b) if cost(i) < cost(b) => best = Some(i),
            Some(_) => {}
            None => best = Some(i),
        }
    }
    best
}

/// The guards and the kv choice over scored candidates; `eligible` (id order, not empty) are
/// the positions role, drain and registration leave. `capacity[i]` is candidate i's
/// `kv_capacity_blocks`. None when an integer leaves the range where the comparisons are exact
/// (the router then refuses the input).
pub fn pick(terms: &[Terms], capacity: &[i64], eligible: Vec<usize>, p: &PickParams) -> Option<Pick> {
    let mut out = Pick {
        over: Vec::new(),
        capacity: Capacity::Unchanged,
        eligible,
        imbalance: None,
        competing: Vec::new(),
        tied: Vec::new(),
        runner_up: None,
    };
    if p.capacity_guard {
        out.over = out.eligible.iter().copied().filter(|&i| 0 < capacity[i] && capacity[i] < terms[i].decode).collect();
        if !out.over.is_empty() {
            if out.over.len() < out.eligible.len() {
                out.capacity = Capacity::Excluded;
                let over = &out.over;
                out.eligible.retain(|i| !over.contains(i));
            } else {
                out.capacity = Capacity::Ignored;
            }
        }
    }
    out.competing = out.eligible.clone();
    if p.imbalance_guard && out.eligible.len() > 1 {
        let load = |i: usize| terms[i].in_flight;
        let hi = out.eligible.iter().map(|&i| load(i)).max()?;
        let lo = out.eligible.iter().map(|&i| load(i)).min()?;
        // `hi > rel * lo`: Python multiplies float(lo) and compares the int hi with the float
        // exactly; both are exact here only while hi and lo convert to f64 exactly.
        let threshold = p.imbalance_rel * exact(lo)?;
        if hi.checked_sub(lo)? > p.imbalance_abs && exact(hi)? > threshold {
            out.imbalance = Some((hi, lo));
            out.competing = out.eligible.iter().copied().filter(|&i| load(i) == lo).collect();
        }
    }
    if p.argmin {
        let cost = |i: usize| terms[i].cost;
        let best = cost(first_min(out.competing.iter().copied(), cost)?);
        let scale = if best.abs() > 1.0 { best.abs() } else { 1.0 };
        let limit = best + TIE_RTOL * scale;
        out.tied = out.competing.iter().copied().filter(|&i| cost(i) <= limit).collect();
        if out.tied.len() == 1 {
            let chosen = out.tied[0];
            out.runner_up = first_min(out.competing.iter().copied().filter(|&i| i != chosen), cost);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(prompt_blocks: i64, output_blocks: i64) -> Params {
        Params {
            n_hash: prompt_blocks,
            block_size: 16,
            prompt_tokens: prompt_blocks * 16,
            request_blocks: prompt_blocks + output_blocks,
            does_prefill: true,
            weights: [1.0, 0.75, 0.25, 0.1, 0.5],
            stale_factor: 0.0,
            use_max: true,
            prefill_load_scale: 1.0,
        }
    }

    /// The decision module's burst example: 128 prompt blocks, 16 output blocks, scale 1.
    #[test]
    fn burst_spreads_then_concentrates() {
        let p = params(128, 16);
        let empty = score(&p, Load::default(), None, None).unwrap();
        assert_eq!((empty.prefill, empty.decode, empty.cost), (128.0, 144, 272.0));
        // r2 on A, where r1 is in flight: the hit exactly pays for the queue.
        let r1 = Mine { prefill_tokens: 2048, decode_blocks: 144, requests: 1, shared_blocks: 128 };
        let on_a = score(&p, Load::default(), Some(r1), None).unwrap();
        assert_eq!((on_a.prefill, on_a.decode, on_a.cost, on_a.overlap_w), (128.0, 160, 288.0, 128.0));
        // After r1's prefill: A's queue is empty and the cached prefix wins.
        let done = Mine { prefill_tokens: 0, ..r1 };
        assert_eq!(score(&p, Load::default(), Some(done), None).unwrap().cost, 160.0);
    }

    #[test]
    fn tiers_weighted_and_stale_discounted() {
        let p = params(8, 0);
        let tiers = [2, 2, 2, 2];
        let fresh = score(&p, Load::default(), None, Some(Overlap { tiers: &tiers, stale: false })).unwrap();
        assert_eq!(fresh.overlap_w, ((0.0 + 2.0 * 1.0) + 2.0 * 0.75) + 2.0 * 0.25 + 2.0 * 0.1);
        let stale = score(&p, Load::default(), None, Some(Overlap { tiers: &tiers, stale: true })).unwrap();
        assert_eq!((stale.overlap_w, stale.prefill), (0.0, 8.0));
    }

    /// In-flight blocks count as device hits first; the index's blocks beyond them keep their
    /// tier by position (device 0..3, host 3..5): 4 shared cover the device blocks and one host
    /// block, so one host block adds its weight.
    #[test]
    fn speculative_overlap_covers_the_fastest_positions() {
        let p = params(10, 0);
        let mine = Mine { prefill_tokens: 0, decode_blocks: 0, requests: 1, shared_blocks: 4 };
        let t = score(&p, Load::default(), Some(mine), Some(Overlap { tiers: &[3, 2], stale: false })).unwrap();
        assert_eq!(t.overlap_w, 1.0 * 4.0 + 1.0 * (0.0 + 0.75 * 1.0));
        assert_eq!(t.decode, 10 - 4);
    }

    #[test]
    fn loads_combine_by_max_or_sum() {
        let mut p = params(1, 0);
        let load = Load { queued_prefill_tokens: 10, active_decode_blocks: 5, inflight_requests: 3 };
        let mine = Mine { prefill_tokens: 4, decode_blocks: 9, requests: 1, shared_blocks: 0 };
        let t = score(&p, load, Some(mine), None).unwrap();
        assert_eq!((t.queued, t.active, t.in_flight), (10, 9, 3));
        p.use_max = false;
        let t = score(&p, load, Some(mine), None).unwrap();
        assert_eq!((t.queued, t.active, t.in_flight), (14, 14, 4));
        // No requests in flight: the ledger entry is ignored.
        let idle = Mine { requests: 0, ..mine };
        assert_eq!(score(&p, load, Some(idle), None).unwrap().queued, 10);
    }

    #[test]
    fn decode_phase_has_no_prefill_term() {
        let p = Params { does_prefill: false, ..params(4, 2) };
        let t = score(&p, Load { queued_prefill_tokens: 999, ..Load::default() }, None, None).unwrap();
        assert_eq!((t.prefill, t.cost, t.queued), (0.0, 6.0, 999));
    }

    #[test]
    fn refuses_what_f64_cannot_reproduce() {
        let p = params(1, 0);
        let big = Load { queued_prefill_tokens: EXACT, ..Load::default() };
        assert!(score(&p, big, None, None).is_none());
        let overflow = Load { active_decode_blocks: i64::MAX, ..Load::default() };
        assert!(score(&p, overflow, None, None).is_none());
    }

    /// A peer reach is laid after the worker's own tiers and weighed by the peer weight.
    #[test]
    fn peer_reach_weighs_after_the_tiers() {
        let p = params(8, 0);
        let slots = [2, 0, 0, 0, 4];
        let t = score(&p, Load::default(), None, Some(Overlap { tiers: &slots, stale: false })).unwrap();
        assert_eq!(t.overlap_w, 2.0 * 1.0 + 4.0 * 0.5);
        // Beyond the prompt's blocks nothing counts: 6 of the 8 matched positions fit in 6.
        let p6 = params(6, 0);
        let t = score(&p6, Load::default(), None, Some(Overlap { tiers: &[2, 0, 0, 0, 6], stale: false })).unwrap();
        assert_eq!(t.overlap_w, 2.0 + 4.0 * 0.5);
    }

    fn scored(costs: &[f64], in_flight: &[i64], decode: &[i64]) -> Vec<Terms> {
        costs.iter().zip(in_flight).zip(decode)
            .map(|((&cost, &in_flight), &decode)| Terms { cost, in_flight, decode, ..Terms::default() })
            .collect()
    }

    const ARGMIN: PickParams =
        PickParams { capacity_guard: true, imbalance_guard: true, imbalance_abs: 64, imbalance_rel: 1.5, argmin: true };

    #[test]
    fn argmin_ties_within_tolerance_and_runner_up() {
        let t = scored(&[5.0, 3.0, 3.0 + 1e-10, 4.0], &[0; 4], &[1; 4]);
        let p = pick(&t, &[0; 4], vec![0, 1, 2, 3], &ARGMIN).unwrap();
        assert_eq!((p.tied, p.runner_up), (vec![1, 2], None));
        let t = scored(&[5.0, 3.0, 4.0, 4.0], &[0; 4], &[1; 4]);
        let p = pick(&t, &[0; 4], vec![0, 1, 2, 3], &ARGMIN).unwrap();
        assert_eq!((p.tied, p.runner_up), (vec![1], Some(2)));
    }

    /// Capacity: 0 = unknown (never over); all over = the guard is ignored.
    #[test]
    fn capacity_guard_excludes_unless_all_are_over() {
        let t = scored(&[1.0, 2.0, 3.0], &[0; 3], &[10, 10, 10]);
        let p = pick(&t, &[5, 0, 20], vec![0, 1, 2], &ARGMIN).unwrap();
        assert_eq!((p.over.clone(), p.capacity, p.eligible.clone(), p.tied.clone()), (vec![0], Capacity::Excluded, vec![1, 2], vec![1]));
        let p = pick(&t, &[5, 5, 5], vec![0, 1, 2], &ARGMIN).unwrap();
        assert_eq!((p.capacity, p.eligible), (Capacity::Ignored, vec![0, 1, 2]));
    }

    /// Spread 100 - 10 > 64 and 100 > 1.5 x 10: only the least busy compete.
    #[test]
    fn imbalance_guard_keeps_the_least_busy() {
        let t = scored(&[1.0, 9.0, 8.0], &[100, 10, 10], &[1; 3]);
        let p = pick(&t, &[0; 3], vec![0, 1, 2], &ARGMIN).unwrap();
        assert_eq!((p.imbalance, p.competing, p.tied, p.runner_up), (Some((100, 10)), vec![1, 2], vec![2], Some(1)));
        let t = scored(&[1.0, 9.0], &[i64::MAX, 0], &[1; 2]);
        assert!(pick(&t, &[0; 2], vec![0, 1], &ARGMIN).is_none());
    }
}
