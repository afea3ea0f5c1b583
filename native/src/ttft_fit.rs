//! The TTFT fit's solve (`control_plane/router/ttft_fit.py`): ridge regression of the six costs
//! around a prior, from the fit's sums reduced to floats, with costs >= 0.
//!
//! The sums themselves stay exact Python integers (they outgrow `i128`); Python hands over their
//! floats once per change of the sums (`TtftSolver`), and each solve is then a pure function of
//! those floats and the prior. Every operation is the one the Python code did before, in the
//! same order (no fused multiply-add: rustc never contracts), so the models, and the decisions
//! recorded with them, come out bit for bit the same: `replay verify` re-derives old logs' fits
//! with this code. The pure-Python specification it is tested against is the differential oracle
//! `tests/oracles/ttft_solve.py`.

use std::collections::HashMap;

/// The costs: base, steps, tokens, attention, decode blocks per step, step tokens squared.
pub const N: usize = 6;
/// Feature scales, for the conditioning of the solve (`ttft_fit._SCALE`).
pub const SCALE: [f64; N] = [1.0, 1.0, 2048.0, 2048.0 * 2048.0, 1024.0, 2048.0 * 2048.0];

/// A zero pivot: Python's `ZeroDivisionError` where the elimination divides by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroPivot;

/// The fit of one set of free costs as an affine function of the prior it is pulled toward (in
/// the scaled space): `z = c + K p`.
#[derive(Debug, Clone, PartialEq)]
pub struct Affine {
    pub c: Vec<f64>,
    pub k: Vec<Vec<f64>>,
}

/// One set of sums, as floats: `xx` the 6x6 `X^T W X` (upper triangle; row-major), `xy_ms` each
/// `X^T W y` over 1000 (y in ms), `ws` the prior weights (`ttft_fit._prior_weights`). Its affine
/// maps are computed once per free set and kept (the sums do not change under it).
#[derive(Debug, Clone)]
pub struct Solver {
    xx: [f64; N * N],
    xy_ms: [f64; N],
    ws: [f64; N],
    /// Free set (a bit per cost) -> its map.
    maps: HashMap<u8, Affine>,
}

impl Solver {
    pub fn new(xx: [f64; N * N], xy_ms: [f64; N], ws: [f64; N]) -> Self {
        Solver { xx, xy_ms, ws, maps: HashMap::new() }
    }

    /// Ridge around `prior`, costs >= 0: solve over the free costs, pin the negative ones at 0
    /// and solve again over the others (all pinned: all 0).
    pub fn solve(&mut self, prior: &[f64; N]) -> Result<[f64; N], ZeroPivot> {
        let mut free: Vec<usize> = (0..N).collect();
        loop {
            let key = free.iter().fold(0u8, |b, &i| b | (1 << i));
            if !self.maps.contains_key(&key) {
                let aff = affine(&self.xx, &self.xy_ms, &self.ws, &free)?;
                self.maps.insert(key, aff);
            }
            let aff = &self.maps[&key];
            let p: Vec<f64> = free.iter().map(|&i| prior[i] * SCALE[i]).collect();
            let mut theta = [0.0f64; N];
            for (r, &i) in free.iter().enumerate() {
                let kr = &aff.k[r];
                let mut z = aff.c[r];
                for j in 0..free.len() {
                    z += kr[j] * p[j];
                }
                theta[i] = z / SCALE[i];
            }
            let before = free.len();
            free.retain(|&i| !(theta[i] < 0.0));
            if free.len() == before {
                return Ok(theta);
            }
            if free.is_empty() {
                return Ok([0.0; N]);
            }
        }
    }
}

/// The fit of the `free` costs (the others pinned at 0) as an affine function of the prior: in
/// the scaled space `(A + D) z = b + D p`, so `c = (A + D)^-1 b` and `K = (A + D)^-1 D`.
pub fn affine(xx: &[f64; N * N], xy_ms: &[f64; N], ws: &[f64; N], free: &[usize]) -> Result<Affine, ZeroPivot> {
    let k = free.len();
    let mut a: Vec<Vec<f64>> = Vec::with_capacity(k);
    for (r, &i) in free.iter().enumerate() {
        let mut row = Vec::with_capacity(2 * k + 1);
        for &j in free {
            let d = if i == j { ws[i] } else { 0.0 };
            row.push(xx[i.min(j) * N + i.max(j)] / (SCALE[i] * SCALE[j]) + d);
        }
        row.push(xy_ms[i] / SCALE[i]);
        for c in 0..k {
            row.push(if r == c { ws[i] } else { 0.0 });
        }
        a.push(row);
    }
    let z = gauss_columns(&mut a, 1 + k)?;
    Ok(Affine { c: z.iter().map(|row| row[0]).collect(), k: z.iter().map(|row| row[1..].to_vec()).collect() })
}

