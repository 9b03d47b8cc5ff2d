//! A zoom request: the steps a scan's finding needs recorded whole, and the recording plan
//! (`parity_trace::Record`) that does it (`judge::zoom` decides it, the reports show it).

use serde::Serialize;

/// Which steps to record whole, and the plan line that records them with the scan kept.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Zoom {
    /// The steps to record whole.
    pub steps: Vec<usize>,
    /// The plan that records them, the scan kept (`taps=l_out,logits;full=3`).
    pub record: String,
}

impl Zoom {
    /// The advice, one sentence.
    pub fn describe(&self) -> String {
        let steps: Vec<String> = self.steps.iter().map(usize::to_string).collect();
        // A long step keeps its probabilities for the rows that show the finding alone.
        let rows = match parity_trace::Record::parse(&self.record)
            .ok()
            .and_then(|r| r.kq_rows)
        {
            Some(r) if !r.is_empty() => format!(
                " (kq_soft_max for positions {}-{} only)",
                r[0].start(),
                r[r.len() - 1].end()
            ),
            _ => String::new(),
        };
        format!(
            "to judge it op by op, record step {} whole{rows}: --record '{}' (PARITY_RECORD for an engine writing through a parity kit)",
            steps.join(", "),
            self.record
        )
    }
}
