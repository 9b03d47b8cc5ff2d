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
        // A long step keeps the layers that can hold the fault, and its probabilities for the
        // rows that show the finding, alone.
        let plan = parity_trace::Record::parse(&self.record).ok();
        let span = |r: &[std::ops::RangeInclusive<usize>]| match (r.first(), r.last()) {
            (Some(a), Some(b)) if a.start() == b.end() => a.start().to_string(),
            (Some(a), Some(b)) => format!("{}-{}", a.start(), b.end()),
            _ => String::new(),
        };
        let mut only = Vec::new();
        if let Some(l) = plan.as_ref().and_then(|p| p.layers.as_deref()) {
            let what = if l.len() == 1 && l[0].start() == l[0].end() {
                "layer"
            } else {
                "layers"
            };
            only.push(format!("{what} {} alone", span(l)));
        }
        if let Some(r) = plan.as_ref().and_then(|p| p.kq_rows.as_deref()) {
            only.push(format!("kq_soft_max for positions {} only", span(r)));
        }
        let rows = if only.is_empty() {
            String::new()
        } else {
            format!(" ({})", only.join("; "))
        };
        format!(
            "to judge it op by op, record step {} whole{rows}: --record '{}' (PARITY_RECORD for an engine writing through a parity kit)",
            steps.join(", "),
            self.record
        )
    }
}
