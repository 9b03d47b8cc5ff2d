//! `parity mutations` (the catalog of known engine bugs) and `parity selftest` (each bug run
//! through `dump` and `diff` exactly as an external engine's trace would be, checking that the
//! clean run passes and each bug is found at its place and named).

use super::Result;
use crate::backend::mutation::{Mutation, MutationKind};
use crate::model::Model;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct MutationsArgs {
    /// A GGUF model: also say whether each bug applies to it and exactly where it first shows.
    model: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct CatalogRow {
    name: &'static str,
    kind: MutationKind,
    description: &'static str,
    first_shows: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    applies: Option<bool>,
}

pub fn mutations(a: MutationsArgs) -> Result<ExitCode> {
    let model = a.model.as_ref().map(Model::open).transpose()?;
    let rows: Vec<CatalogRow> = Mutation::ALL
        .iter()
        .map(|&m| {
            let applies = model.as_ref().map(|md| m.applies_to(md));
            let first_shows = match &model {
                Some(md) if m.applies_to(md) => place(&m.first_shows(md)),
                Some(_) => "-".into(),
                None => m.typical_place().into(),
            };
            CatalogRow {
                name: m.name(),
                kind: m.kind(),
                description: m.describe(),
                first_shows,
                applies,
            }
        })
        .collect();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<22} {:<8} {:<8}{:<34} description",
        "name",
        "kind",
        if model.is_some() { "applies " } else { "" },
        "first shows"
    );
    for r in &rows {
        let kind = serde_json::to_value(r.kind)?;
        let applies = match r.applies {
            Some(true) => "yes     ",
            Some(false) => "no      ",
            None => "",
        };
        println!(
            "{:<22} {:<8} {applies}{:<34} {}",
            r.name,
            kind.as_str().unwrap_or(""),
            r.first_shows,
            r.description
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `step 0, layer 3, q_rope` / `step 1, logits`.
pub fn place(k: &crate::trace::TapKey) -> String {
    match k.layer {
        Some(l) => format!("step {}, layer {l}, {}", k.step, k.tap),
        None => format!("step {}, {}", k.step, k.tap),
    }
}
