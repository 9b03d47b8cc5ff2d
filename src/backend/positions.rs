//! The positions an engine rotates q and k at, where they are not the tokens' own: a rule the
//! judge solves from a trace's own rotations (`judge::rope_fit`) and the reference replays
//! (`Reference::with_rope_at`), so that a position bug no catalog lists is still one
//! experiment, named in words.

/// Where a row at sequence position `p` is rotated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PosRule {
    /// At `p` (the model's).
    Own,
    /// From position `from` on at `p + by` (before it at `p`).
    Shift { from: usize, by: i64 },
    /// From position `from` on at `at` (a counter that stopped; 0: not rotated at all).
    Fixed { from: usize, at: usize },
    /// At `p mod w` (a counter kept modulo a buffer's size).
    Modulo(usize),
    /// From position `from` on at `p - s`, `s` the first position of the row's step: the
    /// index inside the step (a decode step's row at 0), not the position in the sequence.
    StepLocal { from: usize },
}

impl PosRule {
    /// The position a row at `p`, in a step whose first position is `step0`, is rotated at.
    pub fn at(self, p: usize, step0: usize) -> usize {
        match self {
            PosRule::Own => p,
            PosRule::Shift { from, by } if p >= from => (p as i64 + by).max(0) as usize,
            PosRule::Fixed { from, at } if p >= from => at,
            PosRule::Modulo(w) if w > 0 => p % w,
            PosRule::StepLocal { from } if p >= from => p - step0.min(p),
            _ => p,
        }
    }

    /// The first position it moves (None: none).
    pub fn from(self) -> Option<usize> {
        match self {
            PosRule::Own => None,
            PosRule::Shift { from, .. }
            | PosRule::Fixed { from, .. }
            | PosRule::StepLocal { from } => Some(from),
            PosRule::Modulo(w) => Some(w),
        }
    }

    /// As a hypothesis name writes it: `p`, `p+1@24`, `0@0`, `p%24`, `p-s@24`.
    pub fn name(self) -> String {
        match self {
            PosRule::Own => "p".into(),
            PosRule::Shift { from, by } if by >= 0 => format!("p+{by}@{from}"),
            PosRule::Shift { from, by } => format!("p-{}@{from}", -by),
            PosRule::Fixed { from, at } => format!("{at}@{from}"),
            PosRule::Modulo(w) => format!("p%{w}"),
            PosRule::StepLocal { from } => format!("p-s@{from}"),
        }
    }

    /// In words, for the rows it moves: "at p + 1", "at position 0 (not rotated)".
    pub fn describe(self) -> String {
        match self {
            PosRule::Own => "at its own position".into(),
            PosRule::Shift { by, .. } if by >= 0 => format!("at p + {by}"),
            // From 0 on a shift below 0 is clamped there: a counter that starts late.
            PosRule::Shift { from: 0, by } => format!("at max(p - {}, 0)", -by),
            PosRule::Shift { by, .. } => format!("at p - {}", -by),
            PosRule::Fixed { at: 0, .. } => "at position 0, that is not rotated at all".into(),
            PosRule::Fixed { at, .. } => format!("at position {at} whatever its own"),
            PosRule::Modulo(w) => format!("at p mod {w}"),
            PosRule::StepLocal { .. } => {
                "at its index inside its step (p minus the step's first position: a decode step's one row at 0)".into()
            }
        }
    }
}

/// The rules q and k are rotated by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RopeAt {
    pub q: PosRule,
    pub k: PosRule,
}

/// The prefix of a fitted RoPE-position hypothesis: `rope-at:q,k=p+1@24`,
/// `rope-at:q=0@0,k=p`.
pub const PREFIX: &str = "rope-at:";

impl RopeAt {
    pub fn name(self) -> String {
        if self.q == self.k {
            format!("{PREFIX}q,k={}", self.q.name())
        } else {
            format!("{PREFIX}q={},k={}", self.q.name(), self.k.name())
        }
    }

    /// One sentence: "from position 24 on, the engine rotates q and k at p + 1 (RoPE's
    /// angles, solved from the trace, say so row by row)".
    /// `solved`: the rule was read from the trace's own rotations, not guessed from where
    /// the error starts (a sparse dump).
    pub fn describe(self, solved: bool) -> String {
        let part = |who: &str, r: PosRule| match r {
            PosRule::Own => format!("{who} at its own position"),
            PosRule::Modulo(w) => format!(
                "{who} {} (from position {w} on, positions restart: a counter kept modulo {w})",
                r.describe()
            ),
            _ => format!(
                "from position {} on, {who} {}",
                r.from().unwrap_or(0),
                r.describe()
            ),
        };
        let said = if solved {
            "RoPE's angles, solved row by row from the trace's q/k before and after it, say so"
        } else {
            "a rule starting at the first row out of the floor, replayed over the trace: it holds no q or k on both sides of RoPE to solve the positions from"
        };
        if self.q == self.k {
            format!(
                "the engine rotates each row of q and k at another position than its own: {} ({said}); the model rotates position p at p",
                part("a row is rotated", self.q)
            )
        } else {
            format!(
                "q and k are rotated at different positions: {}; {} ({said}); the model rotates both at p",
                part("q is rotated", self.q),
                part("k is rotated", self.k)
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_move_only_from_their_first_position_and_their_names_differ() {
        let rules = [
            PosRule::Own,
            PosRule::Shift { from: 24, by: 1 },
            PosRule::Shift { from: 5, by: -2 },
            PosRule::Fixed { from: 0, at: 0 },
            PosRule::Fixed { from: 30, at: 29 },
            PosRule::Modulo(13),
            PosRule::StepLocal { from: 30 },
        ];
        // Names tell the rules apart (a hypothesis is keyed and reported by its name).
        let names: std::collections::BTreeSet<String> = rules.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), rules.len(), "{names:?}");
        for r in rules {
            if let Some(f) = r.from() {
                for p in 0..f {
                    assert_eq!(r.at(p, 0), p, "{} at {p}", r.name());
                }
                // (A counter stopped at 0 from 0 leaves position 0 itself.)
                if r != (PosRule::Fixed { from: 0, at: 0 }) {
                    assert_ne!(r.at(f, f), f, "{} at {f}", r.name());
                }
            }
        }
        assert_eq!(PosRule::Shift { from: 24, by: 1 }.at(30, 30), 31);
        assert_eq!(PosRule::Modulo(13).at(27, 27), 1);
        assert_eq!(PosRule::StepLocal { from: 30 }.at(33, 30), 3);
        assert_eq!(PosRule::Fixed { from: 30, at: 29 }.at(40, 40), 29);
        let both = RopeAt {
            q: PosRule::Modulo(9),
            k: PosRule::Modulo(9),
        };
        let apart = RopeAt {
            q: PosRule::Fixed { from: 0, at: 0 },
            k: PosRule::Own,
        };
        assert_eq!(both.name(), "rope-at:q,k=p%9");
        assert_eq!(apart.name(), "rope-at:q=0@0,k=p");
    }
}
