//! `kq_soft_max` cut to some heads and rows: the one tap that grows with the square of the
//! length (a 2,048-token prompt's is 512 MB a layer on a 1.1B shape), kept where a finding
//! needs it. A plan asks for it (`kq_heads=0-3;kq_rows=1000-1015`, see [`crate::Record`]); the
//! manifest entry of a cut tensor lists what it kept (`"heads"`, and `"rows"` by position).

/// The heads and the rows (by position) one `kq_soft_max` tensor keeps; `None`: all of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cut {
    pub heads: Option<Vec<usize>>,
    /// Positions of the rows kept (the step's own positions, not row indices).
    pub rows: Option<Vec<usize>>,
}

/// What a plan makes of one step's `kq_soft_max`.
#[derive(Debug, PartialEq)]
pub enum Cutting {
    /// The plan cuts nothing: the tensor as it is.
    Whole,
    /// Nothing of it is kept (no kept row falls in the step, or no kept head in the model).
    Nothing,
    /// Kept cut: the cut, the stored (canonical, head-major) shape and values.
    Kept(Cut, [usize; 3], Vec<f32>),
}

impl Cut {
    /// Whether this cut keeps nothing out (it lists every head and row, or lists none).
    pub fn is_whole(&self, n_head: usize, pos0: usize, t: usize) -> bool {
        self.head_index(n_head).len() == n_head && self.row_index(pos0, t).len() == t
    }

    /// Whether it keeps nothing (a list part with no item).
    pub fn is_empty(&self) -> bool {
        self.heads.as_ref().is_some_and(Vec::is_empty)
            || self.rows.as_ref().is_some_and(Vec::is_empty)
    }

    /// The head indices kept, of `n_head`.
    pub fn head_index(&self, n_head: usize) -> Vec<usize> {
        match &self.heads {
            None => (0..n_head).collect(),
            Some(h) => h.iter().copied().filter(|&h| h < n_head).collect(),
        }
    }

    /// The row indices kept, of a step of `t` rows from position `pos0`.
    pub fn row_index(&self, pos0: usize, t: usize) -> Vec<usize> {
        match &self.rows {
            None => (0..t).collect(),
            Some(r) => r
                .iter()
                .filter(|&&p| p >= pos0 && p - pos0 < t)
                .map(|&p| p - pos0)
                .collect(),
        }
    }

    /// Select this cut from a head-major `[n_head, t, n_kv]` tensor of a step from `pos0`.
    pub fn select(&self, dims: [usize; 3], pos0: usize, data: &[f32]) -> ([usize; 3], Vec<f32>) {
        let [n_head, t, n_kv] = dims;
        let (heads, rows) = (self.head_index(n_head), self.row_index(pos0, t));
        let mut out = Vec::with_capacity(heads.len() * rows.len() * n_kv);
        for &h in &heads {
            for &r in &rows {
                let at = (h * t + r) * n_kv;
                out.extend_from_slice(&data[at..at + n_kv]);
            }
        }
        ([heads.len(), rows.len(), n_kv], out)
    }

    /// The values two stored tensors of one step's `kq_soft_max` both hold, in one order:
    /// each as stored (head-major), with what it kept (`None`: whole, then `n_head` heads and
    /// `t` rows). Rows are matched by position (a step from `pos0`); the first `cols` columns
    /// of each row are taken (a replay of a prompt's first rows has fewer keys). None where
    /// they share no value.
    pub fn common(
        a: Side<'_>,
        b: Side<'_>,
        pos0: usize,
        cols: usize,
    ) -> Option<(Vec<f32>, Vec<f32>)> {
        let (ha, ra, wa) = a.axes(pos0);
        let (hb, rb, wb) = b.axes(pos0);
        let cols = cols.min(wa).min(wb);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for (ia, h) in ha.iter().enumerate() {
            let Ok(ib) = hb.binary_search(h) else {
                continue;
            };
            for (ja, r) in ra.iter().enumerate() {
                let Ok(jb) = rb.binary_search(r) else {
                    continue;
                };
                let at = (ia * ra.len() + ja) * wa;
                let bt = (ib * rb.len() + jb) * wb;
                x.extend_from_slice(&a.data[at..at + cols]);
                y.extend_from_slice(&b.data[bt..bt + cols]);
            }
        }
        (!x.is_empty()).then_some((x, y))
    }
}

