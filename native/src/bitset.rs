//! A growable set of small integers (slot numbers), the native form of the reference's int masks.

#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct BitSet {
    words: Vec<u64>,
}

impl BitSet {
    pub fn new() -> Self {
        BitSet { words: Vec::new() }
    }

    pub fn single(i: u32) -> Self {
        let mut b = BitSet::new();
        b.insert(i);
        b
    }

    #[inline]
    pub fn contains(&self, i: u32) -> bool {
        let w = (i / 64) as usize;
        w < self.words.len() && self.words[w] >> (i % 64) & 1 == 1
    }

    #[inline]
    pub fn insert(&mut self, i: u32) {
        let w = (i / 64) as usize;
        if w >= self.words.len() {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << (i % 64);
    }

    #[inline]
    pub fn remove(&mut self, i: u32) {
        let w = (i / 64) as usize;
        if w < self.words.len() {
            self.words[w] &= !(1 << (i % 64));
        }
    }

    pub fn set(&mut self, i: u32, on: bool) {
        if on {
            self.insert(i)
        } else {
            self.remove(i)
        }
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn union_with(&mut self, other: &BitSet) {
        if other.words.len() > self.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    pub fn difference_with(&mut self, other: &BitSet) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= !b;
        }
    }

    pub fn intersects(&self, other: &BitSet) -> bool {
        self.words.iter().zip(&other.words).any(|(a, b)| a & b != 0)
    }

    /// Members in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(wi, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros();
                w &= w - 1;
                Some(wi as u32 * 64 + b)
            })
        })
    }

    pub fn to_vec(&self) -> Vec<u32> {
        self.iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_operations() {
        let mut a = BitSet::new();
        a.insert(3);
        a.insert(70);
        assert!(a.contains(70) && !a.contains(69) && !a.contains(1000));
        let mut b = BitSet::single(3);
        b.insert(200);
        assert!(a.intersects(&b));
        a.difference_with(&b);
        assert_eq!(a.to_vec(), vec![70]);
        a.union_with(&b);
        assert_eq!(a.to_vec(), vec![3, 70, 200]);
        a.remove(3);
        a.remove(70);
        a.remove(200);
        assert!(a.is_empty());
    }
}
