//! Backends by name for the commands that run one (`generate`, `dump`, `bench`): the
//! registry's names, a planted mutation, threads, the context, and how a trace names its producer.

use super::{Result, err};
use crate::backend::mutation::{Mutation, MutationKind};
use crate::backend::{self, Backend, Emulation, Reference};
use crate::model::Model;

/// A backend by its registry name (`backend::registry`).
pub fn make_backend<'m>(
    name: &str,
    model: &'m Model,
    n_ctx: usize,
    threads: usize,
) -> Result<Box<dyn Backend + 'm>> {
    match (backend::registry::find(name), reference_family(name)) {
        (Err(_), Some(e)) => Ok(Box::new(Reference::new(model, e, n_ctx))),
        (entry, _) => Ok(entry?.build(model, n_ctx, threads)?),
    }
}

/// `reference:FAMILY` for a rounding family the registry has no row for (the zoo's clean
/// engines: `reference:ggml-scalar`, `reference:q8k`, ...): the reference under that emulation.
fn reference_family(name: &str) -> Option<Emulation> {
    match name {
        "reference" => Some(Emulation::None),
        _ => Emulation::parse(name.strip_prefix("reference:")?),
    }
}

/// `--mutate NAME`: the mutation, refused (one line, exit 2) when unknown or when it cannot
/// show on this model.
pub fn parse_mutation(name: &str, model: &Model) -> Result<Mutation> {
    let m = Mutation::parse(name).ok_or_else(|| {
        err(format!(
            "unknown mutation '{name}' (known: {})",
            Mutation::names()
        ))
    })?;
    if !m.applies_to(model) {
        let ok: Vec<&str> = Mutation::ALL
            .iter()
            .filter(|m| m.applies_to(model))
            .map(|m| m.name())
            .collect();
        return Err(err(format!(
            "mutation '{name}' does not apply to this model (applicable: {})",
            ok.join(", ")
        )));
    }
    Ok(m)
}

/// [`make_backend`] for an engine with bug `m`: compute and layout bugs need the reference
/// backend (where the catalog's hooks live); token bugs change the ids, not the backend.
pub fn make_mutated_backend<'m>(
    name: &str,
    model: &'m Model,
    n_ctx: usize,
    threads: usize,
    m: Option<Mutation>,
    from_layer: usize,
) -> Result<Box<dyn Backend + 'm>> {
    let Some(m) = m.filter(|m| m.kind() != MutationKind::Tokens) else {
        return make_backend(name, model, n_ctx, threads);
    };
    let Some(emulation) = reference_family(name) else {
        return Err(err(format!(
            "--mutate {m} needs the reference backend (not '{name}')"
        )));
    };
    Ok(Box::new(
        Reference::new(model, emulation, n_ctx)
            .with_mutation(Some(m))
            .mutation_from_layer(from_layer),
    ))
}

/// `--threads 0` means every core; more than 4 per core is capped, with a note on stderr.
pub fn resolve_threads(n: usize) -> usize {
    let r = backend::registry::resolve_threads(n);
    if n != 0 && r < n {
        eprintln!(
            "note: --threads {n} capped at {r} (4 per core on this machine's {} cores)",
            r / 4
        );
    }
    r
}

/// Refuse, before any work, a run whose prompt and steps do not fit the model's context
/// (`what` names the steps argument, e.g. `--steps 8`).
pub fn check_context(model: &Model, n_prompt: usize, what: &str, steps: usize) -> Result<()> {
    let n_ctx = model.config.n_ctx_train;
    if n_prompt.saturating_add(steps) > n_ctx {
        return Err(err(format!(
            "{n_prompt} prompt ids + {what} {steps} exceed the model's context of {n_ctx} positions"
        )));
    }
    Ok(())
}

/// The backend name for `--backend B --emulate E` (E unset: the backend's own rounding).
pub fn backend_name(backend: &str, emulate: Option<&str>) -> Result<String> {
    let Some(e) = emulate else {
        return Ok(backend.to_string());
    };
    let family = Emulation::parse(e)
        .ok_or_else(|| err(format!("unknown --emulate '{e}' ({})", Emulation::names())))?;
    if backend == "reference" {
        return Ok(match family {
            Emulation::None => "reference".into(),
            f => format!("reference:{}", f.name()),
        });
    }
    let entry = backend::registry::find(backend)?;
    if entry.rounding == family {
        Ok(backend.to_string())
    } else {
        Err(err(format!(
            "--backend {backend} always rounds activations as '{}'; --emulate {e} is for the reference backend",
            entry.rounding.name()
        )))
    }
}