/// Solve the system `a` (k rows of k coefficients then `m` right-hand sides) for every
/// right-hand side at once, with partial pivoting (the first row of the largest magnitude); the
/// solutions as rows, one value per side.
pub fn gauss_columns(a: &mut [Vec<f64>], m: usize) -> Result<Vec<Vec<f64>>, ZeroPivot> {
    let k = a.len();
    for col in 0..k {
        let mut piv = col;
        let mut best = a[col][col].abs();
        for r in col + 1..k {
            let v = a[r][col].abs();
            if v > best {
                best = v;
                piv = r;
            }
        }
        a.swap(col, piv);
        if col + 1 < k && a[col][col] == 0.0 {
            return Err(ZeroPivot);
        }
        for r in col + 1..k {
            let f = a[r][col] / a[col][col];
            if f != 0.0 {
                let (top, bottom) = a.split_at_mut(r);
                let (pivot_row, row) = (&top[col], &mut bottom[0]);
                for c in col..k + m {
                    row[c] -= f * pivot_row[c];
                }
            }
        }
    }
    let mut z = vec![vec![0.0f64; m]; k];
    for r in (0..k).rev() {
        let row = &a[r];
        let d = row[r];
        if d == 0.0 {
            return Err(ZeroPivot);
        }
        for j in 0..m {
            let mut acc = row[k + j];
            for c in r + 1..k {
                acc -= row[c] * z[c][j];
            }
            z[r][j] = acc / d;
        }
    }
    Ok(z)
}

#[cfg(feature = "python")]
pub(crate) mod py {
    //! `TtftSolver` for `control_plane/router/ttft_fit.py`.

    use pyo3::exceptions::{PyValueError, PyZeroDivisionError};
    use pyo3::prelude::*;

    use super::{Solver, N};

    /// One set of the fit's sums as floats (`TtftSolver(xx, xy_ms, ws)`: 36, 6 and 6 floats), its
    /// affine maps kept by free set; `solve(prior)` the six costs (a tuple).
    #[pyclass(module = "switchyard_native", name = "TtftSolver")]
    struct PyTtftSolver {
        inner: Solver,
    }

    #[pymethods]
    impl PyTtftSolver {
        #[new]
        fn new(xx: Vec<f64>, xy_ms: Vec<f64>, ws: Vec<f64>) -> PyResult<Self> {
            let (Ok(xx), Ok(xy_ms), Ok(ws)) =
                (<[f64; N * N]>::try_from(xx), <[f64; N]>::try_from(xy_ms), <[f64; N]>::try_from(ws))
            else {
                return Err(PyValueError::new_err("TtftSolver takes 36, 6 and 6 floats"));
            };
            Ok(PyTtftSolver { inner: Solver::new(xx, xy_ms, ws) })
        }

        fn solve(&mut self, prior: [f64; N]) -> PyResult<(f64, f64, f64, f64, f64, f64)> {
            match self.inner.solve(&prior) {
                Ok(t) => Ok((t[0], t[1], t[2], t[3], t[4], t[5])),
                Err(_) => Err(PyZeroDivisionError::new_err("float division by zero")),
            }
        }
    }

    pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<PyTtftSolver>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solves_a_small_system_with_pivoting() {
        // [[0, 2], [1, 1]] z = [4, 3] and = [2, 1]: the first pivot is the second row.
        let mut a = vec![vec![0.0, 2.0, 4.0, 2.0], vec![1.0, 1.0, 3.0, 1.0]];
        let z = gauss_columns(&mut a, 2).unwrap();
        assert_eq!(z, vec![vec![1.0, 0.0], vec![2.0, 1.0]]);
    }

    #[test]
    fn a_singular_system_is_refused() {
        let mut a = vec![vec![1.0, 1.0, 1.0], vec![1.0, 1.0, 2.0]];
        assert_eq!(gauss_columns(&mut a, 1), Err(ZeroPivot));
        let mut a = vec![vec![0.0, 1.0]];
        assert_eq!(gauss_columns(&mut a, 1), Err(ZeroPivot));
    }

    fn diagonal(cost: [f64; N], weight: f64) -> Solver {
        // One observation per feature alone (x = e_i scaled back), exact: theta_i's data term
        // pulls toward cost_i with weight `weight`, the prior toward prior_i with weight 1.
        let mut xx = [0.0; N * N];
        let mut xy = [0.0; N];
        for i in 0..N {
            xx[i * N + i] = weight * SCALE[i] * SCALE[i];
            xy[i] = weight * cost[i] * SCALE[i] * SCALE[i];
        }
        Solver::new(xx, xy, [1.0; N])
    }

    #[test]
    fn the_fit_lies_between_the_data_and_the_prior() {
        let mut s = diagonal([2.0; N], 3.0);
        let theta = s.solve(&[6.0; N]).unwrap();
        for t in theta {
            assert!((t - 3.0).abs() < 1e-12, "{theta:?}"); // (3 * 2 + 1 * 6) / 4
        }
    }

    #[test]
    fn negative_costs_are_pinned_at_zero_and_the_rest_solved_again() {
        let mut s = diagonal([2.0, -9.0, 2.0, 2.0, 2.0, 2.0], 1.0);
        let theta = s.solve(&[0.0; N]).unwrap();
        assert_eq!(theta[1], 0.0);
        assert!((theta[0] - 1.0).abs() < 1e-12);
        assert_eq!(s.maps.len(), 2); // the full set and the set without cost 1
        assert_eq!(s.solve(&[0.0; N]).unwrap(), theta); // from the kept maps, the same
        let mut all = diagonal([-1.0; N], 1.0);
        assert_eq!(all.solve(&[0.0; N]).unwrap(), [0.0; N]);
    }
}