/// One stored `kq_soft_max` for [`Cut::common`]: its values, what it kept (`None`: whole),
/// and the heads and rows a whole one holds.
#[derive(Clone, Copy, Debug)]
pub struct Side<'a> {
    pub data: &'a [f32],
    pub cut: Option<&'a Cut>,
    pub n_head: usize,
    pub t: usize,
}

impl Side<'_> {
    /// The heads and row positions stored, in order, and the row width.
    fn axes(&self, pos0: usize) -> (Vec<usize>, Vec<usize>, usize) {
        let heads = match self.cut.and_then(|c| c.heads.as_ref()) {
            Some(h) => h.clone(),
            None => (0..self.n_head).collect(),
        };
        let rows = match self.cut.and_then(|c| c.rows.as_ref()) {
            Some(r) => r.clone(),
            None => (pos0..pos0 + self.t).collect(),
        };
        let width = self.data.len() / (heads.len() * rows.len()).max(1);
        (heads, rows, width)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_selects_its_heads_and_rows_and_two_cuts_meet_where_they_share() {
        // [3 heads, 4 rows, 6 keys] of a step from position 2: value = 100h + 10r + c.
        let full: Vec<f32> = (0..3 * 4 * 6)
            .map(|i| (100 * (i / 24) + 10 * (i / 6 % 4) + i % 6) as f32)
            .collect();
        // What a cut lists is what it stores (a plan's cut is taken within the step).
        let a = Cut {
            heads: Some(vec![0, 2]),
            rows: Some(vec![3, 5]),
        };
        let (shape, v) = a.select([3, 4, 6], 2, &full);
        assert_eq!(shape, [2, 2, 6]);
        assert_eq!(&v[..6], &[10., 11., 12., 13., 14., 15.]);
        assert_eq!(
            v[6..].iter().step_by(6).copied().collect::<Vec<_>>(),
            [30., 210., 230.]
        );
        let b = Cut {
            heads: Some(vec![2]),
            rows: None,
        };
        let (_, w) = b.select([3, 4, 6], 2, &full);
        let side = |data, cut| Side {
            data,
            cut,
            n_head: 3,
            t: 4,
        };
        let (x, y) = Cut::common(side(&v, Some(&a)), side(&w, Some(&b)), 2, 6).unwrap();
        assert_eq!(x, y);
        assert_eq!(
            x.iter().step_by(6).copied().collect::<Vec<_>>(),
            [210., 230.]
        );
        // Against the whole tensor, the first 4 columns only.
        let (x, y) = Cut::common(side(&full, None), side(&v, Some(&a)), 2, 4).unwrap();
        assert_eq!((x.len(), x == y), (16, true));
        // A whole side of fewer rows (a replay of the first 2): the rows both hold.
        let first: Vec<f32> = (0..3)
            .flat_map(|h| full[h * 24..h * 24 + 12].iter().copied())
            .collect();
        let short = Side {
            data: &first,
            cut: None,
            n_head: 3,
            t: 2,
        };
        let (x, y) = Cut::common(short, side(&v, Some(&a)), 2, 6).unwrap();
        assert_eq!(x, y);
        assert_eq!(
            x.iter().step_by(6).copied().collect::<Vec<_>>(),
            [10., 210.]
        );
        let none = Cut {
            heads: Some(vec![1]),
            rows: None,
        };
        let (_, n) = none.select([3, 4, 6], 2, &full);
        assert!(Cut::common(side(&v, Some(&a)), side(&n, Some(&none)), 2, 6).is_none());
        assert!(a.row_index(2, 4) == [1, 3] && !a.is_whole(3, 2, 4));
        assert!(Cut::default().is_whole(3, 2, 4));
    }
}
