//! The token position a finding first shows at. A bug inside a long prompt shows at step 0
//! whatever its position, so the step alone does not say where: a cache that wraps at 128
//! slots, a mask wrong past a block boundary, RoPE restarting at some position all leave the
//! rows before their first position exact. Read from the own error row by row: the first row
//! over the key's floor (one must be: if every row were within it, so would the whole key).

use crate::trace::Tap;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Position {
    /// The position in the sequence (0: the first prompt token).
    pub position: usize,
    /// Its row within the step, of `rows` (a prefill or chunk has many; a decode step one).
    pub row: usize,
    pub rows: usize,
    /// The id at that position.
    pub token: u32,
    /// Read from a tensor cut to rows from this one on (`kq_soft_max`, `kq_rows`) with no
    /// whole tap after it to read earlier rows from: the rows before were not recorded.
    #[serde(skip)]
    pub cut_from: bool,
}

impl Position {
    /// "position 137 (row 137 of the step's 421, id 2201; the rows before it match)".
    pub fn describe(&self) -> String {
        if self.rows == 1 {
            return format!("position {} (id {})", self.position, self.token);
        }
        format!(
            "position {} (row {} of the step's {}, id {}{})",
            self.position,
            self.row,
            self.rows,
            self.token,
            match (self.row, self.cut_from) {
                (0, _) => "",
                (_, false) => "; the rows before it match",
                (_, true) =>
                    "; kq_soft_max was recorded from this row on: the rows before it were not",
            }
        )
    }
}

/// The first row of a tensor in canonical dims `dims` whose NMSE against `reference` exceeds
/// `floor`, or holds a value that is not finite. Rows are the token axis: the first, but the
/// second for the probabilities (`[head, token, kv]`).
pub fn first_row(
    reference: &[f32],
    cand: &[f32],
    dims: [usize; 3],
    tap: Tap,
    floor: f64,
) -> Option<usize> {
    let [a, b, c] = dims;
    if reference.len() != a * b * c || cand.len() != reference.len() {
        return None;
    }
    let (rows, segments): (usize, Vec<(usize, usize)>) = if tap == Tap::KqSoftMax {
        // Row r: [h, r, ..] for every head h.
        (b, (0..a).map(|h| (h * b * c, c)).collect())
    } else {
        (a, vec![(0, b * c)])
    };
    let stride = if tap == Tap::KqSoftMax { c } else { b * c };
    (0..rows).find(|&r| {
        let (mut see, mut saa) = (0.0f64, 0.0f64);
        for &(base, len) in &segments {
            let at = base + r * stride;
            for (x, y) in reference[at..at + len].iter().zip(&cand[at..at + len]) {
                if !x.is_finite() || !y.is_finite() {
                    return true;
                }
                let (x, y) = (*x as f64, *y as f64);
                see += (x - y) * (x - y);
                saa += x * x;
            }
        }
        see > 0.0 && (saa == 0.0 || see / saa > floor)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_row_is_the_first_over_the_floor() {
        // 4 tokens × 2 × 3: row 2 off.
        let reference: Vec<f32> = (0..24).map(|i| 1.0 + i as f32).collect();
        let mut cand = reference.clone();
        cand[2 * 6 + 1] += 0.5;
        cand[3 * 6] += 0.5;
        assert_eq!(
            first_row(&reference, &cand, [4, 2, 3], Tap::LOut, 1e-6),
            Some(2)
        );
        assert_eq!(
            first_row(&reference, &reference, [4, 2, 3], Tap::LOut, 1e-6),
            None
        );
        // Under the floor: no row.
        assert_eq!(
            first_row(&reference, &cand, [4, 2, 3], Tap::LOut, 1.0),
            None
        );
        let mut nan = reference.clone();
        nan[6] = f32::NAN;
        assert_eq!(
            first_row(&reference, &nan, [4, 2, 3], Tap::LOut, 1.0),
            Some(1)
        );
    }

    #[test]
    fn probabilities_rows_are_their_second_axis() {
        // 2 heads × 3 tokens × 3 cells: head 1, token 1 off.
        let reference: Vec<f32> = (0..18).map(|i| 0.1 + i as f32).collect();
        let mut cand = reference.clone();
        cand[9 + 3 + 2] += 1.0;
        assert_eq!(
            first_row(&reference, &cand, [2, 3, 3], Tap::KqSoftMax, 1e-6),
            Some(1)
        );
        // Read as a [token, …] tensor it would be row 1 of 2 as well, but head 1's row 0
        // (index 9) off must give row 0, not row 1.
        let mut cand = reference.clone();
        cand[9] += 1.0;
        assert_eq!(
            first_row(&reference, &cand, [2, 3, 3], Tap::KqSoftMax, 1e-6),
            Some(0)
        );
    }
}
